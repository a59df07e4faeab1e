"""Shared helpers: tiny configs and a torchrun launcher for multi-rank tests."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

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


def torchrun(nproc: int, args: list[str], timeout: int = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``args`` (a script or ``-m module`` and its options) on ``nproc`` CPU ranks."""
    # PYTHONFAULTHANDLER: a rank that dies of SIGSEGV/SIGABRT prints its Python stack (a rare native crash in the
    # 4-rank batch gave only "Signal 11 received")
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1",
                "PYTHONPATH": str(ROOT), **(env or {})}
    full_env.pop("MESHTRAIN_DEVICE", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode:
        # Tests print the tail of stderr; the rank that failed first is often far above it.
        causes = [line for line in proc.stderr.splitlines()
                  if re.search(r"terminate called|what\(\)|\w+(Error|Exception):|enforce fail", line)]
        proc.stderr += "\n--- error lines of every rank, in order ---\n" + "\n".join(causes[:30])
    return proc


@pytest.fixture
def run_dir(tmp_path):
    return str(tmp_path / "run")


def pytest_configure(config):
    config.addinivalue_line("markers", "job(job): the multi-rank batch job (tests/batch.py) this test reads")


_SELECTED_JOBS = pytest.StashKey[dict]()


@pytest.hookimpl(trylast=True)  # after -k / -m deselection: only the selected tests' jobs run
def pytest_collection_modifyitems(config, items):
    from tests.batch import selected_jobs

    config.stash[_SELECTED_JOBS] = selected_jobs(items)


@pytest.fixture(scope="session")
def batches(request, tmp_path_factory):
    """Runs the collected tests' multi-rank jobs, one torchrun launch per world size (tests/batch.py)."""
    from tests.batch import Batches

    return Batches(request.config.stash.get(_SELECTED_JOBS, {}), tmp_path_factory.mktemp("jobs"))
