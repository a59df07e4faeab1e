"""Process-group set-up from the environment: device and backend are never hard-coded.

torchrun (or Slurm through launch/) sets RANK, WORLD_SIZE, LOCAL_RANK and the rendezvous address;
a plain ``python -m meshtrain`` is a world of one. The device is CUDA when present, else CPU, and
the backend is torch's default for that device (nccl / gloo); MESHTRAIN_DEVICE overrides it.
"""

from __future__ import annotations

import datetime
import logging
import os
import sys
from dataclasses import dataclass
from typing import NoReturn

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Runtime:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def device_type_from_env() -> str:
    return os.environ.get("MESHTRAIN_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def die_with_launcher() -> None:
    """Make this rank end when the process that started it does (Linux's parent-death signal).

    A launcher killed with SIGKILL (or a lost login shell) cannot stop its ranks; without this they
    would train on as orphans, and their checkpoint clean-up would race a rerun in the same run dir.
    Only for ranks a launcher started (torchrun and srun set LOCAL_RANK / SLURM_PROCID): a
    ``python -m meshtrain`` from a shell is its own job.
    """
    if not sys.platform.startswith("linux") or not ({"LOCAL_RANK", "SLURM_PROCID"} & os.environ.keys()):
        return
    import ctypes
    import signal

    PR_SET_PDEATHSIG = 1
    launcher = os.getppid()  # not "ppid == 1": in a container the launcher itself may be pid 1
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        return  # not fatal: the run-dir lock still keeps a rerun away from an orphan
    if os.getppid() != launcher:  # the launcher died before the signal was armed
        os._exit(1)


def init_distributed(timeout_s: int, flight_recorder: int = 0) -> Runtime:
    """This rank's process group, with ``timeout_s`` and the flight recorder keeping the last
    ``flight_recorder`` collectives of each group."""
    from meshtrain.telemetry import flight_recorder as recorder

    die_with_launcher()
    recorder.arm(flight_recorder)
    device_type = device_type_from_env()
    rank, world, local_rank = (int(os.environ.get(k, d)) for k, d in
                               (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")))
    device = torch.device(device_type, local_rank) if device_type != "cpu" else torch.device("cpu")
    if device_type != "cpu":
        torch.accelerator.set_device_index(local_rank)
    if not dist.is_initialized():
        backend = dist.Backend.default_device_backend_map[device_type]
        timeout = datetime.timedelta(seconds=timeout_s)
        if "MASTER_ADDR" in os.environ:
            dist.init_process_group(backend, timeout=timeout, device_id=device if device_type != "cpu" else None)
        else:  # a world of one without a launcher
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return Runtime(rank, world, local_rank, device)


def shutdown(synchronize: bool = False) -> None:
    """Tear the process group down; ``synchronize`` first waits (bounded by the group timeout) for
    every rank to finish.

    On success all ranks must reach destroy_process_group together: a rank that tears gloo down
    while a peer still has a collective in flight with it can abort in gloo's destructor
    ("terminate called without an active exception", seen in CI with 4-rank convert). After an
    error a barrier could wait on a dead peer, so the error path destroys at once.
    """
    if not dist.is_initialized():
        return
    if synchronize and dist.get_world_size() > 1:
        try:
            dist.barrier()
        except Exception:  # a peer died after our work finished: nothing to save, still tear down
            pass
    dist.destroy_process_group()
    global _torn_down
    _torn_down = True


_torn_down = False


def release_groups() -> None:
    """Destroy every process group but the world's, so that a process running job after job on one
    process group (the test batches) holds a bounded number of them: each DeviceMesh dim and each
    flattened dim is a group, and each gloo group keeps 3 threads alive until it is freed.

    Every rank calls it between jobs, when no collective is in flight. DTensor's mesh caches are
    emptied first: they would otherwise keep the job's meshes (and groups) alive and hand a later
    job's equal mesh the destroyed groups.
    """
    import gc

    from meshtrain.parallel._torch_private import clear_dtensor_mesh_caches, subgroups

    clear_dtensor_mesh_caches()
    for group in subgroups():
        dist.destroy_process_group(group)
    gc.collect()  # the groups' threads end when the last mesh holding them is freed


def exit_process(code: int) -> NoReturn:
    """End a program that used a process group, skipping interpreter finalisation once it is torn down.

    Checked with torch 2.13 + gloo: after a clean barrier + destroy_process_group a rank still
    aborts now and then at interpreter exit ("terminate called without an active exception",
    SIGABRT; about 1 run in 100 on a loaded CPU box), when the C++ statics holding gloo's worker
    threads and pending functional-collective work are destroyed (pytorch PR #179291 describes the
    same race). Nothing is left to finalise by then: our files are closed, so flush and _exit.
    """
    if not _torn_down:
        sys.exit(code)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# What gloo and NCCL raise when a peer is gone or silent (gloo raises plain RuntimeErrors).
_PEER_FAILURE = ("Timed out", "timed out", "Connection closed by peer", "Connection reset by peer", "NCCL")


def is_collective_failure(error: BaseException) -> bool:
    return isinstance(error, dist.DistError) or (
        isinstance(error, RuntimeError) and any(s in str(error) for s in _PEER_FAILURE))


def collective_error(error: BaseException, timeout_s: int, record: tuple | None = None) -> "CollectiveError":
    """The error a rank raises when a collective fails; ``record``: (path, last collective) from
    ``telemetry.flight_recorder.write``."""
    from meshtrain.errors import CollectiveError

    detail = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    seen = (f" This rank's last collective: {record[1]}; its recent ones are in {record[0]} (compare the "
            "ranks' files: the rank whose sequence numbers stop short is the one to look at).") if record else ""
    return CollectiveError(
        f"a collective did not complete ({detail}): another rank has died or hangs, and its own output says "
        f"why; parallel.timeout_s={timeout_s} bounds how long the others wait.{seen} Fix: look at the first "
        "failing rank's log, or raise parallel.timeout_s if one step legitimately takes longer")
