"""A model as the planner sees it: its shape (from a meshtrain YAML, a Hugging Face config.json or a
parameter count) and the inventory of tensors the trainer allocates for it, with how tp/ep cut each.

The model is always a ModelConfig the trainer can build: a config.json is read by the family's own
reader (hf/adapter.py), a parameter count becomes a Llama 3 (or, with experts, Mixtral-shaped)
config. The inventory is that model built on the meta device, each tensor's tp (or etp) dim taken
from the blocks' own tensor-parallel plans, so a new family is planned with no code here."""

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
    materialized_attention: str = ""
    """How attention is computed where no SDPA kernel does it: "softcapped" (Gemma 2), "sinks"
    (GPT-OSS), or "" (SDPA): the first two keep every score (planning/memory.py)."""
    latent_attention: tuple[int, int, int] | None = None
    """Multi-head latent attention's (q_lora_rank or 0, kv_lora_rank, qk_rope_head_dim) (DeepSeek)."""
    v_head_dim: int = 0
    norms_per_layer: int = 2
    """RMSNorms in a decoder layer, each keeping its input (Gemma's sandwich layers: 4)."""
    expert_activations: int = 4
    """Elements of the FFN width an expert keeps per routed copy (SwiGLU: 4; GPT-OSS's clamped one: 7)."""
    reference_copy: bool = False
    """Preference training without LoRA: a frozen copy of the weights, sharded like them, is the reference."""
    model: ModelConfig | None = dataclasses.field(default=None, compare=False)
    """The model these numbers describe, which the inventory builds (set by every constructor below)."""

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
    base = _with_model(ModelShape(name=f"{total / 1e9:.4g}B (Llama 3 {key} shape)", **LLAMA3_SHAPES[key]))
    embed = base.vocab_size * base.hidden_size * (1 if base.tied else 2) + base.hidden_size
    if not moe:
        per_layer = _attention_params(base) + 3 * base.hidden_size * base.intermediate_size
        if abs(embed + base.num_layers * per_layer - total) <= 0.05 * total:
            return base  # a nominal size ("70b") means the model itself, not 79.4 of its layers
        layers = max(1, round((total - embed) / per_layer))
        return _with_model(dataclasses.replace(base, num_layers=layers))
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
    return _with_model(dataclasses.replace(base, num_layers=layers, intermediate_size=0, num_experts=num_experts,
                                           experts_per_token=experts_per_token, expert_intermediate_size=expert_i,
                                           tied=False))


def _with_model(s: ModelShape) -> ModelShape:
    """A fitted shape with the model it stands for: Llama 3 blocks, or with experts Mixtral's (Llama
    attention, an MoE MLP in every layer)."""
    moe = dict(family="mixtral", num_experts=s.num_experts, num_experts_per_tok=s.experts_per_token,
               moe_intermediate_size=s.expert_intermediate_size) if s.is_moe else dict(family="llama")
    model = ModelConfig(vocab_size=s.vocab_size, hidden_size=s.hidden_size,
                        intermediate_size=s.intermediate_size or s.expert_intermediate_size,
                        num_hidden_layers=s.num_layers, num_attention_heads=s.num_heads,
                        num_key_value_heads=s.num_kv_heads, head_dim=s.head_dim,
                        max_position_embeddings=s.max_position_embeddings, tie_word_embeddings=s.tied, **moe)
    return dataclasses.replace(s, model=model)


def shape_from_model_config(m: ModelConfig, name: str) -> ModelShape:
    moe = {}
    if m.is_moe:
        moe = dict(num_experts=m.num_experts, experts_per_token=m.num_experts_per_tok,
                   expert_intermediate_size=m.resolved_moe_intermediate_size,
                   shared_expert_intermediate_size=m.shared_expert_intermediate_size,
                   dense_layers=tuple(i for i in range(m.num_hidden_layers) if not m.is_sparse_layer(i)))
    import torch

    from meshtrain.models.transformer import RMSNorm

    family = m.definition
    with torch.device("meta"):
        norms = sum(isinstance(c, RMSNorm) for c in family.decoder_layer(m, 0).children())
        if m.is_moe:
            moe["expert_activations"] = family.experts_module(m).SAVED_PER_ROW
    latent = (m.q_lora_rank or 0, m.kv_lora_rank, m.qk_rope_head_dim) if m.kv_lora_rank else None
    materialized = "sinks" if family.attention_sinks else "softcapped" if m.attn_logit_softcapping else ""
    return ModelShape(name=name, vocab_size=m.vocab_size, hidden_size=m.hidden_size, num_layers=m.num_hidden_layers,
                      # a head's query/key dims: what its q, k (and v, padded to them under latent attention) hold;
                      # latent attention's keys and values are per head
                      num_heads=m.num_attention_heads, num_kv_heads=m.num_attention_heads if latent else m.num_key_value_heads,
                      head_dim=family.attention_dims(m)[0], materialized_attention=materialized,
                      latent_attention=latent, v_head_dim=family.attention_dims(m)[1], norms_per_layer=norms,
                      intermediate_size=m.intermediate_size, tied=m.tie_word_embeddings, qk_norm=family.qk_norm,
                      max_position_embeddings=m.max_position_embeddings, model=m, **moe)


def shape_from_hf_config(hf: dict, where: str) -> ModelShape:
    """A config.json, read as the trainer reads it (its family's reader): an architecture meshtrain
    cannot train is refused, naming the ones it can."""
    from meshtrain.errors import CheckpointError
    from meshtrain.hf.adapter import model_config_from_hf

    try:
        model, _ = model_config_from_hf(hf, where)
    except CheckpointError as e:
        raise ConfigError(f"{e}. Fix: plan it by size instead (--params, and --active-params and --num-experts "
                          "for a mixture of experts)") from None
    return shape_from_model_config(model, f"{where} ({model.family})")


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
    preference = job.data.format == "preference" and job.preference.loss != "simpo"  # SimPO has no reference
    return dataclasses.replace(shape, reference_copy=preference and not job.peft.adapters)


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


_INVENTORIES: dict[str, list[ParamTensor]] = {}


def _base_tensors(s: ModelShape) -> list[ParamTensor]:
    """The model's parameters, from the model built on the meta device (cached: the search asks for
    the same model's inventory for every candidate layout)."""
    key = json.dumps(dataclasses.asdict(s.model), sort_keys=True)
    if key not in _INVENTORIES:
        _INVENTORIES[key] = _model_tensors(s.model)
    return _INVENTORIES[key]


def _model_tensors(model: ModelConfig) -> list[ParamTensor]:
    import torch
    from torch import nn

    from meshtrain.models.transformer import Transformer

    with torch.device("meta"):
        built = Transformer(model)
    dims = tensor_parallel_dims(built)
    out = []
    for name, p in built.named_parameters():  # a tied head is the embedding: listed once
        owner, _, leaf = name.rpartition(".")
        expert = ".experts." in name
        linear = expert or (leaf == "weight" and isinstance(built.get_submodule(owner), nn.Linear))
        layer = int(name.split(".")[1]) if name.startswith("layers.") else None
        out.append(ParamTensor(name, tuple(p.shape), dims.get(name), expert, layer, linear))
    return out


def tensor_parallel_dims(model) -> dict[str, int]:
    """The dim tp shards each parameter on, read from the plans parallel/tensor.py applies: a
    column-parallel linear's weight and bias on 0, a row-parallel one's weight on 1, the vocab-
    parallel embedding and head on their rows; stacked experts on the dim etp splits."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)

    from meshtrain.parallel.styles import ShardedParameters, TensorParallelStyles

    styles = TensorParallelStyles(ColwiseParallel, RowwiseParallel, PrepareModuleInput, SequenceParallel,
                                  Replicate(), sequence_parallel_norms=False)
    dims = {"embed_tokens.weight": 0, "lm_head.weight": 0}
    for index, layer in model.layers.items():
        for path, style in layer.tp_plan(styles).items():
            prefix = f"layers.{index}.{path}"
            if isinstance(style, ColwiseParallel):
                dims |= {f"{prefix}.weight": 0, f"{prefix}.bias": 0}
            elif isinstance(style, RowwiseParallel):
                dims[f"{prefix}.weight"] = 1
            elif isinstance(style, ShardedParameters):
                dims[f"{prefix}.weight"] = style.dim
    for name, _ in model.named_parameters():
        if ".experts." in name:
            owner, _, pname = name.rpartition(".")
            dims[name] = model.get_submodule(owner).ETP_DIMS[pname]
    return dims


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
    # under LoRA the reference is the base with the adapters off: no copy
    shape = dataclasses.replace(shape, reference_copy=(cfg.preference or shape.reference_copy) and not shape.lora_rank)
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
