"""Build one layout's mesh (args: the parallel section as JSON, over tests.conftest.TINY) and run a
DTensor redistribute and an all-reduce over every dim of it, raising if a result is wrong. Many such
jobs in one batch show that a batch process's groups stay bounded (tests/batch_worker.py), and that
a later job's equal mesh gets live groups, not the destroyed ones DTensor's caches would hand it."""

import json

import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from meshtrain.parallel.layout import plan_layout
from meshtrain.parallel.mesh import EXPERT_DIMS, FLATTENED_DIMS, build_mesh
from tests.conftest import tiny_config

MOE = {"family": "qwen3_moe", "num_experts": 4}


def run(args, out, runtime) -> None:
    parallel = json.loads(args[0])
    model = MOE if parallel.get("ep", 1) * parallel.get("etp", 1) > 1 else {}
    cfg = tiny_config(parallel=parallel, model=model, train={"micro_batch_size": 1})
    mesh = build_mesh(plan_layout(cfg, runtime.world_size), runtime.device.type)
    full = torch.arange(8.0 * mesh.world.size()).reshape(mesh.world.size(), 8)  # the same on every rank
    # sharded over every dense dim of size > 1 at once, then gathered back through DTensor's planner
    placements = [Shard(0) if size > 1 else Replicate() for size in mesh.world.mesh.shape]
    gathered = distribute_tensor(full, mesh.world, placements).redistribute(
        mesh.world, [Replicate()] * mesh.world.ndim).to_local()
    if not torch.equal(gathered, full):
        raise AssertionError(f"{parallel}: redistribute over {mesh.world} gave wrong values")
    dims = (*mesh.world.mesh_dim_names, *FLATTENED_DIMS, *(EXPERT_DIMS if mesh.experts is not None else ()))
    for dim in dims:
        submesh = mesh[dim]
        for group in submesh.get_all_groups():
            one = torch.ones(())
            dist.all_reduce(one, group=group)
            if one.item() != dist.get_world_size(group):
                raise AssertionError(f"{parallel}: all-reduce over {dim} gave {one.item()}")
        if submesh.ndim == 1:  # an op through DTensor's dispatch (its sharding caches), as the trainer's
            total = (distribute_tensor(full, submesh, [Shard(0)]) * 2).sum().full_tensor().item()
            if total != 2 * full.sum().item():
                raise AssertionError(f"{parallel}: a sum sharded over {dim} gave {total}")
