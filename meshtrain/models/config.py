"""The model's options (``model.*``): its family and shape, under Hugging Face config.json's names.
Part of the typed configuration (``meshtrain.config``, which holds the rest), kept beside the
family modules that read it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from meshtrain.models import families


@dataclass
class RopeScalingConfig:
    """RoPE frequency scaling: llama3 (Llama 3.1's blend), linear (every frequency / factor, Gemma 3's
    global layers), yarn (DeepSeek-V3, GPT-OSS); "none" disables it. Fields as in config.json's
    rope_parameters."""

    type: Literal["none", "llama3", "linear", "yarn"] = "none"
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0
    """yarn: frequencies turning more than this many times over the original context are kept."""
    beta_slow: float = 1.0
    """yarn: frequencies turning fewer than this many times are interpolated (divided by factor)."""
    mscale: float | None = None
    mscale_all_dim: float | None = None
    """yarn (DeepSeek): cos/sin scaled by mscale(factor, mscale) / mscale(factor, mscale_all_dim), the
    softmax scale by mscale(factor, mscale_all_dim) squared."""
    attention_factor: float | None = None
    """yarn: the factor on cos/sin, when given (else derived from factor and the mscales)."""
    truncate: bool = True
    """yarn: round the ramp's ends to whole dimensions (GPT-OSS: false)."""


FamilyName = Literal[families.names()]  # the modules of meshtrain/models/families


@dataclass
class ModelConfig:
    """Decoder-only transformer. Field names follow Hugging Face config.json names."""

    family: FamilyName = "llama"
    """The architecture: a module of meshtrain/models/families (docs/adding-a-family.md). llama: Llama 3;
    qwen3: RMSNorm on per-head queries and keys; qwen3_moe: Qwen3 with mixture-of-experts MLPs;
    mixtral: Llama attention with mixture-of-experts MLPs."""
    vocab_size: int = 384
    """Embedding rows. May exceed the tokenizer's vocabulary (padding, e.g. to divide by tp)."""
    hidden_size: int = 128
    intermediate_size: int = 384
    """SwiGLU hidden size."""
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    """Fewer than num_attention_heads gives grouped-query attention."""
    head_dim: int | None = None
    """Per-head size; None means hidden_size // num_attention_heads (Qwen3 sets it explicitly)."""
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScalingConfig = field(default_factory=RopeScalingConfig)
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    """Local attention: each token attends to itself and the sliding_window - 1 tokens before it, on the
    layers the family windows (Mistral: every layer; Gemma 3: the "sliding_attention" layer_types);
    None: full causal attention."""
    layer_types: list[str] = field(default_factory=list)
    """Per layer "full_attention" or "sliding_attention", for families that mix them (Gemma 3); empty:
    the family's own pattern."""
    local_rope_theta: float | None = None
    """RoPE base of the sliding-window layers where it differs from rope_theta (Gemma 3: 10000 beside
    1e6); those layers use no rope_scaling."""
    query_pre_attn_scalar: int | None = None
    """Attention scores scaled by query_pre_attn_scalar ** -0.5 rather than head_dim ** -0.5 (Gemma)."""
    attn_logit_softcapping: float | None = None
    """Attention scores soft-capped, cap * tanh(score / cap), before the mask (Gemma 2: 50)."""
    final_logit_softcapping: float | None = None
    """The output logits soft-capped the same way (Gemma 2: 30)."""
    kv_lora_rank: int = 0
    """Multi-head latent attention (DeepSeek-V3: 512): keys and values are per-head projections of one
    latent of this size per token (plus a shared RoPE key); 0 for the families without it."""
    q_lora_rank: int | None = None
    """MLA: the queries' latent size (DeepSeek-V3: 1536); None projects queries directly (V2-Lite)."""
    qk_nope_head_dim: int = 0
    """MLA: each head's query/key dims without RoPE (DeepSeek-V3: 128)."""
    qk_rope_head_dim: int = 0
    """MLA: each head's query/key dims with RoPE, the key's shared by the heads (DeepSeek-V3: 64)."""
    v_head_dim: int = 0
    """MLA: each head's value dims (DeepSeek-V3: 128)."""
    rope_interleave: bool = True
    """MLA: the rotated pairs are adjacent dims (DeepSeek's checkpoints) rather than the two halves."""
    init_std: float = 0.02
    """Std of the normal init; output projections use init_std / sqrt(2 * num_hidden_layers)."""
    init_from_hf: str | None = None
    """A Hugging Face model directory (config.json + *.safetensors): the architecture comes from its
    config.json and each rank reads only its slices of the weights, for any layout."""
    skip_mtp_layers: bool = False
    """Import a checkpoint that carries multi-token-prediction layers (DeepSeek-V3's and R1's
    model.layers.61) without them: meshtrain does not train MTP, so they are left unread and an export
    holds none. Without it such a checkpoint is refused, naming them."""

    num_experts: int = 0
    """Routed experts per MoE layer (MoE families only; HF: num_experts / num_local_experts)."""
    num_experts_per_tok: int = 2
    """Experts each token is routed to (top-k)."""
    moe_intermediate_size: int | None = None
    """Each expert's SwiGLU size; None means intermediate_size (Mixtral's convention)."""
    norm_topk_prob: bool = True
    """Renormalise the top-k routing weights to sum to one (Mixtral always does; Qwen3-MoE configs say)."""
    decoder_sparse_step: int = 1
    """Every this many layers is an MoE layer (HF's rule: (layer + 1) % step == 0)."""
    mlp_only_layers: list[int] = field(default_factory=list)
    """Layers that keep a dense MLP, e.g. [0] for a dense first layer."""
    shared_expert_intermediate_size: int = 0
    """SwiGLU size of an always-on shared expert added to every MoE layer's output; 0: none."""
    router_aux_loss_coef: float = 0.001
    """Weight of the load-balancing loss E * sum_i f_i * P_i (Switch Transformer, per sequence), averaged
    over MoE layers."""
    router_bias_update_rate: float = 0.0
    """Aux-loss-free balancing (DeepSeek-V3): after each step each expert's routing bias moves by this
    much towards balance (only selection uses the bias, not the weights); 0 disables it."""
    capacity_factor: float = 0.0
    """Token dropping: each expert takes at most ceil(capacity_factor * seq_len * top_k / E) token
    copies of each sequence (first choices of every token before second choices, earlier tokens
    first: GShard's priority); the rest are dropped (the residual carries them). 0: no dropping."""
    n_group: int = 1
    """Group-limited routing (DeepSeek-V3: 8): the experts fall into this many groups, and each token
    chooses among the topk_group groups whose two best scores sum highest; 1: no groups."""
    topk_group: int = 1
    """Group-limited routing: the groups each token's experts come from (DeepSeek-V3: 4)."""
    routed_scaling_factor: float = 1.0
    """The routed experts' weights are multiplied by this (DeepSeek-V3: 2.5)."""
    swiglu_alpha: float = 1.702
    """GPT-OSS's clamped SwiGLU: (up + 1) * gate * sigmoid(swiglu_alpha * gate)."""
    swiglu_limit: float = 7.0
    """GPT-OSS's clamped SwiGLU: gate clamped above, up on both sides, at this value."""

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_attention_heads

    @property
    def definition(self):
        """The family's definition (models/family.py): what generic code asks about the architecture."""
        return families.get(self.family)

    @property
    def is_moe(self) -> bool:
        return self.definition.is_moe

    @property
    def resolved_moe_intermediate_size(self) -> int:
        return self.moe_intermediate_size or self.intermediate_size

    def is_sparse_layer(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` has an MoE MLP (the family's rule)."""
        return self.definition.is_sparse_layer(self, layer)
