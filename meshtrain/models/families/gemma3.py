"""Gemma 3 text models (``Gemma3ForCausalLM``, model_type gemma3_text; the 1B, and the language model
of the larger ones): Gemma 2's layers (gemma2.py) without soft-capping, with RMSNorm on queries and
keys, and sliding-window layers with a RoPE base of their own (10k) beside global ones (1M, linear
scaling in the 4B and up), five local to one global by default."""

from __future__ import annotations

from meshtrain.errors import CheckpointError
from meshtrain.models.families.gemma2 import Gemma2
from meshtrain.models.family import FULL, SLIDING


class Gemma3(Gemma2):
    name = "gemma3"
    architecture = "Gemma3ForCausalLM"
    model_type = "gemma3_text"
    qk_norm = True
    layer_pattern = 6
    settings = frozenset({"sliding_window", "layer_types", "local_rope_theta", "query_pre_attn_scalar"})
    unsupported = Gemma2.unsupported | {"attn_logit_softcapping": None, "final_logit_softcapping": None,
                                        "use_bidirectional_attention": False}

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
        return super().config_from_hf(hf, where) | dict(rope_theta=float(theta), rope_scaling=rope_scaling_from_hf(full, where),
                             local_rope_theta=float(local_theta))

    def config_to_hf(self, cfg):
        from meshtrain.hf.adapter import rope_to_hf

        # Gemma 2's keys (its soft caps None, as unsupported requires), the RoPE per layer type
        return super().config_to_hf(cfg) | {
            "rope_parameters": {FULL: rope_to_hf(cfg), SLIDING: {"rope_type": "default", "rope_theta": cfg.local_rope_theta}}}


FAMILY = Gemma3()
