"""The CPU path of context parallelism, built from torch's own CP internals (private APIs).

Checked against torch 2.13.0. Stock ``context_parallel`` shards the buffers and sends SDPA through
DTensor to ring kernels it has only for the CUDA ops (flash / efficient / cuDNN); on CPU the op is
``aten._scaled_dot_product_flash_attention_for_cpu`` and DTensor raises NotImplementedError for it.
Here the same pieces run without DTensor: torch's buffer sharding with its head-tail load balancer
(``_context_parallel_buffers``, ``_create_default_load_balancer``), and torch's templated ring
forward and backward (``_templated_ring_attention[_backward]``: K/V rotation, the causal
skip/half-block logic of load balancing, the logsumexp merge) driving the CPU flash kernels.
So the CPU path computes what CUDA's does, block for block, and honours ``set_rotate_method``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.experimental._context_parallel import _attention as cp_attention
from torch.distributed.tensor.experimental._context_parallel._load_balancer import _create_default_load_balancer

aten = torch.ops.aten
SEQ_DIM = 2  # of SDPA's [batch, heads, seq, head_dim]


class _RingAttention(torch.autograd.Function):
    """Causal ring attention over ``group`` on load-balanced (head-tail) local q, k, v. Saves only the
    local blocks and the merged logsumexp; backward rotates K/V again, as torch's CUDA ring does."""

    @staticmethod
    def forward(ctx, query, key, value, group: dist.ProcessGroup, scale: float | None):
        out, lse = cp_attention._templated_ring_attention(
            group, SEQ_DIM, aten._scaled_dot_product_flash_attention_for_cpu, query, key, value,
            is_causal=True, dropout_p=0.0, scale=scale)[:2]
        out = out.to(query.dtype)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.group, ctx.scale = group, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, out, lse = ctx.saved_tensors
        grad_q, grad_k, grad_v = cp_attention._templated_ring_attention_backward(
            ctx.group, SEQ_DIM, aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
            grad_out=grad_out.contiguous(), grad_out_name="grad_out", query=query, key=key, value=value, out=out,
            logsumexp=lse, is_causal=True, dropout_p=0.0, scale=ctx.scale)[:3]
        return grad_q, grad_k, grad_v, None, None


@torch.compiler.disable  # a compiled layer runs it eagerly between its graphs: dynamo cannot trace the ring's process group
def ring_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, group: dist.ProcessGroup,
                   scale: float | None = None) -> torch.Tensor:
    return _RingAttention.apply(query, key, value, group, scale)


def load_balanced_shards(mesh: DeviceMesh, buffers: list[torch.Tensor], seq_dims: list[int]) -> list[torch.Tensor]:
    """This cp rank's head-tail load-balanced share of each buffer along its sequence dim."""
    seq_len = buffers[0].shape[seq_dims[0]]
    balancer = _create_default_load_balancer(seq_len, mesh.size(), buffers[0].device)
    if balancer is None:  # plan_layout's seq_len % (2 * cp) rule makes this unreachable from a config
        raise ValueError(f"sequence length {seq_len} is not divisible by 2*cp = {2 * mesh.size()}")
    return [shard.clone() for shard in cp_attention._context_parallel_buffers(mesh, buffers, seq_dims, balancer)]


@contextlib.contextmanager
def sharded_in_place(mesh: DeviceMesh, buffers: list[torch.Tensor], seq_dims: list[int]) -> Iterator[None]:
    """Within: each buffer holds only this rank's load-balanced share; restored on exit."""
    originals = [b.clone() for b in buffers]
    for buffer, shard in zip(buffers, load_balanced_shards(mesh, buffers, seq_dims)):
        buffer.resize_(shard.shape)
        buffer.copy_(shard)
    try:
        yield
    finally:
        for buffer, original in zip(buffers, originals):
            buffer.resize_(original.shape)
            buffer.copy_(original)


@contextlib.contextmanager
def cpu_context_parallel(mesh: DeviceMesh, buffers: list[torch.Tensor], seq_dims: list[int]) -> Iterator[None]:
    """``context_parallel``'s contract on CPU: shard ``buffers`` in place along ``seq_dims`` (head-tail
    load balanced), route causal SDPA calls to the ring, restore both on exit."""
    group = mesh.get_group()
    stock_sdpa = F.scaled_dot_product_attention
    saved_load_balance = cp_attention._cp_options.enable_load_balance
    cp_attention._cp_options.enable_load_balance = True

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if attn_mask is not None or dropout_p or not is_causal:
            raise NotImplementedError("context parallel attention supports causal SDPA without a mask or dropout")
        return ring_attention(query, key, value, group, scale)

    F.scaled_dot_product_attention = sdpa
    try:
        with sharded_in_place(mesh, buffers, seq_dims):
            yield
    finally:
        F.scaled_dot_product_attention = stock_sdpa
        cp_attention._cp_options.enable_load_balance = saved_load_balance
