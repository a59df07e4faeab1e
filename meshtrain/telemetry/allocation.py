"""What a rank really holds for training state: its parameter, gradient and optimizer-state bytes,
measured on a live trainer (the planner's per-rank estimate is checked against this)."""

from __future__ import annotations

import contextlib

import torch
from torch.distributed.tensor import DTensor


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@contextlib.contextmanager
def _recording_grads(optimizers, seen: dict):
    """Gradients exist only between backward and the optimizer's zero_grad: count them as the
    optimizer sees them, just before its step."""
    originals = [opt.step for opt in optimizers]

    def recording(opt, step):
        def step_and_record(*args, **kwargs):
            grads = [_local(p.grad) for group in opt.param_groups for p in group["params"] if p.grad is not None]
            seen["grad_bytes"] = seen.get("grad_bytes", 0) + _nbytes(grads)
            return step(*args, **kwargs)
        return step_and_record

    for opt, step in zip(optimizers, originals):
        opt.step = recording(opt, step)
    try:
        yield
    finally:
        for opt, step in zip(optimizers, originals):
            opt.step = step


def measure_training_state(trainer) -> dict:
    """Take one optimizer step on ``trainer`` and return this rank's local bytes of parameters,
    gradients and optimizer state (and the parameter element count)."""
    seen: dict = {}
    with _recording_grads(trainer.optimizers, seen):
        trainer.train_step()
    params = [_local(p) for p in trainer.params]
    states = [_local(v) for opt in trainer.optimizers for state in opt.state.values()
              for v in state.values() if isinstance(v, torch.Tensor)]
    return {"param_elements": sum(p.numel() for p in params), "param_bytes": _nbytes(params),
            "grad_bytes": seen.get("grad_bytes", 0), "optimizer_bytes": _nbytes(states)}


def mesh_coordinates(mesh) -> dict:
    """The coordinates the planner needs to name this rank's share (pp stage, tp slice, FSDP shard,
    expert FSDP shard)."""
    return {"pp_rank": mesh["pp"].get_local_rank(), "tp_rank": mesh["tp"].get_local_rank(),
            "fsdp_rank": mesh["dp_shard_cp"].get_local_rank(),
            "edp_rank": mesh["edp"].get_local_rank() if mesh.experts is not None else 0}
