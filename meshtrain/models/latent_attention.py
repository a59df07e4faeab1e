"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2), in plain PyTorch under transformers' names.

Keys and values are per-head up-projections (``kv_b_proj``) of one small latent per token
(``kv_a_proj_with_mqa``, normalised by ``kv_a_layernorm``), beside which the same projection gives a
RoPE key shared by every head. Queries come through a latent of their own (``q_a_proj`` ->
``q_a_layernorm`` -> ``q_b_proj``), or directly (``q_proj``, when ``q_lora_rank`` is null). Each
head's query/key is [dims without RoPE, dims with RoPE]; RoPE in DeepSeek's interleaved layout
(``rope_interleave``) or the rotate-half one; values have dims of their own (``v_head_dim``).

Tensor parallelism splits what is per head (``q_b_proj``/``q_proj`` and ``kv_b_proj`` by columns,
``o_proj`` by rows); the latent projections and their norms are small and stay whole on every tp
rank, computed on the whole (gathered) sequence like the heads' inputs, so their gradients come out
whole and equal on every rank (the up-projections' input gradients are all-reduced by their
column-parallel style, the shared RoPE key's here), as a norm's without sequence parallelism.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate

from meshtrain.models.config import ModelConfig
from meshtrain.models.rope import apply_interleaved_rope, apply_rope, yarn_mscale

if TYPE_CHECKING:
    from meshtrain.parallel.styles import TensorParallelStyles

LATENT_NORM_EPS = 1e-6
"""transformers builds q_a_layernorm and kv_a_layernorm with the norm's default eps, not rms_norm_eps."""


class LatentAttention(nn.Module):
    local_rope = False
    """The model's one RoPE table (asked by Transformer.forward)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        norm = cfg.definition.norm_type
        heads, hidden = cfg.num_attention_heads, cfg.hidden_size
        self.nope_dim, self.rope_dim, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.qk_dim = self.nope_dim + self.rope_dim
        self.kv_rank = cfg.kv_lora_rank
        self.rotate = apply_interleaved_rope if cfg.rope_interleave else apply_rope
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, heads * self.qk_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, cfg.q_lora_rank, bias=False)
            self.q_a_layernorm = norm(cfg.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, heads * self.qk_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.kv_rank + self.rope_dim, bias=False)
        self.kv_a_layernorm = norm(self.kv_rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.kv_rank, heads * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = nn.Linear(heads * self.v_dim, hidden, bias=False)
        self.scale = self.qk_dim ** -0.5
        s = cfg.rope_scaling
        if s.type == "yarn" and s.mscale_all_dim:  # YaRN's long-context temperature, as transformers applies it
            self.scale *= yarn_mscale(s.factor, s.mscale_all_dim) ** 2

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """As ``Attention.forward``: the RoPE tables (or per-token rows) and the document mask."""
        tp_mesh = x.device_mesh if isinstance(x, DTensor) else None
        if tp_mesh is not None:  # tensor parallel: the whole sequence, the same on every tp rank
            x = x.to_local()
        batch, seq, _ = x.shape
        if hasattr(self, "q_proj"):
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_rot = q.view(batch, seq, -1, self.qk_dim).split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_rot = self.kv_a_proj_with_mqa(x).split([self.kv_rank, self.rope_dim], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(batch, seq, -1, self.nope_dim + self.v_dim)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        if cos.dim() == 2:
            cos, sin = cos[:seq], sin[:seq]
        k_rot = k_rot.view(batch, seq, 1, self.rope_dim)
        if tp_mesh is not None:
            # One RoPE key for every head, and this rank holds some of the heads: its gradient here
            # is a partial sum, completed over tp (DTensor all-reduces a Partial into the Replicate)
            k_rot = DTensor.from_local(k_rot, tp_mesh, [Replicate()], run_check=False).to_local(
                grad_placements=[Partial()])
        q_rot, k_rot = self.rotate(q_rot, cos, sin), self.rotate(k_rot, cos, sin)
        q = torch.cat([q_nope, q_rot], dim=-1)
        k = torch.cat([k_nope, k_rot.expand(-1, -1, k_nope.shape[2], -1)], dim=-1)
        # Values padded to the query/key dims: the flash kernels (CPU and CUDA) and the ring of context
        # parallelism take one head size; the padded outputs are zeros, cut off below.
        if self.v_dim < self.qk_dim:
            v = F.pad(v, (0, self.qk_dim - self.v_dim))
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                             is_causal=mask is None, scale=self.scale)
        out = out[..., :self.v_dim].transpose(1, 2).reshape(batch, seq, -1)
        return self.o_proj(out)

    def tp_plan(self, tp: TensorParallelStyles) -> dict:
        """The per-head projections column-parallel (each rank a slice of the heads), o row-parallel;
        the latent projections and norms whole (see the module's docstring)."""
        heads = {"q_proj": tp.colwise()} if hasattr(self, "q_proj") else {"q_b_proj": tp.colwise()}
        return heads | {"kv_b_proj": tp.colwise(), "o_proj": tp.rowwise(output_layouts=tp.residual)}
