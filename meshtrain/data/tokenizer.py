"""Tokenizers: raw bytes (the default, no files needed) or a Hugging Face ``tokenizer.json``."""

from __future__ import annotations

import functools
import pathlib
import re
from typing import Protocol

from meshtrain.config import DataConfig
from meshtrain.errors import DataError


@functools.cache
def special_token_pattern(tokens: frozenset[str]) -> re.Pattern:
    """Any of ``tokens`` (special tokens' text), longest first where one is a prefix of another.
    Cached: built once per tokenizer, not once per conversation."""
    return re.compile("|".join(re.escape(t) for t in sorted(tokens, key=len, reverse=True)))


class Tokenizer(Protocol):
    vocab_size: int
    eos_id: int | None
    special_tokens: frozenset[str]  # the text of each special token (a chat template's turn markers)

    def encode(self, text: str) -> list[int]: ...

    def encode_with_offsets(self, text: str, literal: list[tuple[int, int]] = ()) -> tuple[list[int], list[int]]: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, then BOS=256 and EOS=257. Needs no files."""

    vocab_size = 258
    bos_id = 256
    eos_id = 257
    special_tokens: frozenset[str] = frozenset()

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def encode_with_offsets(self, text: str, literal: list[tuple[int, int]] = ()) -> tuple[list[int], list[int]]:
        """The ids and, for each, the index of the character it comes from (no special tokens: every
        character is literal)."""
        ids, starts = [], []
        for index, char in enumerate(text):
            encoded = char.encode("utf-8")
            ids.extend(encoded)
            starts.extend([index] * len(encoded))
        return ids, starts


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` through the ``tokenizers`` library."""

    EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|im_end|>")

    def __init__(self, path: str):
        from tokenizers import Tokenizer as _Tokenizer

        file = pathlib.Path(path)
        if file.is_dir():
            file = file / "tokenizer.json"
        if not file.is_file():
            raise DataError(f"data.tokenizer: no tokenizer file at {str(file)!r}; "
                            "give the path of a tokenizer.json or use data.tokenizer=byte")
        try:
            self._tok = _Tokenizer.from_file(str(file))
        except Exception as e:  # tokenizers raises a bare Exception on malformed files
            raise DataError(f"data.tokenizer: cannot read {str(file)!r} as a Hugging Face tokenizer.json "
                            f"({e}); check the file or use data.tokenizer=byte") from None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eos_id = next((i for n in self.EOS_NAMES if (i := self._tok.token_to_id(n)) is not None), None)
        self.special_tokens = frozenset(t.content for t in self._tok.get_added_tokens_decoder().values() if t.special)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_with_offsets(self, text: str, literal: list[tuple[int, int]] = ()) -> tuple[list[int], list[int]]:
        """The ids and, for each, the index of the character it starts at. Special tokens in the text
        (a chat template's) are matched whole, except inside the ``literal`` character ranges, where
        their text is ordinary text."""
        if not literal or not self.special_tokens:
            encoding = self._tok.encode(text, add_special_tokens=False)
            return encoding.ids, [start for start, _ in encoding.offsets]
        ids, starts, at = [], [], 0

        def literally(end: int) -> None:  # text[at:end], special-token text in it spelled out
            encoding = self._tok.encode(text[at:end], add_special_tokens=False)
            ids.extend(encoding.ids)
            starts.extend(at + start for start, _ in encoding.offsets)

        self._tok.encode_special_tokens = True
        try:
            for marker in special_token_pattern(self.special_tokens).finditer(text):
                if any(a <= marker.start() < b for a, b in literal):
                    continue  # inside a message: left to the text around it
                literally(marker.start())
                ids.append(self._tok.token_to_id(marker.group()))  # one of the template's own
                starts.append(marker.start())
                at = marker.end()
            literally(len(text))
        finally:
            self._tok.encode_special_tokens = False
        return ids, starts

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]


def build_tokenizer(cfg: DataConfig) -> Tokenizer:
    return ByteTokenizer() if cfg.tokenizer == "byte" else HFTokenizer(cfg.tokenizer)
