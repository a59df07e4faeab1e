"""User-facing errors.

Anything a user can fix (a config value, a layout, a missing file) raises a subclass of
``MeshtrainError``. The CLI prints its message and exits with status 2 instead of a traceback, and
does the same for an ``OSError`` that names a file (unreadable, missing, a full disk:
``describe_file_error``); everything else is a bug and keeps its traceback.
"""

import errno
import os

FIXES = {errno.ENOSPC: "free space there or point it at a larger disk",
         errno.EDQUOT: "free space within your quota there or point it elsewhere",
         errno.EROFS: "point it at a writable file system",
         errno.EACCES: "give this user access to it (chmod/chown) or use a copy it can access",
         errno.EPERM: "give this user access to it (chmod/chown) or use a copy it can access",
         errno.ENOENT: "check the path", errno.EISDIR: "name a file, not a directory",
         errno.ENOTDIR: "check the path: a part of it is a file"}
"""The usual fix for each errno a file operation meets."""


def describe_file_error(error: OSError, path=None) -> str:
    """One line for a failed file operation: the file (the error's, else ``path``), the reason and
    the usual fix."""
    reason = os.strerror(error.errno) if error.errno else str(error)
    return f"{error.filename or path or '?'}: {reason}. Fix: {FIXES.get(error.errno, 'check the path and the disk')}"


class MeshtrainError(Exception):
    """A mistake in the user's input, with a message that names the field, the rule and a fix."""


class ConfigError(MeshtrainError):
    """A configuration value or combination is invalid."""


class DataError(MeshtrainError):
    """Input data or a tokenizer cannot be read or is unusable."""


class TrainingError(MeshtrainError):
    """Training cannot go on (for example the loss became non-finite)."""


class CollectiveError(TrainingError):
    """A collective failed or timed out: another rank died or hangs. Each rank says so itself,
    since each one knows only which of its own operations broke."""

    every_rank = True


class CheckpointError(MeshtrainError):
    """A checkpoint or model directory is missing, incomplete, corrupted or does not match the run."""


class CheckpointWriteError(CheckpointError):
    """A checkpoint could not be written (a full disk, a lost permission). Every rank raises it
    together and says which rank failed, so none of them waits on the others."""

    every_rank = True
