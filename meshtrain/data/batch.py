"""A micro-batch by name: what the data gives the trainer, whatever the objective.

The datasets and the loader yield positional tuples (``(inputs, labels)``, with document ids third
where the data has its own documents: SFT's conversations, preference pairs' sequences), which is
what torch's DataLoader collates; the trainer reads them here once, as a ``Batch``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Batch:
    inputs: torch.Tensor
    """[batch, seq] token ids."""
    labels: torch.Tensor
    """[batch, seq] the next token of each position, -100 where it is not a target."""
    documents: torch.Tensor | None = None
    """[batch, seq] document ids where the data defines them (else None: found from EOS, or one
    document per sample)."""

    @classmethod
    def of(cls, sample: tuple | list) -> Batch:
        return cls(*sample)

    @classmethod
    def joined(cls, batches: list[Batch]) -> Batch:
        """A step's micro-batches as one batch (a pipeline schedule splits it again)."""
        documents = None if batches[0].documents is None else torch.cat([b.documents for b in batches])
        return cls(torch.cat([b.inputs for b in batches]), torch.cat([b.labels for b in batches]), documents)

    def to(self, device: torch.device) -> Batch:
        """A copy on ``device``, always a copy: sharding over cp rewrites the tensors it is given in
        place, and a step may run the same micro-batch through two models (a preference loss's
        reference, then the policy)."""
        return Batch(self.inputs.to(device, copy=True), self.labels.to(device, copy=True),
                     None if self.documents is None else self.documents.to(device, copy=True))
