"""What a block's tensor-parallel plan is written with (``tp_plan`` in models/transformer.py and
models/moe.py): the styles to use and where the residual stream lives, chosen once by
parallel/tensor.py from the layout (float8 swaps in torchao's styles; sequence parallel shards the
residual stream on the sequence)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from torch.distributed.tensor import Placement


@dataclass(frozen=True)
class TensorParallelStyles:
    colwise: Callable
    rowwise: Callable
    prepare_input: Callable
    sequence_parallel: Callable
    residual: Placement
    """The residual stream's layout between blocks: Shard(1) under sequence parallel, else Replicate()."""
    sequence_parallel_norms: bool
