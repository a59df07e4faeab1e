"""Tied embeddings across pipeline stages: Megatron's embedding group.

A tied model uses one [vocab, hidden] matrix as the embedding (first stage) and the output head
(last stage). Under pp they are two copies on two ranks: both start from the embedding's value
(``models.initialize``, ``hf.adapter.to_hf``), each step their gradients are summed (the gradient
the single parameter gets from both uses), and AdamW then moves them identically, so they stay
equal bit for bit. The gradient norm counts the head's copy once, as the embedding. Under the
V schedules (ZBV, DualPipeV) the first and last stages are on the same rank: the sum is local.
Elsewhere the pairs are the first and last pp coordinates of every other mesh coordinate (the pp
group itself when pp = 2); under FSDP and TP both copies are sharded alike, so each pair sums its
local shards.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from meshtrain.config import JobConfig
from meshtrain.parallel.layout import resolve_schedule
from meshtrain.parallel.mesh import ParallelMesh
from meshtrain.parallel.pipeline import stage_ids_for_rank

EMBEDDING, HEAD = "embed_tokens.weight", "lm_head.weight"


def tied_copies(cfg: JobConfig, parts: list[nn.Module], mesh: ParallelMesh) -> "TiedCopies | None":
    """A pipeline rank's copies of a tied embedding (None for an untied model)."""
    if not cfg.model.tie_word_embeddings:
        return None
    pp, vpp = mesh.size("pp"), cfg.parallel.vpp
    schedule = resolve_schedule(cfg.parallel.pp_schedule, vpp)
    last = next(r for r in range(pp) if pp * vpp - 1 in stage_ids_for_rank(r, pp, vpp, schedule))
    return TiedCopies(parts, mesh, (0, last), datetime.timedelta(seconds=cfg.parallel.timeout_s))


class TiedCopies:
    """This rank's copies of a tied embedding across pipeline stages (none when it holds neither)."""

    def __init__(self, parts: list[nn.Module], mesh: ParallelMesh, first_and_last_pp_ranks: tuple[int, int],
                 timeout: datetime.timedelta) -> None:
        params = {name: p for part in parts for name, p in part.named_parameters()}
        self.embedding, self.head = params.get(EMBEDDING), params.get(HEAD)
        self.group = None
        first, last = first_and_last_pp_ranks
        if first == last:
            return  # both stages on each rank of pp coordinate 0: summed locally
        if mesh.size("pp") == 2:
            self.group = mesh["pp"].get_group()
            return
        grid = mesh.world.mesh  # [pp, dp_replicate, dp_shard, cp, tp] ranks
        pairs = torch.stack([grid[first].flatten(), grid[last].flatten()], dim=1).tolist()
        me = dist.get_rank()
        for pair in pairs:  # every rank makes every group, in the same order
            group = dist.new_group(pair, timeout=timeout, group_desc="tied_embedding")
            if me in pair:
                self.group = group

    @property
    def counted_elsewhere(self) -> list[torch.Tensor]:
        """The head's copy: its gradient, once summed, is the embedding's (not counted twice in the norm)."""
        return [self.head] if self.head is not None else []

    @torch.no_grad()
    def sum_grads(self) -> None:
        mine = [p for p in (self.embedding, self.head) if p is not None and p.grad is not None]
        if not mine:
            return
        grads = [_local(p.grad) for p in mine]
        if len(grads) == 2:
            grads[0].add_(grads[1])
            grads[1].copy_(grads[0])
        elif self.group is not None:
            dist.all_reduce(grads[0], group=self.group)


def _local(grad: torch.Tensor) -> torch.Tensor:
    return grad.to_local() if isinstance(grad, DTensor) else grad
