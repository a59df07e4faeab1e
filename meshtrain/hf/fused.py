"""Hugging Face tensors that are several of meshtrain's weights stacked by rows (Phi-3's
``qkv_proj`` = [q; k; v] and ``gate_up_proj`` = [gate; up]; ``models.family.RowStack``).

meshtrain keeps those linears apart, so tensor parallelism splits each by heads or by half (a row
split of the fused tensor would give one rank all the queries and another the keys). Each rank's
shards of the parts are then row ranges of the checkpoint's one tensor:

- import reads exactly those ranges: a DCP load planner gives each part's local chunk its offset in
  the fused tensor (the rows of the parts before it added), so no rank reads more than its shards;
- export writes the parts under their own names through DCP (one rank can hold chunks of several
  parts, and DCP's safetensors writer keeps one tensor per name and file), and after consolidation
  the coordinator joins them. Rows stacked are bytes concatenated, so a file is rewritten by
  copying byte ranges: no tensor is decoded, and memory stays at one copy buffer.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import struct

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.tensor import DTensor

from meshtrain.models.family import RowStack

_COPY_BYTES = 64 << 20


def split_stacks(state: dict) -> tuple[dict, dict[str, RowStack]]:
    """A state dict's plain entries and its row stacks."""
    plain = {k: v for k, v in state.items() if not isinstance(v, RowStack)}
    return plain, {k: v for k, v in state.items() if isinstance(v, RowStack)}


def _local_chunks(stack: RowStack) -> list[tuple[ChunkStorageMetadata, torch.Tensor]]:
    """Each part's chunk on this rank, placed in the fused tensor, with the local tensor that holds it."""
    out, row = [], 0
    for value in stack.parts.values():
        if isinstance(value, DTensor):
            (chunk,) = value.__create_chunk_list__()  # DTensor's own answer to DCP: its shard's offsets
            local = value.to_local()
        else:
            chunk, local = ChunkStorageMetadata(torch.Size([0] * value.dim()), value.size()), value
        if local.numel():  # an uneven FSDP shard can be empty
            offsets = torch.Size([row + chunk.offsets[0], *chunk.offsets[1:]])
            out.append((ChunkStorageMetadata(offsets, chunk.sizes), local))
        row += value.shape[0]
    return out


class RowStackLoadPlanner(DefaultLoadPlanner):
    """DCP's default load plan for the plain entries, plus reads of each row stack's parts from the
    rows of the one checkpoint tensor that hold them."""

    def __init__(self, stacks: dict[str, RowStack]):
        super().__init__()
        self.stacks = {key: _local_chunks(stack) for key, stack in stacks.items()}

    def create_local_plan(self):
        plan = super().create_local_plan()
        items = list(plan.items)
        for key, chunks in self.stacks.items():
            items += create_read_items_for_chunk_list(key, self.metadata.state_dict_metadata[key],
                                                      [chunk for chunk, _ in chunks])
        return dataclasses.replace(plan, items=items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        if index.fqn in self.stacks:
            return next(local for chunk, local in self.stacks[index.fqn] if chunk.offsets == index.offset)
        return super().lookup_tensor(index)


def parts_for_writing(state: dict, plan: dict[str, int]) -> tuple[dict, dict[str, int], dict[str, list[str]]]:
    """The state with each row stack's parts under their own names, the file plan extended to them
    (each in its stack's file), and stack name -> part names, for ``join_parts``."""
    plain, stacks = split_stacks(state)
    joins = {key: list(stack.parts) for key, stack in stacks.items()}
    for key, stack in stacks.items():
        plain.update(stack.parts)
    # the stacks leave the plan: DCP's consolidation would write an empty entry for a name it was not given
    plan = {k: v for k, v in plan.items() if k not in joins} | {
        part: plan[key] for key, parts in joins.items() for part in parts}
    return plain, plan, joins


def join_parts(index_path: pathlib.Path, joins: dict[str, list[str]]) -> None:
    """Rewrite a consolidated export's files so that each stack is one tensor of its parts' rows,
    and its index (``index_path``) with it. Files without parts are left as they are."""
    if not joins:
        return
    directory = index_path.parent
    index = json.loads(index_path.read_text())
    weight_map: dict[str, str] = index["weight_map"]
    for file in sorted({weight_map[parts[0]] for parts in joins.values()}):
        _rewrite(directory / file, {k: v for k, v in joins.items() if weight_map[v[0]] == file})
    for key, parts in joins.items():
        weight_map[key] = weight_map[parts[0]]
        for part in parts:
            del weight_map[part]
    index["weight_map"] = dict(sorted(weight_map.items()))
    index_path.write_text(json.dumps(index, indent=2) + "\n")


def _read_header(f) -> tuple[dict, int]:
    (size,) = struct.unpack("<Q", f.read(8))
    return json.loads(f.read(size)), 8 + size


def _rewrite(path: pathlib.Path, joins: dict[str, list[str]]) -> None:
    """One safetensors file again, each stack's parts replaced by one entry where the first was."""
    with open(path, "rb") as src:
        header, data_start = _read_header(src)
        meta = header.pop("__metadata__", None)
        first = {parts[0]: key for key, parts in joins.items()}
        later = {part for parts in joins.values() for part in parts[1:]}
        order = sorted(header, key=lambda k: header[k]["data_offsets"][0])
        entries: list[tuple[str, str, list[int], list[str]]] = []  # name, dtype, shape, source tensors
        for name in order:
            if name in later:
                continue
            sources = joins[first[name]] if name in first else [name]
            shapes = [header[s]["shape"] for s in sources]
            if any(header[s]["dtype"] != header[name]["dtype"] or shape[1:] != shapes[0][1:]
                   for s, shape in zip(sources, shapes)):
                raise ValueError(f"{path}: the parts of {first[name]} do not stack by rows: {sources} {shapes}")
            entries.append((first.get(name, name), header[name]["dtype"],
                            [sum(s[0] for s in shapes), *shapes[0][1:]], sources))
        new_header, offset = {}, 0
        for name, dtype, shape, sources in entries:
            size = sum(header[s]["data_offsets"][1] - header[s]["data_offsets"][0] for s in sources)
            new_header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
            offset += size
        if meta is not None:
            new_header["__metadata__"] = meta
        encoded = json.dumps(new_header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned, as safetensors writes it
        tmp = path.with_name(path.name + ".joining")
        with open(tmp, "wb") as dst:
            dst.write(struct.pack("<Q", len(encoded)) + encoded)
            for _, _, _, sources in entries:
                for s in sources:
                    begin, end = header[s]["data_offsets"]
                    src.seek(data_start + begin)
                    remaining = end - begin
                    while remaining:
                        block = src.read(min(remaining, _COPY_BYTES))
                        if not block:
                            raise ValueError(f"{path}: ends inside tensor {s}")
                        dst.write(block)
                        remaining -= len(block)
    tmp.replace(path)
