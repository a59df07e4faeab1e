"""The order parallelism is applied in, the design in one function.

Build the model (or one pipeline stage of it) on the meta device, apply TP/SP, then EP to the
stacked experts, then FSDP2, and only then materialise and initialise the local shards: no rank
ever holds more than its shards, so a model larger than one rank's memory can be built.
"""

from __future__ import annotations

import torch
from torch.distributed._functional_collectives import wait_tensor
from torch.distributed.tensor.parallel import parallelize_module

from meshtrain.config import JobConfig
from meshtrain.models.float8 import convert_to_float8
from meshtrain.models.initialize import init_weights
from meshtrain.models.lora import add_lora, check_lora, init_lora
from meshtrain.models.moe import MoE
from meshtrain.models.transformer import Transformer
from meshtrain.parallel.expert import ExpertParallel
from meshtrain.parallel.fsdp import apply_fsdp
from meshtrain.parallel.layout import reshard_after_forward, stage_layer_counts
from meshtrain.parallel.mesh import ParallelMesh
from meshtrain.parallel.pipeline import split_for_stage
from meshtrain.parallel.tensor import apply_tensor_parallel


def build_model(cfg: JobConfig, mesh: ParallelMesh, device: torch.device, stage: int | None = None, *,
                initialize: bool = True) -> Transformer:
    """The whole model, or pipeline stage ``stage`` of it: built on meta, sharded, then initialised
    (``initialize=False`` leaves the memory uninitialised, for weights about to be loaded)."""
    with torch.device("meta"):
        model = Transformer(cfg.model)
    if stage is not None:
        split_for_stage(model, stage, stage_layer_counts_for(cfg))
    if cfg.train.float8:
        convert_to_float8(model, fsdp_all_gather=float8_all_gather(cfg, mesh), emulate=cfg.train.float8_emulate)
    model.activation_checkpointing = cfg.train.activation_checkpointing
    model.activation_checkpointing_every = cfg.train.activation_checkpointing_every
    model.reset_position_ids = cfg.data.reset_position_ids
    if mesh.size("tp") > 1:
        apply_tensor_parallel(model, mesh["tp"], sequence_parallel=cfg.parallel.sp,
                              loss_parallel=cfg.parallel.loss_parallel, float8=cfg.train.float8)
    if mesh.experts is not None:
        for module in model.modules():
            if isinstance(module, MoE):
                parallelize_module(module.experts, mesh.expert_grid, ExpertParallel())
    if cfg.peft.adapters:  # after EP, which makes the experts' parameters anew (trainable)
        check_lora(cfg.peft, model)
        add_lora(model, cfg.peft)
    if cfg.train.compile:
        compile_layers(model, ring_attention=mesh.size("cp") > 1)
    apply_fsdp(model, mesh, mixed_precision=cfg.train.mixed_precision,
               reshard_after_forward=reshard_after_forward(cfg.parallel.fsdp_reshard_after_forward, mesh.size("pp")))
    if mesh.size("dp_cp") == 1 and cfg.train.mixed_precision == "bf16":
        model.forward = torch.autocast(device.type, dtype=torch.bfloat16)(model.forward)  # FSDP's policy casts otherwise
    model.to_empty(device=device)
    model.tie_weights()
    if initialize:
        init_weights(model, cfg.train.seed)
    if cfg.peft.adapters:  # not in a Hugging Face checkpoint: initialised either way
        init_lora(model, cfg.train.seed)
    return model


def compile_layers(model: Transformer, *, ring_attention: bool) -> None:
    """torch.compile each decoder layer (parameter names unchanged; the module's own hooks, FSDP's
    among them, stay outside the graph and run eagerly around it; TP's hooks on the projections are
    traced into it). A dense layer compiles whole, as one graph, except under context parallelism,
    where the ring attention runs eagerly between two graphs. An MoE layer compiles its attention
    half only: routing has data-dependent shapes (bincount, nonzero, uneven all-to-all), and
    compiling it split each layer into ~14 graphs and recompiled them whenever the expert loads
    took new shapes (steps 6 and 7 of 8 on the ep2 test model), so it stays eager."""
    for layer in model.layers.values():
        if isinstance(layer.mlp, MoE):
            layer.attention_residual = _resolving_async_input(
                torch.compile(layer.attention_residual, fullgraph=not ring_attention))
        else:
            layer.forward = _resolving_async_input(torch.compile(layer.forward, fullgraph=not ring_attention))


def _resolving_async_input(compiled_forward):
    """Wait for an async collective's output before it enters the compiled layer. Under TP the
    embedding hands layer 0 an AsyncCollectiveTensor (its all-reduce or reduce-scatter runs
    async_op=True); torch 2.13's AOTAutograd traces it as a subclass input and its backward then
    gives DTensor's Redistribute a plain gradient (``'Tensor' object has no attribute
    '_local_tensor'``; pytorch#179506/#179849). ``wait_tensor`` is differentiable and a no-op on a
    plain tensor."""
    def forward(x: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
        return compiled_forward(wait_tensor(x), *rest)
    return forward


def float8_all_gather(cfg: JobConfig, mesh: ParallelMesh) -> bool:
    """Whether float8 weights are all-gathered in float8: asked for, and FSDP shards them."""
    return cfg.train.float8 and cfg.train.float8_all_gather and mesh.size("dp_shard_cp") > 1


def stage_layer_counts_for(cfg: JobConfig) -> tuple[int, ...]:
    p = cfg.parallel
    return tuple(stage_layer_counts(cfg.model.num_hidden_layers, p.pp, p.vpp, p.pp_layers_per_stage))
