"""Mistral (7B, Nemo, Small): Llama's blocks, an explicit ``head_dim`` (Nemo: 128 with hidden 5120 and
32 heads), and sliding-window attention on every layer when ``sliding_window`` is set (7B v0.1: 4096;
later releases: null)."""

from meshtrain.models.family import Family


class Mistral(Family):
    name = "mistral"
    architecture = "MistralForCausalLM"
    model_type = "mistral"
    windowed = True
    settings = frozenset({"sliding_window"})
    unsupported = {"hidden_act": "silu"}

    def config_from_hf(self, hf, where):
        return {"sliding_window": hf.get("sliding_window")}

    def config_to_hf(self, cfg):
        return {"hidden_act": "silu", "sliding_window": cfg.sliding_window}


FAMILY = Mistral()
