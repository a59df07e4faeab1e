"""Preference data: for each prompt a chosen and a rejected response, as pairs of sequences.

``data.format=preference`` reads records (jsonl, parquet, a saved HF dataset) in the common public
forms, trl's among them:

- text: ``prompt``, ``chosen``, ``rejected`` strings; each sequence is prompt + response + EOS, the
  response and EOS the targets (as ``prompt_response`` SFT);
- chat: ``chosen`` and ``rejected`` message lists, rendered by the model's chat template as SFT
  renders them. The prompt is ``prompt`` (messages, or a string: one user message) followed by each
  list, or, without a ``prompt`` (UltraFeedback's and HH's form: two whole conversations), the
  messages both lists begin with. The targets are the assistant turns of the response only.

The field names are ``data.prompt_field``, ``data.chosen_field``, ``data.rejected_field``. A pair
is packed whole (``data/packing.py``): its chosen sequence is document 2k of its sample and its
rejected one 2k + 1, so both are in the same micro-batch on the same dp rank, each attending to
itself. A pair longer than a sample is truncated (the longer response cut) or dropped
(``data.overlong``); one that truncation leaves without targets on a side is dropped; each counted.
"""

from __future__ import annotations

from collections.abc import Iterator

from meshtrain.config import DataConfig
from meshtrain.data.packing import PackedUnits, Sequence
from meshtrain.data.sft import ChatRenderer, chat_messages, completion
from meshtrain.data.text import records
from meshtrain.data.tokenizer import Tokenizer
from meshtrain.errors import DataError


def _messages(record: dict, field: str) -> list[dict]:
    return chat_messages({field: record[field]}, field)


def pair(record: dict, cfg: DataConfig, tokenizer: Tokenizer, render: ChatRenderer | None) -> list[Sequence]:
    """A record's chosen and rejected sequences."""
    fields = (cfg.chosen_field, cfg.rejected_field)
    chosen, rejected = (record.get(f) for f in fields)
    prompt = record.get(cfg.prompt_field)
    if isinstance(chosen, str) and isinstance(rejected, str):
        if not isinstance(prompt, str):
            raise DataError(f"string responses {fields[0]!r} and {fields[1]!r} need a string prompt {cfg.prompt_field!r} "
                            f"(got {type(prompt).__name__}); set data.prompt_field")
        return [completion(tokenizer, prompt, chosen), completion(tokenizer, prompt, rejected)]
    if not isinstance(chosen, list) or not isinstance(rejected, list):
        raise DataError(f"no preference pair: {fields[0]!r} and {fields[1]!r} must both be strings or both lists "
                        f"of messages (got {type(chosen).__name__} and {type(rejected).__name__}); set "
                        "data.chosen_field / data.rejected_field")
    if render is None:
        raise DataError("chat-form pairs need the model's chat template (data.tokenizer's tokenizer_config.json, "
                        "or data.chat_template)")
    chosen, rejected = _messages(record, fields[0]), _messages(record, fields[1])
    if prompt is None:  # two whole conversations: the prompt is what they share
        shared = 0
        while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
            shared += 1
        context, chosen, rejected = chosen[:shared], chosen[shared:], rejected[shared:]
    elif isinstance(prompt, str):
        context = [{"role": "user", "content": prompt}]
    else:
        context = _messages(record, cfg.prompt_field)
    sequences = []
    for name, response in zip(fields, (chosen, rejected)):
        turns = sum(m["role"] == "assistant" for m in response)
        if not turns:
            raise DataError(f"the {name!r} response holds no assistant message after the prompt; each response "
                            "is the assistant's turn(s) that follow the prompt")
        sequences.append(render(context + response, record.get("tools"), last_turns=turns))
    return sequences


def pairs(cfg: DataConfig, path: str, tokenizer: Tokenizer, skipped: list[str]) -> Iterator[list[Sequence]]:
    render = None
    for where, record in records(path):
        try:
            if render is None and isinstance(record.get(cfg.chosen_field), list):
                render = ChatRenderer(cfg, tokenizer)
            yield pair(record, cfg, tokenizer, render)
        except DataError as e:
            if cfg.bad_records == "skip":
                skipped.append(f"{where}: {e}")
                continue
            raise DataError(f"{where}: {e}") from None


def preference_dataset(cfg: DataConfig, path: str, tokenizer: Tokenizer, seq_len: int) -> tuple[PackedUnits, str]:
    pad = tokenizer.eos_id if tokenizer.eos_id is not None else 0
    skipped: list[str] = []
    dataset = PackedUnits(pairs(cfg, path, tokenizer, skipped), seq_len, pad, cfg.overlong, need_targets=True)
    if len(dataset) == 0:
        raise DataError(f"data.path: {path} holds no preference pair that fits train.seq_len + 1 tokens"
                        + (f" ({dataset.dropped:,} dropped)" if dataset.dropped else "")
                        + (f" ({len(skipped):,} bad records skipped; the first: {skipped[0]})" if skipped else ""))
    more = f", {len(skipped):,} bad records skipped (data.bad_records=skip; the first: {skipped[0]})" if skipped else ""
    return dataset, (f"data: {path}, preference pairs: {dataset.units:,} pairs in {len(dataset):,} samples{more}; "
                     f"{dataset.truncated} truncated, {dataset.dropped} dropped as longer than train.seq_len + 1 "
                     f"(data.overlong={cfg.overlong}) or left without a response")
