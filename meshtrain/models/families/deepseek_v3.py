"""DeepSeek-V3 (``DeepseekV3ForCausalLM``; also the shape of Kimi K2 and DeepSeek-R1): multi-head
latent attention (models/latent_attention.py) with YaRN RoPE, and mixture-of-experts MLPs after the
first ``first_k_dense_replace`` dense layers: sigmoid router scores with a per-expert correction
bias (HF's ``e_score_correction_bias``, meshtrain's aux-loss-free balancing bias, so it is read,
written and updated by ``model.router_bias_update_rate``), group-limited top-k, weights renormalised
and scaled by ``routed_scaling_factor``, and ``n_shared_experts`` experts' worth of shared SwiGLU
(HF's ``shared_experts``). The released checkpoints' multi-token-prediction layer (layer 61) is
not trained: an import names it and refuses, or with ``model.skip_mtp_layers`` leaves it unread."""

from __future__ import annotations

from meshtrain.errors import CheckpointError
from meshtrain.models.family import ExpertNames, Family, required

MLA_SETTINGS = frozenset({"kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                          "rope_interleave"})


class DeepseekV3(Family):
    name = "deepseek_v3"
    architecture = "DeepseekV3ForCausalLM"
    model_type = "deepseek_v3"
    experts = ExpertNames()
    router_scoring = "sigmoid"
    settings = MLA_SETTINGS | {"n_group", "topk_group", "routed_scaling_factor"}
    renames = {"mlp.shared_expert.": "mlp.shared_experts.", "mlp.gate.expert_bias": "mlp.gate.e_score_correction_bias"}
    hf_buffers = frozenset({"mlp.gate.expert_bias"})
    # the original releases' config.json spell out their routing; transformers implements this one
    unsupported = Family.unsupported | {"attention_dropout": 0.0, "scoring_func": "sigmoid", "topk_method": "noaux_tc"}

    def is_sparse_layer(self, cfg, layer):
        return cfg.num_experts > 0 and layer not in cfg.mlp_only_layers

    def attention(self, cfg, layer):
        from meshtrain.models.latent_attention import LatentAttention
        return LatentAttention(cfg)

    def rope_dim(self, cfg):
        return cfg.qk_rope_head_dim

    def attention_dims(self, cfg):
        return cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim

    def check(self, cfg):
        if problems := super().check(cfg):
            return problems
        experts, groups = cfg.num_experts, cfg.n_group
        dense = list(range(len(cfg.mlp_only_layers)))
        rules = [
            (cfg.kv_lora_rank > 0 and cfg.qk_rope_head_dim > 0 and cfg.v_head_dim > 0,
             "model.kv_lora_rank, qk_rope_head_dim and v_head_dim must be positive for latent attention",
             "set them (DeepSeek-V3: 512, 64, 128)"),
            (cfg.qk_rope_head_dim % 2 == 0, f"model.qk_rope_head_dim={cfg.qk_rope_head_dim} must be even (RoPE "
             "rotates pairs)", "use an even size"),
            (cfg.v_head_dim <= cfg.qk_nope_head_dim + cfg.qk_rope_head_dim,
             f"model.v_head_dim={cfg.v_head_dim} exceeds the query/key head dims "
             f"{cfg.qk_nope_head_dim + cfg.qk_rope_head_dim}", "use v_head_dim <= qk_nope_head_dim + qk_rope_head_dim"),
            (cfg.head_dim is None, f"model.head_dim={cfg.head_dim} on {self.name}, whose heads are sized by "
             "qk_nope_head_dim, qk_rope_head_dim and v_head_dim", "drop model.head_dim"),
            (groups >= 1 and experts % groups == 0 and (groups == 1 or experts // groups >= 2),
             f"model.n_group={groups} must divide model.num_experts={experts} into groups of 2 or more experts",
             "set n_group to a divisor of num_experts (DeepSeek-V3: 8 of 256)"),
            (1 <= cfg.topk_group <= groups and cfg.num_experts_per_tok <= cfg.topk_group * (experts // groups),
             f"model.topk_group={cfg.topk_group} must be 1..n_group={groups} with room for "
             f"num_experts_per_tok={cfg.num_experts_per_tok} experts in its groups", "raise topk_group"),
            (cfg.decoder_sparse_step == 1, f"model.decoder_sparse_step={cfg.decoder_sparse_step}: {self.name}'s MoE "
             "layers are all those after the dense ones", "drop model.decoder_sparse_step"),
            (cfg.mlp_only_layers == dense, f"model.mlp_only_layers={cfg.mlp_only_layers}: {self.name}'s dense "
             "layers are the first ones (first_k_dense_replace)", f"set model.mlp_only_layers={dense}"),
            (cfg.shared_expert_intermediate_size % cfg.resolved_moe_intermediate_size == 0,
             f"model.shared_expert_intermediate_size={cfg.shared_expert_intermediate_size} is not a whole number of "
             f"experts of moe_intermediate_size={cfg.resolved_moe_intermediate_size} (n_shared_experts)",
             "use a multiple of moe_intermediate_size"),
        ]
        return [(problem, fix) for ok, problem, fix in rules if not ok][:1]

    def mtp_tensors(self, keys, cfg):
        return {k for k in keys if k.startswith(f"model.layers.{cfg.num_hidden_layers}.")}

    def config_from_hf(self, hf, where):
        experts = hf.get("n_routed_experts") or required(hf, "num_local_experts", where)
        moe_size = required(hf, "moe_intermediate_size", where)
        if hf.get("first_k_dense_replace") is None:
            raise CheckpointError(f"{where}: required key 'first_k_dense_replace' is missing")
        return dict(
            head_dim=None,  # transformers writes qk_rope_head_dim here; meshtrain sizes MLA's heads itself
            kv_lora_rank=int(required(hf, "kv_lora_rank", where)), q_lora_rank=hf.get("q_lora_rank"),
            qk_nope_head_dim=int(required(hf, "qk_nope_head_dim", where)),
            qk_rope_head_dim=int(required(hf, "qk_rope_head_dim", where)),
            v_head_dim=int(required(hf, "v_head_dim", where)), rope_interleave=bool(hf.get("rope_interleave", True)),
            num_experts=experts, num_experts_per_tok=required(hf, "num_experts_per_tok", where),
            moe_intermediate_size=moe_size, shared_expert_intermediate_size=moe_size * int(hf.get("n_shared_experts") or 0),
            mlp_only_layers=list(range(int(hf["first_k_dense_replace"]))),
            norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
            n_group=int(hf.get("n_group") or 1), topk_group=int(hf.get("topk_group") or 1),
            routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
            router_aux_loss_coef=float(hf.get("router_aux_loss_coef", hf.get("aux_loss_alpha", 0.001))))

    def config_to_hf(self, cfg):
        return super().config_to_hf(cfg) | {
            "head_dim": cfg.qk_rope_head_dim, "kv_lora_rank": cfg.kv_lora_rank, "q_lora_rank": cfg.q_lora_rank,
            "qk_nope_head_dim": cfg.qk_nope_head_dim, "qk_rope_head_dim": cfg.qk_rope_head_dim,
            "v_head_dim": cfg.v_head_dim, "rope_interleave": cfg.rope_interleave,
            "n_routed_experts": cfg.num_experts, "num_experts_per_tok": cfg.num_experts_per_tok,
            "moe_intermediate_size": cfg.resolved_moe_intermediate_size,
            "n_shared_experts": cfg.shared_expert_intermediate_size // cfg.resolved_moe_intermediate_size,
            "first_k_dense_replace": len(cfg.mlp_only_layers), "norm_topk_prob": cfg.norm_topk_prob,
            "n_group": cfg.n_group, "topk_group": cfg.topk_group, "routed_scaling_factor": cfg.routed_scaling_factor,
            "router_aux_loss_coef": cfg.router_aux_loss_coef,
            "num_nextn_predict_layers": 0}  # no multi-token prediction module is written


FAMILY = DeepseekV3()
