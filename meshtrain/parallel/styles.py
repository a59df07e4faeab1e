"""What a block's tensor-parallel plan is written with (``tp_plan`` in models/transformer.py and
models/moe.py): the styles to use and where the residual stream lives, chosen once by
parallel/tensor.py from the layout (float8 swaps in torchao's styles; sequence parallel shards the
residual stream on the sequence)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle


@dataclass(frozen=True)
class TensorParallelStyles:
    colwise: Callable
    rowwise: Callable
    prepare_input: Callable
    sequence_parallel: Callable
    residual: Placement
    """The residual stream's layout between blocks: Shard(1) under sequence parallel, else Replicate()."""
    sequence_parallel_norms: bool

    def shard_parameters(self, dim: int) -> ParallelStyle:
        """A module's own parameters split on ``dim`` over tp, its inputs and outputs left alone
        (GPT-OSS's per-head attention sinks: each rank holds its heads')."""
        return ShardedParameters(dim)


class ShardedParameters(ParallelStyle):
    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def shard(name, mod, mesh):
            for pname, param in list(mod.named_parameters(recurse=False)):
                mod.register_parameter(pname, nn.Parameter(distribute_tensor(param, mesh, [Shard(self.dim)])))

        return distribute_module(module, device_mesh, shard)
