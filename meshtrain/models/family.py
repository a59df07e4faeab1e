"""What a model family is: everything meshtrain knows about one architecture, asked by generic code.

A family (one module in ``models/families/``, found by its file name) says how its decoder layers
are built from the blocks of ``models/transformer.py`` and ``models/moe.py``, which of its layers
are mixture-of-experts, how its tensors are named in a Hugging Face checkpoint (stacked experts
split per expert, blocks renamed), and how its config.json reads and writes. The blocks carry their
own tensor-parallel plans, so a family built from existing blocks has its plan, its planner
inventory (the model on the meta device) and its FLOPs with no code elsewhere; a family with a new
kind of block writes that block and its plan.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import torch
from torch import nn

from meshtrain.errors import CheckpointError

if TYPE_CHECKING:
    from meshtrain.config import ModelConfig

T = TypeVar("T")


@dataclass(frozen=True)
class ExpertNames:
    """Where a family's Hugging Face checkpoint keeps the experts meshtrain stacks as [E, ...]:
    ``model.layers.N.{block}.experts.{e}.{names[kind]}.weight`` for kind in gate/up/down_proj."""

    block: str = "mlp"
    names: dict[str, str] = field(default_factory=lambda: {"gate_proj": "gate_proj", "up_proj": "up_proj",
                                                           "down_proj": "down_proj"})
    stacked: bool = False
    """The checkpoint holds the experts stacked as meshtrain does, under meshtrain's names (GPT-OSS)."""


@dataclass(frozen=True)
class RowStack(Generic[T]):
    """One Hugging Face tensor that is several of meshtrain's weights stacked by rows (Phi-3's
    ``qkv_proj`` = [q; k; v]): each part's own HF-style name and value, in row order. ``hf/fused.py``
    reads and writes each rank's shards of the parts as row ranges of the one tensor."""

    parts: dict[str, T]


class Family:
    """The Llama-shaped decoder every family starts from; subclasses change what differs."""

    name: str = ""
    """``model.family``: the name of the family's module in models/families/."""
    architecture: str = ""
    """config.json's ``architectures[0]`` (the transformers class)."""
    model_type: str = ""
    qk_norm: bool = False
    """RMSNorm on each head's queries and keys before RoPE (Qwen3)."""
    attention_bias: bool = False
    """Biases on the q/k/v projections (Qwen2); o_proj has none."""
    output_bias: bool = False
    """A bias on o_proj too (GPT-OSS)."""
    attention_sinks: bool = False
    """A learned logit per head in each attention softmax's denominator (GPT-OSS's sinks)."""
    windowed: bool = False
    """Every layer's attention is local over ``model.sliding_window`` tokens when that is set (Mistral)."""
    layer_pattern: int = 0
    """Local and global layers (``model.layer_types``): by default every layer_pattern-th global, the
    rest local over ``model.sliding_window`` (Gemma 2, GPT-OSS: 2; Gemma 3: 6); 0 for none."""
    offset_norm: bool = False
    """Gemma's RMSNorm: (1 + weight), computed in fp32."""
    settings: frozenset[str] = frozenset()
    """The optional ModelConfig fields this family honours (and writes to config.json); another one set
    is an error, never silently dropped."""
    experts: ExpertNames | None = None
    """Set for a mixture-of-experts family: how its checkpoint names the experts."""
    topk_always_normalized: bool = False
    """The top-k routing weights sum to one whatever ``norm_topk_prob`` says (Mixtral)."""
    router_scoring: str = "softmax"
    """How the router scores the experts: "softmax" over them, "topk_softmax" over the chosen
    ones' logits (GPT-OSS), or "sigmoid" each (DeepSeek-V3)."""
    router_bias: bool = False
    """A bias on the router's logits (GPT-OSS)."""
    expert_biases: bool = False
    """Biases on the experts' projections (GPT-OSS)."""
    renames: dict[str, str] = {}
    """Names inside a layer that the checkpoint spells otherwise: meshtrain's -> its (a leading part
    of the name: DeepSeek-V3's ``mlp.shared_experts.`` for meshtrain's ``mlp.shared_expert.``)."""
    quantizations: frozenset[str] = frozenset()
    """config.json's ``quantization_config.quant_method`` values whose weights the import dequantizes
    (another is refused, naming it)."""
    hf_buffers: frozenset[str] = frozenset()
    """Buffers (by their name in a layer) that the checkpoint holds beside the parameters
    (DeepSeek-V3's routing bias, ``mlp.gate.expert_bias``)."""
    config_defaults: dict[str, Any] = {}
    """config.json keys written when the checkpoint the weights came from has none (a model trained
    from scratch), where the transformers config class's own default would not fit the model."""
    fused: dict[str, tuple[str, ...]] = {}
    """Checkpoint modules that hold several of meshtrain's linears stacked by output rows, by their
    names in a layer -> the linears', in row order (Phi-3: ``self_attn.qkv_proj`` is q/k/v_proj).
    meshtrain keeps the linears apart, so tensor parallelism splits each by heads or by half."""
    unsupported: dict[str, Any] = {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False}
    """config.json keys whose value must be this one (the default when absent) for meshtrain's
    blocks to compute what transformers computes; another value is an error naming the key."""

    @property
    def is_moe(self) -> bool:
        return self.experts is not None

    @property
    def fused_into(self) -> dict[str, str]:
        """Each linear of a fused tensor (``self_attn.q_proj``) -> the checkpoint module holding it."""
        return {part: fused for fused, parts in self.fused.items() for part in parts}

    # --- the model -------------------------------------------------------------------------------

    def is_sparse_layer(self, cfg: ModelConfig, layer: int) -> bool:
        """Whether decoder layer ``layer`` has a mixture-of-experts MLP."""
        return False

    @property
    def norm_type(self) -> type[nn.Module]:
        from meshtrain.models.transformer import OffsetRMSNorm, RMSNorm
        return OffsetRMSNorm if self.offset_norm else RMSNorm

    def rope_dim(self, cfg: ModelConfig) -> int:
        """The dims of a head that RoPE rotates (the tables' width)."""
        return cfg.resolved_head_dim

    def attention_dims(self, cfg: ModelConfig) -> tuple[int, int]:
        """Each head's query/key dims and value dims (FLOPs of the scores and of their sum of values)."""
        return cfg.resolved_head_dim, cfg.resolved_head_dim

    def checkpoint_tensors(self, model: nn.Module) -> list[tuple[str, torch.Tensor]]:
        """The model's tensors a Hugging Face checkpoint holds, by meshtrain's names: its parameters and
        the buffers in ``hf_buffers``."""
        tensors = list(model.named_parameters())
        if self.hf_buffers:
            tensors += [(n, b) for n, b in model.named_buffers() if n.split(".", 2)[-1] in self.hf_buffers]
        return tensors

    def norm(self, dim: int, eps: float) -> nn.Module:
        return self.norm_type(dim, eps)

    def decoder_layer(self, cfg: ModelConfig, layer: int) -> nn.Module:
        from meshtrain.models.transformer import DecoderLayer
        return DecoderLayer(cfg, layer)

    def embedding_scale(self, cfg: ModelConfig) -> float | None:
        """A factor on the embedding's output (Gemma: sqrt(hidden_size)), or None."""
        return None

    def activation(self, x: torch.Tensor) -> torch.Tensor:
        """The MLP gate's activation: SwiGLU's SiLU."""
        return torch.nn.functional.silu(x)

    def attention(self, cfg: ModelConfig, layer: int) -> nn.Module:
        from meshtrain.models.transformer import Attention
        window = self.sliding_window(cfg, layer)
        return Attention(cfg, bias=self.attention_bias, qk_norm=self.norm_type if self.qk_norm else None,
                         sliding_window=window, local_rope=window is not None and cfg.local_rope_theta is not None,
                         output_bias=self.output_bias, sinks=self.attention_sinks)

    def layer_types(self, cfg: ModelConfig) -> list[str]:
        """Each layer's attention, SLIDING or FULL, where the family mixes them (``layer_pattern``)."""
        if not self.layer_pattern:
            return list(cfg.layer_types)
        return cfg.layer_types or pattern_layer_types(cfg.num_hidden_layers, self.layer_pattern)

    def sliding_window(self, cfg: ModelConfig, layer: int) -> int | None:
        """The window of layer ``layer``'s attention, or None for full causal attention."""
        if self.layer_pattern:
            return cfg.sliding_window if self.layer_types(cfg)[layer] == SLIDING else None
        return cfg.sliding_window if self.windowed else None

    def needs_masked_attention(self, cfg: ModelConfig, seq_len: int) -> bool:
        """Whether attention is more than causal SDPA at ``seq_len``: some layer's window is shorter, or
        scores are soft-capped, or sinks join the softmax (context parallelism then takes its masked
        route, parallel/context.py)."""
        windowed = any((self.sliding_window(cfg, i) or seq_len) < seq_len for i in range(cfg.num_hidden_layers))
        return windowed or cfg.attn_logit_softcapping is not None or self.attention_sinks

    def experts_module(self, cfg: ModelConfig) -> nn.Module:
        """An MoE layer's stacked experts."""
        from meshtrain.models.moe import Experts
        return Experts(cfg)

    def mlp(self, cfg: ModelConfig, layer: int) -> nn.Module:
        from meshtrain.models.moe import MoE
        from meshtrain.models.transformer import MLP
        if not self.is_sparse_layer(cfg, layer):
            return MLP(cfg, activation=self.activation)
        shared = MLP(cfg, cfg.shared_expert_intermediate_size) if cfg.shared_expert_intermediate_size else None
        return MoE(cfg, shared)

    def check(self, cfg: ModelConfig) -> list[tuple[str, str]]:
        """Settings this family cannot run, as (what is wrong, the fix); validation raises the first."""
        from meshtrain.config import ModelConfig as Defaults
        from meshtrain.models import families
        for name in OPTIONAL_SETTINGS - self.settings:
            if getattr(cfg, name) != getattr(Defaults(), name):
                having = ", ".join(f.name for f in families.every() if name in f.settings)
                return [(f"model.{name}={getattr(cfg, name)!r} on the family {self.name!r}, which has no such setting",
                         f"drop model.{name} (families with it: {having})")]
        if self.is_moe and cfg.num_experts < 2:
            return [(f"model.family={self.name} needs model.num_experts >= 2, got {cfg.num_experts}",
                     "set model.num_experts")]
        if cfg.num_experts and not self.is_moe:
            moe = " or ".join(f.name for f in families.every() if f.is_moe)
            return [(f"model.num_experts={cfg.num_experts} on the dense family {self.name!r}",
                     f"use family {moe}, or set model.num_experts=0")]
        kinds = cfg.layer_types
        if self.layer_pattern and kinds and (len(kinds) != cfg.num_hidden_layers or set(kinds) - {SLIDING, FULL}):
            return [(f"model.layer_types={kinds} must name {SLIDING!r} or {FULL!r} for each of the "
                     f"{cfg.num_hidden_layers} layers", f"list one per layer, or drop it for {self.name}'s pattern")]
        if self.layer_pattern and cfg.sliding_window is None and SLIDING in self.layer_types(cfg):
            return [(f"model.sliding_window is unset, and {self.name}'s sliding_attention layers need a window",
                     "set model.sliding_window")]
        return []

    def mtp_tensors(self, keys: set[str], cfg: ModelConfig) -> set[str]:
        """Which of the checkpoint's tensors ``keys`` (ones the model does not have) belong to
        multi-token-prediction modules, which meshtrain does not train (``model.skip_mtp_layers``)."""
        return set()

    # --- Hugging Face tensor names ---------------------------------------------------------------

    def to_hf(self, state_dict: dict[str, T], cfg: ModelConfig) -> dict[str, T]:
        """meshtrain names -> HF names (values are tensors, or shapes). A tied output projection is
        not written (HF omits it too), or, without the embedding beside it (a pipeline's last
        stage), is the embedding; stacked experts become HF's per-expert tensors (views), and the
        linears of a fused tensor one ``RowStack`` (a stacked shape, for shapes)."""
        out: dict[str, T] = {}
        for name, value in self._stack_fused(state_dict).items():
            name = _rename(name, self.renames)
            if cfg.tie_word_embeddings and name == LM_HEAD:
                if "embed_tokens.weight" in state_dict:
                    continue
                name = "embed_tokens.weight"  # a pipeline's last stage: its head is the embedding's copy
            if self.experts is not None and (".mlp.gate." in name or ".mlp.experts." in name):
                prefix, rest = name.split(".mlp.", 1)
                if rest.startswith("experts.") and not self.experts.stacked:
                    kind = rest.removeprefix("experts.")
                    for e, v in _per_expert(value, cfg.num_experts).items():
                        out[f"model.{prefix}.{self.experts.block}.experts.{e}.{self.experts.names[kind]}.weight"] = v
                    continue
                name = f"{prefix}.{self.experts.block}.{rest}"
            elif self.experts is not None and ".mlp." in name:
                name = name.replace(".mlp.", f".{self.experts.block}.", 1)
            out[LM_HEAD if name == LM_HEAD else f"model.{name}"] = value
        return out

    def _stack_fused(self, state_dict: dict[str, T]) -> dict[str, Any]:
        """The parts of each fused tensor as one entry where the first stood: shapes become the
        stacked shape, values a ``RowStack``. A state dict with some parts only (one weight's name
        asked) gives the fused name with those parts."""
        if not self.fused:
            return state_dict
        owner = self.fused_into
        out: dict[str, Any] = {}
        stacks: dict[str, dict[str, T]] = {}
        for name, value in state_dict.items():
            m = _LAYER_WEIGHT.fullmatch(name)
            if m is None or m[2] not in owner:
                out[name] = value
                continue
            key = f"{m[1]}.{owner[m[2]]}.weight"
            out.setdefault(key, None)
            stacks.setdefault(key, {})[f"model.{name}"] = value
        for key, parts in stacks.items():
            values = list(parts.values())
            if all(isinstance(v, torch.Size) for v in values):
                out[key] = torch.Size([sum(v[0] for v in values), *values[0][1:]])
            else:
                out[key] = RowStack(parts)
        return out

    def part_rows(self, cfg: ModelConfig, part: str) -> int:
        """The rows of linear ``part`` (``self_attn.k_proj``...) in a fused tensor."""
        heads = {"q_proj": cfg.num_attention_heads, "k_proj": cfg.num_key_value_heads, "v_proj": cfg.num_key_value_heads}
        leaf = part.rsplit(".", 1)[-1]
        return heads[leaf] * cfg.resolved_head_dim if leaf in heads else cfg.intermediate_size

    def from_hf(self, hf_state_dict: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
        """HF names -> meshtrain names; per-expert tensors are stacked (copies), fused ones split (views)."""
        out: dict[str, torch.Tensor] = {}
        experts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
        block = self.experts.block if self.experts else "mlp"
        kinds = {hf: ours for ours, hf in self.experts.names.items()} if self.experts else {}
        for key, value in hf_state_dict.items():
            if key != LM_HEAD and not key.startswith("model."):
                raise KeyError(key)
            name = key.removeprefix("model.")
            m = _LAYER_WEIGHT.fullmatch(name)
            if m is not None and m[2] in self.fused:
                parts = self.fused[m[2]]
                for part, rows in zip(parts, value.split([self.part_rows(cfg, p) for p in parts])):
                    out[f"{m[1]}.{part}.weight"] = rows
                continue
            if self.experts is not None and not self.experts.stacked and f".{block}.experts." in name:
                prefix, rest = name.split(f".{block}.experts.", 1)
                index, hf_kind, _ = rest.split(".")
                experts.setdefault((prefix, kinds[hf_kind]), {})[int(index)] = value
                continue
            out[_rename(name.replace(f".{block}.", ".mlp.", 1), self._renamed_back)] = value
        for (prefix, kind), per_expert in experts.items():
            out[f"{prefix}.mlp.experts.{kind}"] = torch.stack([per_expert[e] for e in range(cfg.num_experts)])
        return out

    @property
    def _renamed_back(self) -> dict[str, str]:
        return {theirs: ours for ours, theirs in self.renames.items()}

    # --- config.json -----------------------------------------------------------------------------

    def config_from_hf(self, hf: dict, where: str) -> dict[str, Any]:
        """The ModelConfig fields this family reads beyond the common ones (hf/adapter.py)."""
        return {}

    def layer_types_from_hf(self, hf: dict, where: str) -> list[str]:
        """config.json's ``layer_types``, or the ones its ``sliding_window_pattern`` (else the
        family's ``layer_pattern``) gives."""
        return list(hf.get("layer_types") or pattern_layer_types(
            required(hf, "num_hidden_layers", where), hf.get("sliding_window_pattern", self.layer_pattern)))

    def config_to_hf(self, cfg: ModelConfig) -> dict[str, Any]:
        """The config.json keys this family writes beyond the common ones."""
        return {"hidden_act": "silu", "attention_bias": False}


LM_HEAD = "lm_head.weight"
SLIDING, FULL = "sliding_attention", "full_attention"


def pattern_layer_types(layers: int, pattern: int) -> list[str]:
    """Every pattern-th layer global, the rest local (transformers' sliding_window_pattern)."""
    return [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(layers)]


_LAYER_WEIGHT = re.compile(r"(layers\.\d+)\.(.+)\.weight")
OPTIONAL_SETTINGS = frozenset({"sliding_window", "layer_types", "local_rope_theta", "query_pre_attn_scalar",
                               "attn_logit_softcapping", "final_logit_softcapping", "kv_lora_rank", "q_lora_rank",
                               "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "rope_interleave", "n_group",
                               "topk_group", "routed_scaling_factor", "swiglu_alpha", "swiglu_limit"})
"""ModelConfig fields only some families have."""


def require(hf: dict, key: str, expected: Any, where: str) -> None:
    value = hf.get(key, expected)
    if value != expected:
        raise CheckpointError(f"{where}: {key}={value!r} is not supported (meshtrain's model implements "
                              f"{key}={expected!r}); this checkpoint cannot be trained faithfully")


def required(hf: dict, key: str, where: str) -> Any:
    if key not in hf:
        raise CheckpointError(f"{where}: required key {key!r} is missing")
    return hf[key]


def _rename(name: str, renames: dict[str, str]) -> str:
    """``layers.N.{a}...`` -> ``layers.N.{b}...`` for the first (a -> b) of ``renames`` that fits."""
    for a, b in renames.items():
        if f".{a}" in name:
            return name.replace(f".{a}", f".{b}", 1)
    return name


def _per_expert(value, num_experts: int) -> dict:
    """A stacked value's slices by expert index: views of a tensor, the shape of one expert, or
    (already split, by ``hf_io`` for sharded experts) the experts this rank holds."""
    if isinstance(value, dict):
        return value
    if isinstance(value, torch.Size):
        return dict.fromkeys(range(num_experts), torch.Size(value[1:]))
    return dict(enumerate(value.unbind(0)))
