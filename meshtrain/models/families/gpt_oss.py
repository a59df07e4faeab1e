"""GPT-OSS (``GptOssForCausalLM``; gpt-oss-20b and -120b): attention with biases on q/k/v and o,
learned per-head sinks in each softmax's denominator, layers alternating a 128-token sliding window
and full attention, YaRN RoPE; a mixture-of-experts MLP in every layer whose router has a bias and
weighs the chosen experts by a softmax over their logits alone, and whose experts
(models/interleaved_experts.py) keep the checkpoint's interleaved ``gate_up_proj`` with biases and
the clamped SwiGLU. The released checkpoints store the experts in MXFP4 (``*_blocks``/``*_scales``):
hf/mxfp4.py dequantizes them on import exactly as transformers does; exports are unquantized."""

from __future__ import annotations

from meshtrain.models.family import ExpertNames, Family, required


class GptOss(Family):
    name = "gpt_oss"
    architecture = "GptOssForCausalLM"
    model_type = "gpt_oss"
    attention_bias = True
    output_bias = True
    attention_sinks = True
    experts = ExpertNames(stacked=True)
    router_scoring = "topk_softmax"
    router_bias = True
    expert_biases = True
    quantizations = frozenset({"mxfp4"})
    layer_pattern = 2
    settings = frozenset({"sliding_window", "layer_types", "swiglu_alpha", "swiglu_limit"})
    renames = {"mlp.gate.": "mlp.router.", "mlp.expert_output_bias": "mlp.experts.down_proj_bias",
               "self_attn.sinks.weight": "self_attn.sinks"}
    unsupported = {"hidden_act": "silu", "attention_bias": True, "attention_dropout": 0.0}

    def is_sparse_layer(self, cfg, layer):
        return cfg.num_experts > 0

    def experts_module(self, cfg):
        from meshtrain.models.interleaved_experts import InterleavedExperts
        return InterleavedExperts(cfg)

    def check(self, cfg):
        if problems := super().check(cfg):
            return problems
        if cfg.shared_expert_intermediate_size or cfg.mlp_only_layers or cfg.decoder_sparse_step != 1:
            return [("model.shared_expert_intermediate_size, mlp_only_layers or decoder_sparse_step set on "
                     "gpt_oss, whose every layer is a mixture of experts without a shared one", "drop them")]
        return []

    def config_from_hf(self, hf, where):
        return dict(num_experts=required(hf, "num_local_experts", where),
                    num_experts_per_tok=required(hf, "num_experts_per_tok", where),
                    router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)),
                    sliding_window=required(hf, "sliding_window", where),
                    layer_types=self.layer_types_from_hf(hf, where),
                    swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)), swiglu_limit=float(hf.get("swiglu_limit", 7.0)))

    def config_to_hf(self, cfg):
        return dict(self.unsupported) | {
            "num_local_experts": cfg.num_experts, "num_experts_per_tok": cfg.num_experts_per_tok,
            "router_aux_loss_coef": cfg.router_aux_loss_coef, "sliding_window": cfg.sliding_window,
            "layer_types": self.layer_types(cfg), "swiglu_alpha": cfg.swiglu_alpha, "swiglu_limit": cfg.swiglu_limit}


FAMILY = GptOss()
