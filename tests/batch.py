"""Multi-rank jobs run in batches: one ``torchrun`` launch per world size runs every selected job of
that size in turn, on one process group, and each test reads its own job's result.

Most of a small multi-rank test's time is the launch (torchrun, then torch imported on every rank,
then the process group), not its few tiny steps; a batch pays it once per world size. Tests name
their job with ``@pytest.mark.job(Job(...))`` (or ``jobs(...)`` inside a parametrisation), the
``batches`` fixture runs the jobs of every collected test lazily, and ``batches.result(job)``
returns the job's output directory. A job that fails fails its own test only: the batch is
relaunched with the jobs after it.
"""

from __future__ import annotations

import json
import pathlib
import re
from dataclasses import dataclass
from typing import Callable

import pytest

from tests.conftest import torchrun

KINDS = ("train", "hf", "mesh", "ring_attention", "allocation")
"""What a job does on every rank: tests/workers/<kind>.py."""

SECONDS_PER_JOB = 120


@dataclass(frozen=True)
class Job:
    name: str
    """Unique over the suite, e.g. "parallel/dp2"; also the job's directory under the batch root."""
    nproc: int
    kind: str
    args: tuple[str, ...] = ()
    prepare: Callable[[pathlib.Path], tuple[str, ...]] | None = None
    """Run in the pytest process before the launch, with the job's directory: returns more args
    (e.g. writes a Hugging Face model there and returns --model.init-from-hf DIR)."""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"job {self.name}: kind {self.kind!r} is not one of {KINDS}")


def jobs(argname: str, table: dict[str, Job]):
    """``pytest.mark.parametrize(argname, table)`` with each case marked by its job, ids unchanged."""
    return pytest.mark.parametrize(argname, [pytest.param(name, marks=pytest.mark.job(job), id=str(name))
                                             for name, job in table.items()])


def selected_jobs(items) -> dict[str, Job]:
    found: dict[str, Job] = {}
    for item in items:
        for mark in item.iter_markers("job"):
            job = mark.args[0]
            if found.setdefault(job.name, job) != job:
                raise ValueError(f"two different jobs are named {job.name!r}")
    return found


class Batches:
    def __init__(self, jobs: dict[str, Job], root: pathlib.Path):
        self.pending = dict(jobs)
        self.root = root
        self.errors: dict[str, str] = {}

    def result(self, job: Job) -> pathlib.Path:
        """The job's directory, once it has run (with every pending job of its world size)."""
        directory = self.root / job.name
        if not (directory / "done").exists() and job.name not in self.errors:
            self.pending.setdefault(job.name, job)
            self._run([j for j in self.pending.values() if j.nproc == job.nproc])
        if job.name in self.errors:
            pytest.fail(f"job {job.name} on {job.nproc} ranks failed:\n{self.errors[job.name]}", pytrace=False)
        return directory

    def _run(self, batch: list[Job]) -> None:
        for job in batch:
            self.pending.pop(job.name)
            directory = self.root / job.name
            directory.mkdir(parents=True, exist_ok=True)
        specs = []
        for job in batch:
            directory = self.root / job.name
            extra = job.prepare(directory) if job.prepare else ()
            specs.append({"name": job.name, "kind": job.kind, "dir": str(directory), "args": [*job.args, *extra]})
        while specs:
            spec_file = self.root / f"batch-{re.sub(r'[^A-Za-z0-9]+', '_', specs[0]['name'])}.json"
            spec_file.write_text(json.dumps(specs, indent=1))
            try:
                proc = torchrun(batch[0].nproc, ["tests/batch_worker.py", str(spec_file)],
                                timeout=60 + SECONDS_PER_JOB * len(specs))
                failure = proc.stdout[-3000:] + proc.stderr[-6000:] if proc.returncode else ""
            except Exception as e:  # a hung batch: subprocess.TimeoutExpired
                failure = f"{type(e).__name__}: {e}"
            unfinished = [s for s in specs if not (pathlib.Path(s["dir"]) / "done").exists()]
            if not unfinished:
                return
            # The first unfinished job is the one that failed (or hung); the rest run again.
            self.errors[unfinished[0]["name"]] = failure or "the batch ended before this job was done"
            specs = unfinished[1:]
