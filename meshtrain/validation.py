"""The range of every numeric option that is not a parallel size, checked before any work starts.

A value's type is checked where it is parsed (config.py); the parallel sizes and the rules that tie
them to the model and batch are layout rules (parallel/layout.py); the MoE fields are checked there
too, with the layout they constrain. What is left is here: each field against its own range, and
the few model shapes that must divide. ``check_ranges`` runs in the dry run and before every job,
so a negative batch or a zero-layer model is one message naming the field, never a
ZeroDivisionError, a negative tokens/s or a loss of 0.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from meshtrain.config import JobConfig, PreferenceConfig
from meshtrain.errors import ConfigError

Rule = tuple[str, Callable[[Any], bool], str, str]
"""(field, holds, the rule in words, the fix)."""


def _positive(field: str, fix: str = "") -> Rule:
    return field, lambda v: v >= 1, "must be >= 1", fix or f"set {field} to a positive value"


def _non_negative(field: str, fix: str = "") -> Rule:
    return field, lambda v: v >= 0, "must be >= 0", fix or f"set {field} to 0 or more"


def _above_zero(field: str, fix: str = "") -> Rule:
    return field, lambda v: v > 0, "must be > 0", fix or f"set {field} to a positive value"


def _optional(rule: Rule) -> Rule:
    field, holds, words, fix = rule
    return field, lambda v: v is None or holds(v), f"{words} (or unset)", fix


RULES: list[Rule] = [
    _positive("model.vocab_size"),
    _positive("model.hidden_size"),
    _positive("model.intermediate_size"),
    _positive("model.num_hidden_layers"),
    _positive("model.num_attention_heads"),
    _positive("model.num_key_value_heads"),
    _optional(_positive("model.head_dim")),
    _optional(_positive("model.sliding_window")),
    _optional(_above_zero("model.local_rope_theta", "use e.g. 10000")),
    _optional(_positive("model.query_pre_attn_scalar")),
    _optional(_above_zero("model.attn_logit_softcapping", "use e.g. 50")),
    _optional(_above_zero("model.final_logit_softcapping", "use e.g. 30")),
    _above_zero("model.rms_norm_eps", "use e.g. 1e-5"),
    _above_zero("model.rope_theta", "use e.g. 10000 or 500000"),
    _positive("model.max_position_embeddings"),
    _non_negative("model.init_std", "use e.g. 0.02"),
    _non_negative("model.num_experts"),
    _optional(_positive("model.moe_intermediate_size")),
    _non_negative("model.shared_expert_intermediate_size", "use 0 for no shared expert"),
    _above_zero("model.rope_scaling.factor"),
    _positive("model.rope_scaling.original_max_position_embeddings"),
    _non_negative("optimizer.lr", "use e.g. 3e-4"),
    _non_negative("optimizer.weight_decay", "use e.g. 0.1, or 0 for none"),
    ("optimizer.beta1", lambda v: 0 <= v < 1, "must be in [0, 1)", "use e.g. 0.9"),
    ("optimizer.beta2", lambda v: 0 <= v < 1, "must be in [0, 1)", "use e.g. 0.95"),
    _above_zero("optimizer.eps", "use e.g. 1e-8"),
    _non_negative("lr_schedule.warmup_steps", "use 0 for no warmup"),
    ("lr_schedule.min_lr_ratio", lambda v: 0 <= v <= 1, "must be in [0, 1]", "use e.g. 0.1"),
    _non_negative("data.num_workers", "use 0 to load in the training process"),
    _positive("train.steps"),
    _positive("train.global_batch_size"),
    _positive("train.micro_batch_size"),
    _positive("train.seq_len"),
    _positive("train.activation_checkpointing_every", "use 1 to checkpoint every layer"),
    _non_negative("train.seed"),
    _non_negative("train.grad_clip", "use 0 to disable clipping, or e.g. 1.0"),
    _non_negative("eval.interval", "use 0 for no evaluation, or e.g. 100"),
    _positive("eval.steps"),
    ("eval.split", lambda v: 0 <= v < 1, "must be in [0, 1)", "use e.g. 0.01 to hold out 1% of the training samples"),
    _positive("peft.rank", "use e.g. 16"),
    _above_zero("peft.alpha", "use e.g. 2 x peft.rank"),
    ("peft.dropout", lambda v: 0 <= v < 1, "must be in [0, 1)", "use 0, or e.g. 0.05"),
    _above_zero("preference.beta", "use e.g. 0.1"),
    ("preference.label_smoothing", lambda v: 0 <= v < 0.5, "must be in [0, 0.5)", "use 0, or e.g. 0.1"),
    _non_negative("preference.nll_weight", "use 0, or e.g. 1.0 for RPO"),
    _non_negative("checkpoint.interval", "use 0 to save nothing"),
    _non_negative("checkpoint.keep_last", "use 0 to keep all"),
    _above_zero("checkpoint.hf_max_shard_gb", "use e.g. 5"),
    _positive("logging.log_every"),
    _optional(_above_zero("logging.peak_tflops")),
    _non_negative("logging.phase_every", "use 0 for no phase breakdown, or e.g. 10"),
    _non_negative("profiling.trace_wait"),
    _non_negative("profiling.trace_warmup"),
    _positive("profiling.trace_active"),
    ("profiling.memory_snapshot_steps", lambda v: all(step >= 1 for step in v), "must hold steps >= 1",
     "list training steps, e.g. [2, 10]"),
    _non_negative("profiling.flight_recorder", "use 0 to disable it, or e.g. 1000"),
]


def _value(cfg: JobConfig, field: str) -> Any:
    value = cfg
    for part in field.split("."):
        value = getattr(value, part)
    return value


def check_ranges(cfg: JobConfig) -> None:
    """Raise a ConfigError naming the first field outside its range, or a model shape that cannot work."""
    for field, holds, words, fix in RULES:
        value = _value(cfg, field)
        if not holds(value):
            raise ConfigError(f"{field}={value} {words}. Fix: {fix}")
    if cfg.peft.adapters and cfg.train.float8:
        raise ConfigError(f"peft.method={cfg.peft.method} with train.float8=true is not supported: the adapters would replace "
                          "the float8 linears' forward. Fix: set train.float8=false")
    e = cfg.eval
    # Options that would do nothing beside another: said, not ignored.
    if e.data and e.split:
        raise ConfigError(f"eval.data={e.data} and eval.split={e.split} both choose the held-out data; eval.data wins "
                          "and eval.split would hold nothing out. Fix: set one of them")
    if e.split and cfg.data.blend:
        raise ConfigError(f"eval.split={e.split} with data.blend: a blend repeats its smaller datasets, so its last "
                          "samples are not held out from training. Fix: give held-out data as eval.data")
    if cfg.peft.export_adapter and not cfg.peft.adapters:
        raise ConfigError(f"peft.export_adapter={cfg.peft.export_adapter} with peft.method=none: there are no adapters "
                          "to export. Fix: set peft.method=lora (or dora), or drop peft.export_adapter")
    if cfg.data.chat_template and cfg.data.format not in ("chat", "preference"):
        raise ConfigError(f"data.chat_template={cfg.data.chat_template} with data.format={cfg.data.format}: only chat "
                          "data is rendered through a template. Fix: set data.format=chat, or drop data.chat_template")
    if cfg.data.format == "preference" and cfg.data.document_mask == "off":
        raise ConfigError("data.document_mask=off with data.format=preference: a pair's chosen and rejected sequences "
                          "share a sample, and each must attend to itself only. Fix: drop data.document_mask (auto)")
    if cfg.preference != PreferenceConfig() and cfg.data.format != "preference":
        changed = next(f.name for f in dataclasses.fields(PreferenceConfig)
                       if getattr(cfg.preference, f.name) != getattr(PreferenceConfig(), f.name))
        raise ConfigError(f"preference.{changed}={getattr(cfg.preference, changed)!r} with data.format={cfg.data.format}: "
                          "the preference section sets the loss of preference pairs. Fix: set data.format=preference "
                          f"(records with prompt / chosen / rejected), or drop preference.{changed}")
    if e.interval and not e.data and not e.split:
        raise ConfigError(f"eval.interval={e.interval} needs held-out data. Fix: set eval.data to a held-out "
                          "dataset, or eval.split to the fraction of the training samples to hold out (e.g. 0.01)")
    m = cfg.model
    if m.head_dim is None and m.hidden_size % m.num_attention_heads:
        raise ConfigError(f"model.hidden_size={m.hidden_size} must be divisible by model.num_attention_heads="
                          f"{m.num_attention_heads} (each head gets hidden_size / heads). Fix: change either, "
                          "or set model.head_dim")
    if m.num_attention_heads % m.num_key_value_heads:
        raise ConfigError(f"model.num_attention_heads={m.num_attention_heads} must be divisible by "
                          f"model.num_key_value_heads={m.num_key_value_heads} (grouped-query attention shares each "
                          "key/value head between a whole number of query heads). Fix: change either")
