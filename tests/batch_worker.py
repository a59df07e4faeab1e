"""Run on every rank by torchrun: the jobs of a batch (tests/batch.py), one after another, on one
process group.

    torchrun ... tests/batch_worker.py BATCH.json

BATCH.json is a list of {"name", "kind", "dir", "args"}; tests/workers/<kind>.py runs each. After
a job every rank meets at a barrier and rank 0 writes DIR/done. A job that raises ends the process
with an error, torchrun stops the other ranks, and the batch runner relaunches the jobs after it.

The process groups a job's DeviceMesh created stay alive: torch 2.13's DTensor caches redistribute
plans by mesh equality (shape and dim names, not groups), so a later job's equal mesh may run a
collective on an earlier job's group (the same ranks; destroying it fails with "Could not resolve
the process group").
"""

import importlib
import json
import pathlib
import sys

import torch.distributed as dist

from meshtrain.parallel.runtime import exit_process, init_distributed, shutdown


def main() -> None:
    specs = json.loads(pathlib.Path(sys.argv[1]).read_text())
    runtime = init_distributed(300)
    try:
        for spec in specs:
            worker = importlib.import_module(f"tests.workers.{spec['kind']}")
            worker.run(spec["args"], pathlib.Path(spec["dir"]), runtime)
            dist.barrier()
            if runtime.is_main:
                (pathlib.Path(spec["dir"]) / "done").write_text("")
    except BaseException:
        shutdown()
        raise
    shutdown(synchronize=True)
    exit_process(0)  # see exit_process: a clean exit without gloo's teardown race


if __name__ == "__main__":
    main()
