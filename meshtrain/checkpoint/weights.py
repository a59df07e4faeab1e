"""Weights-only checkpoints: what ``meshtrain convert --to dcp`` writes and any layout reads back.

The model's weights under their global names (DCP: resharded for any layout on load) and
``meshtrain.json`` with kind "weights", the architecture and, from a Hugging Face source, what an
export needs to give back the same files; written atomically like a training checkpoint.
"""

from __future__ import annotations

import json
import pathlib
import shutil

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from meshtrain.checkpoint.checkpointer import (FORMAT_VERSION, INCOMPLETE, META, _barrier, _load, check_architecture,
                                               model_state, read_meta)
from meshtrain.config import ModelConfig
from meshtrain.hf.adapter import architecture_fields


def save_weights(parts: list[nn.Module], model: ModelConfig, directory: pathlib.Path, *, source: str,
                 hf_origin: dict | None = None, extra_files: dict[str, pathlib.Path] | None = None) -> None:
    """A weights-only checkpoint (what ``meshtrain convert --to dcp`` writes), atomically.
    ``hf_origin`` (``hf_origin_of``) and ``extra_files`` (tokenizer files) let a later export give
    back the Hugging Face directory the weights came from."""
    tmp = directory.with_name(directory.name + INCOMPLETE)
    is_main = not dist.is_initialized() or dist.get_rank() == 0
    if is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    dcp.save({"model": model_state(parts)}, checkpoint_id=str(tmp))
    if is_main:
        meta = {"format": FORMAT_VERSION, "kind": "weights", "step": 0, "model": architecture_fields(model),
                "source": source, "world_size": dist.get_world_size() if dist.is_initialized() else 1,
                **(hf_origin or {})}
        for name, f in (extra_files or {}).items():
            shutil.copy2(f, tmp / name)
        (tmp / META).write_text(json.dumps(meta, indent=1))
        if directory.exists():
            directory.rmdir()  # empty: the caller checked
        tmp.rename(directory)
    _barrier()


def load_weights(parts: list[nn.Module], path: pathlib.Path) -> dict:
    """Fill model parts from any meshtrain checkpoint (training or weights-only); returns its meta."""
    meta = read_meta(path)
    check_architecture(meta, parts[0].cfg, path)
    _load({"model": model_state(parts)}, parts, path)
    return meta
