"""Run on every rank by torchrun: build the trainer for several layouts of one world size, take one
optimizer step, and record what this rank really holds.

    torchrun ... tests/allocation_worker.py OUT_DIR LAYOUTS.json

LAYOUTS.json is a list of {"name": ..., "sections": {...}} (config sections over tests.conftest.TINY).
OUT_DIR/<name>.rank<R>.json gets the local element counts and bytes of parameters, gradients (as the
optimizer sees them, just before its step) and optimizer state, and the rank's mesh coordinates.
"""

import json
import pathlib
import sys

import torch
from torch.distributed.tensor import DTensor

from meshtrain.distributed import exit_process, init_distributed, shutdown
from meshtrain.mesh import build_mesh, plan_layout
from meshtrain.train import Trainer
from tests.conftest import tiny_config


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def measure(trainer: Trainer) -> dict:
    seen: dict = {}

    def recording(opt):
        step = opt.step

        def step_and_record(*args, **kwargs):
            grads = [local(p.grad) for group in opt.param_groups for p in group["params"] if p.grad is not None]
            seen["grad_bytes"] = seen.get("grad_bytes", 0) + sum(g.numel() * g.element_size() for g in grads)
            return step(*args, **kwargs)
        return step_and_record

    for opt in trainer.optimizers:
        opt.step = recording(opt)
    trainer.train_step()
    params = [local(p) for p in trainer.params]
    states = [local(v) for opt in trainer.optimizers for state in opt.state.values()
              for v in state.values() if isinstance(v, torch.Tensor)]
    return {"param_elements": sum(p.numel() for p in params),
            "param_bytes": sum(p.numel() * p.element_size() for p in params),
            "grad_bytes": seen["grad_bytes"],
            "optimizer_bytes": sum(s.numel() * s.element_size() for s in states)}


def main() -> None:
    out, layouts = pathlib.Path(sys.argv[1]), json.loads(pathlib.Path(sys.argv[2]).read_text())
    runtime = init_distributed(120)
    try:
        for spec in layouts:
            cfg = tiny_config(**spec["sections"])
            mesh = build_mesh(plan_layout(cfg, runtime.world_size), runtime.device.type)
            record = measure(Trainer(cfg, runtime, mesh))
            record |= {"pp_rank": mesh["pp"].get_local_rank(), "tp_rank": mesh["tp"].get_local_rank(),
                       "fsdp_rank": mesh["dp_shard_cp"].get_local_rank()}
            (out / f"{spec['name']}.rank{runtime.rank}.json").write_text(json.dumps(record))
    except BaseException:
        shutdown()
        raise
    shutdown(synchronize=True)
    exit_process(0)  # see exit_process: a clean exit without gloo's teardown race


if __name__ == "__main__":
    main()
