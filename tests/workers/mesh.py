"""On 8 ranks: check the ranks of every submesh of one layout and of the expert grid (raises if wrong)."""

import dataclasses

import torch.distributed as dist

from meshtrain.parallel.layout import plan_layout
from meshtrain.parallel.mesh import build_expert_mesh, build_mesh
from tests.conftest import tiny_config


def group(mesh):
    return sorted(dist.get_process_group_ranks(mesh.get_group())) if mesh.ndim == 1 else mesh.mesh.flatten().tolist()


def run(args, out, runtime) -> None:
    r = runtime.rank
    # dense grid: (pp1, dp_replicate2, dp_shard2, cp1, tp2), tp innermost
    layout = plan_layout(tiny_config(parallel={"tp": 2, "dp_replicate": 2}, train={"micro_batch_size": 1}), 8)
    mesh = build_mesh(layout, "cpu")
    checks = {
        "tp": [r - r % 2, r - r % 2 + 1],
        "dp": [r % 2 + 2 * i for i in range(4)],
        "dp_cp": [r % 2 + 2 * i for i in range(4)],
        "dp_shard_cp": [(r // 4) * 4 + r % 2 + 2 * i for i in range(2)],
        "dp_shard": [(r // 4) * 4 + r % 2 + 2 * i for i in range(2)],
        "dp_replicate": [r % 4 + 4 * i for i in range(2)],
    }
    for dim, want in checks.items():
        assert group(mesh[dim]) == want, (r, dim, group(mesh[dim]), want)
    assert mesh.fsdp.mesh_dim_names == ("dp_replicate", "dp_shard_cp") and mesh.fsdp.mesh.shape == (2, 2)
    assert mesh.fsdp.mesh.tolist() == [[r % 2, r % 2 + 2], [r % 2 + 4, r % 2 + 6]]
    # expert grid over the same 8 ranks: (edp2, ep2, etp2), etp innermost
    # (the dense model refuses ep, so the expert sizes are set on the checked layout directly)
    expert = build_expert_mesh(mesh, dataclasses.replace(layout, ep=2, etp=2))
    assert expert.mesh_dim_names == ("edp", "ep", "etp")
    assert group(expert["etp"]) == [r - r % 2, r - r % 2 + 1]
    assert group(expert["ep"]) == [(r // 4) * 4 + r % 2 + 2 * i for i in range(2)]
    assert group(expert["edp"]) == [r % 4 + 4 * i for i in range(2)]
