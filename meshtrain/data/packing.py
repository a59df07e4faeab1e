"""Packing whole units of sequences into samples of seq_len + 1 tokens, each sequence a document.

A unit is what must stay together: one conversation (SFT), or a preference pair's chosen and
rejected sequences (which the loss compares, so they share a sample, a micro-batch and a dp rank).
Units are packed first fit in order; the rest of a sample is padding, a document of its own that is
never a target. Every sequence gets the next document id of its sample, so attention never crosses
from one into another, and a unit of k sequences that starts with document d holds d .. d+k-1.

A unit longer than a sample is truncated (each sequence cut from its end, the longest first, so
short ones stay whole: the sample's tokens shared out by water-filling) or dropped
(``data.overlong``); with ``need_targets``, a unit one of whose sequences lost all its targets to
truncation is dropped too. Each is counted for the log.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.utils.data import Dataset

IGNORE = -100
Sequence = tuple[list[int], list[bool]]
"""Token ids and, per token, whether it is a target (its label is itself, predicted from the one before)."""


def shares(lengths: list[int], width: int) -> list[int]:
    """How many tokens of each sequence fit in ``width``: all of the shorter ones, the rest of the
    width split evenly between the longer ones."""
    take, left = [0] * len(lengths), width
    for n, i in enumerate(sorted(range(len(lengths)), key=lambda i: lengths[i])):
        take[i] = min(lengths[i], left // (len(lengths) - n))
        left -= take[i]
    return take


class PackedUnits(Dataset):
    """Sample i: (inputs, labels, document ids), seq_len tokens each, of whole units."""

    def __init__(self, units: Iterable[list[Sequence]], seq_len: int, pad_id: int, overlong: str,
                 need_targets: bool = False):
        width = seq_len + 1
        tokens, targets, documents = [], [], []
        row_tokens, row_targets, row_docs = [], [], []
        self.truncated = self.dropped = self.units = self.without_targets = 0

        def close_row():
            pad = width - len(row_tokens)
            tokens.append(row_tokens + [pad_id] * pad)
            targets.append(row_targets + [False] * pad)
            documents.append(row_docs + [(row_docs[-1] + 1) if row_docs else 0] * pad)

        for unit in units:
            self.without_targets += not any(any(flags) for _, flags in unit)
            if sum(len(ids) for ids, _ in unit) > width:
                if overlong == "drop":
                    self.dropped += 1
                    continue
                unit = [(ids[:n], flags[:n]) for (ids, flags), n in zip(unit, shares([len(i) for i, _ in unit], width))]
                self.truncated += 1
                if need_targets and not all(any(flags) for _, flags in unit):
                    self.dropped += 1
                    continue
            if len(row_tokens) + sum(len(ids) for ids, _ in unit) > width:
                close_row()
                row_tokens, row_targets, row_docs = [], [], []
            for ids, flags in unit:
                doc = (row_docs[-1] + 1) if row_docs else 0
                row_tokens, row_targets, row_docs = row_tokens + ids, row_targets + flags, row_docs + [doc] * len(ids)
            self.units += 1
        if row_tokens:
            close_row()
        self.tokens = torch.tensor(tokens, dtype=torch.int64).reshape(-1, width)
        self.targets = torch.tensor(targets, dtype=torch.bool).reshape(-1, width)
        self.documents = torch.tensor(documents, dtype=torch.int32).reshape(-1, width)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        chunk, docs = self.tokens[i], self.documents[i]
        # a target only inside its own sequence: never the first token of the next one
        keep = self.targets[i][1:] & (docs[1:] == docs[:-1])
        return chunk[:-1], torch.where(keep, chunk[1:], IGNORE), docs[:-1]
