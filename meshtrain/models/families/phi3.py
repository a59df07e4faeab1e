"""Phi-3 and Phi-4 (``Phi3ForCausalLM``): Llama's blocks, with the checkpoint's q/k/v projections
in one ``qkv_proj`` (rows [q; k; v]) and gate/up in one ``gate_up_proj`` (rows [gate; up]), and
sliding-window attention on every layer when ``sliding_window`` is set (Phi-3-mini-4k: 2047;
Phi-4: null). meshtrain keeps the linears apart (tensor parallelism then splits each by heads or
by half); ``hf/fused.py`` reads and writes them as row ranges of the fused tensors. The 128k
variants' ``longrope`` and Phi-4-mini's partial rotary embedding are refused, naming the key."""

from meshtrain.errors import CheckpointError
from meshtrain.models.family import Family


class Phi3(Family):
    name = "phi3"
    architecture = "Phi3ForCausalLM"
    model_type = "phi3"
    windowed = True
    settings = frozenset({"sliding_window"})
    fused = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
             "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}
    # Phi3Config's defaults are Phi-3's 32k-vocabulary ids (pad 32000), out of range of another vocabulary
    config_defaults = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
    # meshtrain's blocks have no dropout: a checkpoint that trains with it is refused, not run without
    unsupported = {"hidden_act": "silu", "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attention_dropout": 0.0}

    def config_from_hf(self, hf, where):
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
        if partial != 1.0:
            raise CheckpointError(f"{where}: partial_rotary_factor={partial!r} is not supported (meshtrain rotates "
                                  "every dimension of a head, partial_rotary_factor=1.0); this checkpoint cannot be "
                                  "trained faithfully")
        return {"sliding_window": hf.get("sliding_window")}

    def config_to_hf(self, cfg):
        return {"hidden_act": "silu", "sliding_window": cfg.sliding_window}


FAMILY = Phi3()
