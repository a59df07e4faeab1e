"""Hugging Face safetensors into and out of any layout, through DCP's HuggingFaceStorage{Reader,Writer}.

Import: every rank asks ``dcp.load`` for exactly the slices its DTensor shards cover, and the reader
reads only those slices (``safe_open(...).get_slice``), so no rank materialises the model. Values
are cast to the parameter dtype on the way in (bf16 -> fp32 master weights is exact).
Export: every rank writes its own shards (DCP keeps one copy of replicated tensors), then the
coordinator consolidates them into ``model-0000K-of-0000N.safetensors`` and
``model.safetensors.index.json`` one tensor at a time, so the extra memory is one tensor, not the
model. Nothing is written under the final name until it is complete: the export goes to
``NAME.incomplete`` and is renamed at the end.

Both directions check the directory first, identically on every rank, so a bad input ends every
rank with the same message (naming the file and key) instead of a hang or an assertion from torch.
"""

from __future__ import annotations

import collections
import json
import math
import pathlib
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors import SafetensorError, safe_open
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.tensor import DTensor, Shard

from meshtrain.parallel._torch_private import StridedShard
from meshtrain.config import ModelConfig
from meshtrain.errors import CheckpointError
from meshtrain.hf.adapter import DTYPE_NAMES, DTYPES, hf_config_from_model, hf_shapes, to_hf
from meshtrain.hf.mxfp4 import Mxfp4StorageReader, logical_tensors
from meshtrain.hf.fused import RowStackLoadPlanner, join_parts, parts_for_writing, split_stacks
from meshtrain.models.family import RowStack
from meshtrain.models.lora import is_adapter
from meshtrain.models.transformer import Transformer

INDEX = "model.safetensors.index.json"
INCOMPLETE = ".incomplete"
# Copied beside an export when the weights came with them.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "generation_config.json")


def _shorten(keys, n: int = 4) -> str:
    keys = sorted(keys)
    return ", ".join(keys[:n]) + (f" and {len(keys) - n} more" if len(keys) > n else "")


def inspect_hf_dir(directory: str | pathlib.Path, expected: dict[str, torch.Size],
                   cfg: ModelConfig | None = None) -> dict[str, torch.dtype]:
    """Check that ``directory`` holds exactly the tensors ``expected`` (HF key -> shape), readable;
    returns each key's stored dtype. Reads the safetensors headers only. ``cfg``: the model, whose
    family may know what tensors it lacks are."""
    root = pathlib.Path(directory)
    if not root.is_dir():
        raise CheckpointError(f"{root}: no such directory (model.init_from_hf / the conversion source)")
    files = sorted(p.name for p in root.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{root}: holds no *.safetensors files")
    index_path = root / INDEX
    weight_map: dict[str, str] | None = None
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index_path}: not a valid safetensors index ({e!r})") from None
        listed = set(weight_map.values())
        if missing := listed - set(files):
            raise CheckpointError(f"{index_path} names files that are not there: {_shorten(missing)} "
                                  "(an incomplete download?)")
        if extra := set(files) - listed:
            raise CheckpointError(f"{root}: {_shorten(extra)} not in {INDEX}; all *.safetensors files are "
                                  "read, so move the extra ones out of the directory")
    elif len(files) > 1:
        raise CheckpointError(f"{root}: {len(files)} safetensors files but no {INDEX}")

    found: dict[str, tuple[str, torch.Size, torch.dtype]] = {}
    for name in files:
        try:
            with safe_open(str(root / name), framework="pt") as f:
                for key in f.keys():
                    view = f.get_slice(key)
                    if key in found:
                        raise CheckpointError(f"{root}: tensor {key!r} is in both {found[key][0]} and {name}")
                    found[key] = (name, torch.Size(view.get_shape()), getattr(torch, _TORCH_DTYPE[view.get_dtype()]))
        except SafetensorError as e:
            raise CheckpointError(f"{root / name}: not a readable safetensors file, truncated or corrupted ({e})") \
                from None
        except KeyError as e:
            raise CheckpointError(f"{root / name}: unsupported tensor dtype {e}") from None
    if weight_map is not None:
        wrong = {k for k, f in weight_map.items() if k not in found or found[k][0] != f}
        if wrong:
            raise CheckpointError(f"{index_path} does not match the files for {_shorten(wrong)}")
    if cfg is not None and "mxfp4" in cfg.definition.quantizations:  # blocks and scales stand for one tensor
        found = logical_tensors(found)
    if missing := set(expected) - set(found):
        raise CheckpointError(f"{root}: missing tensors {_shorten(missing)} (config.json describes a model "
                              "these files do not hold)")
    if TIED_HEAD in found and TIED_HEAD not in expected and TIED_EMBEDDING in expected:
        # Some tied checkpoints carry the head as well (transformers loads and ignores it): fine
        # when it is the embedding, bit for bit; otherwise the files disagree with config.json.
        if not _same_tensor(root, found, TIED_HEAD, TIED_EMBEDDING):
            raise CheckpointError(f"{root / found[TIED_HEAD][0]}: {TIED_HEAD} differs from {TIED_EMBEDDING}, but "
                                  "config.json says tie_word_embeddings=true (one matrix for both). Fix: set "
                                  "tie_word_embeddings to false in config.json if the head is its own matrix")
        del found[TIED_HEAD]
    unexpected = set(found) - set(expected)
    if mtp := cfg.definition.mtp_tensors(unexpected, cfg) if cfg is not None and unexpected else set():
        if not cfg.skip_mtp_layers:
            raise CheckpointError(f"{root}: {len(mtp)} tensors of multi-token prediction modules ({_shorten(mtp, 2)}), "
                                  "which meshtrain does not train (transformers skips them too). Fix: set "
                                  "model.skip_mtp_layers=true to import the model without them")
        unexpected -= mtp
        found = {k: v for k, v in found.items() if k not in mtp}
    if unexpected:
        raise CheckpointError(f"{root}: unexpected tensors {_shorten(unexpected)} (in "
                              f"{found[min(unexpected)][0]}); meshtrain's model has no such parameter")
    for key, shape in expected.items():
        if found[key][1] != shape:
            raise CheckpointError(f"{root / found[key][0]}: {key} has shape {list(found[key][1])}, "
                                  f"config.json implies {list(shape)}")
    return {key: dtype for key, (_, _, dtype) in found.items()}


TIED_HEAD, TIED_EMBEDDING = "lm_head.weight", "model.embed_tokens.weight"


def _same_tensor(root: pathlib.Path, found: dict, a: str, b: str, rows_per_read: int = 4096) -> bool:
    """Whether two stored tensors hold the same bytes, read a block of rows at a time."""
    if found[a][1:] != found[b][1:]:
        return False
    with safe_open(str(root / found[a][0]), framework="pt") as fa, safe_open(str(root / found[b][0]), framework="pt") as fb:
        sa, sb = fa.get_slice(a), fb.get_slice(b)
        for start in range(0, found[a][1][0], rows_per_read):
            if not same_bytes(sa[start:start + rows_per_read], sb[start:start + rows_per_read]):
                return False
    return True


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality: unlike torch.equal, a NaN copied exactly equals itself."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


_TORCH_DTYPE = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64", "U8": "uint8"}


def _first_expert(stacked: DTensor) -> int:
    """The global index of the first expert in this rank's local stack. Each mesh dim that shards
    dim 0 splits the block the previous ones left, as ``torch.chunk`` does; FSDP's dim (a strided
    shard: experts over edp) splits what ep left this rank, so it comes last."""
    mesh, placements = stacked.device_mesh, stacked.placements
    order = [i for i, pl in enumerate(placements) if isinstance(pl, Shard) and pl.dim == 0]
    order += [i for i, pl in enumerate(placements) if isinstance(pl, StridedShard) and pl.dim == 0]
    start, rows = 0, stacked.shape[0]
    for dim in order:
        chunk, rank = -(-rows // mesh.size(dim)), mesh.get_local_rank(dim)
        start, rows = start + rank * chunk, max(0, min(chunk, rows - rank * chunk))
    return start


def expert_pieces(stacked: torch.Tensor) -> dict[int, torch.Tensor] | torch.Tensor:
    """HF keeps one tensor per expert, meshtrain a stack [E, ...] that EP and FSDP shard on dim 0
    (whole experts per rank) and ETP on an FFN dim. Return the experts this rank holds, each as a
    view of its local stack: a plain tensor when the rank holds it whole (replicas are deduplicated
    by DCP), else a DTensor over the mesh dims that split it, so DCP reads and writes exactly this
    rank's slice of each per-expert HF tensor. Unsharded stacks are returned as they are."""
    if not isinstance(stacked, DTensor):
        return stacked
    mesh, placements = stacked.device_mesh, stacked.placements
    local, start = stacked.to_local(), _first_expert(stacked)
    inner = [i for i, pl in enumerate(placements) if isinstance(pl, (Shard, StridedShard)) and pl.dim > 0]
    if not inner:
        return {start + j: local[j] for j in range(local.shape[0])}
    if any(isinstance(placements[i], StridedShard) for i in inner):
        raise CheckpointError(f"experts sharded {placements}: an FFN dim split twice is not a meshtrain layout")
    sub = mesh[tuple(mesh.mesh_dim_names[i] for i in inner)]
    per_expert = [Shard(placements[i].dim - 1) for i in inner]
    shape = stacked.shape[1:]
    stride = torch.empty(shape, device="meta").stride()
    return {start + j: DTensor.from_local(local[j], sub, per_expert, run_check=False, shape=shape, stride=stride)
            for j in range(local.shape[0])}


def _hf_state(part: Transformer, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The part's weights under their Hugging Face names (LoRA adapters are not in a HF model:
    hf/peft.py writes them)."""
    per_expert = cfg.definition.experts is not None and not cfg.definition.experts.stacked
    return to_hf({n: expert_pieces(p.detach()) if per_expert and ".experts." in n else p.detach()
                  for n, p in cfg.definition.checkpoint_tensors(part) if not is_adapter(n)}, cfg)


@torch.no_grad()
def load_hf_weights(parts: list[Transformer], directory: str) -> None:
    """Fill this rank's model parts (any layout) from a Hugging Face directory."""
    cfg = parts[0].cfg
    inspect_hf_dir(directory, hf_shapes(cfg), cfg)
    for part in parts:  # the same number of parts on every rank, so the collectives pair up
        state, stacks = split_stacks(_hf_state(part, cfg))
        reader = Mxfp4StorageReader(directory) if "mxfp4" in cfg.definition.quantizations else \
            HuggingFaceStorageReader(directory)
        dcp.load(state, storage_reader=reader, planner=RowStackLoadPlanner(stacks))
        part.reset_buffers(keep_loaded=bool(cfg.definition.hf_buffers))  # the buffers just read stay


@torch.no_grad()
def check_finite(parts: list[Transformer], directory: str) -> None:
    """Refuse imported weights that hold NaN or Inf, naming the file and key, before they reach a
    step (where they would surface as a non-finite loss, blamed on the learning rate). Each rank
    checks its own shards; the verdict is the union over ranks. ``meshtrain convert`` copies such
    weights as they are and does not call this."""
    cfg = parts[0].cfg
    bad = sorted({key for part in parts for key, value in _hf_state(part, cfg).items()
                  if not all(torch.isfinite(t.to_local() if isinstance(t, DTensor) else t).all()
                             for t in (value.parts.values() if isinstance(value, RowStack) else [value]))})
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered: list[list[str]] = [[] for _ in range(dist.get_world_size())]
        dist.all_gather_object(gathered, bad)
        bad = sorted({key for keys in gathered for key in keys})
    if bad:
        root = pathlib.Path(directory)
        index = root / INDEX
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
        else:  # one file holds every tensor
            weight_map = dict.fromkeys(bad, next(root.glob("*.safetensors")).name)
        where = [f"{root / weight_map[key]}: {key}" for key in bad]
        raise CheckpointError(f"model.init_from_hf: {len(bad)} tensor(s) hold NaN or Inf values: {'; '.join(where[:4])}"
                              f"{' and more' if len(where) > 4 else ''}. Training from them would stop at the first "
                              "step. Fix: re-download or re-export the checkpoint")


def shard_plan(shapes: dict[str, torch.Size], dtypes: dict[str, torch.dtype], max_shard_bytes: int) -> dict[str, int]:
    """HF key -> file number (1-based): keys in module order, a new file when one would overflow."""
    plan, index, used = {}, 1, 0
    for key, shape in shapes.items():
        size = math.prod(shape) * dtypes[key].itemsize
        if used and used + size > max_shard_bytes:
            index, used = index + 1, 0
        plan[key] = index
        used += size
    return plan


def _is_main() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def check_export_target(directory: str | pathlib.Path) -> pathlib.Path:
    out = pathlib.Path(directory)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(f"{out}: already exists and is not empty; an export never overwrites. "
                              "Fix: name a new directory or remove this one")
    return out


def agreed_export_target(directory: str | pathlib.Path) -> pathlib.Path:
    """``check_export_target`` on every rank, before any rank writes, and one outcome for all: a rank
    that checked after rank 0 had published the directory would fail alone (a LoRA export once ended
    so, in a collective error after the last step), and one rank's failure must stop every rank."""
    try:
        out, failure = check_export_target(directory), None
    except CheckpointError as e:
        out, failure = pathlib.Path(directory), str(e)
    failures = [failure]
    if dist.is_initialized() and dist.get_world_size() > 1:
        failures = [None] * dist.get_world_size()
        dist.all_gather_object(failures, failure)
    first = next(((rank, f) for rank, f in enumerate(failures) if f), None)
    if first is not None:
        raise CheckpointError(first[1] if len(failures) == 1 else f"{first[1]} (seen by rank {first[0]})")
    return out


@torch.no_grad()
def save_hf(parts: list[Transformer], directory: str, dtypes: dict[str, torch.dtype], *, max_shard_bytes: int,
            base_config: dict | None = None, extra_files: dict[str, pathlib.Path] | None = None) -> pathlib.Path:
    """Write this job's model (every rank calls this with its parts) as a Hugging Face directory.
    ``dtypes``: HF key -> stored dtype (``export_dtypes``)."""
    cfg: ModelConfig = parts[0].cfg
    out = agreed_export_target(directory)
    tmp = out.with_name(out.name + INCOMPLETE)
    if _is_main():
        shutil.rmtree(tmp, ignore_errors=True)  # left by an export that crashed
        tmp.mkdir(parents=True)
    _barrier()
    plan = shard_plan(hf_shapes(cfg), dtypes, max_shard_bytes)
    state = {}
    for part in parts:
        state.update({k: _cast(v, dtypes[k]) for k, v in _hf_state(part, cfg).items()})
    state, plan, joins = parts_for_writing(state, plan)
    dcp.save(state, storage_writer=HuggingFaceStorageWriter(str(tmp), fqn_to_index_mapping=plan,
                                                            save_distributed=True, enable_consolidation=True))
    if _is_main():
        shutil.rmtree(tmp / "sharded")  # the per-rank pieces, now consolidated
        join_parts(tmp / INDEX, joins)
        dtype = collections.Counter(dtypes.values()).most_common(1)[0][0]
        (tmp / "config.json").write_text(json.dumps(hf_config_from_model(cfg, dtype, base_config), indent=2) + "\n")
        for name, f in (extra_files or {}).items():
            shutil.copy2(f, tmp / name)
        if out.exists():
            out.rmdir()  # empty, checked above
        tmp.rename(out)
    _barrier()
    return out


def _cast(value, dtype: torch.dtype):
    if isinstance(value, RowStack):
        return RowStack({k: v.to(dtype) for k, v in value.parts.items()})
    return value.to(dtype)


def tokenizer_files(source: str | None) -> dict[str, pathlib.Path]:
    """The tokenizer files to ship with a model, by the name each gets there: a directory's Hugging
    Face tokenizer files, or a lone tokenizer file (``data.tokenizer=x.json``) as tokenizer.json."""
    if source is None:
        return {}
    path = pathlib.Path(source)
    if path.is_file():
        return {"tokenizer.json": path}
    return {name: p for name in TOKENIZER_FILES if (p := path / name).is_file()}


def export_dtypes(cfg: ModelConfig, choice: str, source: dict[str, torch.dtype] | None = None) -> dict[str, torch.dtype]:
    """The stored dtype of every exported tensor. ``auto`` keeps each tensor's dtype in the Hugging
    Face checkpoint the weights came from (``source``, else ``cfg.init_from_hf``), so a round trip is
    bit-exact; a model trained from scratch exports float32."""
    shapes = hf_shapes(cfg)
    if choice != "auto":
        return dict.fromkeys(shapes, DTYPES[choice])
    if source is None and cfg.init_from_hf is not None:
        source = inspect_hf_dir(cfg.init_from_hf, shapes, cfg)
    return {key: (source or {}).get(key, torch.float32) for key in shapes}


def dtype_names(dtypes: dict[str, torch.dtype]) -> dict[str, str]:
    return {k: DTYPE_NAMES[v] for k, v in dtypes.items()}


def dtypes_from_names(names: dict[str, str] | None) -> dict[str, torch.dtype] | None:
    return None if names is None else {k: DTYPES[v] for k, v in names.items()}
