"""``meshtrain train ARGS`` (as tests/workers/train_command.py) with every rank but rank 0 arriving 2 s
late at each export's target check: rank 0 has long finished a tiny export by then, so an export
that let rank 0 write before every rank had checked fails here every time, not one run in four."""

import time
from unittest import mock

from meshtrain.hf import io
from tests.workers import train_command


def run(args, out, runtime) -> None:
    check = io.check_export_target

    def late_check(directory):
        if not runtime.is_main:
            time.sleep(2)
        return check(directory)

    with mock.patch.object(io, "check_export_target", late_check):
        train_command.run(args, out, runtime)
