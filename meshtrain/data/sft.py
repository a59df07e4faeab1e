"""Supervised fine-tuning data: conversations rendered, tokenized with the assistant's tokens marked,
and packed whole.

``data.format=chat``: records with ``messages`` ([{role, content}, ...]) are rendered by the model's
chat template with the assistant's part of the text found (``data/chat_template.py``).
``data.format=prompt_response``: the text is prompt + response + EOS, the response and EOS the
targets.

Tokens are targets where their first character lies in an assistant span (the tokenizer's
offsets), so the labels are -100 everywhere else. Conversations are packed whole into samples of
seq_len + 1 tokens (``data/packing.py``: first fit in order, pads a document of their own and never
targets), each with its document ids, so attention never crosses from one conversation into
another. Longer conversations are truncated or dropped (``data.overlong``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from meshtrain.config import DataConfig
from meshtrain.data.chat_template import (compile_template, load_chat_template, render_chat, with_reasoning_aliases,
                                           written_contents)
from meshtrain.data.packing import IGNORE, PackedUnits, Sequence
from meshtrain.data.text import records
from meshtrain.data.tokenizer import Tokenizer
from meshtrain.errors import DataError


def tokenize_spans(tokenizer: Tokenizer, text: str, spans: list[tuple[int, int]],
                   literal: list[tuple[int, int]] = ()) -> tuple[list[int], list[bool]]:
    ids, starts = tokenizer.encode_with_offsets(text, literal)
    targets = [any(a <= start < b for a, b in spans) for start in starts]
    return ids, targets


class ChatRenderer:
    """The chat template, compiled once: conversations into (token ids, target flags)."""

    def __init__(self, cfg: DataConfig, tokenizer: Tokenizer):
        template, self.special = load_chat_template(cfg)
        self.compiled = compile_template(template)
        self.turn_ends = tokenizer.special_tokens | {v for v in self.special.values() if v}  # a frozenset: its pattern is cached
        self.tokenizer, self.literal = tokenizer, cfg.special_text_in_content == "text"

    def __call__(self, messages: list[dict], tools: list | None = None, last_turns: int | None = None) -> Sequence:
        """The conversation's tokens, its assistant turns the targets (``last_turns``: the last so
        many of them only)."""
        text, spans = render_chat(self.compiled, messages, self.special, self.turn_ends, tools)
        if last_turns is not None:
            if len(spans) < last_turns:
                raise DataError(f"the chat template's render holds {len(spans)} assistant turn(s), not the "
                                f"{last_turns} of the response")
            spans = spans[len(spans) - last_turns:]
        literal = written_contents(text, with_reasoning_aliases(messages)) if self.literal else ()
        return tokenize_spans(self.tokenizer, text, spans, literal)


def completion(tokenizer: Tokenizer, prompt: str, response: str) -> Sequence:
    """prompt + response + EOS, the response and the EOS the targets."""
    ids, targets = tokenize_spans(tokenizer, prompt + response, [(len(prompt), len(prompt + response))])
    if tokenizer.eos_id is not None:  # learn to stop
        ids, targets = ids + [tokenizer.eos_id], targets + [True]
    return ids, targets


def examples(cfg: DataConfig, path: str, tokenizer: Tokenizer,
             skipped: list[str] | None = None) -> Iterator[Sequence]:
    """(token ids, target flags) of every conversation under ``path``. A record that cannot be
    rendered raises a DataError naming it, or with ``data.bad_records=skip`` is left out and its
    reason appended to ``skipped``."""
    render = ChatRenderer(cfg, tokenizer) if cfg.format == "chat" else None
    for where, record in records(path):
        try:
            if render is not None:
                yield render(chat_messages(record, cfg.messages_field), record.get("tools"))
            else:
                prompt, response = record.get(cfg.prompt_field), record.get(cfg.response_field)
                if not isinstance(prompt, str) or not isinstance(response, str):
                    raise DataError(f"no string fields {cfg.prompt_field!r} and {cfg.response_field!r}; set "
                                    "data.prompt_field / data.response_field")
                yield completion(tokenizer, prompt, response)
        except DataError as e:
            if cfg.bad_records == "skip" and skipped is not None:
                skipped.append(f"{where}: {e}")
                continue
            raise DataError(f"{where}: {e}") from None


def chat_messages(record: dict, field: str) -> list[dict]:
    """The record's messages as the template should see them: a null key is an absent one (a parquet
    file or HF dataset gives every row every column), and a content given as a list of text parts
    (``[{"type": "text", "text": ...}]``, the OpenAI form) is their text joined."""
    messages = record.get(field)
    if not isinstance(messages, list) or not messages:
        raise DataError(f"no list of {{role, content}} messages in field {field!r}; set data.messages_field, or "
                        "data.format=prompt_response")
    plain = []
    for turn, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise DataError(f"message {turn} has no role (got {str(message)[:80]!r}); each message is "
                            "{\"role\": ..., \"content\": ...}")
        message = {k: v for k, v in message.items() if v is not None}
        content = message.get("content")
        if isinstance(content, list):
            kinds = {part.get("type") if isinstance(part, dict) else type(part).__name__ for part in content}
            if kinds - {"text"}:
                raise DataError(f"message {turn} ({message['role']}) has content parts of type "
                                f"{sorted(map(str, kinds - {'text'}))}; meshtrain trains on text: give text parts only")
            message["content"] = "".join(part.get("text", "") for part in content)
        elif content is None and not message.get("tool_calls"):
            raise DataError(f"message {turn} ({message['role']}) has no content; give it one (an empty string if "
                            "it is empty)")
        elif content is not None and not isinstance(content, str):
            raise DataError(f"message {turn} ({message['role']}) has a content of type {type(content).__name__} "
                            f"({str(content)[:40]!r}); it must be a string or a list of text parts")
        plain.append(message)
    return plain


class PackedConversations(PackedUnits):
    """Sample i: (inputs, labels, document ids), seq_len tokens each, of whole conversations."""

    def __init__(self, conversations: Iterable[Sequence], seq_len: int, pad_id: int, overlong: str):
        super().__init__(([c] for c in conversations), seq_len, pad_id, overlong)

    @property
    def conversations(self) -> int:
        return self.units


def sft_dataset(cfg: DataConfig, path: str, tokenizer: Tokenizer, seq_len: int) -> tuple[PackedConversations, str]:
    pad = tokenizer.eos_id if tokenizer.eos_id is not None else 0
    skipped: list[str] = []
    dataset = PackedConversations(examples(cfg, path, tokenizer, skipped), seq_len, pad, cfg.overlong)
    if len(dataset) == 0:
        raise DataError(f"data.path: {path} holds no conversation for data.format={cfg.format}"
                        + (f" ({dataset.dropped} dropped as longer than train.seq_len + 1)" if dataset.dropped else "")
                        + (f" ({len(skipped):,} bad records skipped; the first: {skipped[0]})" if skipped else ""))
    targets = int(dataset.targets.sum())
    if targets == 0:
        if dataset.without_targets == dataset.conversations:
            why = (f"none of its {dataset.conversations:,} conversations has a response to train on (an assistant "
                   f"turn, or data.response_field). Fix: check the roles in data.messages_field "
                   f"({cfg.messages_field!r}) name the model's turns 'assistant', or use data.format=pretrain")
        else:
            why = (f"every response was cut off ({dataset.truncated:,} conversations longer than train.seq_len + 1 "
                   "were truncated). Fix: raise train.seq_len or use data.overlong=drop")
        raise DataError(f"data.path: {path} holds no target tokens: {why}")
    without = f", {dataset.without_targets:,} without a response" if dataset.without_targets else ""
    if skipped:
        without += f", {len(skipped):,} bad records skipped (data.bad_records=skip; the first: {skipped[0]})"
    return dataset, (f"data: {path}, {cfg.format} SFT: {dataset.conversations:,} conversations in {len(dataset):,} "
                     f"samples, {targets:,} target tokens{without}; {dataset.truncated} truncated, {dataset.dropped} dropped "
                     f"as longer than train.seq_len + 1 (data.overlong={cfg.overlong})")
