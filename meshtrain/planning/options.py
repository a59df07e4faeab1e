"""The options of ``meshtrain plan``: the model, the cluster, and the sizes a user fixes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

GB = 1e9
USABLE_MEMORY = 0.9
"""Fraction of a GPU's memory a plan may fill: the rest is the CUDA context, NCCL buffers and
allocator fragmentation."""


@dataclass
class PlanConfig:
    """meshtrain plan: recommend a parallel layout for a model on a cluster and estimate per-GPU memory."""

    model: str | None = None
    """A meshtrain YAML config (its model section) or a Hugging Face model directory / config.json."""
    params: str | None = None
    """Total parameter count instead of --model, e.g. 70b, 671B, 8e9: the nearest Llama 3 shape."""
    active_params: str | None = None
    """MoE: parameters each token uses (e.g. 37b); with --num-experts."""
    num_experts: int = 0
    """MoE: routed experts per layer (0: a dense model)."""
    experts_per_token: int = 8
    """MoE: experts each token is routed to (top-k)."""
    gpus: int = 8
    gpus_per_node: int = 8
    interconnect: Literal["nvlink", "infiniband", "ethernet"] = "infiniband"
    """nvlink: one NVLink node; infiniband: NVLink inside nodes, IB across; ethernet: weak links."""
    gpu_memory_gb: float = 80.0
    seq_len: int | None = None
    """Default: train.seq_len of a meshtrain YAML --model, else 4096."""
    micro_batch_size: int | None = None
    """Default: train.micro_batch_size of a meshtrain YAML --model, else 1."""
    precision: Literal["fp32", "bf16-mixed", "bf16", "fp16"] | None = None
    """Default: a meshtrain YAML's train.mixed_precision (fp32 or bf16-mixed), else bf16-mixed. fp32; bf16-mixed: fp32 weights and grads, bf16 compute (meshtrain's train.mixed_precision=bf16);
    bf16/fp16: 16-bit weights and grads (Megatron style), see --optimizer-states."""
    optimizer_states: Literal["fp32", "half"] = "fp32"
    """With 16-bit weights: fp32 Adam moments plus an fp32 master copy (12 B/param), or 16-bit moments
    and no master copy (4 B/param)."""
    activation_checkpointing: Literal["auto", "none", "selective", "full"] = "auto"
    """auto: none unless the layout does not fit without it, then selective, then full."""
    tp: int | None = None
    """Fix a size instead of letting the planner choose (likewise pp, vpp, cp, ep)."""
    pp: int | None = None
    vpp: int | None = None
    cp: int | None = None
    ep: int | None = None
    global_batch_size: int | None = None
    """Sequences per step; default micro * dp * (4 * pp micro-batches with a pipeline, else 1)."""
    lora_rank: int | None = None
    """Plan a LoRA fine-tune: adapters of this rank train, the base weights are frozen (no gradients,
    no optimizer state). Default: a meshtrain YAML's peft section; 0 trains every weight."""
    dora: bool = False
    """With --lora-rank: DoRA (a trained magnitude per output row of each adapted layer besides A and B)."""
    preference: bool = False
    """Plan preference training (DPO, IPO, hinge): without --lora-rank a frozen reference copy of the
    weights is held beside them, sharded alike. Default: a meshtrain YAML with data.format=preference."""
    lora_targets: list[str] | None = None
    """With --lora-rank: the modules (wildcards) that get adapters. Default: the YAML's peft.targets,
    else meshtrain's default (attention and MLP projections, the experts' included)."""
