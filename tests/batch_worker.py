"""Run on every rank by torchrun: the jobs of a batch (tests/batch.py), one after another, on one
process group.

    torchrun ... tests/batch_worker.py BATCH.json

BATCH.json is a list of {"name", "kind", "dir", "args"}; tests/workers/<kind>.py runs each. After
a job every rank meets at a barrier and destroys the job's process groups (runtime.release_groups:
a batch of 80 jobs once held ~500 gloo groups, 1,500 threads, per rank), then rank 0 writes
DIR/done: this process's id and the most threads any rank holds after the release. A job that
raises ends the process with an error, torchrun stops the other ranks, and the batch runner
relaunches the jobs after it.
"""

import gc
import importlib
import json
import os
import pathlib
import sys
import time

import torch
import torch.distributed as dist

from meshtrain.parallel.runtime import exit_process, init_distributed, release_groups, shutdown


def thread_count() -> int:
    return len(os.listdir("/proc/self/task"))


def main() -> None:
    specs = json.loads(pathlib.Path(sys.argv[1]).read_text())
    runtime = init_distributed(300)
    try:
        for spec in specs:
            started, cpu = time.monotonic(), time.process_time()
            worker = importlib.import_module(f"tests.workers.{spec['kind']}")
            worker.run(spec["args"], pathlib.Path(spec["dir"]), runtime)
            dist.barrier()
            release_groups()
            # What survives the release stays: the next release's collection then scans only the next
            # job's objects (a full one scans dynamo's and inductor's too: ~0.3 s a job once a job compiled).
            gc.freeze()
            threads = torch.tensor(thread_count())
            dist.all_reduce(threads, op=dist.ReduceOp.MAX)
            cpu_seconds = torch.tensor(time.process_time() - cpu, dtype=torch.float64)
            dist.all_reduce(cpu_seconds)  # every rank's: what the job costs the machine
            if runtime.is_main:
                done = {"pid": os.getpid(), "threads": int(threads), "seconds": round(time.monotonic() - started, 2),
                        "cpu_seconds": round(float(cpu_seconds), 2)}
                (pathlib.Path(spec["dir"]) / "done").write_text(json.dumps(done))
    except BaseException:
        shutdown()
        raise
    shutdown(synchronize=True)
    exit_process(0)  # see exit_process: a clean exit without gloo's teardown race


if __name__ == "__main__":
    main()
