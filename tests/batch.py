"""Multi-rank jobs run in batches: one ``torchrun`` launch per world size runs every selected job of
that size in turn, on one process group, and each test reads its own job's result.

Most of a small multi-rank test's time is the launch (torchrun, then torch imported on every rank,
then the process group), not its few tiny steps; a batch pays it once per world size. Tests name
their jobs with ``@pytest.mark.job(Job(...), ...)`` (or ``jobs(...)`` inside a parametrisation), the
``batches`` fixture runs the jobs of every collected test lazily, and ``batches.result(job)``
returns the job's output directory. A job that fails fails its own test only: the batch is
relaunched with the jobs after it. A job may need others first (``after``: e.g. a resume needs the
run that wrote the checkpoint); ``{jobs}`` in its args is the directory holding every job's.
"""

from __future__ import annotations

import json
import pathlib
import re
from dataclasses import dataclass
from typing import Callable

import pytest

from tests.conftest import torchrun

KINDS = tuple(sorted(p.stem for p in (pathlib.Path(__file__).parent / "workers").glob("*.py") if p.stem != "__init__"))
"""What a job does on every rank: tests/workers/<kind>.py, one file a kind."""

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
    after: tuple["Job", ...] = ()
    """Jobs that must be done first (any world size); a job of the same world size may run earlier in
    the same launch."""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"job {self.name}: kind {self.kind!r} is not one of {KINDS}")


def jobs(argname: str, table: dict[str, Job]):
    """``pytest.mark.parametrize(argname, table)`` with each case marked by its job, ids unchanged."""
    return pytest.mark.parametrize(argname, [pytest.param(name, marks=pytest.mark.job(job), id=str(name))
                                             for name, job in table.items()])


def selected_jobs(items) -> dict[str, Job]:
    """The jobs of these tests and the jobs they need, each after what it needs."""
    found: dict[str, Job] = {}

    def add(job: Job) -> None:
        for dependency in job.after:
            add(dependency)
        if found.setdefault(job.name, job) != job:
            raise ValueError(f"two different jobs are named {job.name!r}")

    for item in items:
        for mark in item.iter_markers("job"):
            for job in mark.args:
                add(job)
    return found


class Batches:
    def __init__(self, jobs: dict[str, Job], root: pathlib.Path):
        self.pending = dict(jobs)
        self.root = root
        self.errors: dict[str, str] = {}
        self._starting: set[int] = set()

    def result(self, job: Job) -> pathlib.Path:
        """The job's directory, once it has run (with every pending job of its world size)."""
        for dependency in job.after:
            self.result(dependency)
        self._complete(job)
        if job.name in self.errors:
            pytest.fail(f"job {job.name} on {job.nproc} ranks failed:\n{self.errors[job.name]}", pytrace=False)
        if not self._done(job):
            raise RuntimeError(f"tests/batch.py: job {job.name} was never run")
        return self.root / job.name

    def _complete(self, job: Job) -> None:
        """Runs the job, after what it needs, unless it is done or failed."""
        for dependency in job.after:
            self._complete(dependency)
        if not self._done(job) and job.name not in self.errors:
            self.pending.setdefault(job.name, job)
            self._launch(job.nproc)

    def _launch(self, nproc: int) -> None:
        """One launch of the pending jobs of this world size that can run. Their dependencies of other
        sizes run first, so that a resume joins this launch instead of needing one of its own; a
        dependency that leads back to this size waits for a later launch (``_starting``)."""
        if nproc in self._starting:
            return
        self._starting.add(nproc)
        try:
            for job in [j for j in self.pending.values() if j.nproc == nproc]:
                for dependency in job.after:
                    if dependency.nproc not in self._starting:
                        self._complete(dependency)
        finally:
            self._starting.discard(nproc)
        self._run(self._ready(nproc))

    def _done(self, job: Job) -> bool:
        return (self.root / job.name / "done").exists()

    def _ready(self, nproc: int) -> list[Job]:
        """The pending jobs of this world size whose dependencies are done or run before them here."""
        ready: list[Job] = []
        for job in self.pending.values():
            if job.nproc == nproc and all(self._done(d) or d in ready for d in job.after):
                ready.append(job)
        return ready

    def _run(self, batch: list[Job]) -> None:
        specs = []
        for job in batch:
            self.pending.pop(job.name)
            directory = self.root / job.name
            directory.mkdir(parents=True, exist_ok=True)
            extra = job.prepare(directory) if job.prepare else ()
            args = [a.replace("{jobs}", str(self.root)) for a in (*job.args, *extra)]
            specs.append({"name": job.name, "kind": job.kind, "dir": str(directory), "args": args})
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
