"""Build the trainer for each layout of one world size, take one optimizer step, and record what this
rank really holds (args: a JSON list of {"name", "sections"}, config sections over tests.conftest.TINY).

OUT/<name>.rank<R>.json gets the local element counts and bytes of parameters, gradients (as the
optimizer sees them, just before its step) and optimizer state, and the rank's mesh coordinates.
"""

import json

from meshtrain.parallel.layout import plan_layout
from meshtrain.parallel.mesh import build_mesh
from meshtrain.telemetry.allocation import measure_training_state, mesh_coordinates
from meshtrain.trainer import Trainer
from tests.conftest import tiny_config


def run(args, out, runtime) -> None:
    for spec in json.loads(args[0]):
        cfg = tiny_config(**spec["sections"])
        mesh = build_mesh(plan_layout(cfg, runtime.world_size), runtime.device.type)
        record = measure_training_state(Trainer(cfg, runtime, mesh)) | mesh_coordinates(mesh)
        (out / f"{spec['name']}.rank{runtime.rank}.json").write_text(json.dumps(record))
