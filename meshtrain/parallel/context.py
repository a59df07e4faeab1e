"""Context parallelism: every layer's activations split along the sequence over the mesh's "cp" dim.

Each step, the batch (input ids, labels) and the RoPE tables (the position ids' cos/sin rows) are
sharded along the sequence with torch's head-tail load balancing: the sequence is cut into 2*cp
chunks and cp rank r keeps chunks r and 2*cp-1-r, so every rank does the same share of causal
attention work. Attention then runs as ring attention: each rank's queries meet every rank's keys
and values as they rotate around the cp group (``parallel.cp_rotate_method``: allgather or
alltoall), partial results merged by their logsumexp. Everything else in a block is per token and
needs no communication. The loss is each rank's mean over its tokens; the cp ranks hold equal
token counts, so averaging over dp x cp (the trainer's loss all-reduce, FSDP's gradient
reduce-scatter over dp_shard x cp) gives the mean over the whole sequence.

On CUDA this is stock ``torch.distributed.tensor.experimental.context_parallel``. torch has ring
kernels only for the CUDA SDPA ops, so on other devices ``_torch_cp`` runs torch's same templated
ring on the CPU flash kernel.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.distributed.tensor.experimental import context_parallel
from torch.distributed.tensor.experimental._attention import set_rotate_method

from meshtrain.parallel._torch_cp import cpu_context_parallel
from meshtrain.parallel.mesh import ParallelMesh

STOCK_CP_DEVICES = ("cuda",)
"""Devices whose SDPA ops torch's context_parallel dispatches to ring kernels (torch 2.13)."""


def rope_buffers(parts) -> list[torch.Tensor]:
    return [t for part in parts for t in (part.rope_cos, part.rope_sin)]


@contextlib.contextmanager
def sequence_sharded(mesh: ParallelMesh, batch: list[torch.Tensor], parts, rotate_method: str) -> Iterator[None]:
    """Within: ``batch`` tensors ([batch, seq] each) and the parts' RoPE tables hold this cp rank's
    load-balanced share of the sequence, and causal SDPA is ring attention. Forward and backward
    must both run inside."""
    cp = mesh["cp"]
    if cp.size() == 1:
        yield
        return
    set_rotate_method(rotate_method)
    buffers = [*batch, *rope_buffers(parts)]
    seq_dims = [1] * len(batch) + [0] * (len(buffers) - len(batch))
    if mesh.device_type in STOCK_CP_DEVICES:
        shard = context_parallel(cp, buffers=buffers, buffer_seq_dims=seq_dims, no_restore_buffers=set(batch))
    else:
        shard = cpu_context_parallel(cp, buffers, seq_dims)
    with shard:
        yield
