"""Shared helpers: tiny configs, a torchrun launcher for multi-rank tests, and helpers for tests that
start and watch processes themselves."""

from __future__ import annotations

import contextlib
import os
import pathlib
import re
import signal
import subprocess
import sys
import threading
import time
from typing import Callable

# One intra-op thread for the tests run in this process, before torch is imported: the background
# batches keep the other core busy, and an op split over two threads then waits for a second thread
# that is not scheduled (an in-process test took 93 s in the suite that takes 1.6 s alone).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402

from meshtrain.config import JobConfig
from meshtrain.config_files import from_dict

ROOT = pathlib.Path(__file__).resolve().parents[1]


TINY = {
    "model": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 384},
    "train": {"steps": 5, "global_batch_size": 8, "micro_batch_size": 2, "seq_len": 32},
    "lr_schedule": {"warmup_steps": 2},
    "logging": {"progress": "off", "jsonl": False},
}
"""A model and batch small enough for 8 CPU ranks."""


def tiny_config(**sections) -> JobConfig:
    """TINY as a config; ``sections`` override by section."""
    base = {name: dict(values) for name, values in TINY.items()}
    for name, values in sections.items():
        base.setdefault(name, {}).update(values)
    return from_dict(JobConfig, base)


def tiny_args() -> list[str]:
    """TINY as command-line options, for runs launched through the CLI."""
    return [arg for section, values in TINY.items() for key, value in values.items()
            for arg in (f"--{section.replace('_', '-')}.{key.replace('_', '-')}", str(value))]


def torchrun(nproc: int, args: list[str], timeout: int = 600, env: dict | None = None, niceness: int = 0,
             started: Callable[[subprocess.Popen], None] = lambda proc: None) -> subprocess.CompletedProcess:
    """Run ``args`` (a script or ``-m module`` and its options) on ``nproc`` CPU ranks, at ``niceness``
    (the background batches yield the CPU to the test running in the foreground). ``started`` is
    handed the launcher's process (the batch runner keeps it to stop it at the end of the session)."""
    # PYTHONFAULTHANDLER: a rank that dies of SIGSEGV/SIGABRT prints its Python stack (a rare native crash in the
    # 4-rank batch gave only "Signal 11 received")
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1",
                "PYTHONPATH": str(ROOT), **(env or {})}
    full_env.pop("MESHTRAIN_DEVICE", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]
    proc = run_in_own_session(cmd, full_env, timeout, niceness, started)
    if proc.returncode:
        # Tests print the tail of stderr; the rank that failed first is often far above it.
        causes = [line for line in proc.stderr.splitlines()
                  if re.search(r"terminate called|what\(\)|\w+(Error|Exception):|enforce fail|Fatal Python error", line)]
        proc.stderr += "\n--- error lines of every rank, in order ---\n" + "\n".join(causes[:30])
    return proc


def run_in_own_session(cmd: list[str], env: dict, timeout: float, niceness: int = 0,
                       started: Callable[[subprocess.Popen], None] = lambda proc: None) -> subprocess.CompletedProcess:
    """``cmd`` from the repository root in a session of its own, so that a timeout (or the end of the
    test session, through ``started``'s handle) stops every process it started, not only the first."""
    if niceness:
        cmd = ["nice", "-n", str(niceness), *cmd]  # not preexec_fn: batches launch from a second thread
    with subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as launcher:
        if niceness:
            nice_session(launcher.pid, niceness)
        started(launcher)
        try:
            stdout, stderr = launcher.communicate(timeout=timeout)
        except BaseException:
            stop_group(launcher)
            raise
    return subprocess.CompletedProcess(cmd, launcher.returncode, stdout, stderr)


def nice_session(leader: int, niceness: int) -> None:
    """Niceness for a whole session. Under the kernel's autogroup scheduling (on here:
    /proc/sys/kernel/sched_autogroup_enabled), every session is a group that shares the CPU with the
    other sessions as one nice-0 task, whatever the nice values of its processes, so a niced session
    of its own took a third of the cores beside two others. The group's own nice
    (/proc/PID/autogroup) is what counts; kernels without autogroup have no such file."""
    with contextlib.suppress(OSError):
        pathlib.Path(f"/proc/{leader}/autogroup").write_text(str(niceness))


def stop_group(launcher: subprocess.Popen) -> None:
    """Kill a launcher started in a session of its own, with every rank it started."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(launcher.pid, signal.SIGKILL)
    launcher.wait()


def env(**extra) -> dict:
    """The environment of a process a test launches through launch/ (not torchrun())."""
    return {**os.environ, "MESHTRAIN_PYTHON": sys.executable, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
            "PYTHONUNBUFFERED": "1",
            **{k: str(v) for k, v in extra.items()}}


def pid_of_rank(rank: int, run_id: str) -> int | None:
    """The pid of a rank started with HANG_TEST_ID=run_id in its environment, if it is running."""
    for proc in pathlib.Path("/proc").iterdir():
        try:
            environ = (proc / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if f"RANK={rank}".encode() in environ and f"HANG_TEST_ID={run_id}".encode() in environ:
            return int(proc.name)
    return None


def drain(stream, lines: list) -> threading.Thread:
    """Collect a pipe's lines with their arrival time, so neither pipe fills while the test waits."""
    def read():
        for line in stream:
            lines.append((time.monotonic(), line))
    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread


@pytest.fixture
def run_dir(tmp_path):
    return str(tmp_path / "run")


def pytest_configure(config):
    config.addinivalue_line("markers", "job(job): the multi-rank batch job (tests/batch.py) this test reads")


_SELECTED_JOBS = pytest.StashKey[dict]()


@pytest.hookimpl(trylast=True)  # after -k / -m deselection: only the selected tests' jobs run
def pytest_collection_modifyitems(config, items):
    """Keeps the selected tests' jobs, and orders the tests so the two cores stay busy: while the
    batches run in the background (tests/batch.py), first the one-process tests, then the slow
    ones that launch processes of their own (they fill both cores once the batches end), and last
    those that read a job. Each group keeps its order."""
    from tests.batch import selected_jobs

    config.stash[_SELECTED_JOBS] = selected_jobs(items)
    items.sort(key=lambda item: (item.get_closest_marker("job") is not None, item.get_closest_marker("slow") is not None))


@pytest.fixture(scope="session", autouse=True)
def batches(request, tmp_path_factory):
    """Runs the collected tests' multi-rank jobs, one torchrun launch per world size, in the background
    from the session's start (tests/batch.py)."""
    from tests.batch import Batches

    runner = Batches(request.config.stash.get(_SELECTED_JOBS, {}), tmp_path_factory.mktemp("jobs"))
    request.config.stash[_BATCHES] = runner
    runner.start()
    yield runner
    runner.stop()


_BATCHES = pytest.StashKey["Batches"]()


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """When the background batches launched and ended, beside the foreground (docs/tests.md)."""
    runner = config.stash.get(_BATCHES, None)
    if runner is not None and runner.timeline:
        terminalreporter.write_sep("-", "batches (from the session's start)")
        for line in runner.timeline:
            terminalreporter.write_line(line)
        costs = runner.job_costs()
        if costs:
            total = sum(cpu for _, cpu, _ in costs)
            terminalreporter.write_line(f"{len(costs)} jobs, {total:.0f} CPU-s over their ranks; the costliest:")
            for name, cpu, seconds in sorted(costs, key=lambda c: -c[1])[:8]:
                terminalreporter.write_line(f"  {cpu:6.1f} CPU-s  {seconds:5.1f} s  {name}")
