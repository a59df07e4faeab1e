"""The command line: ``meshtrain <subcommand> [--config FILE] [--section.field VALUE ...]``.

tyro builds each subcommand's options from its config dataclass; ``--config`` fills that dataclass
from YAML first, so the precedence is defaults < YAML < command line. User mistakes end with one
message and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Callable, NoReturn

import tyro

from meshtrain.config import JobConfig
from meshtrain.config_files import load_yaml
from meshtrain.errors import MeshtrainError, describe_file_error

# Seconds a rank other than local rank 0 waits before printing a config error (see ``main``).
QUIET_RANK_GRACE_S = 5.0


def parse(cls: type, argv: list[str], prog: str):
    """``--config FILE`` (YAML) as the defaults, then tyro parses the rest of ``argv`` over it."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=None)
    known, rest = pre.parse_known_args(argv)
    default = load_yaml(known.config, cls) if known.config else None
    return tyro.cli(cls, default=default, args=rest, prog=prog, config=(tyro.conf.FlagConversionOff,),
                    description=f"{(cls.__doc__ or '').strip()}  Use --config FILE.yaml for defaults.")


def train_main(argv: list[str]) -> None:
    cfg = parse(JobConfig, argv, "meshtrain train")  # before torch is imported: --help and option errors are instant
    from meshtrain.commands import train

    if cfg.train.dry_run:
        train.dry_run(cfg)
    else:
        train.run(cfg)


def convert_main(argv: list[str]) -> None:
    from meshtrain.commands.convert import ConvertConfig, convert

    convert(parse(ConvertConfig, argv, "meshtrain convert"))


def prepare_main(argv: list[str]) -> None:
    from meshtrain.commands.prepare import PrepareConfig, prepare

    prepare(parse(PrepareConfig, argv, "meshtrain prepare"))


def plan_main(argv: list[str]) -> None:
    from meshtrain.planning.options import PlanConfig
    from meshtrain.planning.report import plan_main as run_plan

    run_plan(parse(PlanConfig, argv, "meshtrain plan"))


SUBCOMMANDS: dict[str, tuple[Callable[[list[str]], None], str]] = {
    "train": (train_main, "train a model (add --train.dry-run to validate and print the layout only)"),
    "prepare": (prepare_main, "tokenize text into a memory-mapped dataset for data.path (--input DIR --output PREFIX)"),
    "plan": (plan_main, "recommend a layout for a model and cluster, with per-GPU memory (--params 70b --gpus 64)"),
    "convert": (convert_main, "Hugging Face safetensors <-> meshtrain checkpoints (--src DIR --dst DIR)"),
}


def usage() -> str:
    lines = ["usage: meshtrain <subcommand> [--config FILE.yaml] [options]", "", "subcommands:"]
    lines += [f"  {name:<8} {help_}" for name, (_, help_) in SUBCOMMANDS.items()]
    lines += ["", "meshtrain <subcommand> --help lists every option."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        sys.exit(0 if argv else 2)
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"meshtrain: unknown subcommand {name!r}\n\n{usage()}", file=sys.stderr)
        sys.exit(2)
    try:
        SUBCOMMANDS[name][0](rest)
    except KeyboardInterrupt:
        # Outputs are published by a rename once complete (checkpoints, exports, prepared data), so
        # an interrupted command leaves only .incomplete files behind, never a traceback.
        print(f"meshtrain {name}: interrupted; nothing incomplete was published", file=sys.stderr, flush=True)
        sys.exit(130)
    except (MeshtrainError, OSError) as e:
        if isinstance(e, OSError) and e.filename is None:
            raise  # not about a file the user named: a bug, with its traceback
        rank = os.environ.get("RANK")
        if os.environ.get("LOCAL_RANK", "0") != "0" and not getattr(e, "every_rank", False):
            # Every rank raises a config error, and the launcher stops the others when the first one
            # exits: this rank gives local rank 0 time to print the error once, and prints it itself
            # only if it is still running then (rank 0 did not fail the same way).
            time.sleep(QUIET_RANK_GRACE_S)
        prefix = f"[rank {rank}] " if rank is not None and os.environ.get("WORLD_SIZE", "1") != "1" else ""
        message = describe_file_error(e) if isinstance(e, OSError) else str(e)
        print(f"meshtrain: error: {prefix}{message}", file=sys.stderr, flush=True)
        sys.exit(2)


def entry() -> NoReturn:
    """The program (``meshtrain`` / ``python -m meshtrain``): ``main``, then ``exit_process``."""
    try:
        main()
        code = 0
    except SystemExit as e:
        if e.code is not None and not isinstance(e.code, int):
            raise  # a message for Python to print
        code = e.code or 0
    runtime = sys.modules.get("meshtrain.parallel.runtime")  # loaded whenever a process group was used
    if runtime is None:
        sys.exit(code)  # an option error or --help: torch was never imported
    runtime.exit_process(code)
