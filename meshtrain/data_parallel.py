"""Data parallelism: FSDP2 (``fully_shard``) as the distributed optimizer, HSDP when replicated.

Parameters, gradients and AdamW state are sharded over dp_shard x cp; with dp_replicate > 1 the
mesh is 2-D (replicate, shard) and gradients are also all-reduced across replicas. Each block is
its own FSDP unit so only one block's full parameters exist at a time; the root unit holds the
embedding, final norm and output projection. Composes with tensor parallelism: FSDP shards the
already tp-sharded DTensors along their data-parallel mesh dims.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from meshtrain.model import Transformer

MIXED_PRECISION = {
    "fp32": MixedPrecisionPolicy(),
    "bf16": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
}


def apply_fsdp(model: Transformer, dp_mesh: DeviceMesh, *, mixed_precision: str,
               reshard_after_forward: bool, ignored: set[torch.nn.Parameter] = frozenset()) -> None:
    """``ignored``: parameters FSDP leaves alone (expert-parallel experts, reduced by expert_parallel)."""
    policy = MIXED_PRECISION[mixed_precision]
    for layer in model.layers.values():
        mine = {p for p in layer.parameters() if p in ignored}
        fully_shard(layer, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward,
                    ignored_params=mine or None)
    # The root's parameters (embedding, norm, lm_head) are used again first thing in backward:
    # keeping them unsharded after forward saves an all-gather for little memory.
    fully_shard(model, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=False)
