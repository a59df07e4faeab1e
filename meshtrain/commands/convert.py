"""``meshtrain convert``: Hugging Face safetensors <-> meshtrain DCP checkpoints, on any number of ranks.

The model is built on the meta device and FSDP-sharded over every rank, so each rank reads and
writes 1/world of the weights and no rank holds the whole model. ``--verify`` reads the output
back into a second sharded model and compares every local shard with what was read from the
source, bit for bit (rounded to the output dtype), after writing it as ``DST.unverified``; only a
verified output is renamed to DST. Writes are atomic (see hf_io and checkpoint): a failed
conversion leaves ``DST.incomplete`` or ``DST.unverified``, never a DST that looks complete.
"""

from __future__ import annotations

import dataclasses
import pathlib
import shutil
import time
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from meshtrain.checkpoint import checkpointer as checkpoint
from meshtrain.checkpoint import weights
from meshtrain.config import JobConfig, ModelConfig, TrainConfig
from meshtrain.parallel.runtime import init_distributed, shutdown
from meshtrain.errors import CheckpointError
from meshtrain.hf.adapter import resolve_init_from_hf, to_hf
from meshtrain.hf.io import (check_export_target, dtypes_from_names, export_dtypes, load_hf_weights, same_bytes,
                             save_hf, tokenizer_files)
from meshtrain.parallel.layout import plan_layout
from meshtrain.parallel.mesh import build_mesh
from meshtrain.models.transformer import Transformer

UNVERIFIED = ".unverified"


@dataclass
class ConvertConfig:
    """meshtrain convert: Hugging Face <-> meshtrain (DCP) checkpoints, on any number of ranks."""

    src: str
    """A Hugging Face model directory, or a meshtrain checkpoint (a step-N dir or a converted one)."""
    dst: str
    """The output directory; must not exist yet (or be empty)."""
    to: Literal["auto", "hf", "dcp"] = "auto"
    """auto: dcp from a Hugging Face source, hf from a meshtrain one."""
    verify: bool = True
    """Read the output back and compare it with the source, bit for bit."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """dtype of Hugging Face output; auto: each tensor's dtype in the HF checkpoint the weights came
    from, float32 for a model trained from scratch."""
    max_shard_gb: float = 5.0
    """Largest Hugging Face output file."""
    timeout_s: int = 1800
    """Collective timeout; rank 0 alone consolidates the exported files, so large models need long."""


def source_kind(src: pathlib.Path) -> str:
    if (src / checkpoint.META).is_file():
        return "dcp"
    if (src / "config.json").is_file():
        return "hf"
    if not src.exists():
        raise CheckpointError(f"--src {src}: no such directory")
    raise CheckpointError(f"--src {src}: neither a Hugging Face model (config.json + *.safetensors) nor a "
                          f"meshtrain checkpoint ({checkpoint.META}; an interrupted save ends in .incomplete)")


def build_sharded(model_cfg: ModelConfig, device: torch.device) -> list[Transformer]:
    """The model FSDP-sharded over the whole world, uninitialised (it is about to be loaded)."""
    from meshtrain.parallel.parallelize import build_model

    world = dist.get_world_size()
    # One sample per rank, so that the training-batch rules of the layout hold for any world size.
    job = JobConfig(model=model_cfg, train=TrainConfig(global_batch_size=world, micro_batch_size=1))
    mesh = build_mesh(plan_layout(job, world), device.type)
    return [build_model(job, mesh, device, initialize=False)]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def convert(cc: ConvertConfig) -> None:
    src, dst = pathlib.Path(cc.src), pathlib.Path(cc.dst)
    kind = source_kind(src)
    to = cc.to if cc.to != "auto" else ("dcp" if kind == "hf" else "hf")
    check_export_target(dst)
    if cc.max_shard_gb <= 0:
        raise CheckpointError(f"--max-shard-gb={cc.max_shard_gb} must be > 0")
    if kind == "hf":
        model_cfg = resolve_init_from_hf(ModelConfig(init_from_hf=str(src)))
        origin = checkpoint.hf_origin_of(model_cfg)
    else:
        meta = checkpoint.read_meta(src)
        model_cfg = checkpoint.model_config_of(src)
        origin = {k: meta[k] for k in ("hf_dtypes", "hf_config") if k in meta}

    runtime = init_distributed(cc.timeout_s)

    def say(message: str, since: float) -> None:
        if runtime.is_main:
            print(f"meshtrain convert: {message} ({time.perf_counter() - since:.1f} s)", flush=True)

    try:
        start = time.perf_counter()
        parts = build_sharded(model_cfg, runtime.device)
        n = sum(p.numel() for p in parts[0].parameters())
        say(f"{kind} -> {to}: {model_cfg.family}, {n / 1e6:.2f}M parameters, sharded over {runtime.world_size} "
            f"rank(s)", start)
        t0 = time.perf_counter()
        if kind == "hf":
            load_hf_weights(parts, str(src))
        else:
            weights.load_weights(parts, src)
        say(f"read {src}", t0)
        t0 = time.perf_counter()
        dtypes = export_dtypes(dataclasses.replace(model_cfg, init_from_hf=None), cc.dtype,
                               dtypes_from_names(origin.get("hf_dtypes")))
        # With --verify the output is written under a name that does not look finished and gets
        # DST's name only once verified: a failed (or killed) verify never leaves a DST to trust.
        out = dst.with_name(dst.name + UNVERIFIED) if cc.verify else dst
        if cc.verify and runtime.is_main:
            shutil.rmtree(out, ignore_errors=True)  # left by a conversion that failed its verify
        dist.barrier()
        if to == "hf":
            save_hf(parts, str(out), dtypes, max_shard_bytes=int(cc.max_shard_gb * 1e9),
                    base_config=origin.get("hf_config"), extra_files=tokenizer_files(str(src)))
        else:
            weights.save_weights(parts, model_cfg, out, source=str(src), hf_origin=origin,
                                    extra_files=tokenizer_files(str(src)))
        say(f"wrote {out}", t0)
        if cc.verify:
            t0 = time.perf_counter()
            bad = verify(parts, out, dtypes if to == "hf" else None, model_cfg, runtime.device)
            if bad:
                raise CheckpointError(f"--verify: the output differs from {src} in {len(bad)} tensors: "
                                      f"{', '.join(bad[:4])}; it is left in {out} for inspection and {dst} was not "
                                      "written")
            if runtime.is_main:
                if dst.exists():
                    dst.rmdir()  # empty: check_export_target said so
                out.rename(dst)
            dist.barrier()
            say(f"verified: every tensor of {dst} equals the source bit for bit", t0)
    except BaseException:
        shutdown()
        raise
    shutdown(synchronize=True)


@torch.no_grad()
def verify(parts: list[Transformer], dst: pathlib.Path, hf_dtypes: dict[str, torch.dtype] | None,
           model_cfg: ModelConfig, device: torch.device) -> list[str]:
    """Names of the tensors whose reloaded value differs from the source, over all ranks.
    ``hf_dtypes``: the output is Hugging Face files in these dtypes (None: a DCP checkpoint)."""
    again = build_sharded(dataclasses.replace(model_cfg, init_from_hf=None), device)
    if hf_dtypes is not None:
        load_hf_weights(again, str(dst))
    else:
        weights.load_weights(again, dst)
    bad = []
    for part, other in zip(parts, again):
        reloaded = dict(other.named_parameters())
        for name, p in part.named_parameters():
            expected = _local(p)
            if hf_dtypes is not None:  # what the file can hold: the source rounded to its dtype
                first_key = next(iter(to_hf({name: p.shape}, model_cfg)))  # stacked experts: all one dtype
                expected = expected.to(hf_dtypes[first_key]).to(expected.dtype)
            if not same_bytes(expected, _local(reloaded[name])):
                bad.append(name)
    gathered: list[list[str]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(gathered, bad)
    return sorted({name for names in gathered for name in names})
