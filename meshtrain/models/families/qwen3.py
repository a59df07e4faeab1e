"""Qwen3 (dense): Llama's blocks with RMSNorm on each head's queries and keys (before RoPE)."""

from meshtrain.models.family import Family


class Qwen3(Family):
    name = "qwen3"
    architecture = "Qwen3ForCausalLM"
    model_type = "qwen3"
    qk_norm = True
    unsupported = Family.unsupported | {"use_sliding_window": False}

    def config_to_hf(self, cfg):
        return super().config_to_hf(cfg) | {"use_sliding_window": False}


FAMILY = Qwen3()
