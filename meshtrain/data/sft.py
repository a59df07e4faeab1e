"""Supervised fine-tuning data: conversations rendered, tokenized with the assistant's tokens marked,
and packed whole.

``data.format=chat``: records with ``messages`` ([{role, content}, ...]) are rendered by the model's
chat template (tokenizer_config.json's ``chat_template``) through jinja2 exactly as transformers'
``apply_chat_template`` renders it (the same sandbox, filters and globals). The assistant's part
of the text is what the template's ``{% generation %}`` blocks hold, where it has them
(transformers' assistant-mask convention); else it is found by rendering each conversation prefix
with and without the assistant turn: the span between the prompt (``add_generation_prompt=True``)
and the prefix with the answer is what the model learns to produce, its end-of-turn tokens included. ``data.format=prompt_response``: the
text is prompt + response + EOS, the response and EOS the targets.

Tokens are targets where their first character lies in an assistant span (the tokenizer's
offsets), so the labels are -100 everywhere else. Conversations are packed whole into samples of
seq_len + 1 tokens, first fit in order, the rest of a sample padded (pad tokens are a document of
their own and never targets); each carries its document ids, so attention never crosses from one
conversation into another. Longer conversations are truncated or dropped (``data.overlong``).
"""

from __future__ import annotations

import datetime
import json
import pathlib
from typing import Iterator

import torch
from torch.utils.data import Dataset

from meshtrain.config import DataConfig
from meshtrain.data.text import records
from meshtrain.data.tokenizer import Tokenizer
from meshtrain.errors import DataError

IGNORE = -100


def _token_text(value) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


def load_chat_template(cfg: DataConfig) -> tuple[str, dict[str, str]]:
    """The template and the special tokens it may use (bos_token, eos_token, ...)."""
    if cfg.chat_template is not None:
        path = pathlib.Path(cfg.chat_template)
    elif cfg.tokenizer != "byte":
        tok = pathlib.Path(cfg.tokenizer)
        path = (tok if tok.is_dir() else tok.parent) / "tokenizer_config.json"
    else:
        raise DataError("data.format=chat needs a chat template: set data.chat_template to a tokenizer_config.json "
                        "or a .jinja file, or data.tokenizer to a model's tokenizer")
    if not path.is_file():
        raise DataError(f"data.chat_template: {str(path)!r} does not exist; give a tokenizer_config.json holding a "
                        "chat_template, or a .jinja file")
    if path.suffix != ".json":
        return path.read_text(), {}
    config = json.loads(path.read_text())
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    if not isinstance(template, str):
        jinja = path.parent / "chat_template.jinja"
        if not jinja.is_file():
            raise DataError(f"{path}: no chat_template (nor a chat_template.jinja beside it); set data.chat_template")
        template = jinja.read_text()
    special = {k: _token_text(v) for k, v in config.items()
               if k.endswith("_token") and isinstance(_token_text(v), str)}
    return template, special


def compile_template(template: str):
    """The template compiled the way transformers compiles chat templates (checked: 5.x)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    class GenerationSpans(jinja2.ext.Extension):
        """transformers' ``{% generation %}...{% endgeneration %}`` blocks (its AssistantTracker): the
        template marks what the assistant generates; while ``recording`` holds (the blocks rendered so
        far, the spans), each block's character span in the output is recorded."""

        tags = {"generation"}

        def __init__(self, environment):
            super().__init__(environment)
            self.recording: tuple[list[str], list[tuple[int, int]]] | None = None
            environment.extend(generation_spans=self)

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_generation"), [], [], body).set_lineno(lineno)

        def _generation(self, caller) -> str:
            text = caller()
            if self.recording is not None:
                blocks, spans = self.recording
                start = sum(len(block) for block in blocks)
                spans.append((start, start + len(text)))
            return text

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols, GenerationSpans])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(template)


def render_chat(template, messages: list[dict], special: dict[str, str]) -> tuple[str, list[tuple[int, int]]]:
    """The conversation's text and the character spans of its assistant turns: the template's own
    ``{% generation %}`` blocks where it has them (rendered as transformers renders them for
    ``return_assistant_tokens_mask``), else found by rendering each prefix of the conversation."""
    blocks, spans = [], []
    tracker = template.environment.generation_spans
    tracker.recording = (blocks, spans)
    try:
        for block in template.generate(messages=messages, add_generation_prompt=False, **special):
            blocks.append(block)
    finally:
        tracker.recording = None
    text = "".join(blocks)
    if spans:
        return text, spans
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        prompt = template.render(messages=messages[:i], add_generation_prompt=True, **special)
        answered = template.render(messages=messages[:i + 1], add_generation_prompt=False, **special)
        if not (answered.startswith(prompt) and text.startswith(answered)):
            raise DataError("the chat template does not render conversations incrementally (a prefix of the "
                            "conversation renders differently inside the whole), so the assistant's tokens cannot be "
                            "found; use a template that does, or data.format=prompt_response")
        spans.append((len(prompt), len(answered)))
    return text, spans


def tokenize_spans(tokenizer: Tokenizer, text: str, spans: list[tuple[int, int]]) -> tuple[list[int], list[bool]]:
    ids, starts = tokenizer.encode_with_offsets(text)
    targets = [any(a <= start < b for a, b in spans) for start in starts]
    return ids, targets


def examples(cfg: DataConfig, path: str, tokenizer: Tokenizer) -> Iterator[tuple[list[int], list[bool]]]:
    """(token ids, target flags) of every conversation under ``path``."""
    if cfg.format == "chat":
        template, special = load_chat_template(cfg)
        compiled = compile_template(template)
    for where, record in records(path):
        if cfg.format == "chat":
            messages = record.get(cfg.messages_field)
            if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
                raise DataError(f"{where}: no list of {{role, content}} messages in field {cfg.messages_field!r}; "
                                "set data.messages_field, or data.format=prompt_response")
            yield tokenize_spans(tokenizer, *render_chat(compiled, messages, special))
        else:
            prompt, response = record.get(cfg.prompt_field), record.get(cfg.response_field)
            if not isinstance(prompt, str) or not isinstance(response, str):
                raise DataError(f"{where}: no string fields {cfg.prompt_field!r} and {cfg.response_field!r}; set "
                                "data.prompt_field / data.response_field")
            ids, targets = tokenize_spans(tokenizer, prompt + response, [(len(prompt), len(prompt + response))])
            if tokenizer.eos_id is not None:  # learn to stop
                ids, targets = ids + [tokenizer.eos_id], targets + [True]
            yield ids, targets


class PackedConversations(Dataset):
    """Sample i: (inputs, labels, document ids), seq_len tokens each, of whole conversations."""

    def __init__(self, conversations, seq_len: int, pad_id: int, overlong: str):
        width = seq_len + 1
        tokens, targets, documents = [], [], []
        row_tokens, row_targets, row_docs = [], [], []
        self.truncated = self.dropped = self.conversations = self.without_targets = 0

        def close_row():
            pad = width - len(row_tokens)
            tokens.append(row_tokens + [pad_id] * pad)
            targets.append(row_targets + [False] * pad)
            documents.append(row_docs + [(row_docs[-1] + 1) if row_docs else 0] * pad)

        for ids, flags in conversations:
            self.without_targets += not any(flags)
            if len(ids) > width:
                if overlong == "drop":
                    self.dropped += 1
                    continue
                ids, flags = ids[:width], flags[:width]
                self.truncated += 1
            if len(row_tokens) + len(ids) > width:
                close_row()
                row_tokens, row_targets, row_docs = [], [], []
            doc = (row_docs[-1] + 1) if row_docs else 0
            row_tokens, row_targets, row_docs = row_tokens + ids, row_targets + flags, row_docs + [doc] * len(ids)
            self.conversations += 1
        if row_tokens:
            close_row()
        self.tokens = torch.tensor(tokens, dtype=torch.int64).reshape(-1, width)
        self.targets = torch.tensor(targets, dtype=torch.bool).reshape(-1, width)
        self.documents = torch.tensor(documents, dtype=torch.int32).reshape(-1, width)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        chunk, docs = self.tokens[i], self.documents[i]
        # a target only inside its own conversation: never the first token of the next one
        keep = self.targets[i][1:] & (docs[1:] == docs[:-1])
        return chunk[:-1], torch.where(keep, chunk[1:], IGNORE), docs[:-1]


def sft_dataset(cfg: DataConfig, path: str, tokenizer: Tokenizer, seq_len: int) -> tuple[PackedConversations, str]:
    pad = tokenizer.eos_id if tokenizer.eos_id is not None else 0
    dataset = PackedConversations(examples(cfg, path, tokenizer), seq_len, pad, cfg.overlong)
    if len(dataset) == 0:
        raise DataError(f"data.path: {path} holds no conversation for data.format={cfg.format}"
                        + (f" ({dataset.dropped} dropped as longer than train.seq_len + 1)" if dataset.dropped else ""))
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
    return dataset, (f"data: {path}, {cfg.format} SFT: {dataset.conversations:,} conversations in {len(dataset):,} "
                     f"samples, {targets:,} target tokens{without}; {dataset.truncated} truncated, {dataset.dropped} dropped "
                     f"as longer than train.seq_len + 1 (data.overlong={cfg.overlong})")
