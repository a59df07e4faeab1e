"""Activation checkpointing of decoder layers: none, full, or selective (op-level).

full keeps only each checkpointed layer's input and recomputes the whole layer in backward.
selective keeps the outputs of the expensive ops (the matmuls, attention, and the collectives
between them, so that backward never repeats a communication it can avoid) and recomputes the
cheap ones (norms, RoPE, SwiGLU's activation and product, routing's bookkeeping): per token
3h + 2q + 2kv + 2i elements instead of 4h + 2q + 2kv + 4i (h hidden, i FFN, q/kv head widths;
planning/memory.py has the formulas, checked against what the model keeps) for the cost of
recomputing elementwise ops. ``every`` checkpoints one layer in every ``every`` (by global index), the others keep all.
"""

from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

_aten, _c10d = torch.ops.aten, torch.ops._c10d_functional
# The outputs selective checkpointing keeps (torch 2.13 op names; the attention ops of CPU and CUDA).
SAVED_OPS = {
    _aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten._grouped_mm.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default, _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_efficient_attention.default, _aten._scaled_dot_product_cudnn_attention.default,
    _c10d.reduce_scatter_tensor.default, _c10d.all_to_all_single.default,
}


def _keep_expensive(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def run_layer(layer: torch.nn.Module, index: int, mode: str, every: int, *inputs: torch.Tensor) -> torch.Tensor:
    """``layer(*inputs)``, checkpointed as ``mode`` if its global ``index`` is one in ``every``."""
    if mode == "none" or index % every or not torch.is_grad_enabled():
        return layer(*inputs)
    if mode == "full":
        return checkpoint(layer, *inputs, use_reentrant=False)
    return checkpoint(layer, *inputs, use_reentrant=False,
                      context_fn=functools.partial(create_selective_checkpoint_contexts, _keep_expensive))
