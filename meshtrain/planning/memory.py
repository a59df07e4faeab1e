"""The memory model: each rank's exact parameter shard sizes, and the activations autograd keeps.

Per-rank bytes are exact counts of local shard elements, the same ``torch.chunk`` split FSDP2
makes, so tests/test_planner.py checks them against the trainer's real allocation
(``telemetry.allocation``). Activations are counted per decoder layer as the tensors autograd
saves for backward in this model (SwiGLU MLP, grouped-query attention with a fused SDPA kernel that
keeps no score matrix), for one micro-batch; under 1F1B the first pipeline stage keeps
min(pp, micro-batches) of them in flight.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from meshtrain.config import JobConfig
from meshtrain.planning.options import PlanConfig
from meshtrain.planning.shapes import ModelShape, ParamTensor, parameter_tensors, shape_from_job


@dataclass(frozen=True)
class Sizes:
    """A candidate layout's sizes; ``dp_shard`` ranks (x cp) shard the dense parameters with FSDP."""

    world: int
    pp: int = 1
    vpp: int = 1
    tp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 1
    dp_replicate: int = 1
    sp: bool = False
    stage_layers: tuple[int, ...] = ()

    @property
    def dp(self) -> int:
        return self.world // (self.pp * self.tp * self.cp)

    @property
    def dp_shard(self) -> int:
        return self.dp // self.dp_replicate

    @property
    def edp(self) -> int:
        return self.world // (self.pp * self.ep * self.etp)


def _chunk(n: int, parts: int, index: int) -> int:
    """Length of piece ``index`` when torch.chunk cuts n into ``parts`` (FSDP2's dim-0 split)."""
    size = -(-n // parts)
    return max(0, min(size, n - index * size))


def local_elements(t: ParamTensor, sizes: Sizes, *, tp_rank: int = 0, fsdp_rank: int = 0, edp_rank: int = 0,
                   fsdp: bool = True) -> int:
    """Elements of ``t`` held by the rank at these coordinates (rank 0 of each group holds the most)."""
    shape = list(t.shape)
    if t.expert and sizes.ep * sizes.etp > 1:
        shape[0] //= sizes.ep
        if sizes.etp > 1 and t.tp_dim is not None:  # None: a LoRA adapter replicated over etp
            shape[t.tp_dim] //= sizes.etp
        shards, shard_rank = sizes.edp, edp_rank  # FSDP splits each ep shard over all of edp (HSDP too)
    else:  # dense tensors, and experts without ep/etp (FSDP shards them with the dense ones)
        if t.tp_dim is not None and sizes.tp > 1 and not t.expert:
            shape[t.tp_dim] = _chunk(shape[t.tp_dim], sizes.tp, tp_rank)
        shards, shard_rank = sizes.dp_shard * sizes.cp, fsdp_rank
    if fsdp and shards > 1:
        shape[0] = _chunk(shape[0], shards, shard_rank)
    return math.prod(shape)


def stage_tensors(tensors: list[ParamTensor], s: ModelShape, sizes: Sizes, stage_ids: list[int]) -> list[ParamTensor]:
    """The tensors of the pipeline stages ``stage_ids`` (layers by global index, embedding on stage 0,
    norm and head on the last)."""
    counts = sizes.stage_layers or (s.num_layers,)
    last = len(counts) - 1
    keep: set[int] = set()
    for sid in stage_ids:
        start = sum(counts[:sid])
        keep.update(range(start, start + counts[sid]))
    def kept(t: ParamTensor) -> bool:
        if t.layer is not None:
            return t.layer in keep
        return (0 in stage_ids) if t.name.startswith("embed") else (last in stage_ids)
    out = [t for t in tensors if kept(t)]
    if s.tied and sizes.pp > 1 and last in stage_ids:  # the last stage's own copy of a tied embedding
        embedding = next(t for t in tensors if t.name == "embed_tokens.weight")
        out.append(dataclasses.replace(embedding, name="lm_head.weight", linear=True))
    return out


def stage_ids_of(pp_rank: int, sizes: Sizes, schedule: str) -> list[int]:
    from meshtrain.parallel.pipeline import stage_ids_for_rank

    return stage_ids_for_rank(pp_rank, sizes.pp, sizes.vpp, schedule) if sizes.pp > 1 else [0]


def rank_parameters(s: ModelShape, sizes: Sizes, schedule: str, *, pp_rank: int = 0, tp_rank: int = 0,
                    fsdp_rank: int = 0, edp_rank: int = 0, fsdp: bool = True, trainable: bool = False) -> int:
    """Parameter elements on one rank: its pipeline stages, its tp/ep slice, its FSDP shard (with
    ``trainable``, only those that get gradients and optimizer state: a LoRA fine-tune's adapters)."""
    mine = stage_tensors(parameter_tensors(s), s, sizes, stage_ids_of(pp_rank, sizes, schedule))
    return sum(local_elements(t, sizes, tp_rank=tp_rank, fsdp_rank=fsdp_rank, edp_rank=edp_rank, fsdp=fsdp)
               for t in mine if t.trainable or not trainable)


# ---- bytes per parameter and per activation ----------------------------------------------------

@dataclass(frozen=True)
class Precision:
    weights: int
    grads: int
    optimizer: int
    activations: int
    note: str


def precision_of(cfg: PlanConfig) -> Precision:
    if cfg.precision == "fp32":
        return Precision(4, 4, 8, 4, "fp32 weights and grads, fp32 Adam moments m and v")
    if cfg.precision == "bf16-mixed":
        return Precision(4, 4, 8, 2, "fp32 weights and grads (FSDP gathers bf16 copies to compute), fp32 Adam m and v")
    if cfg.optimizer_states == "fp32":
        return Precision(2, 2, 12, 2, f"{cfg.precision} weights and grads; fp32 master weights + Adam m and v")
    return Precision(2, 2, 4, 2, f"{cfg.precision} weights, grads and Adam m and v (no master copy)")


def trainer_rank_state(cfg: JobConfig, layout, *, pp_rank: int, tp_rank: int, fsdp_rank: int,
                       edp_rank: int = 0) -> dict:
    """The plan's parameter elements and parameter/grad/optimizer bytes for one rank of a trainer
    run with ``cfg`` on ``layout`` (the figures ``telemetry.allocation.measure_training_state`` measures)."""
    prec = precision_of(PlanConfig(precision={"fp32": "fp32", "bf16": "bf16-mixed"}[cfg.train.mixed_precision]))
    n, trained = (rank_parameters(shape_from_job(cfg, cfg.model.family), sizes_of(layout), layout.pp_schedule,
                                  pp_rank=pp_rank, tp_rank=tp_rank, fsdp_rank=fsdp_rank, edp_rank=edp_rank,
                                  trainable=only) for only in (False, True))
    return {"param_elements": n, "param_bytes": n * prec.weights, "grad_bytes": trained * prec.grads,
            "optimizer_bytes": trained * prec.optimizer}


def layer_activation_elements(s: ModelShape, layer: int, sizes: Sizes, tokens: int, ac: str,
                              fused_norm: bool = True, seq_len: int | None = None,
                              activation_bytes: int = 2) -> float:
    """Elements autograd keeps for one micro-batch of ``tokens`` (= micro * seq) through ``layer``,
    in the activations' dtype of ``activation_bytes`` (``seq_len``: the keys each query meets,
    ``tokens`` when None).

    Per layer, with t = tp, c = cp, T = tokens / c (checked against the tensors autograd saves in
    tests/test_planner.py):
      norm inputs (2; Gemma's 4), kept for RMSNorm's backward: 2 T h  (/ t with SP)
      norm outputs (2), the inputs of q/k/v and gate/up:   2 T h  (whole per tp rank: torch's SP gathers
                                                                   them, then the matmul saves them)
      q, k, v and the attention output (SDPA's saves):     T (2 q + 2 kv) / t  (+ q, k before their norms
                                                                   for Qwen3)
      SwiGLU gate, up, silu(gate), their product:          4 T i / t
      MoE instead: per routed copy the token (h), 4 i_e / etp, the expert output (h) and its weighted
      copy (h, which index_add keeps for the combine)
    A fused RMSNorm kernel (CUDA) saves its input and rstd; the composite one (CPU) also saves the
    normalized input (``fused_norm=False``). ``ac`` (train.activation_checkpointing): with full
    checkpointing only the layer input T h (/ t with SP) is kept; selective keeps the input and the
    outputs of the matmuls, attention and collectives (models/checkpointing.py):
      q, k, v and the attention output:                   T (2 q + 2 kv) / t
      o_proj and down_proj outputs (whole per tp rank):   2 T h
      gate and up outputs:                                2 T i / t
      MoE instead of gate/up/down: the router's logits T E, and per routed copy 2 i_e / etp + h
    Attention computed on materialised scores (Gemma 2's soft-capping, GPT-OSS's sinks:
    ``materialized_attention``) keeps per head and query every key's probability, in fp32 and
    (when the activations are not) again in their dtype for the product with v, plus Gemma 2's
    tanh output: T (heads / t) S x that many, S the sequence (every key, under cp too); k and v
    repeated to every head (2 q instead of 2 kv). Selective checkpointing keeps the scores' matmul
    output: T (heads / t) S. GPT-OSS's experts keep 7 i_e per copy (clamps and the sigmoid gate:
    ``expert_activations``). Latent attention (DeepSeek) keeps its latents whole per tp rank (the
    query latent and, per norm copy, its normalised one; the key/value latent with the RoPE key),
    and a copy of the attention output for o_proj: T (latent terms + heads v / t).
    """
    t, T, h = sizes.tp, tokens / sizes.cp, s.hidden_size
    split = t if sizes.sp else 1
    q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    scores = T * s.num_heads / t * (seq_len or tokens)  # per layer, when materialised
    if ac == "full":
        return T * h / split
    if ac == "selective":
        elements = T * h / split + T * (2 * q + 2 * kv) / t + T * h + (scores if s.materialized_attention else 0)
        if s.is_sparse(layer):
            k, ei = s.experts_per_token, s.expert_intermediate_size
            elements += T / split * (s.num_experts + k * (2 * ei / sizes.etp + h))
            if s.shared_expert_intermediate_size:
                elements += 2 * T * s.shared_expert_intermediate_size / t + T * h
        else:
            elements += 2 * T * s.intermediate_size / t + T * h
        return elements
    copies = 1 if fused_norm else 2
    if s.materialized_attention:
        kv = q  # k and v repeated to every head
        per_score = 4 / activation_bytes + (activation_bytes != 4) + (s.materialized_attention == "softcapped")
        elements = scores * per_score
    else:
        elements = 0.0
    attn = 2 * q + 2 * kv + ((q + kv) * copies if s.qk_norm else 0)
    elements += s.norms_per_layer * copies * T * h / split + 2 * T * h + T * attn / t
    if s.latent_attention:
        q_rank, kv_rank, rope = s.latent_attention
        elements += T * ((copies + 1) * q_rank + kv_rank + rope + copies * kv_rank) + T * s.num_heads * s.v_head_dim / t
    if s.is_sparse(layer):
        k, ei = s.experts_per_token, s.expert_intermediate_size
        # MoE tokens: each tp rank routes the whole sequence unless SP split it.
        elements += T / split * k * (3 * h + s.expert_activations * ei / sizes.etp)
        if s.shared_expert_intermediate_size:
            elements += 4 * T * s.shared_expert_intermediate_size / t
    else:
        elements += 4 * T * s.intermediate_size / t
    return elements


def in_flight_microbatches(sizes: Sizes, schedule: str, microbatches: int, pp_rank: int = 0) -> float:
    """Micro-batches whose activations pp rank ``pp_rank`` holds at its peak: under 1F1B rank r runs
    pp - r forwards before its first backward (rank 0 the most)."""
    if sizes.pp == 1:
        return 1  # gradient accumulation frees each micro-batch's activations in its backward
    if schedule == "GPipe" or schedule == "LoopedBFS":
        return microbatches
    flight = min(sizes.pp - pp_rank, microbatches)
    if sizes.vpp > 1:  # Megatron's interleaved-schedule factor (Narayanan et al. 2021)
        flight *= 1 + (sizes.pp - 1) / (sizes.pp * sizes.vpp)
    return flight


@dataclass
class Memory:
    """Bytes on the busiest rank (pp rank 0, or the last stage when its head weighs more)."""

    params: int
    params_no_fsdp: int
    precision: Precision
    activations: float
    activations_per_layer: float
    logits: float
    in_flight: float
    layers_on_rank: int
    ac: str
    """train.activation_checkpointing: none, full or selective."""
    pp_rank: int = 0
    trainable: int | None = None
    """Of ``params``, those with gradients and optimizer state (a LoRA fine-tune's adapters); None: all."""
    trainable_no_fsdp: int | None = None
    reference: bool = False
    """A frozen reference copy of the weights (preference training without LoRA) beside them."""

    @property
    def trained(self) -> int:
        return self.params if self.trainable is None else self.trainable

    @property
    def trained_no_fsdp(self) -> int:
        return self.params_no_fsdp if self.trainable_no_fsdp is None else self.trainable_no_fsdp

    @property
    def weights(self) -> float:
        return self.params * self.precision.weights

    @property
    def grads(self) -> float:
        return self.trained * self.precision.grads

    @property
    def optimizer(self) -> float:
        return self.trained * self.precision.optimizer

    @property
    def states(self) -> float:
        return self.weights * (2 if self.reference else 1) + self.grads + self.optimizer

    @property
    def states_no_fsdp(self) -> float:
        p = self.precision
        return self.params_no_fsdp * p.weights * (2 if self.reference else 1) + self.trained_no_fsdp * (p.grads + p.optimizer)

    @property
    def total(self) -> float:
        return self.states + self.activations + self.logits

    @property
    def total_no_fsdp(self) -> float:
        return self.states_no_fsdp + self.activations + self.logits


def sizes_of(layout) -> Sizes:
    """The planner's view of a ``parallel.layout.Layout`` (to compare with what the trainer builds from it)."""
    return Sizes(world=layout.world_size, pp=layout.pp, vpp=layout.vpp, tp=layout.tp, cp=layout.cp, ep=layout.ep,
                 etp=layout.etp, dp_replicate=layout.dp_replicate, sp=layout.sp, stage_layers=layout.stage_layers)


def estimate(s: ModelShape, sizes: Sizes, cfg: PlanConfig, schedule: str, microbatches: int,
             ac: str) -> Memory:
    prec = precision_of(cfg)
    tokens = cfg.micro_batch_size * cfg.seq_len
    best: Memory | None = None
    for pp_rank in sorted({0, sizes.pp - 1}):
        stages = stage_ids_of(pp_rank, sizes, schedule)
        layers = [t.layer for t in stage_tensors(parameter_tensors(s), s, sizes, stages) if t.layer is not None]
        layer_ids = sorted(set(layers))
        per_layer = [layer_activation_elements(s, i, sizes, tokens, ac, seq_len=cfg.seq_len,
                                               activation_bytes=prec.activations) for i in layer_ids]
        flight = in_flight_microbatches(sizes, schedule, microbatches, pp_rank)
        act = sum(per_layer) * flight * prec.activations
        if ac != "none" and layer_ids:  # one layer is recomputed at a time in backward (at most all of it)
            act += layer_activation_elements(s, layer_ids[0], sizes, tokens, "none", seq_len=cfg.seq_len,
                                             activation_bytes=prec.activations) * prec.activations
        last = (sizes.pp * sizes.vpp - 1) in stages
        # logits (compute dtype) + their fp32 copy + log-softmax output, vocab-sharded by tp (loss_parallel)
        logits = tokens / sizes.cp * s.vocab_size / sizes.tp * (prec.activations + 8) if last else 0.0
        counts = [rank_parameters(s, sizes, schedule, pp_rank=pp_rank, fsdp=fsdp, trainable=trainable)
                  for trainable in (False, True) for fsdp in (True, False)]
        m = Memory(counts[0], counts[1], prec, act, (per_layer[0] if per_layer else 0) * prec.activations, logits,
                   flight, len(layer_ids), ac, pp_rank, *(counts[2:] if s.lora_rank else (None, None)),
                   reference=s.reference_copy)
        if best is None or m.total > best.total:
            best = m
    return best
