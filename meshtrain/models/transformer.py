"""The decoder-only transformer and its blocks, in plain PyTorch; each family (models/families/) says
which blocks its layers are built of.

Module names follow Hugging Face's (``layers.N.self_attn.q_proj`` ...) so that the checkpoint
adapters are a prefix away. RoPE uses HF's rotate-half layout, so imported q/k weights need no
permutation. Every module reads its head count from its (possibly tensor-parallel-sharded) weight,
so the same code runs whole or sharded. ``layers`` is a ModuleDict keyed by the global layer index:
pipeline stages that drop layers keep the global names.

Build on the meta device, shard, then ``init_weights``: the values depend only on the seed and the
parameter's name, never on the layout (see ``initialize``).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate

from meshtrain.models.config import ModelConfig
from meshtrain.models.rope import apply_rope, rope_tables
from meshtrain.models.checkpointing import run_layer
from meshtrain.models import documents
from meshtrain.models.moe import MoE, local as local_part

if TYPE_CHECKING:
    from meshtrain.parallel.styles import TensorParallelStyles


class RMSNorm(nn.Module):
    init_value = 1.0
    """What models/initialize.py fills the weight with."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class OffsetRMSNorm(RMSNorm):
    """Gemma's RMSNorm: scales by (1 + weight), in fp32 (the weight starts at zero, not one)."""

    init_value = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (F.rms_norm(x.float(), (x.shape[-1],), None, self.eps) * (1.0 + self.weight.float())).type_as(x)


def sliding_window_mask(mask: torch.Tensor | None, seq: int, window: int, device: torch.device) -> torch.Tensor | None:
    """``mask`` (block-causal, or None for causal) without the keys ``window`` or more positions back:
    query i attends key j iff i - window < j <= i (transformers' sliding_window_overlay). Unchanged
    where the window covers the whole sequence (causal attention keeps its flash kernels)."""
    queries, keys = documents.query_key_positions(seq, device)
    if keys.numel() <= window:
        return mask
    band = (keys[None, :] <= queries[:, None]) & (keys[None, :] > queries[:, None] - window)
    return band if mask is None else mask & band


def materialized_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                           scale: float, cap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention that no SDPA kernel does, as transformers' eager attention: the [heads, seq, seq]
    scores materialised, softmax in fp32. ``cap``: scores soft-capped before the mask, cap *
    tanh(score / cap) (Gemma 2); ``sinks`` [heads]: a learned logit per head joins each softmax's
    denominator and takes its share of the probability (GPT-OSS). q [batch, heads, seq, head_dim],
    k/v [batch, kv_heads, ...]; under context parallelism the keys are every rank's
    (documents.every_key)."""
    k, v = documents.every_key(k, v)
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = q @ k.transpose(-2, -1) * scale
    if cap is not None:
        scores = torch.tanh(scores / cap) * cap
    if mask is None:
        queries, keys = documents.query_key_positions(q.shape[2], q.device)
        mask = keys[None, :] <= queries[:, None]
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return scores.softmax(dim=-1, dtype=torch.float32).to(q.dtype) @ v
    sink = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    return torch.cat([scores, sink], dim=-1).softmax(dim=-1, dtype=torch.float32)[..., :-1].to(q.dtype) @ v


class Sinks(nn.Module):
    """GPT-OSS's attention sinks: one learned logit per head (``weight`` [heads]), sharded with the
    heads under tensor parallelism (``tp_plan``)."""

    def __init__(self, heads: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(heads))


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, *, bias: bool = False, qk_norm: type[RMSNorm] | None = None,
                 sliding_window: int | None = None, local_rope: bool = False, output_bias: bool = False,
                 sinks: bool = False):
        """bias: on q/k/v (Qwen2's); qk_norm: the norm on each head's queries and keys (Qwen3's,
        Gemma 3's); sliding_window: local attention over that many tokens (Mistral's); local_rope:
        the model's local RoPE table (Gemma 3's sliding layers); output_bias: on o_proj too, and
        sinks: a learned logit per head in each softmax (GPT-OSS's)."""
        super().__init__()
        self.sliding_window, self.local_rope = sliding_window, local_rope
        # Gemma: scores scaled by query_pre_attn_scalar ** -0.5; None: SDPA's head_dim ** -0.5
        self.scale = cfg.query_pre_attn_scalar ** -0.5 if cfg.query_pre_attn_scalar else None
        self.softcap = cfg.attn_logit_softcapping
        self.head_dim = cfg.resolved_head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_attention_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_key_value_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_key_value_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(cfg.num_attention_heads * self.head_dim, cfg.hidden_size, bias=output_bias)
        self.sinks = Sinks(cfg.num_attention_heads) if sinks else None
        self.qk_norm = qk_norm is not None
        if self.qk_norm:
            self.q_norm = qk_norm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = qk_norm(self.head_dim, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """cos/sin: the whole RoPE tables (or per-token rows); the sequence length is read here, where
        the input is whole even when sequence parallelism splits the residual stream. mask: the
        block-causal document mask (models/documents.py), or None for plain causal attention."""
        batch, seq, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds a slice of the heads.
        q = self.q_proj(x).view(batch, seq, -1, self.head_dim)
        k = self.k_proj(x).view(batch, seq, -1, self.head_dim)
        v = self.v_proj(x).view(batch, seq, -1, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if cos.dim() == 2:
            cos, sin = cos[:seq], sin[:seq]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.sliding_window is not None:
            # Under cp this rank holds a slice of the queries: the trainer then always attends
            # through the document-masked route (keys gathered, positions global), see
            # parallel/context.py.
            mask = sliding_window_mask(mask, seq, self.sliding_window, x.device)
        if self.softcap is not None or self.sinks is not None:
            out = materialized_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask,
                                         self.scale or self.head_dim ** -0.5, self.softcap,
                                         None if self.sinks is None else local_part(self.sinks.weight))
        else:
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, is_causal=mask is None,
                scale=self.scale, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))

    def tp_plan(self, tp: TensorParallelStyles) -> dict:
        """Megatron's: q/k/v column-parallel (each rank a slice of the heads), o row-parallel."""
        plan = {"q_proj": tp.colwise(), "k_proj": tp.colwise(), "v_proj": tp.colwise(),
                "o_proj": tp.rowwise(output_layouts=tp.residual)}
        if self.sinks is not None:  # each rank's heads' sinks
            plan["sinks"] = tp.shard_parameters(0)
        if self.qk_norm:
            # Input [batch, seq, local_heads, head_dim] is sharded on the heads dim (2).
            plan |= {"q_norm": tp.sequence_parallel(sequence_dim=2, use_local_output=True),
                     "k_norm": tp.sequence_parallel(sequence_dim=2, use_local_output=True)}
        return plan


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, intermediate_size: int | None = None, activation=F.silu):
        """activation: of the gate (SwiGLU's SiLU; Gemma's GeGLU uses tanh-approximated GeLU)."""
        super().__init__()
        self.activation = activation
        size = intermediate_size or cfg.intermediate_size
        self.gate_proj = nn.Linear(cfg.hidden_size, size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, size, bias=False)
        self.down_proj = nn.Linear(size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.activation(self.gate_proj(x)) * self.up_proj(x))

    def tp_plan(self, tp: TensorParallelStyles) -> dict:
        """gate/up column-parallel (each rank a slice of the FFN), down row-parallel; the input becomes
        one Replicate DTensor shared by gate and up (see DecoderLayer.tp_plan)."""
        return {"gate_proj": tp.colwise(), "up_proj": tp.colwise(), "down_proj": tp.rowwise(output_layouts=tp.residual),
                "": tp.prepare_input(input_layouts=(tp.residual,), desired_input_layouts=(Replicate(),))}


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__()
        family = cfg.definition
        self.input_layernorm = family.norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = family.attention(cfg, index)
        self.post_attention_layernorm = family.norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = family.mlp(cfg, index)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.mlp_residual(self.attention_residual(x, cos, sin, mask))

    # The two halves are methods of their own so that train.compile can compile the attention half
    # alone where the MLP half (MoE routing) has data-dependent shapes.
    def attention_residual(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                           mask: torch.Tensor | None = None) -> torch.Tensor:
        return x + self.self_attn(self.input_layernorm(x), cos, sin, mask)

    def mlp_residual(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.mlp(self.post_attention_layernorm(h))

    def tp_plan(self, tp: TensorParallelStyles) -> dict:
        """The layer's ``parallelize_module`` plan: each block's own, and the norms under SP."""
        # The attention inputs become one Replicate DTensor shared by q/k/v (the MLP's by gate/up),
        # so backward sums their Partial input gradients first and all-reduces once per block, not
        # once per projection (bench/compare.py measured 3 extra all-reduces per layer without
        # this). (hidden, cos, sin, mask): under SP this also gathers the sequence before the
        # column-parallel projections. With float8 the input is cast before the gather (half of
        # bf16's bytes) with its global amax.
        plan = {"self_attn": tp.prepare_input(input_layouts=(tp.residual, None, None, None),
                                              desired_input_layouts=(Replicate(), None, None, None))}
        for name in ("self_attn", "mlp"):
            for path, style in getattr(self, name).tp_plan(tp).items():
                plan[f"{name}.{path}" if path else name] = style
        if tp.sequence_parallel_norms:
            plan |= {name: tp.sequence_parallel() for name, child in self.named_children() if isinstance(child, RMSNorm)}
        return plan


class SandwichDecoderLayer(DecoderLayer):
    """Gemma 2/3's layer: each block's output is normalised too before it joins the residual stream
    (post_attention_layernorm on the attention's output, pre/post_feedforward_layernorm around the MLP)."""

    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__(cfg, index)
        self.pre_feedforward_layernorm = cfg.definition.norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_feedforward_layernorm = cfg.definition.norm(cfg.hidden_size, cfg.rms_norm_eps)

    def attention_residual(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                           mask: torch.Tensor | None = None) -> torch.Tensor:
        return x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, mask))

    def mlp_residual(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))

    def tp_plan(self, tp: TensorParallelStyles) -> dict:
        plan = super().tp_plan(tp)
        if tp.sequence_parallel_norms:  # their outputs join the residual stream, which is a local tensor
            plan |= {name: tp.sequence_parallel(use_local_output=True)
                     for name in ("post_attention_layernorm", "post_feedforward_layernorm")}
        return plan


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.activation_checkpointing = "none"  # or "full" / "selective" (models/checkpointing.py)
        self.activation_checkpointing_every = 1
        self.reset_position_ids = False  # with document ids: RoPE positions restart per document
        family = cfg.definition
        self.embedding_scale = family.embedding_scale(cfg)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleDict({str(i): family.decoder_layer(cfg, i) for i in range(cfg.num_hidden_layers)})
        self.norm = family.norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()
        meta = "meta" if self.embed_tokens.weight.is_meta else None
        # Not persistent: derived from the config, so checkpoints never carry them.
        for prefix, local in self.rope_kinds():
            cos, sin = rope_tables(cfg, device=meta, local=local)
            self.register_buffer(f"{prefix}_cos", cos, persistent=False)
            self.register_buffer(f"{prefix}_sin", sin, persistent=False)

    def rope_kinds(self) -> list[tuple[str, bool]]:
        """The RoPE tables' buffer prefixes: rope (every family), rope_local (local layers with a base
        of their own, Gemma 3's)."""
        local = self.cfg.local_rope_theta is not None
        return [("rope", False)] + ([("rope_local", True)] if local else [])

    def rope_buffers(self) -> list[torch.Tensor]:
        """Every RoPE table, [positions, head_dim] each: what context parallelism shards by position."""
        return [getattr(self, f"{prefix}_{part}") for prefix, _ in self.rope_kinds() for part in ("cos", "sin")]

    def forward(self, x: torch.Tensor, document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids to logits; a pipeline stage without the embedding takes hidden states, and one
        without the output head returns them. ``document_ids`` ([batch, seq], models/documents.py):
        attention stays inside each document of a packed sample."""
        tables, mask = {prefix: (getattr(self, f"{prefix}_cos"), getattr(self, f"{prefix}_sin"))
                        for prefix, _ in self.rope_kinds()}, None
        if document_ids is not None:
            mask = documents.attention_mask(document_ids)
            positions = documents.token_positions(document_ids, self.reset_position_ids, mask)
            if positions is not None:
                tables = {prefix: (cos[positions], sin[positions]) for prefix, (cos, sin) in tables.items()}
        h = x
        if self.embed_tokens is not None:
            h = self.embed_tokens(x)
            if self.embedding_scale is not None:  # Gemma: rounded to the activations' dtype, as transformers does
                h = h * torch.tensor(self.embedding_scale, dtype=h.dtype).item()
        for index, layer in self.layers.items():
            cos, sin = tables["rope_local" if layer.self_attn.local_rope else "rope"]
            h = run_layer(layer, int(index), self.activation_checkpointing, self.activation_checkpointing_every,
                          h, cos, sin, mask)
        if self.lm_head is None:
            return h
        logits = self.lm_head(self.norm(h))
        cap = self.cfg.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def keep_only(self, layer_ids: range, *, embedding: bool, head: bool) -> None:
        """Drop everything a pipeline stage does not own. Kept layers keep their global index, so
        parameter names (and checkpoints) are those of the whole model."""
        for name in [n for n in self.layers if int(n) not in layer_ids]:
            del self.layers[name]
        if not embedding:
            self.embed_tokens = None
        if not head:
            self.norm = None
            self.lm_head = None

    def tie_weights(self) -> None:
        """Share the embedding with the output projection; again after ``to_empty``, which unties."""
        if self.cfg.tie_word_embeddings and self.embed_tokens is not None and self.lm_head is not None:
            self.lm_head.weight = self.embed_tokens.weight

    def reset_buffers(self, *, keep_loaded: bool = False) -> None:
        """Recompute the RoPE tables and zero the routers' state (after ``to_empty`` from the meta
        device). ``keep_loaded``: a training checkpoint has just filled the persistent buffers (the
        aux-loss-free routing biases): keep those."""
        for prefix, local in self.rope_kinds():
            cos, sin = rope_tables(self.cfg, device=self.rope_cos.device, local=local)
            getattr(self, f"{prefix}_cos").copy_(cos)
            getattr(self, f"{prefix}_sin").copy_(sin)
        for module in self.modules():
            if isinstance(module, MoE):
                module.reset_statistics() if keep_loaded else module.reset_state()


def count_parameters(cfg: ModelConfig) -> int:
    """Parameters of the whole model (tied weights once), without allocating them."""
    with torch.device("meta"):
        return sum(p.numel() for p in Transformer(cfg).parameters())


def count_active_parameters(cfg: ModelConfig) -> int:
    """Parameters one token uses: an MoE layer's experts count num_experts_per_tok / num_experts."""
    with torch.device("meta"):
        named = list(Transformer(cfg).named_parameters())
    return sum(p.numel() * cfg.num_experts_per_tok // cfg.num_experts if ".experts." in n else p.numel()
               for n, p in named)


def init_std_for(name: str, cfg: ModelConfig) -> float | None:
    """Std of the normal init for a parameter, or None for ones (norm weights)."""
    if name.endswith("norm.weight"):
        return None
    if name.endswith((".bias", "_bias")):
        return 0.0
    if name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")):
        return cfg.init_std / math.sqrt(2 * cfg.num_hidden_layers)
    return cfg.init_std
