"""LoRA adapters as a PEFT adapter directory: ``adapter_model.safetensors`` under PEFT's names
(``base_model.model.<HF module path>.lora_A.weight``) and ``adapter_config.json``, which
``peft.PeftModel.from_pretrained`` loads onto the base Hugging Face model."""

from __future__ import annotations

import json
import os
import pathlib
import shutil

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from meshtrain.config import PeftConfig
from meshtrain.hf.adapter import to_hf_name
from meshtrain.hf.io import INCOMPLETE, check_export_target
from meshtrain.models.lora import adapter_tensors


def peft_key(name: str) -> str:
    """``layers.0.self_attn.q_proj.lora_A`` -> ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``."""
    module, adapter = name.rsplit(".", 1)
    return f"base_model.model.{to_hf_name(module + '.weight').removesuffix('.weight')}.{adapter}.weight"


def save_peft_adapter(parts: list[torch.nn.Module], directory: str, cfg: PeftConfig, base: str | None,
                      dtype: torch.dtype) -> pathlib.Path:
    """Every rank calls this; rank 0 writes (under ``DIR.incomplete``, renamed when done)."""
    mine: dict[str, torch.Tensor] = {}
    for part in parts:
        mine.update(adapter_tensors(part))
    every = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:  # pipeline stages hold different layers
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
    out = check_export_target(directory)
    if not dist.is_initialized() or dist.get_rank() == 0:
        tensors = {peft_key(n): t.to(dtype).contiguous() for part in every for n, t in part.items()}
        modules = sorted({n.rsplit(".", 2)[-2] for part in every for n in part})
        tmp = out.with_name(out.name + INCOMPLETE)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        save_file(tensors, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
        (tmp / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": cfg.rank, "lora_alpha": cfg.alpha,
            "lora_dropout": cfg.dropout, "target_modules": modules, "bias": "none", "fan_in_fan_out": False,
            "base_model_name_or_path": os.path.abspath(base) if base else None, "inference_mode": True,
        }, indent=2) + "\n")
        if out.exists():
            out.rmdir()  # empty, checked above
        tmp.rename(out)
    if dist.is_initialized():
        dist.barrier()
    return out
