"""Multi-rank jobs run in batches: one ``torchrun`` launch per world size runs every selected job of
that size in turn, on one process group, and each test reads its own job's result.

Most of a small multi-rank test's time is the launch (torchrun, then torch imported on every rank,
then the process group), not its few tiny steps; a batch pays it once per world size. Tests name
their jobs with ``@pytest.mark.job(Job(...), ...)`` (or ``jobs(...)`` inside a parametrisation).
The session's ``batches`` fixture starts every selected job at once, in a background thread, and
conftest runs the tests that read jobs last: the batches' ranks (which spend much of their time
waiting on each other's collectives) share the two cores with the single-process tests instead of
running after them. ``batches.result(job)`` waits for the job and returns its output directory.

A job that fails fails its own test only: the batch is relaunched with the jobs after it. A job may
need others first (``after``: e.g. a resume needs the run that wrote the checkpoint); ``{jobs}`` in
its args is the directory holding every job's.
"""

from __future__ import annotations

import json
import pathlib
import re
import subprocess
import threading
import traceback
from dataclasses import dataclass
from typing import Callable

import pytest

from tests.conftest import torchrun_process, with_error_lines

KINDS = ("train", "train_command", "hf", "mesh", "ring_attention", "allocation")
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
        self.jobs = dict(jobs)
        self.root = root
        self.errors: dict[str, str] = {}
        self._specs: dict[str, dict] = {}
        self._changed = threading.Condition()
        self._thread: threading.Thread | None = None
        self._process: subprocess.Popen | None = None
        self._stopping = False
        self._crash = ""

    def start(self) -> None:
        """Prepare every job here (``prepare`` callbacks seed torch's global RNG, which the tests in
        this thread use too), then run them all in a background thread."""
        for job in self.jobs.values():
            directory = self.root / job.name
            directory.mkdir(parents=True, exist_ok=True)
            extra = job.prepare(directory) if job.prepare else ()
            args = [a.replace("{jobs}", str(self.root)) for a in (*job.args, *extra)]
            self._specs[job.name] = {"name": job.name, "kind": job.kind, "dir": str(directory), "args": args}
        if self.jobs:
            self._thread = threading.Thread(target=self._run_all, name="multi-rank batches", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """End the session's batches (all done, or the session was cut short)."""
        self._stopping = True
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
        if self._thread is not None:
            self._thread.join(timeout=60)

    def result(self, job: Job) -> pathlib.Path:
        """The job's directory, once it has run."""
        with self._changed:
            # done files appear while their launch still runs: look again every second
            while not (self._done(job) or job.name in self.errors or self._thread is None
                       or not self._thread.is_alive()):
                self._changed.wait(timeout=1.0)
        if job.name in self.errors:
            pytest.fail(f"job {job.name} on {job.nproc} ranks failed:\n{self.errors[job.name]}", pytrace=False)
        if not self._done(job):
            pytest.fail(f"job {job.name} was not run: it was not selected, or the batches stopped\n{self._crash}",
                        pytrace=False)
        return self.root / job.name

    def _done(self, job: Job) -> bool:
        return (self.root / job.name / "done").exists()

    def _run_all(self) -> None:
        """Launch after launch until every job has run or failed: each time the smallest world size
        whose pending jobs can all run now (their dependencies done, or earlier in the same launch),
        else the smallest with any that can."""
        pending = dict(self.jobs)
        try:
            while pending and not self._stopping:
                for job in list(pending.values()):
                    failed = [d.name for d in job.after if d.name in self.errors]
                    if failed:
                        self._fail(job.name, f"it needs job {failed[0]}, which failed")
                        del pending[job.name]
                ready = {n: self._ready(pending, n) for n in sorted({j.nproc for j in pending.values()})}
                complete = [n for n, jobs in ready.items() if len(jobs) == sum(j.nproc == n for j in pending.values())]
                runnable = complete or [n for n, jobs in ready.items() if jobs]
                if not runnable:  # a dependency cycle or a dependency nobody selected
                    for name in pending:
                        self._fail(name, "its dependencies can never run")
                    return
                batch = ready[runnable[0]]
                for job in batch:
                    del pending[job.name]
                self._launch([self._specs[job.name] for job in batch], batch[0].nproc)
        except BaseException:
            self._crash = traceback.format_exc()
            raise
        finally:
            with self._changed:
                self._changed.notify_all()

    def _ready(self, pending: dict[str, Job], nproc: int) -> list[Job]:
        """The pending jobs of this world size whose dependencies are done or run before them here."""
        ready: list[Job] = []
        for job in pending.values():
            if job.nproc == nproc and all(self._done(d) or d in ready for d in job.after):
                ready.append(job)
        return ready

    def _fail(self, name: str, why: str) -> None:
        with self._changed:
            self.errors[name] = why
            self._changed.notify_all()

    def _launch(self, specs: list[dict], nproc: int) -> None:
        while specs and not self._stopping:
            spec_file = self.root / f"batch-{re.sub(r'[^A-Za-z0-9]+', '_', specs[0]['name'])}.json"
            spec_file.write_text(json.dumps(specs, indent=1))
            self._process = torchrun_process(nproc, ["tests/batch_worker.py", str(spec_file)])
            try:
                out, err = self._process.communicate(timeout=60 + SECONDS_PER_JOB * len(specs))
                failure = out[-3000:] + with_error_lines(err)[-6000:] if self._process.returncode else ""
            except subprocess.TimeoutExpired as e:  # a hung batch
                self._process.kill()
                self._process.communicate()
                failure = f"TimeoutExpired: {e}"
            unfinished = [s for s in specs if not (pathlib.Path(s["dir"]) / "done").exists()]
            with self._changed:
                self._changed.notify_all()
            if not unfinished:
                return
            # The first unfinished job is the one that failed (or hung); the rest run again.
            self._fail(unfinished[0]["name"], failure or "the batch ended before this job was done")
            specs = unfinished[1:]
