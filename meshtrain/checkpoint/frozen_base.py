"""What a LoRA checkpoint's frozen base was, so that it resumes on that base only.

An adapter-only checkpoint (``checkpointer.model_state`` under LoRA) keeps the adapters, not the
frozen weights they were trained on, which come from ``model.init_from_hf`` (or the seed) again on
resume. Adapters resumed on another base would train another model without a word, so the
checkpoint records its base and a resume onto another one is refused, naming both.
"""

from __future__ import annotations

import hashlib
import pathlib

import torch
import torch.distributed as dist

from meshtrain.errors import CheckpointError


def frozen_base_of(cfg, params: list[torch.Tensor]) -> dict | None:
    """What a run's frozen weights are (LoRA: everything but the adapters), or None when nothing is
    frozen. An adapter-only checkpoint keeps only the adapters, so it records its base: the Hugging
    Face directory and a sha256 of its safetensors files (rank 0 reads them once; a moved copy still
    matches), or the seed and init std of a random base. Every rank calls this."""
    if all(p.requires_grad for p in params):
        return None
    if cfg.model.init_from_hf is None:
        return {"random": {"train.seed": cfg.train.seed, "model.init_std": cfg.model.init_std}}
    digest = [hf_weights_digest(pathlib.Path(cfg.model.init_from_hf))
              if not dist.is_initialized() or dist.get_rank() == 0 else None]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(digest, src=0)
    return {"init_from_hf": str(pathlib.Path(cfg.model.init_from_hf).absolute()), "sha256": digest[0]}


def hf_weights_digest(directory: pathlib.Path) -> str:
    """sha256 over a Hugging Face directory's safetensors files, each by name and content."""
    digest = hashlib.sha256()
    for path in sorted(directory.glob("*.safetensors")):
        digest.update(path.name.encode() + b"\0")
        with open(path, "rb") as f:
            while chunk := f.read(1 << 24):
                digest.update(chunk)
    return digest.hexdigest()


def describe_base(base: dict) -> str:
    if "random" in base:
        return "a random base (" + ", ".join(f"{k}={v}" for k, v in base["random"].items()) + ")"
    return f"model.init_from_hf={base['init_from_hf']} (safetensors sha256 {base['sha256'][:16]}...)"


def check_frozen_base(meta: dict, mine: dict, where: pathlib.Path) -> None:
    """A run with frozen weights (LoRA) resumes only adapters trained on the same base: on another
    one they would train another model without a word."""
    if meta["kind"] == "weights":
        raise CheckpointError(f"{where}: holds whole weights (meshtrain convert --to dcp), not the LoRA adapters "
                              "this run trains; a LoRA run takes its frozen base from model.init_from_hf. Fix: "
                              "write the weights as a Hugging Face directory (meshtrain convert) and set "
                              "model.init_from_hf to it, or set checkpoint.resume=never")
    saved = meta.get("frozen_base")
    if saved is None:
        raise CheckpointError(f"{where}: was not written by a LoRA run on a recorded base (its checkpoints keep "
                              "every weight, or predate the record), so this LoRA run cannot resume from it. Fix: "
                              "resume it without peft, or set checkpoint.resume=never")
    same = (saved.get("random") == mine.get("random") if "random" in saved or "random" in mine
            else saved["sha256"] == mine["sha256"])
    if not same:
        raise CheckpointError(f"{where}: its LoRA adapters were trained on {describe_base(saved)}; this run's frozen "
                              f"base is {describe_base(mine)}. Adapters resumed on another base train another "
                              "model. Fix: start from the same base, or set checkpoint.resume=never")


def check_base_given(meta: dict, model, where: pathlib.Path) -> None:
    """A LoRA checkpoint of an HF base resumed without model.init_from_hf: said as such (the
    architecture check would name the first default that differs, e.g. rms_norm_eps)."""
    base = meta.get("frozen_base", {}).get("init_from_hf")
    if base and model.init_from_hf is None:
        raise CheckpointError(f"{where}: holds LoRA adapters trained on model.init_from_hf={base}, and this run has no "
                              f"model.init_from_hf. Fix: set model.init_from_hf={base}")
