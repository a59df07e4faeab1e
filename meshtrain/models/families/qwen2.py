"""Qwen2 and Qwen2.5 (dense): Llama's blocks with biases on the q/k/v projections. Qwen's configs
carry a ``sliding_window`` that ``use_sliding_window: false`` switches off; a checkpoint that
switches it on (local attention on the layers from ``max_window_layers``) is refused."""

from meshtrain.models.family import Family


class Qwen2(Family):
    name = "qwen2"
    architecture = "Qwen2ForCausalLM"
    model_type = "qwen2"
    attention_bias = True
    unsupported = {"hidden_act": "silu", "use_sliding_window": False}

    def config_to_hf(self, cfg):
        return {"hidden_act": "silu", "use_sliding_window": False}


FAMILY = Qwen2()
