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

from meshtrain.telemetry.allocation import measure_training_state, mesh_coordinates
from meshtrain.parallel.runtime import exit_process, init_distributed, shutdown
from meshtrain.parallel.layout import plan_layout
from meshtrain.parallel.mesh import build_mesh
from meshtrain.trainer import Trainer
from tests.conftest import tiny_config


def main() -> None:
    out, layouts = pathlib.Path(sys.argv[1]), json.loads(pathlib.Path(sys.argv[2]).read_text())
    runtime = init_distributed(120)
    try:
        for spec in layouts:
            cfg = tiny_config(**spec["sections"])
            mesh = build_mesh(plan_layout(cfg, runtime.world_size), runtime.device.type)
            record = measure_training_state(Trainer(cfg, runtime, mesh)) | mesh_coordinates(mesh)
            (out / f"{spec['name']}.rank{runtime.rank}.json").write_text(json.dumps(record))
    except BaseException:
        shutdown()
        raise
    shutdown(synchronize=True)
    exit_process(0)  # see exit_process: a clean exit without gloo's teardown race


if __name__ == "__main__":
    main()
