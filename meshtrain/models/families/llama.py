"""Llama 3 (and 3.1/3.2/3.3): the plain decoder every other family starts from."""

from meshtrain.models.family import Family


class Llama(Family):
    name = "llama"
    architecture = "LlamaForCausalLM"
    model_type = "llama"

    def config_to_hf(self, cfg):
        return super().config_to_hf(cfg) | {"mlp_bias": False}


FAMILY = Llama()
