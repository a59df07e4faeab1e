"""Data parallelism: FSDP2 (``fully_shard``) as the distributed optimizer, HSDP when replicated.

Parameters, gradients and AdamW state are sharded over dp_shard x cp; with dp_replicate > 1 the
mesh is 2-D (replicate, shard) and gradients are also all-reduced across replicas. Each block is
its own FSDP unit so only one block's full parameters exist at a time; the root unit holds the
embedding, final norm and output projection. Composes with tensor parallelism: FSDP shards the
already tp-sharded DTensors along their data-parallel mesh dims.

Expert-parallel experts are their own FSDP unit on the expert mesh's "edp" dim instead (expert data
parallel: the ranks holding the same experts). Their stack [E/ep, ...] is split further on dim 0
over edp, so a rank keeps E / (ep * edp) experts between uses. Each edp rank's gradient is one
summand of the stage's loss (the ep, and tp, ranks in between bring other tokens), so the
reduce-scatter sums over edp and divides by dp x cp: the mean over the sequences, as the dense
weights get it. ep folds over tp as well, but tp ranks share one loss, so tp is not in the divisor.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from meshtrain.parallel.mesh import ParallelMesh
from meshtrain.models.transformer import Transformer
from meshtrain.models.moe import MoE

MIXED_PRECISION = {
    "fp32": MixedPrecisionPolicy(),
    "bf16": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
}


def apply_fsdp(model: Transformer, mesh: ParallelMesh, *, mixed_precision: str, reshard_after_forward: bool) -> None:
    policy = MIXED_PRECISION[mixed_precision]
    if mesh.experts is not None:
        for moe in (m for m in model.modules() if isinstance(m, MoE)):
            fully_shard(moe.experts, mesh=mesh["edp"], mp_policy=policy, reshard_after_forward=reshard_after_forward)
            moe.experts.set_gradient_divide_factor(float(mesh.size("dp_cp")))
            # A divisor other than the group size is NCCL's PREMUL_SUM, which gloo lacks; a plain
            # sum and one division of the reduced shard work on every backend. Not on one rank:
            # torch 2.13 then divides twice (its no-communication path divides, then the post-divide).
            moe.experts.set_force_sum_reduction_for_comms(mesh.size("edp") > 1)
    if mesh.size("dp_cp") == 1:
        return
    for layer in model.layers.values():
        fully_shard(layer, mesh=mesh.fsdp, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    # The root's parameters (embedding, norm, lm_head) are used again first thing in backward:
    # keeping them unsharded after forward saves an all-gather for little memory.
    fully_shard(model, mesh=mesh.fsdp, mp_policy=policy, reshard_after_forward=False)


def before_micro_batch(model: nn.Module, accumulate: str, last: bool) -> None:
    """Set up FSDP for the next micro-batch's backward under ``parallel.fsdp_accumulate``: unless
    it is the step's last, keep its gradients unsharded and unreduced (and, with
    reduce_last_unsharded, its parameters gathered); the last one reduces the sum once. Every FSDP
    unit is set, the expert units on edp included (they need not sit under a root unit)."""
    if accumulate == "reduce_each":
        return
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_requires_gradient_sync(last, recurse=False)
            if accumulate == "reduce_last_unsharded":
                module.set_reshard_after_backward(last, recurse=False)
