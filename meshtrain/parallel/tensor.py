"""Tensor and sequence parallelism: the ``parallelize_module`` plan for the transformer (the
embedding and head here, each block's from its own ``tp_plan``).

Megatron's scheme: q/k/v and gate/up are column-parallel (each rank holds a slice of the heads or
of the FFN), o and down are row-parallel, so each block costs one all-reduce in forward for
attention and one for the MLP. With sequence parallel the norms and residual stream are split along
the sequence: each all-reduce becomes a reduce-scatter after o/down plus an all-gather before
q/k/v and gate/up, the same bytes with 1/tp of the norm activations per rank.

The embedding is vocab-parallel (row-wise over its [vocab, hidden] table). The output projection is
vocab-parallel too (the same rows: a tied model keeps one parameter for both), and with ``loss_parallel`` the logits stay sharded into the cross-entropy
(``torch.distributed.tensor.parallel.loss_parallel``), so no rank holds the full [tokens, vocab].
Qwen3's per-head q/k norms see only the local heads; their weights are replicated DTensors so that
autograd sums their gradients over the tp group.

MoE blocks are not split by tp: each tp rank routes its own slice of the sequence through the whole
router and experts (the way expert parallelism folds over tp), and ``sum_moe_grads_over_tp`` adds up
their gradients; expert tensor parallelism (``parallel.etp``, in expert_parallel.py) is the way to
split the experts' FFNs instead.

A replicated parameter fed by sharded activations (the norms under SP, the q/k norms) gets a
Partial gradient: each tp rank holds a summand. ``grads_to_param_placements`` sums them once per step,
after the last micro-batch (and slices gradients that come back Replicate for a sharded
parameter); FSDP2 does this itself during its reduce-scatter when it is applied.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from meshtrain.models.transformer import Transformer
from meshtrain.parallel.styles import TensorParallelStyles


def apply_tensor_parallel(model: Transformer, tp_mesh: DeviceMesh, *, sequence_parallel: bool,
                          loss_parallel: bool, float8: bool = False) -> None:
    sp = sequence_parallel
    colwise, rowwise, prepare_input = _float8_styles() if float8 else (ColwiseParallel, RowwiseParallel,
                                                                       PrepareModuleInput)
    residual = Shard(1) if sp else Replicate()  # layout of the residual stream between blocks

    top = {
        "embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=residual),
        "lm_head": ColwiseParallel(
            input_layouts=residual,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        ),
    }
    if sp:
        top["norm"] = SequenceParallel()
    # A pipeline stage holds only some of these modules.
    top = {name: style for name, style in top.items() if getattr(model, name) is not None}
    if top:
        parallelize_module(model, tp_mesh, top)
        # Each style distributes its own module's weight, which unties a tied head. Both are the
        # same rows of one [vocab, hidden] matrix, Shard(0) over tp (the embedding vocab-parallel
        # row-wise, the head column-wise), so the head takes the embedding's sharded parameter
        # again: one parameter, whose gradient sums both uses.
        model.tie_weights()

    styles = TensorParallelStyles(colwise, rowwise, prepare_input, SequenceParallel, residual,
                                  sequence_parallel_norms=sp)
    for layer in model.layers.values():
        parallelize_module(layer, tp_mesh, layer.tp_plan(styles))


def _float8_styles():
    """torchao's float8 counterparts of the column/row-parallel styles and of the input preparation
    (models/float8.py converted the projections already)."""
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )
    return Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput


@torch.no_grad()
def grads_to_param_placements(params: list[torch.Tensor]) -> None:
    """Bring every gradient to its parameter's placements: all-reduce the ones tensor parallelism
    left Partial, and slice the ones it left Replicate. The vocab-parallel embedding's gradient
    comes out of its backward Replicate (torch 2.13): whole [vocab, hidden] on every tp rank, which
    would otherwise stay allocated and make AdamW redistribute it every step."""
    for p in params:
        g = p.grad
        if isinstance(g, DTensor) and isinstance(p, DTensor) and g.placements != p.placements:
            p.grad = g.redistribute(g.device_mesh, p.placements)


@torch.no_grad()
def sum_moe_grads_over_tp(params: list[torch.Tensor], tp_mesh: DeviceMesh) -> None:
    """MoE blocks are not tensor-parallel: each tp rank runs the whole router (and shared expert, and
    its experts) on its own slice of the sequence, so each holds one summand of their gradients.
    Sum them over tp once per step (before clipping; FSDP has reduced over dp x cp already)."""
    group = tp_mesh.get_group()
    for p in params:
        if p.grad is not None:
            torch.distributed.all_reduce(p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad, group=group)
