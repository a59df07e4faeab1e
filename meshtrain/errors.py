"""User-facing errors.

Anything a user can fix (a config value, a layout, a missing file) raises a subclass of
``MeshtrainError``. The CLI prints its message and exits with status 2 instead of a traceback;
everything else is a bug and keeps its traceback.
"""


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
