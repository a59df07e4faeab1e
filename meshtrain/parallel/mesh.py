"""The one DeviceMesh a Layout builds, and the flattened submeshes every parallel decision reads.

    dense mesh  ("pp", "dp_replicate", "dp_shard", "cp", "tp")   tp innermost, pp outermost
    flattened   "dp" = dp_replicate x dp_shard        data loading (each dp rank reads its shard)
                "dp_shard_cp" = dp_shard x cp         FSDP2 shards parameters over these ranks
                "dp_cp" = dp_replicate x dp_shard x cp  loss and gradient averaging
                "cp_tp" = cp x tp                     the ranks sharing a sequence (MoE balancing loss)
                "stage" = dp_replicate x dp_shard x cp x tp   one pp stage (expert load counts)
    expert mesh ("edp", "ep", "etp")                  the same ranks of one pp stage, regrouped:
                ep folds over dp x cp (x tp), edp = world / (pp * ep * etp)
"""

from __future__ import annotations

import dataclasses
import datetime
from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh

from meshtrain.config import ParallelConfig
from meshtrain.parallel._torch_private import flatten, group_options, unflatten
from meshtrain.parallel.layout import DENSE_DIMS, Layout, describe_sizes, layout_extras, resolve_schedule


@dataclass(frozen=True)
class ParallelMesh:
    """The DeviceMesh and the flattened submeshes derived from it, kept by name.

    torch asks callers to keep flattened meshes themselves rather than slice them from the root,
    so they live here. ``mesh["tp"]`` and ``mesh["dp_cp"]`` read the same way either way.
    """

    world: DeviceMesh
    dp: DeviceMesh
    dp_shard_cp: DeviceMesh
    dp_cp: DeviceMesh
    fsdp: DeviceMesh
    """dp_shard_cp, or the 2-D (dp_replicate, dp_shard_cp) mesh for HSDP."""
    cp_tp: DeviceMesh
    """The ranks that share each sequence (cp splits it, and tp under SP or in MoE blocks)."""
    stage: DeviceMesh
    """Every rank of this pipeline stage: dp_replicate x dp_shard x cp x tp."""
    experts: DeviceMesh | None = None
    """The expert grid (edp, ep, etp), when the layout has expert parallelism."""

    def __getitem__(self, dim: str) -> DeviceMesh:
        if dim in EXPERT_DIMS:
            if self.experts is None:
                raise KeyError(f"mesh dim {dim!r}: this layout has no expert parallelism")
            return self.experts[dim]
        return getattr(self, dim) if dim in FLATTENED_DIMS else self.world[dim]

    def size(self, dim: str) -> int:
        if dim in EXPERT_DIMS and self.experts is None:
            return 1
        return self[dim].size()

    @property
    def expert_grid(self) -> DeviceMesh:
        """The mesh the experts are sharded over: ep, or (ep, etp) with expert tensor parallelism."""
        return self["ep"] if self.size("etp") == 1 else self.experts["ep", "etp"]

    @property
    def device_type(self) -> str:
        return self.world.device_type

    def describe(self, parallel: ParallelConfig) -> str:
        """The layout line; the config adds what is not a mesh dim (SP, virtual stages, schedule)."""
        schedule = resolve_schedule(parallel.pp_schedule, parallel.vpp) if self.size("pp") > 1 else ""
        return describe_sizes({d: self.size(d) for d in DENSE_DIMS}, self.world.size(), ep=self.size("ep"),
                              extras=layout_extras(parallel.sp, parallel.vpp, schedule, self.size("etp")))


FLATTENED_DIMS = ("dp", "dp_shard_cp", "dp_cp", "fsdp", "cp_tp", "stage")
EXPERT_DIMS = ("edp", "ep", "etp")


def build_mesh(layout: Layout, device_type: str) -> ParallelMesh:
    """Create the process groups of the dense mesh and its flattened submeshes, each with the
    layout's collective timeout (parallel.timeout_s)."""
    from torch.distributed.device_mesh import init_device_mesh

    timeout = datetime.timedelta(seconds=layout.timeout_s)
    sizes = tuple(getattr(layout, d) for d in DENSE_DIMS)
    world = init_device_mesh(device_type, sizes, mesh_dim_names=DENSE_DIMS,
                             backend_override={d: group_options(timeout) for d in DENSE_DIMS})
    dp_cp = flatten(world, ("dp_replicate", "dp_shard", "cp"), "dp_cp", timeout)
    dp_shard_cp = flatten(world, ("dp_shard", "cp"), "dp_shard_cp", timeout)
    if layout.dp_replicate > 1:
        fsdp = unflatten(dp_cp, (layout.dp_replicate, layout.dp_shard * layout.cp), ("dp_replicate", "dp_shard_cp"),
                         timeout)
    else:
        fsdp = dp_shard_cp
    mesh = ParallelMesh(world, flatten(world, ("dp_replicate", "dp_shard"), "dp", timeout), dp_shard_cp, dp_cp, fsdp,
                        flatten(world, ("cp", "tp"), "cp_tp", timeout),
                        flatten(world, ("dp_replicate", "dp_shard", "cp", "tp"), "stage", timeout))
    if layout.ep * layout.etp > 1:
        mesh = dataclasses.replace(mesh, experts=build_expert_mesh(mesh, layout))
    return mesh


def build_expert_mesh(mesh: ParallelMesh, layout: Layout) -> DeviceMesh:
    """The expert grid (edp, ep, etp) over the same ranks as one pp stage's dense grid.

    etp is innermost and ep next, as tp and cp are in the dense grid, so with ep*etp == tp*cp the
    experts of a group sit on the ranks that share the dense tp x cp work.
    """
    return unflatten(mesh.stage, (layout.edp, layout.ep, layout.etp), ("edp", "ep", "etp"),
                     datetime.timedelta(seconds=layout.timeout_s))
