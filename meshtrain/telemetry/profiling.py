"""Looking inside steps: torch.profiler traces, CUDA memory snapshots, and a per-phase step clock.

Traces cover a window of steps (profiling.trace_wait / trace_warmup / trace_active) and are written
per rank as Chrome trace JSON under run_dir/profile/ (Perfetto and chrome://tracing open them).
Memory snapshots (CUDA only) go to run_dir/memory/ after the chosen steps and on an out-of-memory
error. The phase clock splits a step's wall time into data wait, forward+backward, optimizer and
checkpoint; it synchronizes the device at each phase end, so it runs only on the steps it reports.
"""

from __future__ import annotations

import contextlib
import pathlib
import time

import torch

from meshtrain.config import ProfilingConfig
from meshtrain.parallel._torch_private import dump_cuda_memory_snapshot, record_cuda_memory_history

PHASES = ("data", "forward_backward", "optimizer", "eval", "checkpoint")


def trace_path(run_dir: pathlib.Path, rank: int) -> pathlib.Path:
    return run_dir / "profile" / f"rank{rank}.json"


def trace_window(cfg: ProfilingConfig, run_dir: pathlib.Path, rank: int, device: torch.device):
    """A torch.profiler over the configured window (call ``.step()`` after each training step), or
    a no-op context when tracing is off."""
    if not cfg.trace:
        return contextlib.nullcontext(None)
    from torch.profiler import ProfilerActivity, profile, schedule

    path = trace_path(run_dir, rank)

    def export(prof) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(path))

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    return profile(activities=activities, on_trace_ready=export,
                   schedule=schedule(wait=cfg.trace_wait, warmup=cfg.trace_warmup, active=cfg.trace_active, repeat=1))


class MemorySnapshots:
    """CUDA memory history, dumped after the chosen steps and on out-of-memory."""

    def __init__(self, cfg: ProfilingConfig, run_dir: pathlib.Path, rank: int, device: torch.device):
        self.steps, self.dir, self.rank = set(cfg.memory_snapshot_steps), run_dir / "memory", rank
        self.enabled = bool(self.steps) and device.type == "cuda"
        if self.enabled:
            record_cuda_memory_history(max_entries=100_000)

    def dump(self, label: str) -> pathlib.Path | None:
        if not self.enabled:
            return None
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / f"rank{self.rank}_{label}.pickle"
        dump_cuda_memory_snapshot(str(path))
        return path

    def after_step(self, step: int) -> pathlib.Path | None:
        return self.dump(f"step{step}") if step in self.steps else None


class PhaseClock:
    """Seconds per phase of one step; ``mark(phase)`` ends ``phase`` (a no-op when off)."""

    def __init__(self, device: torch.device):
        self.device, self.enabled = device, False
        self.seconds: dict[str, float] = {}
        self._last = 0.0

    def start(self, enabled: bool) -> None:
        self.enabled, self.seconds = enabled, {}
        self._last = time.perf_counter()

    def mark(self, phase: str) -> None:
        if not self.enabled:
            return
        if self.device.type == "cuda":  # the phase's kernels, not just their launch
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self._last
        self._last = now


def format_phases(step: int, seconds: dict[str, float]) -> str:
    total = sum(seconds.values()) or 1e-12
    parts = [f"{p.replace('_', '+')} {1e3 * seconds[p]:.1f} ms ({100 * seconds[p] / total:.0f}%)"
             for p in PHASES if p in seconds]
    return f"step {step} phases: " + ", ".join(parts)
