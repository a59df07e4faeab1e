"""The private torch APIs meshtrain uses (besides the ring attention of ``_torch_cp``), in one place.

torch 2.13 exposes flattening and unflattening of mesh dims only as ``DeviceMesh._flatten`` and
``DeviceMesh._unflatten``, and names the placement FSDP gives a dim it shards after another mesh
dim already did (experts over edp after ep) only as ``_StridedShard`` (checked against torch
2.13.0). Everything else goes through this file, so a torch upgrade that makes them public (or
changes them) is a one-file change.
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.placement_types import _StridedShard as StridedShard  # noqa: F401 (re-exported)


def flatten(mesh: DeviceMesh, dims: tuple[str, ...], name: str) -> DeviceMesh:
    """Register ``name`` on the root mesh as the flattening of ``dims``; ``mesh[name]`` then works."""
    return mesh[dims]._flatten(name)


def unflatten(mesh: DeviceMesh, sizes: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
    """Regroup a 1-D mesh into an N-D one with new dim names (the same ranks, another grid)."""
    return mesh._unflatten(0, sizes, names)
