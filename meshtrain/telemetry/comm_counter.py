"""Count the collectives a region issues, by op name: calls, and bytes this rank sends.

torch's CommDebugMode counts the same ops but its per-module tracker raises IndexError on FSDP2
modules in torch 2.13.0, and it counts no bytes. This uses the private
``torch.utils._python_dispatch.TorchDispatchMode`` and c10d's ``_resolve_process_group`` /
``ProcessGroup.unbox`` to find each op's group (checked against torch 2.13.0).

Bytes sent per rank follow the bandwidth-optimal algorithms, the volume an implementation cannot
go below: all-gather and reduce-scatter move (n-1)/n of the full tensor, all-reduce twice that
(reduce-scatter + all-gather), all-to-all every split but the rank's own, send its tensor.
"""

from collections import Counter

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.utils._python_dispatch import TorchDispatchMode

NAMESPACES = ("c10d", "_c10d_functional")
NOT_COLLECTIVES = ("wait_tensor", "barrier", "monitored_barrier", "_wrap_tensor_autograd")


def _group(arg) -> dist.ProcessGroup:
    return _resolve_process_group(arg) if isinstance(arg, str) else dist.ProcessGroup.unbox(arg)


def _nbytes(t) -> int:
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return t.numel() * t.element_size()


def _all_to_all_bytes(inp: torch.Tensor, input_splits: list[int], group: dist.ProcessGroup) -> int:
    n, me = group.size(), group.rank()
    if not input_splits:
        return _nbytes(inp) * (n - 1) // n
    row = _nbytes(inp) // max(inp.shape[0], 1)
    return (sum(input_splits) - input_splits[me]) * row


def bytes_sent(op: str, args: tuple) -> int:
    """What this rank puts on the wire for one call of ``op`` (its schema name, e.g. ``c10d::send``)."""
    if op == "_c10d_functional::all_reduce":  # (input, reduce_op, group_name)
        n = _group(args[2]).size()
        return 2 * (n - 1) * _nbytes(args[0]) // n
    if op == "c10d::allreduce_":  # (tensors, group, reduce_op, ...)
        n = _group(args[1]).size()
        return 2 * (n - 1) * _nbytes(args[0]) // n
    if op == "_c10d_functional::all_gather_into_tensor":  # (input, group_size, group_name)
        return (args[1] - 1) * _nbytes(args[0])
    if op == "c10d::_allgather_base_":  # (output, input, group, ...)
        return _nbytes(args[0]) - _nbytes(args[1])
    if op == "_c10d_functional::reduce_scatter_tensor":  # (input, reduce_op, group_size, group_name)
        return (args[2] - 1) * _nbytes(args[0]) // args[2]
    if op == "c10d::_reduce_scatter_base_":  # (output, input, group, ...)
        return _nbytes(args[1]) - _nbytes(args[0])
    if op == "_c10d_functional::all_to_all_single":  # (input, output_splits, input_splits, group_name)
        return _all_to_all_bytes(args[0], list(args[2]), _group(args[3]))
    if op == "c10d::alltoall_base_":  # (output, input, group, output_splits, input_splits, ...)
        return _all_to_all_bytes(args[1], list(args[4]), _group(args[2]))
    if op.startswith("c10d::recv"):
        return 0
    return _nbytes(args[0])  # send, broadcast, ...: its tensor, once


class CollectiveCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts: Counter[str] = Counter()
        self.bytes: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        op = func._schema.name
        name = op.split("::")[-1]
        if func.namespace in NAMESPACES and name not in NOT_COLLECTIVES:
            name = name.rstrip("_").removesuffix("_into_tensor").removesuffix("_tensor")
            self.counts[name] += 1
            self.bytes[name] += bytes_sent(op, args)
        return func(*args, **(kwargs or {}))
