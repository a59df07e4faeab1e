"""The run directory: checked writable before any work, and held by one job at a time.

A job writes its config, metrics and checkpoints under ``train.run_dir`` (checkpoints under
``checkpoint.dir`` when set). Both are checked before a process group exists, so a read-only or
missing-permission path is one message from every rank, in the dry run too, instead of a traceback
from the first write. While a job trains, rank 0 holds an exclusive lock on the run dir and on the
checkpoint dir: a second job there would resume from, and its keep-last clean-up delete, the first
one's checkpoints.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import os
import pathlib
import socket
import sys
from typing import Callable, Iterator

from meshtrain.errors import ConfigError, describe_file_error

LOCK_FILE = ".meshtrain.lock"


def checkpoint_dir(cfg) -> pathlib.Path:
    """Where a job's checkpoints go: checkpoint.dir, by default run_dir/checkpoints."""
    return pathlib.Path(cfg.checkpoint.dir or pathlib.Path(cfg.train.run_dir) / "checkpoints")


def check_writable(path: str | pathlib.Path, field: str) -> None:
    """``path`` (a directory, created later if missing) can be written: it, or the nearest existing
    directory above it, must be a writable directory on a writable file system."""
    path = pathlib.Path(path).absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        raise ConfigError(f"{field}={path}: {existing} is a file, not a directory. Fix: point {field} elsewhere")
    if _read_only_file_system(existing):
        raise ConfigError(f"{field}={path}: {existing} is on a read-only file system. "
                          f"Fix: point {field} at a writable file system")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{field}={path}: {existing} is not writable by this user. "
                          f"Fix: make it writable or point {field} at a writable directory")


def _read_only_file_system(directory: pathlib.Path) -> bool:
    # Checked first: it is the cause to name, whoever the user is.
    return bool(os.statvfs(directory).f_flag & os.ST_RDONLY)


def describe_write_error(error: OSError, what: str, path: str | pathlib.Path | None = None) -> str:
    """One line for a failed write, with the path (the error's, else ``path``) and a fix for the usual causes."""
    return f"cannot write {what} {describe_file_error(error, path)}"


@contextlib.contextmanager
def job_lock(run_dir: str | pathlib.Path, checkpoint_dir: str | pathlib.Path | None,
             enabled: bool = True) -> Iterator[None]:
    """Hold the run dir and the checkpoint dir (``checkpoint.dir``, or run_dir/checkpoints: None when
    this job neither writes nor finds checkpoints) for this job, on rank 0 only (``enabled``). Both:
    a job with its own run dir but another job's checkpoint.dir would resume from, and its keep-last
    delete, that job's checkpoints. The locks are the kernel's (flock), so they end with the process,
    even one killed with SIGKILL: no stale lock to clean up."""
    with contextlib.ExitStack() as held:
        if enabled:
            held.enter_context(_hold(pathlib.Path(run_dir), "train.run_dir", "write and delete each other's files"))
            if checkpoint_dir is not None:
                held.enter_context(_hold(pathlib.Path(checkpoint_dir), "checkpoint.dir",
                                         "resume from and delete each other's checkpoints"))
        yield


def _hold(directory: pathlib.Path, field: str, harm: str) -> contextlib.AbstractContextManager[None]:
    directory.mkdir(parents=True, exist_ok=True)
    return held_lock_file(directory / LOCK_FILE, lambda holder: ConfigError(
        f"{field}={directory} is in use by another meshtrain job ({holder}); two jobs there {harm}. Fix: wait "
        f"for that job or stop it, or give this one another {field}"))


@contextlib.contextmanager
def held_lock_file(path: pathlib.Path, refusal: Callable[[str], Exception], *,
                   remove: bool = False) -> Iterator[None]:
    """Hold ``path`` with an exclusive kernel lock (flock, gone with the process, even one killed with
    SIGKILL) and write who holds it there; if another process holds it, raise ``refusal(holder)``.
    ``remove``: delete the file at the end, while still held, so no other process holds it then."""
    with open(path, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            raise refusal(_holder(f.read())) from None
        f.seek(0)
        f.truncate()
        f.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                            "started": datetime.datetime.now().isoformat(timespec="seconds"),
                            "command": " ".join(sys.argv)}) + "\n")
        f.flush()
        try:
            yield
        finally:
            if remove:
                os.unlink(path)
            fcntl.flock(f, fcntl.LOCK_UN)


def _holder(text: str) -> str:
    try:
        h = json.loads(text)
        return f"pid {h['pid']} on {h['host']}, started {h['started']}: {h['command']}"
    except (ValueError, KeyError, TypeError):
        return "its details are not written yet"
