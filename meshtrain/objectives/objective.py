"""What an objective is: the trainer's micro-batch loop (``micro_batches.py``) asks it, for training
and evaluation alike, and never tests which one it is.

For each step the objective is told the step's micro-batches (``begin``), so that it can scale each
micro-batch's loss to its share of the step's mean (over every micro-batch and dp rank); it gives
the tensor its loss function needs beside the logits (``target``: [batch, seq, ...], sharded with
the inputs under cp and split into micro-batches by a pipeline schedule), and is called as that
loss function, on the model's logits, in the plain loop and as the schedule's ``loss_fn`` on the
last stage alike. What the logs need is kept per call and added to ``sums`` only for the losses the
step used (``commit``): a pipeline stage calls the loss function once more on its first step, on
placeholder activations, to infer the backward's shapes (torch 2.13's dynamic metadata inference),
and that call must count for nothing. ``metrics`` turns the sums, reduced over the mesh by the
loop, into the logged values.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from meshtrain.data.batch import Batch


class Objective:
    sums: torch.Tensor
    """float64 statistics of the micro-batches since ``begin``, summed: each dp x cp rank's and each
    stage's share adds up to the step's (the loop sums them over the mesh)."""

    def __init__(self, statistics: int):
        self.statistics = statistics
        self.sums = torch.zeros(statistics, dtype=torch.float64)
        self._pending: list[tuple[torch.Tensor, Callable[[], None]]] = []

    def attach(self, trainer) -> None:
        """The trainer's model parts hold their starting weights: build what the objective needs
        beside them (a preference loss's reference model)."""

    def begin(self, batches: list[Batch], trainer, training: bool) -> None:
        """A new step (``training``) or evaluation batch: reset ``sums``, set the loss scale."""
        self.sums = torch.zeros(self.statistics, dtype=torch.float64, device=trainer.runtime.device)
        self._pending.clear()

    def target(self, batch: Batch, first_row: int) -> torch.Tensor:
        """What the loss function needs beside the logits, [batch, seq, ...]; ``first_row``: the
        batch's first sample's index among the step's samples on this rank."""
        raise NotImplementedError

    def __call__(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """A micro-batch's loss, scaled for backward."""
        raise NotImplementedError

    def metrics(self, sums: torch.Tensor, training: bool) -> dict[str, float]:
        """The logged values of the reduced sums: ``loss`` first when training, ``val_*`` otherwise."""
        raise NotImplementedError

    def keep(self, loss: torch.Tensor, apply: Callable[[], None]) -> torch.Tensor:
        """Hold what this call adds to the step's record until the loop says its loss was used."""
        self._pending.append((loss, apply))
        return loss

    def add(self, values: list[torch.Tensor]) -> Callable[[], None]:
        """An ``apply`` for ``keep``: these values added to ``sums``."""
        stacked = torch.stack([v.detach().double() for v in values])

        def apply() -> None:
            self.sums += stacked
        return apply

    def commit(self, losses: list[torch.Tensor]) -> None:
        """The calls that gave these losses (the step's micro-batches) go on record; any other is dropped."""
        used = {id(loss) for loss in losses}
        for loss, apply in self._pending:
            if id(loss) in used:
                apply()
        self._pending.clear()
