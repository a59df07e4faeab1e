"""MXFP4 expert weights (GPT-OSS's released checkpoints) read as the bf16 tensors transformers makes
of them, by each rank for its own slices.

Such a checkpoint stores ``...experts.gate_up_proj`` [E, hidden, 2 I] as ``gate_up_proj_blocks``
[E, 2 I, hidden / 32, 16] (two 4-bit codes a byte: the low nibble first, each an e2m1 value) and
``gate_up_proj_scales`` [E, 2 I, hidden / 32] (a power-of-two exponent per 32 values, biased by
127): the transposed weight's rows in blocks of 32. ``logical_tensors`` presents each pair as the
tensor it stands for (so the checks and the load plan see the model's own names and shapes), and
``Mxfp4StorageReader`` answers DCP's requests for slices of it by reading the blocks and scales that
cover the slice and dequantizing them exactly as transformers' ``convert_moe_packed_tensors`` does
(the lookup table and ``ldexp`` in bf16; every value is exact in bf16 and fp32).
"""

from __future__ import annotations

import dataclasses
import math
from torch.futures import Future

import torch
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex, TensorProperties,
                                                   TensorStorageMetadata)

BLOCKS, SCALES = "_blocks", "_scales"
VALUES_PER_SCALE = 32
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
DEQUANTIZED = torch.bfloat16


def packed_names(keys) -> list[str]:
    """The tensors that ``keys`` hold as MXFP4: the names with both a ``_blocks`` and a ``_scales`` key."""
    keys = set(keys)
    return [k.removesuffix(BLOCKS) for k in keys if k.endswith(BLOCKS) and k.removesuffix(BLOCKS) + SCALES in keys]


def logical_shape(blocks_shape) -> torch.Size:
    """[E, rows, groups, 16] blocks -> the stored tensor [E, groups * 32, rows] (transposed back)."""
    experts, rows, groups, width = blocks_shape
    return torch.Size([experts, groups * width * 2, rows])


def logical_tensors(found: dict[str, tuple]) -> dict[str, tuple]:
    """``found`` (key -> (file, shape, dtype), inspect_hf_dir's) with each blocks/scales pair as the
    one tensor it stands for, in bf16."""
    out = dict(found)
    for name in packed_names(found):
        file, shape, _ = out.pop(name + BLOCKS)
        out.pop(name + SCALES)
        out[name] = (file, logical_shape(shape), DEQUANTIZED)
    return out


def dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """blocks [E, rows, groups, 16] uint8, scales [E, rows, groups] uint8 -> [E, groups * 32, rows]."""
    lut = torch.tensor(FP4_VALUES, dtype=DEQUANTIZED)
    *lead, groups, width = blocks.shape
    values = torch.empty(*lead, groups, width * 2, dtype=DEQUANTIZED)
    values[..., 0::2] = lut[(blocks & 0x0F).int()]
    values[..., 1::2] = lut[(blocks >> 4).int()]
    values = torch.ldexp(values, (scales.int() - 127).unsqueeze(-1))
    return values.reshape(*lead, groups * width * 2).transpose(1, 2)


class Mxfp4StorageReader(HuggingFaceStorageReader):
    """HuggingFaceStorageReader that also serves the dequantized tensors of MXFP4 pairs."""

    def read_metadata(self):
        metadata = super().read_metadata()
        tensors, storage = metadata.state_dict_metadata, metadata.storage_data
        for name in packed_names(tensors):
            shape = logical_shape(tensors.pop(name + BLOCKS).size)
            tensors.pop(name + SCALES)
            tensors[name] = TensorStorageMetadata(properties=TensorProperties(dtype=DEQUANTIZED), size=shape,
                                                  chunks=[ChunkStorageMetadata(offsets=torch.Size([0, 0, 0]), sizes=shape)])
            blocks = storage[next(i for i in storage if i.fqn == name + BLOCKS)]
            storage[MetadataIndex(fqn=name, offset=[0, 0, 0])] = dataclasses.replace(blocks, shape=shape,
                                                                                    dtype=DEQUANTIZED)
        return metadata

    def read_data(self, plan, planner) -> Future[None]:
        from safetensors import safe_open

        packed = set(packed_names(i.fqn for i in self.storage_data))
        quantized = [item for item in plan.items if item.storage_index.fqn in packed]
        rest = [item for item in plan.items if item.storage_index.fqn not in packed]
        if rest:
            super().read_data(dataclasses.replace(plan, items=rest), planner).wait()
        for item in quantized:
            name = item.storage_index.fqn
            (e0, c0, r0), (e1, c1, r1) = item.storage_offsets, [o + n for o, n in zip(item.storage_offsets, item.lengths)]
            g0, g1 = c0 // VALUES_PER_SCALE, math.ceil(c1 / VALUES_PER_SCALE)
            with safe_open(self.storage_data[item.storage_index].relative_path, framework="pt") as f:
                blocks = f.get_slice(name + BLOCKS)[e0:e1, r0:r1, g0:g1]
                scales = f.get_slice(name + SCALES)[e0:e1, r0:r1, g0:g1]
            values = dequantize(blocks, scales)[:, c0 - g0 * VALUES_PER_SCALE:c1 - g0 * VALUES_PER_SCALE]
            target = planner.resolve_tensor(item).detach()
            target.copy_(values)
            planner.commit_tensor(item, target)
        done: Future[None] = Future()
        done.set_result(None)
        return done
