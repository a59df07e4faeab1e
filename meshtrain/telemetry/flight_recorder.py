"""What each rank was doing when a collective did not complete: torch's flight recorder.

torch records each rank's recent collectives (op, group, sequence number, sizes, state) for gloo
and NCCL alike once TORCH_FR_BUFFER_SIZE is set before the groups are made (``arm``). When a
collective fails or times out, every rank that notices writes its record to
``run_dir/flight_recorder/rank<R>.json`` (``write``) and names its last collective in the error:
comparing the files' sequence numbers per group shows which rank stopped issuing and where.
"""

from __future__ import annotations

import json
import os
import pathlib

ENV = "TORCH_FR_BUFFER_SIZE"


def arm(entries: int) -> None:
    """Keep the last ``entries`` collectives of every group made from now on (0: none). A value
    the user exported (TORCH_FR_BUFFER_SIZE) wins."""
    if entries > 0:
        os.environ.setdefault(ENV, str(entries))


def write(run_dir: str | pathlib.Path, rank: int) -> tuple[pathlib.Path, str] | None:
    """Write this rank's record; returns its path and its last collective in words, or None when
    nothing was recorded (the recorder is off) or the file cannot be written."""
    from meshtrain.parallel._torch_private import flight_recorder_json

    try:
        record = json.loads(flight_recorder_json())
    except (RuntimeError, ValueError):
        return None
    entries = record.get("entries") or []
    if not entries:
        return None
    path = pathlib.Path(run_dir) / "flight_recorder" / f"rank{rank}.json"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record, indent=1, default=str))
    except OSError:
        return None
    return path, describe(entries[-1])


def describe(entry: dict) -> str:
    """e.g. "gloo:all_reduce on group mesh_tp (#3), sequence 57, input sizes [[4]]"."""
    name, desc = (list(entry.get("process_group") or ["?", "?"]) + ["?"])[:2]
    return (f"{entry.get('profiling_name', '?')} on group {desc} (#{name}), sequence "
            f"{entry.get('collective_seq_id', '?')}, input sizes {entry.get('input_sizes', '?')}")
