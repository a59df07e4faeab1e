"""Where Hugging Face names map: parameter names and config.json, both ways, per family.

meshtrain's module names are HF's without the ``model.`` prefix, and its RoPE is HF's rotate-half
layout, so the dense families (Llama, Qwen3) map by a rename and need no q/k permutation. The
adapters work on name -> tensor dicts rather than on single names so that the MoE families (#6)
can split and stack per-expert tensors here without changing their callers.

config.json is read in both spellings transformers has used (``rope_parameters`` in 5.x,
``rope_theta`` + ``rope_scaling`` before) and written in the 5.x one. A setting meshtrain's model
does not implement (biases, sliding windows, another activation or RoPE type) is an error naming
the key, never silently dropped.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any, TypeVar

import torch

from meshtrain.config import ModelConfig, RopeScalingConfig
from meshtrain.errors import CheckpointError

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                 "mixtral": "MixtralForCausalLM"}
FAMILY_OF_ARCHITECTURE = {arch: family for family, arch in ARCHITECTURES.items()}
MODEL_TYPES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
               "mixtral": "MixtralForCausalLM"}

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}

T = TypeVar("T")
LM_HEAD = "lm_head.weight"


def to_hf_name(name: str) -> str:
    return name if name == LM_HEAD else f"model.{name}"


def from_hf_name(key: str) -> str:
    if key == LM_HEAD:
        return key
    if not key.startswith("model."):
        raise KeyError(key)
    return key.removeprefix("model.")


# Stacked expert weights [E, ...] <-> HF's per-expert linears, per family: (HF block name, HF
# names of gate_proj, up_proj, down_proj).
EXPERT_NAMES = {"qwen3_moe": ("mlp", {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"}),
                "mixtral": ("block_sparse_moe", {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"})}


def _per_expert(value, num_experts: int) -> dict:
    """A stacked value's slices by expert index: views of a tensor, the shape of one expert, or
    (already split, by ``hf_io`` for sharded experts) the experts this rank holds."""
    if isinstance(value, dict):
        return value
    if isinstance(value, torch.Size):
        return dict.fromkeys(range(num_experts), torch.Size(value[1:]))
    return dict(enumerate(value.unbind(0)))


def to_hf(state_dict: dict[str, T], cfg: ModelConfig) -> dict[str, T]:
    """meshtrain names -> HF names (values are tensors, or shapes). A tied output projection is not
    written (HF omits it too), or, without the embedding beside it (a pipeline's last stage), is the
    embedding; stacked experts become HF's per-expert tensors (views)."""
    out: dict[str, T] = {}
    for name, value in state_dict.items():
        if cfg.tie_word_embeddings and name == LM_HEAD:
            if "embed_tokens.weight" in state_dict:
                continue
            name = "embed_tokens.weight"  # a pipeline's last stage: its head is the embedding's copy
        if cfg.is_moe and ".mlp." in name and (".mlp.gate." in name or ".mlp.experts." in name):
            block, names = EXPERT_NAMES[cfg.family]
            prefix, rest = name.split(".mlp.", 1)
            if rest.startswith("experts."):
                kind = rest.removeprefix("experts.")
                for e, v in _per_expert(value, cfg.num_experts).items():
                    out[f"model.{prefix}.{block}.experts.{e}.{names[kind]}.weight"] = v
                continue
            name = f"{prefix}.{block}.{rest}"
        elif cfg.family == "mixtral":
            name = name.replace(".mlp.", f".{EXPERT_NAMES['mixtral'][0]}.", 1)
        out[to_hf_name(name)] = value
    return out


def from_hf(hf_state_dict: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """HF names -> meshtrain names; per-expert tensors are stacked (copies)."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    block, names = EXPERT_NAMES.get(cfg.family, ("mlp", {}))
    kinds = {hf: ours for ours, hf in names.items()}
    for key, value in hf_state_dict.items():
        name = from_hf_name(key)
        if cfg.is_moe and f".{block}.experts." in name:
            prefix, rest = name.split(f".{block}.experts.", 1)
            index, hf_kind, _ = rest.split(".")
            experts.setdefault((prefix, kinds[hf_kind]), {})[int(index)] = value
            continue
        if cfg.family == "mixtral":
            name = name.replace(f".{block}.", ".mlp.", 1)
        out[name] = value
    for (prefix, kind), per_expert in experts.items():
        out[f"{prefix}.mlp.experts.{kind}"] = torch.stack([per_expert[e] for e in range(cfg.num_experts)])
    return out


def hf_shapes(cfg: ModelConfig) -> dict[str, torch.Size]:
    """Every HF key of the whole model and its shape, in module order, computed on the meta device."""
    from meshtrain.models.transformer import Transformer  # the model imports config only; keep this module light

    with torch.device("meta"):
        model = Transformer(cfg)
    return to_hf({n: p.shape for n, p in model.named_parameters()}, cfg)


# --- config.json ------------------------------------------------------------------------------

def _require(hf: dict, key: str, expected: Any, where: str) -> None:
    value = hf.get(key, expected)
    if value != expected:
        raise CheckpointError(f"{where}: {key}={value!r} is not supported (meshtrain's model implements "
                              f"{key}={expected!r}); this checkpoint cannot be trained faithfully")


def _field(hf: dict, key: str, where: str) -> Any:
    if key not in hf:
        raise CheckpointError(f"{where}: required key {key!r} is missing")
    return hf[key]


def _rope_from_hf(hf: dict, where: str) -> tuple[float, RopeScalingConfig]:
    params = hf.get("rope_parameters") or {}
    legacy = hf.get("rope_scaling") or {}
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    scaling = params if params.get("rope_type", "default") != "default" else legacy
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return float(theta), RopeScalingConfig()
    if kind != "llama3":
        raise CheckpointError(f"{where}: rope_type {kind!r} is not supported (meshtrain implements 'default' "
                              "and 'llama3')")
    defaults = RopeScalingConfig()
    return float(theta), RopeScalingConfig(
        type="llama3", factor=float(scaling.get("factor", defaults.factor)),
        low_freq_factor=float(scaling.get("low_freq_factor", defaults.low_freq_factor)),
        high_freq_factor=float(scaling.get("high_freq_factor", defaults.high_freq_factor)),
        original_max_position_embeddings=int(scaling.get("original_max_position_embeddings",
                                                         defaults.original_max_position_embeddings)))


def model_config_from_hf(hf: dict, where: str = "config.json") -> tuple[ModelConfig, torch.dtype | None]:
    """A transformers config.json (as a dict) -> meshtrain's ModelConfig and the checkpoint dtype."""
    archs = hf.get("architectures") or []
    # A config built in memory may name only its model_type; save_pretrained writes architectures.
    arch = archs[0] if archs else MODEL_TYPES.get(hf.get("model_type"))
    if arch not in FAMILY_OF_ARCHITECTURE:
        named = f"architectures={archs!r}" if archs else f"model_type={hf.get('model_type')!r} (and no architectures)"
        raise CheckpointError(f"{where}: {named} is not supported; supported: " + ", ".join(FAMILY_OF_ARCHITECTURE))
    family = FAMILY_OF_ARCHITECTURE[arch]
    _require(hf, "hidden_act", "silu", where)
    _require(hf, "attention_bias", False, where)
    _require(hf, "mlp_bias", False, where)
    if family in ("qwen3", "qwen3_moe"):
        _require(hf, "use_sliding_window", False, where)
    moe: dict[str, Any] = {}
    if family == "qwen3_moe":
        # transformers 5 writes num_local_experts; Qwen's own configs say num_experts
        experts = hf.get("num_experts") or _field(hf, "num_local_experts", where)
        moe = dict(num_experts=experts, moe_intermediate_size=_field(hf, "moe_intermediate_size", where),
                   norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                   decoder_sparse_step=int(hf.get("decoder_sparse_step", 1)),
                   mlp_only_layers=list(hf.get("mlp_only_layers") or []))
    elif family == "mixtral":
        _require(hf, "sliding_window", None, where)
        moe = dict(num_experts=_field(hf, "num_local_experts", where))
    if moe:
        moe |= dict(num_experts_per_tok=_field(hf, "num_experts_per_tok", where),
                    router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)))
    theta, scaling = _rope_from_hf(hf, where)
    hidden, heads = _field(hf, "hidden_size", where), _field(hf, "num_attention_heads", where)
    head_dim = hf.get("head_dim")
    cfg = ModelConfig(
        family=family,
        vocab_size=_field(hf, "vocab_size", where),
        hidden_size=hidden,
        intermediate_size=_field(hf, "intermediate_size", where),
        num_hidden_layers=_field(hf, "num_hidden_layers", where),
        num_attention_heads=heads,
        num_key_value_heads=hf.get("num_key_value_heads") or heads,
        # None where it is the default hidden/heads, so configs compare equal however they spell it.
        head_dim=head_dim if head_dim not in (None, hidden // heads) else None,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=_field(hf, "max_position_embeddings", where),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        init_std=float(hf.get("initializer_range", ModelConfig.init_std)),
        **moe,
    )
    dtype_name = hf.get("dtype") or hf.get("torch_dtype")
    if dtype_name is not None and dtype_name not in DTYPES:
        raise CheckpointError(f"{where}: dtype {dtype_name!r} is not supported; supported: {', '.join(DTYPES)}")
    return cfg, DTYPES.get(dtype_name)


def hf_config_from_model(cfg: ModelConfig, dtype: torch.dtype, base: dict | None = None) -> dict:
    """meshtrain's ModelConfig -> a transformers 5 config.json dict. ``base`` (the config.json the
    weights came from) contributes what meshtrain does not model, such as token ids."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling.type == "llama3":
        s = cfg.rope_scaling
        rope = {"rope_type": "llama3", "rope_theta": cfg.rope_theta, "factor": s.factor,
                "low_freq_factor": s.low_freq_factor, "high_freq_factor": s.high_freq_factor,
                "original_max_position_embeddings": s.original_max_position_embeddings}
    ours = {
        "architectures": [ARCHITECTURES[cfg.family]],
        "model_type": cfg.family,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.resolved_head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_parameters": rope,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": False,
        "initializer_range": cfg.init_std,
        "dtype": DTYPE_NAMES[dtype],
    }
    if cfg.family == "llama":
        ours["mlp_bias"] = False
    elif cfg.family in ("qwen3", "qwen3_moe"):
        ours["use_sliding_window"] = False
    if cfg.family == "qwen3_moe":
        ours |= {"num_experts": cfg.num_experts, "moe_intermediate_size": cfg.resolved_moe_intermediate_size,
                 "norm_topk_prob": cfg.norm_topk_prob, "decoder_sparse_step": cfg.decoder_sparse_step,
                 "mlp_only_layers": list(cfg.mlp_only_layers)}
    elif cfg.family == "mixtral":
        ours |= {"num_local_experts": cfg.num_experts, "sliding_window": None}
    if cfg.is_moe:
        ours |= {"num_experts_per_tok": cfg.num_experts_per_tok, "router_aux_loss_coef": cfg.router_aux_loss_coef}
    legacy = {"rope_theta", "rope_scaling", "torch_dtype", "transformers_version", "_name_or_path"}
    kept = {k: v for k, v in (base or {}).items() if k not in legacy and k not in ours}
    return {**kept, **ours}


def read_hf_config(directory: str | pathlib.Path) -> dict:
    path = pathlib.Path(directory) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{path}: no such file; a Hugging Face model directory holds config.json "
                              "beside its *.safetensors")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return data


def architecture_fields(cfg: ModelConfig) -> dict[str, Any]:
    """The ModelConfig fields that define the weights (what a checkpoint must agree on), as JSON values."""
    return {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("init_from_hf", "init_std")}


def resolve_init_from_hf(model: ModelConfig) -> ModelConfig:
    """The ModelConfig of ``model.init_from_hf``'s config.json. A field the user set to something
    else than both the default and the checkpoint is an error: the weights decide the architecture."""
    directory = model.init_from_hf
    where = str(pathlib.Path(directory) / "config.json")
    loaded, _ = model_config_from_hf(read_hf_config(directory), where)
    mine, default = architecture_fields(model), architecture_fields(ModelConfig())
    for name, theirs in architecture_fields(loaded).items():
        if mine[name] != default[name] and mine[name] != theirs:
            raise CheckpointError(f"model.{name}={mine[name]!r} but {where} says {theirs!r}; with model.init_from_hf "
                                  f"the architecture comes from the checkpoint. Fix: drop the model.{name} setting")
    return dataclasses.replace(loaded, init_from_hf=directory)
