"""Layout-independent weight initialisation, run after the model is sharded.

Each parameter's full value comes from a CPU generator seeded by (seed, parameter name), and each
rank keeps only its slice. So the weights are bitwise the same for every layout and device, which
is what lets a parallel run be compared with the single-process one. Peak extra memory is one
full parameter at a time, never the whole model.
"""

from __future__ import annotations

import zlib

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from meshtrain.models.transformer import Transformer, init_std_for


def _full_value(name: str, shape: torch.Size, std: float | None, seed: int, constant: float = 1.0) -> torch.Tensor:
    """A normal(0, std) draw, or with std None the ``constant`` (a norm's weight: 1, or Gemma's 0)."""
    if std is None:
        return torch.full(shape, constant)
    if std == 0:
        return torch.zeros(shape)
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    return torch.empty(shape).normal_(0.0, std, generator=gen)


@torch.no_grad()
def copy_full_into(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy a full (unsharded) value into a parameter that may be a DTensor shard."""
    if isinstance(param, DTensor):
        # src_data_rank=None: every rank slices its own copy, no communication.
        local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
        param.to_local().copy_(local)
    else:
        param.copy_(full)


@torch.no_grad()
def init_weights(model: Transformer, seed: int) -> None:
    for name, param in model.named_parameters():  # tied weights appear once
        owner = model.get_submodule(name.rpartition(".")[0])
        if name == "lm_head.weight" and model.cfg.tie_word_embeddings:
            name = "embed_tokens.weight"  # a pipeline's last stage: its copy of the tied embedding
        full = _full_value(name, param.shape, init_std_for(name, model.cfg), seed, getattr(owner, "init_value", 1.0))
        copy_full_into(param, full.to(device=param.device, dtype=param.dtype))
    model.reset_buffers()
