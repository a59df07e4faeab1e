"""Gemma 2 (``Gemma2ForCausalLM``): (1+w) RMSNorm in fp32, four norms per layer (each block's output
normalised before the residual add), GeGLU with tanh-approximated GeLU, embeddings scaled by
sqrt(hidden), scores scaled by ``query_pre_attn_scalar`` ** -0.5 and soft-capped (tanh, 50), the
logits soft-capped (30), and ``layer_types`` alternating sliding-window (4096) and global layers.
Embeddings are always tied. Gemma 3 (gemma3.py) builds on it."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from meshtrain.models.family import Family, required


class Gemma2(Family):
    name = "gemma2"
    architecture = "Gemma2ForCausalLM"
    model_type = "gemma2"
    offset_norm = True
    layer_pattern = 2
    settings = frozenset({"sliding_window", "layer_types", "query_pre_attn_scalar", "attn_logit_softcapping",
                          "final_logit_softcapping"})
    unsupported = {"hidden_activation": "gelu_pytorch_tanh", "attention_bias": False}

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
        if not cfg.tie_word_embeddings:
            return [("model.tie_word_embeddings=false: Gemma's output head is its embedding",
                     "set model.tie_word_embeddings=true")]
        return []

    def config_from_hf(self, hf, where):
        return dict(layer_types=self.layer_types_from_hf(hf, where),
                    sliding_window=required(hf, "sliding_window", where),
                    query_pre_attn_scalar=int(required(hf, "query_pre_attn_scalar", where)),
                    attn_logit_softcapping=hf.get("attn_logit_softcapping"),
                    final_logit_softcapping=hf.get("final_logit_softcapping"),
                    tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)))

    def config_to_hf(self, cfg):
        return dict(self.unsupported) | {
            "layer_types": self.layer_types(cfg), "sliding_window": cfg.sliding_window,
            "query_pre_attn_scalar": cfg.query_pre_attn_scalar, "attn_logit_softcapping": cfg.attn_logit_softcapping,
            "final_logit_softcapping": cfg.final_logit_softcapping}


FAMILY = Gemma2()
