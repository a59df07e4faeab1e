"""The private torch APIs meshtrain uses (besides the ring attention of ``_torch_cp``), in one place.

torch 2.13 exposes flattening and unflattening of mesh dims only as ``DeviceMesh._flatten`` and
``DeviceMesh._unflatten``, names the placement FSDP gives a dim it shards after another mesh
dim already did (experts over edp after ep) only as ``_StridedShard``, and gloo's process-group
options (the only way to give a DeviceMesh's groups a timeout) only as ``ProcessGroupGloo._Options``,
and the flight recorder's record of collectives (gloo and NCCL alike, filled when
TORCH_FR_BUFFER_SIZE is set before a group is made) only as ``_dump_fr_trace_json``, and
CUDA memory snapshots only as ``torch.cuda.memory._record_memory_history`` / ``_dump_snapshot``,
and the number of graphs torch.compile made only as dynamo's ``counters``, and an all-gather
whose backward reduce-scatters on any backend only as ``_functional_collectives.all_gather_single``,
and the live process groups only as c10d's ``_world``, and DTensor's caches keyed by mesh equality only
as the caches of ``_redistribute``, the sharding propagator and ``MeshTopoInfo``, and the forward a
pipeline stage runs only to learn its shapes only as ``PipelineStage._forward_metadata_inference``
(checked against torch 2.13.0). Everything else goes through this file, so a torch upgrade that makes them public (or
changes them) is a one-file change.
"""

from __future__ import annotations

import datetime
from typing import Callable, ContextManager

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.placement_types import _StridedShard as StridedShard  # noqa: F401 (re-exported)


def group_options(timeout: datetime.timedelta):
    """Process-group options for the world's backend that give a new group ``timeout``. A DeviceMesh
    given none creates its groups with c10d's default (30 min for gloo, 10 for NCCL), whatever the
    world group's timeout: one hung rank would then hang the job that long."""
    if dist.get_backend() == "nccl":
        options = dist.ProcessGroupNCCL.Options()
    else:
        options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    return options


def flatten(mesh: DeviceMesh, dims: tuple[str, ...], name: str, timeout: datetime.timedelta) -> DeviceMesh:
    """Register ``name`` on the root mesh as the flattening of ``dims``; ``mesh[name]`` then works."""
    return mesh[dims]._flatten(name, backend_override=group_options(timeout))


def unflatten(mesh: DeviceMesh, sizes: tuple[int, ...], names: tuple[str, ...],
              timeout: datetime.timedelta) -> DeviceMesh:
    """Regroup a 1-D mesh into an N-D one with new dim names (the same ranks, another grid)."""
    return mesh._unflatten(0, sizes, names, backend_override={n: group_options(timeout) for n in names})


def flight_recorder_json() -> str:
    """This process's flight-recorder record (every group's recent collectives) as JSON."""
    from torch._C._distributed_c10d import _dump_fr_trace_json

    return _dump_fr_trace_json(includeCollectives=True, onlyActive=False)


def record_cuda_memory_history(max_entries: int) -> None:
    """Start recording CUDA allocations with their stacks (documented, but named privately)."""
    torch.cuda.memory._record_memory_history(max_entries=max_entries)


def dump_cuda_memory_snapshot(path: str) -> None:
    """Write the recorded allocations as a pickle that https://pytorch.org/memory_viz opens."""
    torch.cuda.memory._dump_snapshot(path)


def compiled_graph_count() -> int:
    """Graphs torch.compile has made in this process so far (dynamo's own counter)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def gather_along(tensor: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    """Every rank's ``tensor`` concatenated along ``dim`` in rank order, differentiable: the backward
    reduce-scatters the gradient (gloo too). ``torch.distributed.nn.functional.all_gather`` (an
    all-to-all backward) trained the document-masked cp2 run 3e-3 away from one rank by step 2; an
    isolated gather's gradient was right, so the cause is not known."""
    from torch.distributed._functional_collectives import all_gather_single

    moved = tensor.movedim(dim, 0).contiguous()
    return all_gather_single(moved, 0, group).movedim(0, dim)


def clear_dtensor_mesh_caches() -> None:
    """Empty DTensor's caches that hold DeviceMeshes. They are keyed by mesh equality (shape, ranks and
    dim names, not process groups), so after a job's groups are destroyed a later job's equal mesh
    would be handed the old mesh, and its dead groups, from them ("Could not resolve the process
    group"); they also keep the old meshes, and so their groups' threads, alive. torch 2.13: the
    redistribute planner cache, the ``@cache``d ``_gen_transform_infos``, the sharding propagator's
    two caches (the C++ dispatch fast path's, and the Python LRU cache, which is per thread: this
    empties the calling thread's; on CPU, backward runs on the thread that called it), and two
    ``lru_cache``s found holding meshes by ``gc.get_referrers`` after a job: the propagator's tensor
    metadata (keyed by op schemas, which hold specs) and ``MeshTopoInfo.build_from_mesh``.
    """
    from torch.distributed.tensor import _redistribute
    from torch.distributed.tensor._collective_utils import MeshTopoInfo
    from torch.distributed.tensor._sharding_prop import ShardingPropagator
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    clear_planners = getattr(_redistribute, "clear_redistribute_planner_cache", None)
    if clear_planners is not None:  # a torch release without the planner cache has nothing to clear
        clear_planners()
    _redistribute._gen_transform_infos.cache_clear()
    _clear_sharding_prop_cache()
    ShardingPropagator._propagate_tensor_meta_cached.cache_clear()
    MeshTopoInfo.build_from_mesh.cache_clear()


def subgroups() -> list[dist.ProcessGroup]:
    """Every live process group of this process except the default (world) one."""
    from torch.distributed.distributed_c10d import _world

    return [group for group in _world.pg_map if group is not dist.GroupMember.WORLD]


METADATA_INFERENCE = ("_forward_metadata_inference", "_shape_inference")
"""PipelineStage's methods that run the stage's forward only to learn its shapes: torch 2.13's
dynamic metadata inference runs the first micro-batch once more, past the first stage on empty
tensors (``_shape_inference`` in earlier releases)."""


def pipeline_stage_class(around_inference: Callable[[torch.nn.Module], ContextManager]) -> type:
    """PipelineStage, with ``around_inference(its module)`` entered around that shape-inference forward."""
    from torch.distributed.pipelining import PipelineStage

    def override(name: str):
        def method(self, *args, **kwargs):
            with around_inference(self.submod):
                return getattr(PipelineStage, name)(self, *args, **kwargs)
        return method

    return type("PipelineStage", (PipelineStage,),
                {name: override(name) for name in METADATA_INFERENCE if hasattr(PipelineStage, name)})
