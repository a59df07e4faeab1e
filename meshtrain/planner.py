"""``meshtrain plan``: recommend a starting layout and estimate each GPU's memory, formulas shown.

The model is a ``ModelShape``: read from a meshtrain YAML, a Hugging Face config.json, or derived
from a parameter count (the nearest Llama 3 shape, layers scaled to the count). The shape gives a
tensor inventory that mirrors what the trainer allocates (``parameter_tensors``): each tensor's
shape and how tensor, expert and fully-sharded data parallelism cut it. Per-rank bytes are then
exact counts of local shard elements, the same ``torch.chunk`` split FSDP2 makes, so
tests/test_planner.py checks them against the trainer's real allocation.

Activations are counted per decoder layer as the tensors autograd saves for backward in this
model (SwiGLU MLP, grouped-query attention with a fused SDPA kernel that keeps no score matrix),
for one micro-batch; under 1F1B the first pipeline stage keeps min(pp, micro-batches) of them in
flight. The recommendation starts from the table of the reference (section 3), picks inside the
table's ranges by topology, and takes the first candidate that ``mesh.plan_layout`` accepts and
that fits in memory. Sizes the user fixes are validated by the same rules the trainer enforces.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import re
from dataclasses import dataclass, field
from typing import Literal

from meshtrain.config import JobConfig, ModelConfig, ParallelConfig, TrainConfig, load_yaml
from meshtrain.errors import ConfigError
from meshtrain.mesh import check_expert_layout, describe_sizes, layout_extras, plan_layout

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
    activation_checkpointing: Literal["auto", "on", "off"] = "auto"
    """auto: off unless the layout does not fit without it."""
    tp: int | None = None
    """Fix a size instead of letting the planner choose (likewise pp, vpp, cp, ep)."""
    pp: int | None = None
    vpp: int | None = None
    cp: int | None = None
    ep: int | None = None
    global_batch_size: int | None = None
    """Sequences per step; default micro * dp * (4 * pp micro-batches with a pipeline, else 1)."""


# ---- the model's shape -------------------------------------------------------------------------

@dataclass(frozen=True)
class ModelShape:
    name: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    """Dense FFN (SwiGLU) size; 0 when every layer is MoE."""
    tied: bool = False
    qk_norm: bool = False
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    dense_layers: tuple[int, ...] = ()
    """MoE models: the layers that keep a dense MLP (HF's mlp_only_layers / decoder_sparse_step)."""
    max_position_embeddings: int = 131072

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_sparse(self, layer: int) -> bool:
        return self.is_moe and layer not in self.dense_layers


# Llama 3 shapes a parameter count is fitted to (Llama 3.2 1B, 3.1 8B, 3.1 70B, 3.1 405B).
LLAMA3_SHAPES = {
    "1B": dict(vocab_size=128256, hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64,
               intermediate_size=8192, tied=True),
    "8B": dict(vocab_size=128256, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
               intermediate_size=14336),
    "70B": dict(vocab_size=128256, hidden_size=8192, num_layers=80, num_heads=64, num_kv_heads=8, head_dim=128,
                intermediate_size=28672),
    "405B": dict(vocab_size=128256, hidden_size=16384, num_layers=126, num_heads=128, num_kv_heads=8, head_dim=128,
                 intermediate_size=53248),
}


def parse_count(text: str, field_name: str) -> float:
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmbt]?)\s*", text.lower())
    if not m:
        raise ConfigError(f"--{field_name}={text!r} is not a parameter count. Fix: write e.g. 70b, 1.5t or 8e9")
    return float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}[m.group(2)]


def _attention_params(s: ModelShape) -> int:
    q_o = 2 * s.hidden_size * s.num_heads * s.head_dim
    return q_o + 2 * s.hidden_size * s.num_kv_heads * s.head_dim + 2 * s.hidden_size


def shape_from_count(total: float, active: float | None, num_experts: int, experts_per_token: int) -> ModelShape:
    """A Llama 3 shape (nearest on a log scale to the active parameters) with its layer count, and for
    MoE the expert size, solved so that total and active parameters match the counts."""
    if total <= 0:
        raise ConfigError("--params must be positive")
    moe = num_experts > 0
    if active is not None and not moe:
        raise ConfigError("--active-params is given for a dense model. Fix: add --num-experts, or drop --active-params")
    if moe and active is None:
        raise ConfigError("--num-experts needs --active-params (parameters each token uses). Fix: add e.g. --active-params 37b")
    if moe and not 0 < experts_per_token < num_experts:
        raise ConfigError(f"--experts-per-token={experts_per_token} must be between 1 and --num-experts-1 = {num_experts - 1}")
    if moe and not active < total:
        raise ConfigError(f"--active-params={active:.3g} must be smaller than --params={total:.3g}")
    target = active if moe else total
    key = min(LLAMA3_SHAPES, key=lambda k: abs(math.log(target / parse_count(k, "params"))))
    base = ModelShape(name=f"{total / 1e9:.4g}B (Llama 3 {key} shape)", **LLAMA3_SHAPES[key])
    embed = base.vocab_size * base.hidden_size * (1 if base.tied else 2) + base.hidden_size
    if not moe:
        per_layer = _attention_params(base) + 3 * base.hidden_size * base.intermediate_size
        if abs(embed + base.num_layers * per_layer - total) <= 0.05 * total:
            return base  # a nominal size ("70b") means the model itself, not 79.4 of its layers
        layers = max(1, round((total - embed) / per_layer))
        return dataclasses.replace(base, num_layers=layers)
    # Solve layers L and expert size i: total - active = L (E - k) 3 h i;  active = embed + L (attn + k 3 h i + h E).
    experts_per_layer_params = (total - active) / (num_experts - experts_per_token)  # L * 3 h i
    rest = active - embed - experts_per_token * experts_per_layer_params  # L * (attn + router)
    per_layer_rest = _attention_params(base) + base.hidden_size * num_experts
    if rest <= per_layer_rest:
        raise ConfigError(f"--active-params={active / 1e9:.3g}B is too small for {num_experts} experts with top-"
                          f"{experts_per_token} out of --params={total / 1e9:.3g}B (the experts alone would be more "
                          "than the active count). Fix: check the counts")
    layers = max(1, round(rest / per_layer_rest))
    expert_i = max(1, round(experts_per_layer_params / (layers * 3 * base.hidden_size)))
    return dataclasses.replace(base, num_layers=layers, intermediate_size=0, num_experts=num_experts,
                               experts_per_token=experts_per_token, expert_intermediate_size=expert_i, tied=False)


def shape_from_model_config(m: ModelConfig, name: str) -> ModelShape:
    moe = {}
    if m.is_moe:
        moe = dict(num_experts=m.num_experts, experts_per_token=m.num_experts_per_tok,
                   expert_intermediate_size=m.resolved_moe_intermediate_size,
                   shared_expert_intermediate_size=m.shared_expert_intermediate_size,
                   dense_layers=tuple(i for i in range(m.num_hidden_layers) if not m.is_sparse_layer(i)))
    return ModelShape(name=name, vocab_size=m.vocab_size, hidden_size=m.hidden_size, num_layers=m.num_hidden_layers,
                      num_heads=m.num_attention_heads, num_kv_heads=m.num_key_value_heads, head_dim=m.resolved_head_dim,
                      intermediate_size=m.intermediate_size, tied=m.tie_word_embeddings, qk_norm=m.qk_norm,
                      max_position_embeddings=m.max_position_embeddings, **moe)


def shape_from_hf_config(hf: dict, where: str) -> ModelShape:
    """Llama, Qwen3, Qwen3-MoE and Mixtral config.json (and others with the same field names)."""
    def get(key: str, default=None):
        if key in hf:
            return hf[key]
        if default is None:
            raise ConfigError(f"{where}: config.json has no {key!r}, which the planner needs. Fix: a causal LM config.json")
        return default

    model_type = hf.get("model_type", "")
    layers = get("num_hidden_layers")
    heads = get("num_attention_heads")
    experts = hf.get("num_experts") or hf.get("num_local_experts") or 0
    dense: tuple[int, ...] = ()
    if experts:
        step = hf.get("decoder_sparse_step", 1) or 1
        only = set(hf.get("mlp_only_layers") or [])
        dense = tuple(i for i in range(layers) if i in only or (i + 1) % step)
    expert_i = hf.get("moe_intermediate_size") or (get("intermediate_size") if experts else 0)
    return ModelShape(
        name=f"{where} ({model_type or 'unknown type'})", vocab_size=get("vocab_size"),
        hidden_size=get("hidden_size"), num_layers=layers, num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or get("hidden_size") // heads,
        intermediate_size=(get("intermediate_size") if (not experts or dense) else 0),
        tied=bool(hf.get("tie_word_embeddings", False)), qk_norm=model_type.startswith("qwen3"),
        num_experts=experts, experts_per_token=hf.get("num_experts_per_tok", 0) if experts else 0,
        expert_intermediate_size=expert_i if experts else 0,
        shared_expert_intermediate_size=hf.get("shared_expert_intermediate_size", 0) or 0,
        dense_layers=dense, max_position_embeddings=hf.get("max_position_embeddings", 131072))


def resolve_shape(cfg: PlanConfig) -> tuple[ModelShape, JobConfig | None]:
    """The shape to plan for, and the meshtrain job config when --model is one."""
    if (cfg.model is None) == (cfg.params is None):
        raise ConfigError("give the model as exactly one of --model (a meshtrain YAML or a Hugging Face "
                          "directory) and --params (a parameter count, e.g. 70b)")
    if cfg.params is not None:
        active = parse_count(cfg.active_params, "active-params") if cfg.active_params else None
        return shape_from_count(parse_count(cfg.params, "params"), active, cfg.num_experts, cfg.experts_per_token), None
    path = pathlib.Path(cfg.model)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ConfigError(f"--model: no such file or directory {cfg.model!r}. Fix: a meshtrain YAML config or a "
                          "Hugging Face model directory holding config.json")
    if path.suffix == ".json":
        try:
            hf = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"--model: {path} is not valid JSON ({e})") from None
        return shape_from_hf_config(hf, str(path)), None
    job = load_yaml(str(path))
    return shape_from_model_config(job.model, f"{path} ({job.model.family})"), job


# ---- what each rank holds ----------------------------------------------------------------------

@dataclass(frozen=True)
class ParamTensor:
    name: str
    shape: tuple[int, ...]
    tp_dim: int | None = None
    """The dim tensor parallelism shards (Colwise: 0, Rowwise: 1, vocab-parallel embedding: 0)."""
    expert: bool = False
    """Stacked experts [E, ...]: ep shards dim 0, etp the hidden dim, FSDP runs over edp."""
    layer: int | None = None
    """None for the embedding, final norm and output head."""


def parameter_tensors(s: ModelShape) -> list[ParamTensor]:
    """Every trained tensor, named and placed as ``model.Transformer`` and ``tensor_parallel`` do."""
    h, q, kv = s.hidden_size, s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    out = [ParamTensor("embed_tokens.weight", (s.vocab_size, h), tp_dim=0)]
    for i in range(s.num_layers):
        p = f"layers.{i}."
        out += [ParamTensor(p + "input_layernorm.weight", (h,), layer=i),
                ParamTensor(p + "self_attn.q_proj.weight", (q, h), 0, layer=i),
                ParamTensor(p + "self_attn.k_proj.weight", (kv, h), 0, layer=i),
                ParamTensor(p + "self_attn.v_proj.weight", (kv, h), 0, layer=i),
                ParamTensor(p + "self_attn.o_proj.weight", (h, q), 1, layer=i),
                ParamTensor(p + "post_attention_layernorm.weight", (h,), layer=i)]
        if s.qk_norm:
            out += [ParamTensor(p + "self_attn.q_norm.weight", (s.head_dim,), layer=i),
                    ParamTensor(p + "self_attn.k_norm.weight", (s.head_dim,), layer=i)]
        if s.is_sparse(i):
            e, ei = s.num_experts, s.expert_intermediate_size
            out += [ParamTensor(p + "mlp.gate.weight", (e, h), layer=i),
                    ParamTensor(p + "mlp.experts.gate_proj", (e, ei, h), 1, expert=True, layer=i),
                    ParamTensor(p + "mlp.experts.up_proj", (e, ei, h), 1, expert=True, layer=i),
                    ParamTensor(p + "mlp.experts.down_proj", (e, h, ei), 2, expert=True, layer=i)]
            if s.shared_expert_intermediate_size:
                si = s.shared_expert_intermediate_size
                # MoE blocks are not split by tp (each tp rank routes its own tokens): no tp_dim
                out += [ParamTensor(p + f"mlp.shared_expert.{n}.weight", shp, layer=i) for n, shp in
                        (("gate_proj", (si, h)), ("up_proj", (si, h)), ("down_proj", (h, si)))]
        else:
            ii = s.intermediate_size
            out += [ParamTensor(p + "mlp.gate_proj.weight", (ii, h), 0, layer=i),
                    ParamTensor(p + "mlp.up_proj.weight", (ii, h), 0, layer=i),
                    ParamTensor(p + "mlp.down_proj.weight", (h, ii), 1, layer=i)]
    out.append(ParamTensor("norm.weight", (h,)))
    if not s.tied:
        out.append(ParamTensor("lm_head.weight", (s.vocab_size, h), tp_dim=0))
    return out


def total_parameters(s: ModelShape) -> int:
    return sum(math.prod(t.shape) for t in parameter_tensors(s))


def active_parameters(s: ModelShape) -> int:
    """Parameters one token uses: all but the experts it is not routed to."""
    inactive = sum(math.prod(t.shape) // s.num_experts * (s.num_experts - s.experts_per_token)
                   for t in parameter_tensors(s) if t.expert)
    return total_parameters(s) - inactive


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
        if sizes.etp > 1:
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
    return [t for t in tensors if kept(t)]


def stage_ids_of(pp_rank: int, sizes: Sizes, schedule: str) -> list[int]:
    from meshtrain.pipeline import stage_ids_for_rank

    return stage_ids_for_rank(pp_rank, sizes.pp, sizes.vpp, schedule) if sizes.pp > 1 else [0]


def rank_parameters(s: ModelShape, sizes: Sizes, schedule: str, *, pp_rank: int = 0, tp_rank: int = 0,
                    fsdp_rank: int = 0, edp_rank: int = 0, fsdp: bool = True) -> int:
    """Parameter elements on one rank: its pipeline stages, its tp/ep slice, its FSDP shard."""
    mine = stage_tensors(parameter_tensors(s), s, sizes, stage_ids_of(pp_rank, sizes, schedule))
    return sum(local_elements(t, sizes, tp_rank=tp_rank, fsdp_rank=fsdp_rank, edp_rank=edp_rank, fsdp=fsdp)
               for t in mine)


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
    run with ``cfg`` on ``layout`` (the figures ``allocation.measure_training_state`` measures)."""
    prec = precision_of(PlanConfig(precision={"fp32": "fp32", "bf16": "bf16-mixed"}[cfg.train.mixed_precision]))
    n = rank_parameters(shape_from_model_config(cfg.model, cfg.model.family), sizes_of(layout), layout.pp_schedule,
                        pp_rank=pp_rank, tp_rank=tp_rank, fsdp_rank=fsdp_rank, edp_rank=edp_rank)
    return {"param_elements": n, "param_bytes": n * prec.weights, "grad_bytes": n * prec.grads,
            "optimizer_bytes": n * prec.optimizer}


def layer_activation_elements(s: ModelShape, layer: int, sizes: Sizes, tokens: int, checkpointed: bool,
                              fused_norm: bool = True) -> float:
    """Elements autograd keeps for one micro-batch of ``tokens`` (= micro * seq) through ``layer``.

    Per layer, with t = tp, c = cp, T = tokens / c (checked against the tensors autograd saves in
    tests/test_planner.py):
      norm inputs (2), kept for RMSNorm's backward:        2 T h  (/ t with SP)
      norm outputs (2), the inputs of q/k/v and gate/up:   2 T h  (whole per tp rank: torch's SP gathers
                                                                   them, then the matmul saves them)
      q, k, v and the attention output (SDPA's saves):     T (2 q + 2 kv) / t  (+ q, k before their norms
                                                                   for Qwen3)
      SwiGLU gate, up, silu(gate), their product:          4 T i / t
      MoE instead: top-k copies of the token (h), 4 i_e and the expert output (h) per copy, / etp
    A fused RMSNorm kernel (CUDA) saves its input and rstd; the composite one (CPU) also saves the
    normalized input (``fused_norm=False``). With full activation checkpointing only the layer input
    T h (/ t with SP) is kept.
    """
    t, T, h = sizes.tp, tokens / sizes.cp, s.hidden_size
    split = t if sizes.sp else 1
    if checkpointed:
        return T * h / split
    copies = 1 if fused_norm else 2
    q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    attn = 2 * q + 2 * kv + ((q + kv) * copies if s.qk_norm else 0)
    elements = 2 * copies * T * h / split + 2 * T * h + T * attn / t
    if s.is_sparse(layer):
        k, ei = s.experts_per_token, s.expert_intermediate_size
        # MoE tokens: each tp rank routes the whole sequence unless SP split it.
        elements += T / split * k * (2 * h + 4 * ei / sizes.etp)
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
    checkpointed: bool
    pp_rank: int = 0

    @property
    def weights(self) -> float:
        return self.params * self.precision.weights

    @property
    def grads(self) -> float:
        return self.params * self.precision.grads

    @property
    def optimizer(self) -> float:
        return self.params * self.precision.optimizer

    @property
    def states(self) -> float:
        return self.weights + self.grads + self.optimizer

    @property
    def states_no_fsdp(self) -> float:
        p = self.precision
        return self.params_no_fsdp * (p.weights + p.grads + p.optimizer)

    @property
    def total(self) -> float:
        return self.states + self.activations + self.logits

    @property
    def total_no_fsdp(self) -> float:
        return self.states_no_fsdp + self.activations + self.logits


def sizes_of(layout) -> Sizes:
    """The planner's view of a ``mesh.Layout`` (to compare with what the trainer builds from it)."""
    return Sizes(world=layout.world_size, pp=layout.pp, vpp=layout.vpp, tp=layout.tp, cp=layout.cp, ep=layout.ep,
                 etp=layout.etp, dp_replicate=layout.dp_replicate, sp=layout.sp, stage_layers=layout.stage_layers)


def estimate(s: ModelShape, sizes: Sizes, cfg: PlanConfig, schedule: str, microbatches: int,
             checkpointed: bool) -> Memory:
    prec = precision_of(cfg)
    tokens = cfg.micro_batch_size * cfg.seq_len
    best: Memory | None = None
    for pp_rank in sorted({0, sizes.pp - 1}):
        stages = stage_ids_of(pp_rank, sizes, schedule)
        layers = [t.layer for t in stage_tensors(parameter_tensors(s), s, sizes, stages) if t.layer is not None]
        layer_ids = sorted(set(layers))
        per_layer = [layer_activation_elements(s, i, sizes, tokens, checkpointed) for i in layer_ids]
        flight = in_flight_microbatches(sizes, schedule, microbatches, pp_rank)
        act = sum(per_layer) * flight * prec.activations
        if checkpointed and layer_ids:  # one layer is recomputed whole at a time in backward
            act += layer_activation_elements(s, layer_ids[0], sizes, tokens, False) * prec.activations
        last = (sizes.pp * sizes.vpp - 1) in stages
        # logits (compute dtype) + their fp32 copy + log-softmax output, vocab-sharded by tp (loss_parallel)
        logits = tokens / sizes.cp * s.vocab_size / sizes.tp * (prec.activations + 8) if last else 0.0
        m = Memory(rank_parameters(s, sizes, schedule, pp_rank=pp_rank),
                   rank_parameters(s, sizes, schedule, pp_rank=pp_rank, fsdp=False), prec, act,
                   (per_layer[0] if per_layer else 0) * prec.activations, logits, flight, len(layer_ids), checkpointed,
                   pp_rank)
        if best is None or m.total > best.total:
            best = m
    return best


# ---- choosing a layout -------------------------------------------------------------------------

@dataclass(frozen=True)
class Row:
    upto: float
    label: str
    gpus: str
    tp: tuple[int, int]
    pp: tuple[int, int]
    cp: int = 1
    ep: tuple[int, int] = (1, 1)


# The reference's starting layouts (section 3). Bounds are nominal sizes with 5% slack: a "70B"
# model has 70.6B parameters and belongs to the 10-70B row.
DENSE_ROWS = (Row(1.05e9, "< 1B", "1-8", (1, 1), (1, 1)),
              Row(10.5e9, "1-10B", "8-16", (2, 4), (1, 1)),
              Row(73.5e9, "10-70B", "16-64", (4, 8), (2, 4)),
              Row(184e9, "70-175B", "64-256", (8, 8), (4, 8)),
              Row(math.inf, "175-500B", "256-1024", (8, 8), (8, 16), cp=2))
MOE_ROWS = (Row(21e9, "< 20B", "", (1, 1), (1, 1), ep=(2, 8)),
            Row(105e9, "20-100B", "", (1, 2), (2, 4), ep=(8, 16)),
            Row(525e9, "100-500B", "", (2, 4), (8, 16), ep=(8, 32)),
            Row(math.inf, "> 500B", "", (2, 2), (16, 16), ep=(32, 64)))


def row_for(params: float, rows: tuple[Row, ...]) -> Row:
    return next(r for r in rows if params <= r.upto)


def cp_for_sequence(seq_len: int) -> tuple[int, str]:
    if seq_len > 131072:
        return 8, f"seq {seq_len} > 128K: CP8"
    if seq_len > 32768:
        return 4, f"seq {seq_len} > 32K: CP4"
    if seq_len > 8192:
        return 2, f"seq {seq_len} in 8K-32K: CP2"
    return 1, ""


@dataclass
class Plan:
    shape: ModelShape
    sizes: Sizes
    schedule: str
    microbatches: int
    global_batch: int
    memory: Memory
    reasons: list[str] = field(default_factory=list)
    rejected: list[str] = field(default_factory=list)

    def describe(self) -> str:
        dims = {"pp": self.sizes.pp, "dp_replicate": 1, "dp_shard": self.sizes.dp, "cp": self.sizes.cp,
                "tp": self.sizes.tp}
        return describe_sizes(dims, self.sizes.world, ep=self.sizes.ep,
                              extras=layout_extras(self.sizes.sp, self.sizes.vpp,
                                                   self.schedule if self.sizes.pp > 1 else "", self.sizes.etp))


# Where plan_layout's messages name trainer fields, the planner's own options are meant.
_FIELD_NAMES = {"parallel.": "--", "train.seq_len": "--seq-len", "train.micro_batch_size": "--micro-batch-size",
                "train.global_batch_size": "--global-batch-size"}


def _planner_message(message: str) -> str:
    for old, new in _FIELD_NAMES.items():
        message = message.replace(old, new)
    return message


def stage_split(layers: int, stages: int) -> tuple[int, ...] | None:
    """An even split, or one giving the middle stages the remainder (the first and last stages also
    hold the embedding and the head); None when there are fewer layers than stages."""
    if layers < stages:
        return None
    base, extra = divmod(layers, stages)
    counts = [base] * stages
    middle = list(range(1, stages - 1)) or list(range(stages))
    if extra > len(middle):
        return None
    for i in middle[:extra]:
        counts[i] += 1
    return tuple(counts)


def validate(s: ModelShape, sizes: Sizes, cfg: PlanConfig, global_batch: int) -> tuple[Sizes, str, int]:
    """Run the trainer's own rules on a candidate; returns it with its stage split, the schedule and
    the micro-batch count, or raises ConfigError naming the rule."""
    split = stage_split(s.num_layers, sizes.pp * sizes.vpp)
    if split is None:
        raise ConfigError(f"{s.num_layers} layers cannot fill pp*vpp = {sizes.pp}*{sizes.vpp} stages. Fix: lower --pp or --vpp")
    even = len(set(split)) == 1
    model = ModelConfig(family="qwen3" if s.qk_norm else "llama", vocab_size=s.vocab_size, hidden_size=s.hidden_size,
                        intermediate_size=s.intermediate_size or s.hidden_size, num_hidden_layers=s.num_layers,
                        num_attention_heads=s.num_heads, num_key_value_heads=s.num_kv_heads, head_dim=s.head_dim,
                        max_position_embeddings=s.max_position_embeddings, tie_word_embeddings=s.tied)
    parallel = ParallelConfig(pp=sizes.pp, vpp=sizes.vpp, tp=sizes.tp, cp=sizes.cp, sp=sizes.sp,
                              pp_layers_per_stage=None if even else list(split), gpus_per_node=cfg.gpus_per_node)
    train = TrainConfig(global_batch_size=global_batch, micro_batch_size=cfg.micro_batch_size, seq_len=cfg.seq_len)
    try:
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            layout = plan_layout(JobConfig(model=model, parallel=parallel, train=train), sizes.world)
        check_expert_layout(model.family, s.num_experts, sizes.ep, sizes.etp, sizes.world, sizes.pp, sizes.tp, sizes.cp)
        if s.is_moe and s.expert_intermediate_size % sizes.etp:
            raise ConfigError(f"parallel.etp={sizes.etp} must divide the expert FFN size {s.expert_intermediate_size}")
    except ConfigError as e:
        raise ConfigError(_planner_message(str(e))) from None
    return dataclasses.replace(sizes, stage_layers=layout.stage_layers), layout.pp_schedule, layout.grad_accum_steps


def check_fixed_sizes(cfg: PlanConfig) -> None:
    for name in ("tp", "pp", "vpp", "cp", "ep"):
        value = getattr(cfg, name)
        if value is not None and value < 1:
            raise ConfigError(f"--{name}={value} must be >= 1 (or left out for the planner to choose)")
    fixed = {n: getattr(cfg, n) for n in ("tp", "pp", "cp") if getattr(cfg, n)}
    product = math.prod(fixed.values())
    if fixed and cfg.gpus % product:
        names = "*".join(f"--{n}" for n in fixed)
        raise ConfigError(f"--gpus={cfg.gpus} is not divisible by {names} = {product} (dp = gpus / (tp*pp*cp) "
                          f"must be whole). Fix: use a multiple of {product} GPUs or other sizes")


def _ordered(lo: int, hi: int, descending: bool, allowed: set[int] | None = None) -> list[int]:
    values = [v for v in range(lo, hi + 1) if allowed is None or v in allowed]
    return sorted(values, reverse=descending)


def candidate_sizes(s: ModelShape, cfg: PlanConfig, params: float, active: float) -> tuple[list[list[Sizes]], list[str]]:
    """Groups of candidates in order of preference (the table's ranges first, then beyond them),
    and why that order."""
    reasons = []
    powers = {1, 2, 4, 8, 16, 32, 64, 128, 256}
    multi_node = cfg.gpus > cfg.gpus_per_node
    if s.is_moe:
        row = row_for(params, MOE_ROWS)
        dense_row = row_for(active, DENSE_ROWS)
        tp_lo = min(max(dense_row.tp[0], row.tp[0]), row.tp[1])
        tp_hi = min(max(dense_row.tp[1], row.tp[0]), row.tp[1])
        reasons.append(f"MoE with {_count(params)} parameters ({_count(active)} active): the {row.label} row "
                       f"starts at TP{_rng(row.tp)} PP{_rng(row.pp)} EP{_rng(row.ep)}; TP is sized by the active "
                       f"parameters ({dense_row.label} dense: TP{_rng(dense_row.tp)}) within that: TP{_rng((tp_lo, tp_hi))}")
    else:
        row = row_for(params, DENSE_ROWS)
        tp_lo, tp_hi = row.tp
        reasons.append(f"dense {_count(params)} parameters: the {row.label} row ({row.gpus} GPUs) starts at "
                       f"TP{_rng(row.tp)} PP{_rng(row.pp)}{' CP2' if row.cp > 1 else ''} + DP")
    tp_cap = min(8, cfg.gpus_per_node, cfg.gpus)
    prefer_small_tp = cfg.interconnect == "ethernet"
    if cfg.interconnect == "nvlink":
        reasons.append("one NVLink node: the largest TP in range, at most the node's GPUs (<= 8)")
    elif cfg.interconnect == "infiniband":
        reasons.append("InfiniBand: TP inside a node, PP across nodes" + ("" if multi_node else " (one node here)"))
    else:
        reasons.append("ethernet: TP as small as the range allows, PP preferred across nodes")

    cp_seq, why = cp_for_sequence(cfg.seq_len)
    cp = cfg.cp or max(cp_seq, row.cp)
    if why and not cfg.cp:
        reasons.append(why)
    sp_wanted = cfg.seq_len >= 2048
    tps = [cfg.tp] if cfg.tp else _ordered(tp_lo, min(tp_hi, tp_cap), not prefer_small_tp, powers) or [min(tp_lo, tp_cap)]
    pps = [cfg.pp] if cfg.pp else _ordered(row.pp[0], row.pp[1], cfg.interconnect == "ethernet")
    eps = [cfg.ep] if cfg.ep else (_ordered(row.ep[0], row.ep[1], True, powers) if s.is_moe else [1])
    # Beyond the table's ranges, for when nothing inside them fits: more PP, then more TP.
    extra_pp = [p for p in range(pps[-1] + 1, min(s.num_layers, cfg.gpus) + 1)] if not cfg.pp else []
    extra_tp = [t for t in sorted(powers) if tps[0] < t <= tp_cap] if not cfg.tp else []
    groups = []
    for tp_list, pp_list in ((tps, pps), (tps, extra_pp), (extra_tp, pps + extra_pp)):
        out = []
        groups.append(out)
        for tp in tp_list:
            for pp in pp_list:
                for ep in eps:
                    vpp = cfg.vpp or (2 if pp > 1 and s.num_layers % (2 * pp) == 0 else 1)
                    if pp == 1:
                        vpp = cfg.vpp or 1
                    out.append(Sizes(world=cfg.gpus, pp=pp, vpp=vpp, tp=tp, cp=cp, ep=ep,
                                     sp=tp > 1 and (sp_wanted or cfg.tp is not None)))
    return groups, reasons


def _rng(r: tuple[int, int]) -> str:
    return str(r[0]) if r[0] == r[1] else f"{r[0]}-{r[1]}"


def recommend(cfg: PlanConfig, shape: ModelShape | None = None, *, suggest_gpus: bool = True) -> Plan:
    """The first candidate that the trainer's rules accept and that fits in memory; when none fits,
    the error says how many GPUs would (``suggest_gpus``)."""
    if shape is None:
        cfg, shape = resolve(cfg)
    s = shape
    for name in ("gpus", "gpus_per_node", "seq_len", "micro_batch_size"):
        if getattr(cfg, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')}={getattr(cfg, name)} must be >= 1")
    if cfg.gpu_memory_gb <= 0:
        raise ConfigError(f"--gpu-memory-gb={cfg.gpu_memory_gb} must be positive")
    params, active = total_parameters(s), active_parameters(s)
    check_fixed_sizes(cfg)
    groups, reasons = candidate_sizes(s, cfg, params, active)
    budget = cfg.gpu_memory_gb * GB * USABLE_MEMORY
    checkpointing = {"on": [True], "off": [False], "auto": [False, True]}[cfg.activation_checkpointing]
    rejected: list[str] = []
    indivisible: list[str] = []
    smallest: Plan | None = None
    for index, ac, candidates in ((i, ac, group) for i, group in enumerate(groups) for ac in checkpointing):
        for c in candidates:
            if c.world % (c.pp * c.tp * c.cp):
                indivisible.append(f"TP{c.tp} PP{c.pp} CP{c.cp} needs a multiple of tp*pp*cp = {c.tp * c.pp * c.cp} GPUs")
                continue
            dp = c.world // (c.pp * c.tp * c.cp)
            gb = cfg.global_batch_size or cfg.micro_batch_size * dp * (4 * c.pp if c.pp > 1 else 1)
            try:
                sized, schedule, micro = validate(s, c, cfg, gb)
            except ConfigError as e:
                rejected.append(f"TP{c.tp} PP{c.pp} CP{c.cp} EP{c.ep}: {e}")
                continue
            mem = estimate(s, sized, cfg, schedule, micro, ac)
            plan = Plan(s, sized, schedule, micro, gb, mem, list(reasons), rejected)
            if mem.total <= budget:
                if ac and cfg.activation_checkpointing == "auto":
                    plan.reasons.append("activation checkpointing turned on: no candidate fits without it")
                if index > 0:
                    plan.reasons.append("nothing inside the table's ranges fits in memory: "
                                        + ("PP" if index == 1 else "TP") + " raised beyond them")
                return plan
            rejected.append(f"{plan.describe()}: {mem.total / GB:.1f} GB per GPU exceeds {USABLE_MEMORY:.0%} of "
                            f"--gpu-memory-gb={cfg.gpu_memory_gb:g}")
            if smallest is None or mem.total < smallest.memory.total:
                smallest = plan
    if smallest is None:
        if not rejected:
            raise ConfigError(f"no starting layout for {s.name} divides --gpus={cfg.gpus}: "
                              + "; ".join(_unique(indivisible)[:3]) + ". Fix: use such a GPU count, or fix "
                              "--tp/--pp/--cp to sizes that divide it")
        raise ConfigError("no layout is possible: " + "; ".join(_unique(rejected)[:4]))
    need = _gpus_needed(cfg, s) if suggest_gpus else None
    raise ConfigError(
        f"{s.name} does not fit on {cfg.gpus} GPUs of {cfg.gpu_memory_gb:g} GB: the smallest estimate is "
        f"{smallest.memory.total / GB:.1f} GB per GPU ({smallest.describe()}, "
        f"activation checkpointing {'on' if smallest.memory.checkpointed else 'off'}). Fix: "
        + (f"use at least {need} GPUs" if need else "use more GPUs") + ", a shorter --seq-len, or --precision bf16 "
        "--optimizer-states half")


def _gpus_needed(cfg: PlanConfig, s: ModelShape) -> int | None:
    gpus = cfg.gpus
    while gpus < 1 << 17:
        gpus *= 2
        try:
            recommend(dataclasses.replace(cfg, gpus=gpus), s, suggest_gpus=False)
            return gpus
        except ConfigError:
            continue
    return None


def _unique(items: list[str]) -> list[str]:
    return list(dict.fromkeys(items))


# ---- the report --------------------------------------------------------------------------------

def _count(n: float) -> str:
    return f"{n / 1e9:.3f}B" if n >= 1e9 else f"{n / 1e6:.3f}M"


def unsharded(plan: Plan, cfg: PlanConfig) -> Memory:
    """The same model with no parallelism at all: one device holds everything."""
    one = Sizes(world=1, stage_layers=(plan.shape.num_layers,))
    return estimate(plan.shape, one, cfg, "1F1B", 1, plan.memory.checkpointed)


def report(plan: Plan, cfg: PlanConfig) -> str:
    s, z, m = plan.shape, plan.sizes, plan.memory
    p = m.precision
    params, active = total_parameters(s), active_parameters(s)
    single = unsharded(plan, cfg)
    unit, scale = ("GB", GB) if single.total >= 0.1 * GB else ("MB", 1e6)

    def _gb(x: float) -> str:
        return f"{x / scale:8.2f}"

    lines = [f"model: {s.name}: {_count(params)} parameters"
             + (f", {_count(active)} active ({s.num_experts} experts, top-{s.experts_per_token})" if s.is_moe else "")
             + f"; {s.num_layers} layers, hidden {s.hidden_size}, heads {s.num_heads}/{s.num_kv_heads} kv, vocab {s.vocab_size}",
             f"cluster: {cfg.gpus} GPUs ({cfg.gpus_per_node} per node, {cfg.interconnect}), {cfg.gpu_memory_gb:g} GB each; "
             f"seq {cfg.seq_len} x micro batch {cfg.micro_batch_size}; {cfg.precision}", "",
             f"recommended layout: {plan.describe()}"]
    if z.stage_layers and len(set(z.stage_layers)) > 1:
        lines.append(f"  layers per stage: {list(z.stage_layers)}")
    overrides = [f"--parallel.{k} {v}" for k, v in (("tp", z.tp), ("pp", z.pp), ("vpp", z.vpp), ("cp", z.cp),
                                                      ("ep", z.ep)) if v > 1]
    if z.sp:
        overrides.append("--parallel.sp True")
    if z.stage_layers and len(set(z.stage_layers)) > 1:
        overrides.append("--parallel.pp-layers-per-stage " + " ".join(map(str, z.stage_layers)))
    overrides.append(f"--train.global-batch-size {plan.global_batch} --train.micro-batch-size {cfg.micro_batch_size}")
    if m.checkpointed:
        overrides.append("--train.activation-checkpointing True")
    lines.append("  meshtrain train " + " ".join(overrides))
    lines.append("why:")
    lines += [f"  - {r}" for r in plan.reasons]
    if z.pp > 1:
        bubble = (z.pp - 1) / (z.vpp * plan.microbatches + z.pp - 1)
        lines.append(f"  - pipeline: {plan.microbatches} micro-batches per step, {plan.schedule}; bubble "
                     f"(pp-1)/(vpp*m+pp-1) = {bubble:.1%}")
    if plan.rejected:
        lines.append("passed over (first ones):")
        lines += [f"  - {r}" for r in _unique(plan.rejected)[:5]]

    lines += ["", f"memory per GPU ({unit}), busiest rank (pp rank {m.pp_rank}: {m.layers_on_rank} layers; {p.note}):",
              f"  {'':34}{'no parallelism':>16}{'this layout':>14}{'+ FSDP':>10}"]
    fsdp = z.dp * z.cp > 1
    rows = [("weights", p.weights), ("gradients", p.grads), ("optimizer state", p.optimizer)]
    for name, b in rows:
        lines.append(f"  {name + f' ({b} B/param)':34}{_gb(single.params * b):>16}{_gb(m.params_no_fsdp * b):>14}"
                     f"{_gb(m.params * b):>10}")
    lines.append(f"  {'activations':34}{_gb(single.activations):>16}{_gb(m.activations):>14}{_gb(m.activations):>10}")
    lines.append(f"  {'logits and loss':34}{_gb(single.logits):>16}{_gb(m.logits):>14}{_gb(m.logits):>10}")
    lines.append(f"  {'total':34}{_gb(single.total):>16}{_gb(m.total_no_fsdp):>14}{_gb(m.total):>10}")
    if not fsdp:
        lines.append("  (dp*cp = 1: nothing for FSDP to shard)")
    naive = single.total / (z.tp * z.pp)
    lines.append(f"  no-parallelism total / (tp*pp) = {naive / scale:.2f} {unit}: the naive split; this layout differs by "
                 f"the {m.in_flight:g} micro-batch(es) in flight on that rank, by the embedding or head it holds, "
                 "and by what tp does not shard (norms, the gathered SP inputs)")

    variants = []
    for label, sp, ac in (("no SP, no AC", False, False), ("SP", True, False), ("full AC", z.sp, True)):
        if sp and z.tp == 1:
            continue
        alt = estimate(s, dataclasses.replace(z, sp=sp), cfg, plan.schedule, plan.microbatches, ac)
        variants.append(f"{label}: {alt.activations / scale:.2f}")
    if z.cp == 1 and cfg.seq_len % 4 == 0:
        alt = estimate(s, dataclasses.replace(z, cp=2), cfg, plan.schedule, plan.microbatches, m.checkpointed)
        variants.append(f"CP2: {alt.activations / scale:.2f}")
    lines.append(f"  activations per GPU ({unit}) by option: " + "; ".join(variants)
                 + (f"; CP{z.cp} divides every term by {z.cp}" if z.cp > 1 else ""))

    T = cfg.micro_batch_size * cfg.seq_len
    lines += ["", "formulas (P = parameters on the rank, T = micro * seq / cp tokens, h hidden, i FFN, t = tp):",
              f"  weights + grads + optimizer = P x ({p.weights} + {p.grads} + {p.optimizer}) B; P = its stages' "
              "tensors, tp-sliced (column: rows, row: columns, vocab: rows), experts / ep, then / (dp_shard*cp) "
              "by FSDP (experts / edp)",
              f"  activations per layer = [2Th (/t with SP) + 2Th + T(2q + 2kv)/t + 4Ti/t] x {p.activations} B "
              f"= {m.activations_per_layer / 1e6:.1f} MB here (T = {T // z.cp}); x {m.layers_on_rank} layers x "
              f"{m.in_flight:g} micro-batches in flight (fused RMSNorm as on CUDA; CPU's composite one keeps 2Th more); "
              "full AC keeps T h (/t with SP) per layer + one layer recomputed",
              f"  logits = T x vocab / t x ({p.activations} + 4 + 4) B (logits, fp32 copy, log-softmax), last stage only"]
    return "\n".join(lines)


def resolve(cfg: PlanConfig) -> tuple[PlanConfig, ModelShape]:
    """The shape to plan for, and the config with the sequence length filled in."""
    shape, job = resolve_shape(cfg)
    t = job.train if job else None
    filled = {"seq_len": t.seq_len if t else 4096, "micro_batch_size": t.micro_batch_size if t else 1,
              "precision": {"fp32": "fp32", "bf16": "bf16-mixed"}[t.mixed_precision] if t else "bf16-mixed"}
    cfg = dataclasses.replace(cfg, **{k: v for k, v in filled.items() if getattr(cfg, k) is None})
    return cfg, shape


def plan_main(cfg: PlanConfig) -> Plan:
    cfg, shape = resolve(cfg)
    plan = recommend(cfg, shape)
    print(report(plan, cfg))
    return plan
