"""Qwen3-MoE: Qwen3's attention with mixture-of-experts MLPs on every ``decoder_sparse_step``-th
layer except ``mlp_only_layers`` (HF's rule); routing weights renormalised when ``norm_topk_prob``."""

from meshtrain.models.family import ExpertNames, required
from meshtrain.models.families.qwen3 import Qwen3


class Qwen3Moe(Qwen3):
    name = "qwen3_moe"
    architecture = "Qwen3MoeForCausalLM"
    model_type = "qwen3_moe"
    experts = ExpertNames()

    def is_sparse_layer(self, cfg, layer):
        return (cfg.num_experts > 0 and layer not in cfg.mlp_only_layers
                and (layer + 1) % cfg.decoder_sparse_step == 0)

    def config_from_hf(self, hf, where):
        # transformers 5 writes num_local_experts; Qwen's own configs say num_experts
        experts = hf.get("num_experts") or required(hf, "num_local_experts", where)
        return dict(num_experts=experts, moe_intermediate_size=required(hf, "moe_intermediate_size", where),
                    norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                    decoder_sparse_step=int(hf.get("decoder_sparse_step", 1)),
                    mlp_only_layers=list(hf.get("mlp_only_layers") or []),
                    num_experts_per_tok=required(hf, "num_experts_per_tok", where),
                    router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)))

    def config_to_hf(self, cfg):
        return super().config_to_hf(cfg) | {
            "num_experts": cfg.num_experts, "moe_intermediate_size": cfg.resolved_moe_intermediate_size,
            "norm_topk_prob": cfg.norm_topk_prob, "decoder_sparse_step": cfg.decoder_sparse_step,
            "mlp_only_layers": list(cfg.mlp_only_layers), "num_experts_per_tok": cfg.num_experts_per_tok,
            "router_aux_loss_coef": cfg.router_aux_loss_coef}


FAMILY = Qwen3Moe()
