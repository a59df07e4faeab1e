"""Where Hugging Face names map: parameter names and config.json, both ways. What differs between
families is asked of the family (models/family.py); the common keys are read and written here.

meshtrain's module names are HF's without the ``model.`` prefix, and its RoPE is HF's rotate-half
layout, so dense families map by a rename and need no q/k permutation. The adapters work on
name -> tensor dicts rather than on single names so that MoE families can split and stack
per-expert tensors without changing their callers.

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

from meshtrain.models.config import ModelConfig, RopeScalingConfig
from meshtrain.errors import CheckpointError
from meshtrain.models import families
from meshtrain.models.family import LM_HEAD, require, required

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}

T = TypeVar("T")


def to_hf_name(name: str) -> str:
    return name if name == LM_HEAD else f"model.{name}"


def to_hf(state_dict: dict[str, T], cfg: ModelConfig) -> dict[str, T]:
    """meshtrain names -> HF names, as the family writes them (models/family.py)."""
    return cfg.definition.to_hf(state_dict, cfg)


def from_hf(hf_state_dict: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """HF names -> meshtrain names, as the family reads them."""
    return cfg.definition.from_hf(hf_state_dict, cfg)


def hf_shapes(cfg: ModelConfig) -> dict[str, torch.Size]:
    """Every HF key of the whole model and its shape, in module order, computed on the meta device."""
    from meshtrain.models.transformer import Transformer  # the model imports config only; keep this module light

    with torch.device("meta"):
        model = Transformer(cfg)
    return to_hf({n: p.shape for n, p in cfg.definition.checkpoint_tensors(model)}, cfg)


# --- config.json ------------------------------------------------------------------------------

def _rope_from_hf(hf: dict, where: str) -> tuple[float, RopeScalingConfig]:
    params = hf.get("rope_parameters") or {}
    legacy = hf.get("rope_scaling") or {}
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    scaling = params if params.get("rope_type", "default") != "default" else legacy
    return float(theta), rope_scaling_from_hf(scaling, where)


def rope_scaling_from_hf(scaling: dict, where: str) -> RopeScalingConfig:
    """One rope_parameters (or legacy rope_scaling) dict's scaling; its rope_theta is read by the caller."""
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return RopeScalingConfig()
    if kind == "linear":
        return RopeScalingConfig(type="linear", factor=float(scaling["factor"]))
    if kind == "yarn":
        if "factor" not in scaling or "original_max_position_embeddings" not in scaling:
            raise CheckpointError(f"{where}: rope_type 'yarn' needs 'factor' and 'original_max_position_embeddings'")
        optional = {k: float(scaling[k]) for k in ("mscale", "mscale_all_dim", "attention_factor")
                    if scaling.get(k) is not None}
        return RopeScalingConfig(
            type="yarn", factor=float(scaling["factor"]),
            original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
            beta_fast=float(scaling.get("beta_fast") or 32), beta_slow=float(scaling.get("beta_slow") or 1),
            truncate=bool(scaling.get("truncate", True)), **optional)
    if kind != "llama3":
        raise CheckpointError(f"{where}: rope_type {kind!r} is not supported (meshtrain implements 'default', "
                              "'linear', 'llama3' and 'yarn')")
    defaults = RopeScalingConfig()
    return RopeScalingConfig(
        type="llama3", factor=float(scaling.get("factor", defaults.factor)),
        low_freq_factor=float(scaling.get("low_freq_factor", defaults.low_freq_factor)),
        high_freq_factor=float(scaling.get("high_freq_factor", defaults.high_freq_factor)),
        original_max_position_embeddings=int(scaling.get("original_max_position_embeddings",
                                                         defaults.original_max_position_embeddings)))


def rope_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """rope_parameters (transformers 5) of the model's (global) RoPE."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    s = cfg.rope_scaling
    if s.type == "linear":
        rope = {"rope_type": "linear", "rope_theta": cfg.rope_theta, "factor": s.factor}
    elif s.type == "llama3":
        rope = {"rope_type": "llama3", "rope_theta": cfg.rope_theta, "factor": s.factor,
                "low_freq_factor": s.low_freq_factor, "high_freq_factor": s.high_freq_factor,
                "original_max_position_embeddings": s.original_max_position_embeddings}
    elif s.type == "yarn":
        rope = {"rope_type": "yarn", "rope_theta": cfg.rope_theta, "factor": s.factor,
                "original_max_position_embeddings": s.original_max_position_embeddings}
        # the optional keys where they are not transformers' defaults (absent from its own configs)
        defaults = {"beta_fast": 32.0, "beta_slow": 1.0, "truncate": True, "mscale": None, "mscale_all_dim": None,
                    "attention_factor": None}
        rope |= {k: getattr(s, k) for k, default in defaults.items() if getattr(s, k) != default}
    return rope


def model_config_from_hf(hf: dict, where: str = "config.json") -> tuple[ModelConfig, torch.dtype | None]:
    """A transformers config.json (as a dict) -> meshtrain's ModelConfig and the checkpoint dtype."""
    archs = hf.get("architectures") or []
    family = families.by_architecture(archs[0] if archs else None, hf.get("model_type"))
    if family is None:
        named = f"architectures={archs!r}" if archs else f"model_type={hf.get('model_type')!r} (and no architectures)"
        supported = ", ".join(f.architecture for f in families.every())
        raise CheckpointError(f"{where}: {named} is not supported; supported: {supported}")
    for key, value in family.unsupported.items():
        require(hf, key, value, where)
    specific = family.config_from_hf(hf, where)
    theta, scaling = _rope_from_hf(hf, where)
    hidden, heads = required(hf, "hidden_size", where), required(hf, "num_attention_heads", where)
    head_dim = hf.get("head_dim")
    common = dict(
        family=family.name,
        vocab_size=required(hf, "vocab_size", where),
        hidden_size=hidden,
        intermediate_size=required(hf, "intermediate_size", where),
        num_hidden_layers=required(hf, "num_hidden_layers", where),
        num_attention_heads=heads,
        num_key_value_heads=hf.get("num_key_value_heads") or heads,
        # None where it is the default hidden/heads, so configs compare equal however they spell it.
        head_dim=head_dim if head_dim not in (None, hidden // heads) else None,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=required(hf, "max_position_embeddings", where),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        init_std=float(hf.get("initializer_range", ModelConfig.init_std)),
    )
    cfg = ModelConfig(**(common | specific))
    dtype_name = hf.get("dtype") or hf.get("torch_dtype")
    if dtype_name is not None and dtype_name not in DTYPES:
        raise CheckpointError(f"{where}: dtype {dtype_name!r} is not supported; supported: {', '.join(DTYPES)}")
    return cfg, DTYPES.get(dtype_name)


def hf_config_from_model(cfg: ModelConfig, dtype: torch.dtype, base: dict | None = None) -> dict:
    """meshtrain's ModelConfig -> a transformers 5 config.json dict. ``base`` (the config.json the
    weights came from) contributes what meshtrain does not model, such as token ids."""
    rope = rope_to_hf(cfg)
    source_rope = (base or {}).get("rope_parameters")
    if source_rope and _rope_from_hf({"rope_parameters": source_rope}, "") == (cfg.rope_theta, cfg.rope_scaling):
        rope = source_rope  # the same RoPE: its own spelling (optional keys written or not) kept
    family = cfg.definition
    ours = {
        "architectures": [family.architecture],
        "model_type": family.model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.resolved_head_dim,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_parameters": rope,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "initializer_range": cfg.init_std,
        "dtype": DTYPE_NAMES[dtype],
    } | family.config_to_hf(cfg)
    # and quantization_config: meshtrain writes the weights unquantized, whatever the source held
    legacy = {"rope_theta", "rope_scaling", "torch_dtype", "transformers_version", "_name_or_path", "quantization_config"}
    kept = {k: v for k, v in (base or {}).items() if k not in legacy and k not in ours}
    return {**family.config_defaults, **kept, **ours}


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
    return {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("init_from_hf", "init_std", "skip_mtp_layers")}


def resolve_init_from_hf(model: ModelConfig) -> ModelConfig:
    """The ModelConfig of ``model.init_from_hf``'s config.json. A field the user set to something
    else than both the default and the checkpoint is an error: the weights decide the architecture."""
    directory = model.init_from_hf
    where = str(pathlib.Path(directory) / "config.json")
    hf = read_hf_config(directory)
    loaded, _ = model_config_from_hf(hf, where)
    quantized = (hf.get("quantization_config") or {}).get("quant_method")
    if quantized is not None and quantized not in loaded.definition.quantizations:
        raise CheckpointError(f"{where}: quantization_config.quant_method={quantized!r}: the weights are quantized, and "
                              "meshtrain imports float32, bfloat16 or float16 weights. Fix: dequantize the checkpoint "
                              "first (DeepSeek's inference/fp8_cast_bf16.py writes a bf16 copy of its fp8 releases)")
    mine, default = architecture_fields(model), architecture_fields(ModelConfig())
    for name, theirs in architecture_fields(loaded).items():
        if mine[name] != default[name] and mine[name] != theirs:
            raise CheckpointError(f"model.{name}={mine[name]!r} but {where} says {theirs!r}; with model.init_from_hf "
                                  f"the architecture comes from the checkpoint. Fix: drop the model.{name} setting")
    return dataclasses.replace(loaded, init_from_hf=directory, skip_mtp_layers=model.skip_mtp_layers)
