"""Run on every rank by torchrun: the jobs of a batch (tests/batch.py), one after another, on one
process group.

    torchrun ... tests/batch_worker.py BATCH.json

BATCH.json is a list of {"name", "kind", "dir", "args"}; tests/workers/<kind>.py runs each. After
a job every rank meets at a barrier, rank 0 writes DIR/done, and the process groups the job created
(its DeviceMesh dims) are destroyed, so the next job starts from the world group alone. A job that
raises ends the process with an error, torchrun stops the other ranks, and the batch runner
relaunches the jobs after it.
"""

import importlib
import json
import pathlib
import sys

import torch.distributed as dist

from meshtrain.parallel.runtime import exit_process, init_distributed, shutdown


def process_groups() -> set:
    # torch 2.13: the registry of live process groups is private (c10d's _world.pg_map).
    return set(dist.distributed_c10d._world.pg_map)


def main() -> None:
    specs = json.loads(pathlib.Path(sys.argv[1]).read_text())
    runtime = init_distributed(300)
    try:
        for spec in specs:
            before = process_groups()
            worker = importlib.import_module(f"tests.workers.{spec['kind']}")
            worker.run(spec["args"], pathlib.Path(spec["dir"]), runtime)
            dist.barrier()
            if runtime.is_main:
                (pathlib.Path(spec["dir"]) / "done").write_text("")
            for group in process_groups() - before:
                if group is not dist.GroupMember.WORLD:
                    dist.destroy_process_group(group)
    except BaseException:
        shutdown()
        raise
    shutdown(synchronize=True)
    exit_process(0)  # see exit_process: a clean exit without gloo's teardown race


if __name__ == "__main__":
    main()
