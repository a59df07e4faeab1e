"""Mixtral: Llama's attention with a mixture-of-experts MLP in every layer (HF's
``block_sparse_moe``, experts' w1/w3/w2), top-k weights always renormalised."""

from meshtrain.models.family import ExpertNames, Family, required


class Mixtral(Family):
    name = "mixtral"
    architecture = "MixtralForCausalLM"
    model_type = "mixtral"
    experts = ExpertNames("block_sparse_moe", {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"})
    topk_always_normalized = True
    unsupported = Family.unsupported | {"sliding_window": None}

    def is_sparse_layer(self, cfg, layer):
        return cfg.num_experts > 0

    def config_from_hf(self, hf, where):
        return dict(num_experts=required(hf, "num_local_experts", where),
                    num_experts_per_tok=required(hf, "num_experts_per_tok", where),
                    router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)))

    def config_to_hf(self, cfg):
        return super().config_to_hf(cfg) | {"num_local_experts": cfg.num_experts, "sliding_window": None,
                                            "num_experts_per_tok": cfg.num_experts_per_tok,
                                            "router_aux_loss_coef": cfg.router_aux_loss_coef}


FAMILY = Mixtral()
