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
ring on the CPU flash kernel. With document masking (models/documents.py), or a sliding window
shorter than the sequence, the ring, which takes no mask, gives way on every device to
``document_masked``: keys and values all-gathered, the mask (documents, window) built from the
load-balanced chunks' global positions.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.experimental import context_parallel
from torch.distributed.tensor.experimental._attention import set_rotate_method

from meshtrain.models import documents
from meshtrain.parallel._torch_private import gather_along
from meshtrain.parallel._torch_cp import cpu_context_parallel, load_balanced_shards, sharded_in_place
from meshtrain.parallel.mesh import ParallelMesh

STOCK_CP_DEVICES = ("cuda",)
"""Devices whose SDPA ops torch's context_parallel dispatches to ring kernels (torch 2.13)."""


def rope_buffers(parts) -> list[torch.Tensor]:
    return [t for part in parts for t in part.rope_buffers()]


@contextlib.contextmanager
def sequence_sharded(mesh: ParallelMesh, batch: list[torch.Tensor], parts, rotate_method: str,
                     documents: bool = False) -> Iterator[None]:
    """Within: ``batch`` tensors ([batch, seq] each) and the parts' RoPE tables hold this cp rank's
    load-balanced share of the sequence, and causal SDPA is ring attention. Forward and backward
    must both run inside. ``documents``: the batch carries document ids and attention is
    document-masked (``document_masked``)."""
    cp = mesh["cp"]
    if cp.size() == 1:
        yield
        return
    if documents:
        with document_masked(cp, batch):
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


@contextlib.contextmanager
def document_masked(cp: DeviceMesh, batch: list[torch.Tensor]) -> Iterator[None]:
    """Context parallelism with document masking, on any device. The ring takes no mask, so each
    rank all-gathers the keys and values of the whole sequence instead (as Llama 3's CP does; the
    backward reduce-scatters their gradients) and attends with its load-balanced queries under a
    mask built from every rank's document ids and global positions. The RoPE tables stay whole:
    each token indexes them by its global position (or its position in its document)."""
    group = cp.get_group()
    seq_len = batch[0].shape[1]
    (mine,) = load_balanced_shards(cp, [torch.arange(seq_len, device=batch[0].device)], [0])
    every = gather_along(mine, 0, group)  # global positions, in gathered order
    stock = (F.scaled_dot_product_attention, documents.attention_mask, documents.token_positions,
             documents.query_key_positions, documents.every_key)

    def gathered(ids: torch.Tensor) -> torch.Tensor:
        return gather_along(ids, 1, group)

    def attention_mask(ids: torch.Tensor) -> torch.Tensor:
        every_ids = gathered(ids)
        return ((ids[:, :, None] == every_ids[:, None, :]) & (every[None, None, :] <= mine[None, :, None]))[:, None]

    def token_positions(ids: torch.Tensor, reset: bool, mask: torch.Tensor | None) -> torch.Tensor:
        if not reset:
            return mine
        whole = torch.empty(ids.shape[0], seq_len, dtype=ids.dtype, device=ids.device)
        whole[:, every] = gathered(ids)
        return documents.positions_in_document(whole)[:, mine]

    def every_key(key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return gather_along(key, 2, group), gather_along(value, 2, group)

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        keys, values = every_key(key, value)
        return stock[0](query, keys, values, attn_mask=attn_mask, dropout_p=dropout_p, scale=scale,
                        enable_gqa=enable_gqa)

    def query_key_positions(seq: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        return mine, every

    def install(hooks) -> None:
        (F.scaled_dot_product_attention, documents.attention_mask, documents.token_positions,
         documents.query_key_positions, documents.every_key) = hooks

    install((sdpa, attention_mask, token_positions, query_key_positions, every_key))
    try:
        with sharded_in_place(cp, batch, [1] * len(batch)):
            yield
    finally:
        install(stock)
