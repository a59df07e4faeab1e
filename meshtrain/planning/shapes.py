"""A model as the planner sees it: its shape (from a meshtrain YAML, a Hugging Face config.json or a
parameter count) and the inventory of tensors the trainer allocates for it, with how tp/ep cut each."""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import re
from dataclasses import dataclass

from meshtrain.config import JobConfig, ModelConfig, PeftConfig
from meshtrain.config_files import load_yaml
from meshtrain.errors import ConfigError
from meshtrain.planning.options import PlanConfig


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
    lora_rank: int = 0
    """LoRA fine-tuning: adapters of this rank on ``lora_targets`` train, every other weight is frozen
    (0: every weight trains)."""
    lora_targets: tuple[str, ...] = ()
    lora_magnitudes: bool = False
    """DoRA: a trained magnitude per output row of each adapted linear, besides A and B."""

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
                      intermediate_size=m.intermediate_size, tied=m.tie_word_embeddings, qk_norm=m.definition.qk_norm,
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
    return shape_from_job(job, f"{path} ({job.model.family})"), job


def shape_from_job(job: JobConfig, name: str) -> ModelShape:
    """A meshtrain job's model, with its LoRA adapters when it fine-tunes with LoRA."""
    shape = shape_from_model_config(job.model, name)
    if job.peft.adapters:
        shape = dataclasses.replace(shape, lora_rank=job.peft.rank, lora_targets=tuple(job.peft.targets),
                                    lora_magnitudes=job.peft.method == "dora")
    return shape


# ---- the tensor inventory ------------------------------------------------------------------

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
    linear: bool = False
    """A linear layer's weight or a stacked experts' projection: what LoRA can target."""
    trainable: bool = True
    """False for the frozen base weights of a LoRA fine-tune: no gradient, no optimizer state."""


def parameter_tensors(s: ModelShape) -> list[ParamTensor]:
    """Every parameter, named and placed as ``models.transformer.Transformer`` and ``parallel.tensor``
    do, and with LoRA the adapters (``models.lora``)."""
    base = _base_tensors(s)
    return _with_lora(base, s.lora_rank, s.lora_targets, s.lora_magnitudes) if s.lora_rank else base


def _with_lora(tensors: list[ParamTensor], rank: int, patterns: tuple[str, ...], magnitudes: bool) -> list[ParamTensor]:
    """The base frozen, and after each targeted weight [..., out, in] its A [..., r, in] and B [..., out, r]
    (and DoRA's magnitude [out]), placed as ``models.lora`` places them: split like the base on its
    input dim (A) or output dim (B and the magnitude), replicated otherwise; over experts, both."""
    from meshtrain.models.lora import targeted

    out = []
    for t in tensors:
        out.append(dataclasses.replace(t, trainable=False))
        module = t.name.removesuffix(".weight")
        if not (t.linear and targeted(module, patterns)):
            continue
        *lead, rows, cols = t.shape
        out_dim, in_dim = len(t.shape) - 2, len(t.shape) - 1
        sep = "." if t.name.endswith(".weight") else "_"
        out += [dataclasses.replace(t, name=f"{module}{sep}lora_A", shape=(*lead, rank, cols),
                                    tp_dim=in_dim if t.tp_dim == in_dim else None),
                dataclasses.replace(t, name=f"{module}{sep}lora_B", shape=(*lead, rows, rank),
                                    tp_dim=out_dim if t.tp_dim == out_dim else None)]
        if magnitudes and not t.expert:  # DoRA is refused on experts (see resolve)
            out.append(dataclasses.replace(t, name=f"{module}.lora_magnitude", shape=(rows,),
                                           tp_dim=0 if t.tp_dim == 0 else None))
    return out


def _base_tensors(s: ModelShape) -> list[ParamTensor]:
    h, q, kv = s.hidden_size, s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    out = [ParamTensor("embed_tokens.weight", (s.vocab_size, h), tp_dim=0)]
    for i in range(s.num_layers):
        p = f"layers.{i}."
        out += [ParamTensor(p + "input_layernorm.weight", (h,), layer=i),
                ParamTensor(p + "self_attn.q_proj.weight", (q, h), 0, layer=i, linear=True),
                ParamTensor(p + "self_attn.k_proj.weight", (kv, h), 0, layer=i, linear=True),
                ParamTensor(p + "self_attn.v_proj.weight", (kv, h), 0, layer=i, linear=True),
                ParamTensor(p + "self_attn.o_proj.weight", (h, q), 1, layer=i, linear=True),
                ParamTensor(p + "post_attention_layernorm.weight", (h,), layer=i)]
        if s.qk_norm:
            out += [ParamTensor(p + "self_attn.q_norm.weight", (s.head_dim,), layer=i),
                    ParamTensor(p + "self_attn.k_norm.weight", (s.head_dim,), layer=i)]
        if s.is_sparse(i):
            e, ei = s.num_experts, s.expert_intermediate_size
            out += [ParamTensor(p + "mlp.gate.weight", (e, h), layer=i),
                    ParamTensor(p + "mlp.experts.gate_proj", (e, ei, h), 1, True, i, True),
                    ParamTensor(p + "mlp.experts.up_proj", (e, ei, h), 1, True, i, True),
                    ParamTensor(p + "mlp.experts.down_proj", (e, h, ei), 2, True, i, True)]
            if s.shared_expert_intermediate_size:
                si = s.shared_expert_intermediate_size
                # MoE blocks are not split by tp (each tp rank routes its own tokens): no tp_dim
                out += [ParamTensor(p + f"mlp.shared_expert.{n}.weight", shp, layer=i, linear=True) for n, shp in
                        (("gate_proj", (si, h)), ("up_proj", (si, h)), ("down_proj", (h, si)))]
        else:
            ii = s.intermediate_size
            out += [ParamTensor(p + "mlp.gate_proj.weight", (ii, h), 0, layer=i, linear=True),
                    ParamTensor(p + "mlp.up_proj.weight", (ii, h), 0, layer=i, linear=True),
                    ParamTensor(p + "mlp.down_proj.weight", (h, ii), 1, layer=i, linear=True)]
    out.append(ParamTensor("norm.weight", (h,)))
    if not s.tied:
        out.append(ParamTensor("lm_head.weight", (s.vocab_size, h), tp_dim=0, linear=True))
    return out


def total_parameters(s: ModelShape) -> int:
    return sum(math.prod(t.shape) for t in parameter_tensors(s))


def trainable_parameters(s: ModelShape) -> int:
    return sum(math.prod(t.shape) for t in parameter_tensors(s) if t.trainable)


def active_parameters(s: ModelShape) -> int:
    """Parameters one token uses: all but the experts it is not routed to."""
    inactive = sum(math.prod(t.shape) // s.num_experts * (s.num_experts - s.experts_per_token)
                   for t in parameter_tensors(s) if t.expert)
    return total_parameters(s) - inactive


def resolve(cfg: PlanConfig) -> tuple[PlanConfig, ModelShape]:
    """The shape to plan for, and the config with the sequence length filled in."""
    shape, job = resolve_shape(cfg)
    t = job.train if job else None
    filled = {"seq_len": t.seq_len if t else 4096, "micro_batch_size": t.micro_batch_size if t else 1,
              "precision": {"fp32": "fp32", "bf16": "bf16-mixed"}[t.mixed_precision] if t else "bf16-mixed"}
    cfg = dataclasses.replace(cfg, **{k: v for k, v in filled.items() if getattr(cfg, k) is None})
    if cfg.lora_rank is not None:
        if cfg.lora_rank < 0:
            raise ConfigError(f"--lora-rank={cfg.lora_rank} must be >= 0. Fix: e.g. 16 (0 trains every weight)")
        targets = cfg.lora_targets or shape.lora_targets or PeftConfig().targets
        shape = dataclasses.replace(shape, lora_rank=cfg.lora_rank, lora_targets=tuple(targets),
                                    lora_magnitudes=cfg.dora or shape.lora_magnitudes)
    elif cfg.lora_targets or cfg.dora:
        raise ConfigError("--lora-targets or --dora is given without --lora-rank. Fix: add e.g. --lora-rank 16")
    if shape.lora_magnitudes and any(t.expert and t.trainable for t in parameter_tensors(shape)):
        raise ConfigError(f"DoRA with LoRA targets {list(shape.lora_targets)}, which match the stacked experts: "
                          "DoRA is not supported on experts. Fix: target the attention and dense projections only (e.g. "
                          "'*.self_attn.*'), or plan LoRA")
    if shape.lora_rank and not trainable_parameters(shape):
        raise ConfigError(f"LoRA targets {list(shape.lora_targets)} match no linear layer of the model. Fix: use "
                          "module-name wildcards such as '*.q_proj', '*.mlp.*_proj' or '*.experts'")
    return cfg, shape


def format_count(n: float) -> str:
    return f"{n / 1e9:.3f}B" if n >= 1e9 else f"{n / 1e6:.3f}M"
