"""What a rank really holds for training: its parameter, gradient and optimizer-state bytes, measured
on a live trainer, and the activations a forward keeps for backward (the planner's per-rank
estimates are checked against both)."""

from __future__ import annotations

import contextlib
import weakref

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode


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
    params = [_local(p) for part in trainer.parts for p in part.parameters()]  # frozen ones (LoRA's base) too
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


class _Created(TorchDispatchMode):
    """Weak references to every tensor the ops under it create."""

    def __init__(self):
        super().__init__()
        self.tensors: list[weakref.ref] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.tensors.extend(weakref.ref(t) for t in (out if isinstance(out, (tuple, list)) else [out])
                            if isinstance(t, torch.Tensor))
        return out


def activations_kept(forward, *inputs, exclude=()) -> tuple[int, torch.Tensor]:
    """``(bytes, output)`` of ``forward(*inputs)``: the bytes of every tensor the forward created that
    is still alive once it returns (what autograd, or activation checkpointing, keeps for backward),
    storages counted once; the output and the storages of ``exclude`` (e.g. the weights) are not.
    Eager only: dynamo does not trace under the dispatch mode this counts with."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    with _Created() as created:
        out = forward(*inputs)
    skip.add(out.untyped_storage().data_ptr())
    alive = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
             for ref in created.tensors if (t := ref()) is not None}
    return sum(n for ptr, n in alive.items() if ptr not in skip), out
