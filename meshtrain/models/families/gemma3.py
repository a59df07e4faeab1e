"""Gemma 3 text models (``Gemma3ForCausalLM``, model_type gemma3_text; the 1B, and the language model
of the larger ones): (1+w) RMSNorm in fp32, four norms per layer (each block's output normalised
before the residual add), GeGLU with tanh-approximated GeLU, embeddings scaled by sqrt(hidden), scores
scaled by ``query_pre_attn_scalar`` ** -0.5, RMSNorm on queries and keys, and ``layer_types``:
sliding-window layers with a RoPE base of their own (10k) beside global ones (1M, linear scaling in
the 4B and up), five local to one global by default. Embeddings are always tied."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from meshtrain.errors import CheckpointError
from meshtrain.models.family import Family, required

SLIDING, FULL = "sliding_attention", "full_attention"
PATTERN = 6
"""Without layer_types: every sixth layer global, the rest local (Gemma 3's sliding_window_pattern)."""


class Gemma3(Family):
    name = "gemma3"
    architecture = "Gemma3ForCausalLM"
    model_type = "gemma3_text"
    qk_norm = True
    offset_norm = True
    settings = frozenset({"sliding_window", "layer_types", "local_rope_theta", "query_pre_attn_scalar"})
    unsupported = {"hidden_activation": "gelu_pytorch_tanh", "attention_bias": False,
                   "attn_logit_softcapping": None, "final_logit_softcapping": None,
                   "use_bidirectional_attention": False}

    def layer_types(self, cfg) -> list[str]:
        return cfg.layer_types or [FULL if (i + 1) % PATTERN == 0 else SLIDING for i in range(cfg.num_hidden_layers)]

    def sliding_window(self, cfg, layer):
        return cfg.sliding_window if self.layer_types(cfg)[layer] == SLIDING else None

    def decoder_layer(self, cfg, layer):
        from meshtrain.models.transformer import SandwichDecoderLayer
        return SandwichDecoderLayer(cfg, layer)

    def embedding_scale(self, cfg):
        return math.sqrt(cfg.hidden_size)

    def activation(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x, approximate="tanh")  # transformers' gelu_pytorch_tanh

    def check(self, cfg):
        if problems := super().check(cfg):
            return problems
        kinds = cfg.layer_types
        if kinds and (len(kinds) != cfg.num_hidden_layers or set(kinds) - {SLIDING, FULL}):
            return [(f"model.layer_types={kinds} must name {SLIDING!r} or {FULL!r} for each of the "
                     f"{cfg.num_hidden_layers} layers", "list one per layer, or drop it for Gemma 3's pattern")]
        if cfg.sliding_window is None and SLIDING in self.layer_types(cfg):
            return [("model.sliding_window is unset, and Gemma 3's sliding_attention layers need a window",
                     "set model.sliding_window (Gemma 3 1B: 512, 4B and up: 1024)")]
        if not cfg.tie_word_embeddings:
            return [("model.tie_word_embeddings=false: Gemma's output head is its embedding",
                     "set model.tie_word_embeddings=true")]
        return []

    def config_from_hf(self, hf, where):
        from meshtrain.hf.adapter import rope_scaling_from_hf

        rope = hf.get("rope_parameters") or {}
        if FULL in rope or SLIDING in rope:  # transformers 5: one entry per layer type
            full, local = rope.get(FULL) or {}, rope.get(SLIDING) or {}
            theta, local_theta = full.get("rope_theta", 1e6), local.get("rope_theta", 1e4)
            if local.get("rope_type", "default") != "default":
                raise CheckpointError(f"{where}: rope_parameters.{SLIDING}.rope_type={local['rope_type']!r} is not "
                                      "supported (meshtrain implements 'default' for Gemma 3's local layers)")
        else:  # transformers 4: rope_theta, rope_local_base_freq and rope_scaling
            full, theta, local_theta = hf.get("rope_scaling") or {}, hf.get("rope_theta", 1e6), \
                hf.get("rope_local_base_freq", 1e4)
        kinds = hf.get("layer_types") or [FULL if (i + 1) % hf.get("sliding_window_pattern", PATTERN) == 0 else SLIDING
                                          for i in range(required(hf, "num_hidden_layers", where))]
        return dict(rope_theta=float(theta), rope_scaling=rope_scaling_from_hf(full, where),
                    local_rope_theta=float(local_theta), layer_types=list(kinds),
                    sliding_window=required(hf, "sliding_window", where),
                    query_pre_attn_scalar=int(required(hf, "query_pre_attn_scalar", where)),
                    tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)))

    def config_to_hf(self, cfg):
        from meshtrain.hf.adapter import rope_to_hf

        full = rope_to_hf(cfg)
        return dict(self.unsupported) | {
            "rope_parameters": {FULL: full, SLIDING: {"rope_type": "default", "rope_theta": cfg.local_rope_theta}},
            "layer_types": self.layer_types(cfg), "sliding_window": cfg.sliding_window,
            "query_pre_attn_scalar": cfg.query_pre_attn_scalar}


FAMILY = Gemma3()
