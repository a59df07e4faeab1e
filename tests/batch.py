"""Multi-rank jobs run in batches: one ``torchrun`` launch per world size runs every selected job of
that size in turn, on one process group, and each test reads its own job's result.

Most of a small multi-rank test's time is the launch (torchrun, then torch imported on every rank,
then the process group), not its few tiny steps; a batch pays it once per world size. Tests name
their jobs with ``@pytest.mark.job(Job(...), ...)`` (or ``jobs(...)`` inside a parametrisation), the
``batches`` fixture runs the jobs of every collected test lazily, and ``batches.result(job)``
returns the job's output directory. A job that fails fails its own test only: the batch is
relaunched with the jobs after it. A job may need others first (``after``: e.g. a resume needs the
run that wrote the checkpoint); ``{jobs}`` in its args is the directory holding every job's.

The batches start in a background thread as the session starts (``Batches.start``), niced, and
conftest runs the tests that read no job first: those are mostly one process on one core, so the
batches' ranks get the machine's other cores instead of waiting for their turn. Jobs of the kind
``command`` (a benchmark at toy sizes: a process tree of its own, not a rank of a batch) run niced
one after another in a second background thread beside the batches, so the three kinds of work
fill both cores until the end.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Callable

import pytest

from tests.conftest import ROOT, run_in_own_session, stop_group, torchrun

COMMAND = "command"
"""A job that is a process of its own: its args (and what its prepare returns) are the command line,
run from the repository root; the test reads ``command_result(batches.result(job))``."""
KINDS = tuple(sorted(p.stem for p in (pathlib.Path(__file__).parent / "workers").glob("*.py") if p.stem != "__init__"))
"""What a job does on every rank: tests/workers/<kind>.py, one file a kind (or COMMAND)."""
SECONDS_PER_COMMAND = 900

SECONDS_PER_JOB = 120
BACKGROUND_NICENESS = 19
"""The batches run niced: the test in the foreground (the session's critical path) gets its cores
whenever it needs them, and the batches' ranks take every cycle left. Each batch is a session of its
own, so the nice value is set on the session's autogroup too (conftest.nice_session): with only the
processes niced, the foreground's multi-rank launches, whose ranks wait on each other in every
collective, ran 3-5x slower than alone (two local "nodes": 76 s in the suite, 16 s alone)."""
COMMAND_NICENESS = 10
"""The command jobs run one after another, so their chain must not be the session's last: at the
batches' nice it ended 50 s after them (gpu_check alone took 608 s of wall time for ~58 CPU-s). At
nice 10 (an autogroup weight 7x the batches') they take most of the background's share and end early,
and the batches, whose 8-rank launches fill both cores, end the session."""


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
        if self.kind not in (*KINDS, COMMAND):
            raise ValueError(f"job {self.name}: kind {self.kind!r} is not one of {KINDS} or {COMMAND!r}")


def command_result(directory: pathlib.Path) -> subprocess.CompletedProcess:
    """A command job's exit status and output."""
    record = json.loads((directory / "command.json").read_text())
    return subprocess.CompletedProcess(record["args"], record["returncode"], record["stdout"], record["stderr"])


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
        self._extra_args: dict[str, tuple[str, ...]] = {}
        self._launching = threading.Lock()
        """Held for each launch, by the background thread or by a test that needs a job it has not run."""
        self._launcher: subprocess.Popen | None = None
        self._stopped = False
        self._thread: threading.Thread | None = None
        self._commands: list[Job] = [job for job in jobs.values() if job.kind == COMMAND]
        self._commanding = threading.Lock()
        """Held for each command job, by the second background thread or by a test that needs it now."""
        self._command: subprocess.Popen | None = None
        self._command_thread: threading.Thread | None = None
        self._t0 = time.monotonic()
        self.timeline: list[str] = []
        """What the batches did when, for the session's summary (where the suite's time goes)."""

    def start(self) -> None:
        """Prepare every job here, then launch the batches of every world size in a background thread.
        Jobs are prepared first, in this thread: a prepare builds models with torch's global RNG,
        which the tests running meanwhile use too."""
        for job in list(self.pending.values()):
            try:
                self._prepare(job)
            except Exception:  # fails the job's test, not the session
                self.errors[job.name] = f"its prepare failed:\n{traceback.format_exc()}"
                self.pending.pop(job.name)
        for job in self._commands:
            self.pending.pop(job.name, None)
        sizes = list(dict.fromkeys(job.nproc for job in self.pending.values()))
        self._thread = threading.Thread(target=self._launch_all, args=(sizes,), name="batches", daemon=True)
        self._thread.start()
        self._command_thread = threading.Thread(target=self._run_commands, name="commands", daemon=True)
        self._command_thread.start()

    def stop(self) -> None:
        """End the session's batches: the launch in progress is killed with its ranks."""
        self._stopped = True  # before reading the launcher: _started reads them the other way round
        for process in (self._launcher, self._command):
            if process is not None:
                stop_group(process)
        for thread in (self._thread, self._command_thread):
            if thread is not None:
                thread.join(timeout=60)

    def _launch_all(self, sizes: list[int]) -> None:
        for nproc in sizes:
            with self._launching:
                if self._stopped:
                    return
                self._launch(nproc)

    def job_costs(self) -> list[tuple[str, float, float]]:
        """(job, CPU seconds over its ranks, wall seconds) of every job that ran (tests/batch_worker.py)."""
        costs = []
        for done in self.root.glob("**/done"):
            record = json.loads(done.read_text() or "{}")
            if "cpu_seconds" in record:
                costs.append((str(done.parent.relative_to(self.root)), record["cpu_seconds"], record["seconds"]))
        return costs

    def _note(self, event: str) -> None:
        self.timeline.append(f"+{time.monotonic() - self._t0:.0f}s {event}")

    def _run_commands(self) -> None:
        for job in self._commands:
            with self._commanding:
                if self._stopped:
                    return
                if not self._done(job) and job.name not in self.errors:
                    self._run_command(job)

    def _commands_left(self) -> list[Job]:
        """The command jobs the commands' thread has yet to run (none once it has ended)."""
        alive = self._command_thread is not None and self._command_thread.is_alive()
        return [j for j in self._commands if alive and not self._done(j) and j.name not in self.errors]

    def _run_command(self, job: Job) -> None:
        directory = self.root / job.name
        args = [*job.args, *self._prepare(job)]
        self._note(f"command {job.name}")
        started = time.monotonic()
        try:
            proc = run_in_own_session(args, {**os.environ, "PYTHONPATH": str(ROOT)}, SECONDS_PER_COMMAND,
                                      COMMAND_NICENESS, started=self._command_started)
        except Exception as e:  # a hung command: subprocess.TimeoutExpired
            self.errors[job.name] = f"{type(e).__name__}: {e}"
            return
        finally:
            self._command = None
        (directory / "command.json").write_text(json.dumps(
            {"args": args, "returncode": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr}))
        (directory / "done").write_text(json.dumps({"seconds": round(time.monotonic() - started, 2)}))
        self._note(f"  ended ({job.name}, {time.monotonic() - started:.0f} s)")

    def _command_started(self, process: subprocess.Popen) -> None:
        self._command = process
        if self._stopped:
            stop_group(process)

    def result(self, job: Job) -> pathlib.Path:
        """The job's directory, once it has run (with every pending job of its world size)."""
        if not any("first job read" in line for line in self.timeline):
            self._note(f"first job read ({job.name})")
        if job.kind == COMMAND:
            while not self._done(job) and job.name not in self.errors:
                with self._commanding:  # the commands' thread may be running it (or another one)
                    if not self._done(job) and job.name not in self.errors and (
                            self._stopped or job not in self._commands_left()):
                        self._run_command(job)  # not queued (a single test run): run it here
                time.sleep(0.2)
            if job.name in self.errors:
                pytest.fail(f"command job {job.name} failed: {self.errors[job.name]}", pytrace=False)
            return self.root / job.name
        for dependency in job.after:
            self.result(dependency)
        with self._launching:  # a launch in progress may be running it
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

    def _prepare(self, job: Job) -> tuple[str, ...]:
        """The job's directory made, and the args its ``prepare`` adds (run once)."""
        if job.name not in self._extra_args:
            directory = self.root / job.name
            directory.mkdir(parents=True, exist_ok=True)
            self._extra_args[job.name] = tuple(job.prepare(directory)) if job.prepare else ()
        return self._extra_args[job.name]

    def _started(self, launcher: subprocess.Popen) -> None:
        self._launcher = launcher
        if self._stopped:
            stop_group(launcher)

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
            args = [a.replace("{jobs}", str(self.root)) for a in (*job.args, *self._prepare(job))]
            specs.append({"name": job.name, "kind": job.kind, "dir": str(self.root / job.name), "args": args})
        while specs:
            spec_file = self.root / f"batch-{re.sub(r'[^A-Za-z0-9]+', '_', specs[0]['name'])}.json"
            spec_file.write_text(json.dumps(specs, indent=1))
            self._note(f"launch of {len(specs)} job(s) on {batch[0].nproc} ranks")
            try:
                proc = torchrun(batch[0].nproc, ["tests/batch_worker.py", str(spec_file)],
                                timeout=60 + SECONDS_PER_JOB * len(specs), niceness=BACKGROUND_NICENESS,
                                started=self._started)
                log = spec_file.with_suffix(".log")
                log.write_text(proc.stdout + proc.stderr)  # every rank's whole output, for a post-mortem
                failure = (proc.stdout[-3000:] + proc.stderr[-6000:] + f"\n(every rank's output: {log})"
                           if proc.returncode else "")
            except Exception as e:  # a hung batch: subprocess.TimeoutExpired
                failure = f"{type(e).__name__}: {e}"
            finally:
                self._launcher = None
            self._note(f"  ended ({batch[0].nproc} ranks{', a job failed' if failure else ''})")
            if self._stopped:
                return
            unfinished = [s for s in specs if not (pathlib.Path(s["dir"]) / "done").exists()]
            if not unfinished:
                return
            # The first unfinished job is the one that failed (or hung); the rest run again.
            self.errors[unfinished[0]["name"]] = failure or "the batch ended before this job was done"
            specs = unfinished[1:]
