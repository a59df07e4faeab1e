"""``meshtrain train``: resolve the config, check the layout, then run the Trainer on this rank.

Everything that can be refused is refused here, before any process group exists: the layout rules,
the Hugging Face source, the export target and a resume checkpoint's architecture.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import sys
import warnings

from meshtrain.checkpoint.checkpointer import check_architecture, read_meta
from meshtrain.config import JobConfig
from meshtrain.config_files import dump_yaml
from meshtrain.errors import ConfigError
from meshtrain.hf.adapter import resolve_init_from_hf
from meshtrain.hf.io import check_export_target
from meshtrain.parallel.layout import Layout, plan_layout
from meshtrain.parallel.mesh import build_mesh
from meshtrain.parallel.runtime import (Runtime, collective_error, device_type_from_env, init_distributed,
                                        is_collective_failure, shutdown, world_size_from_env)
from meshtrain.run_dir import check_writable, checkpoint_dir, describe_write_error, job_lock
from meshtrain.data.blend import parse_blend
from meshtrain.models.float8 import check_float8
from meshtrain.telemetry import flight_recorder
from meshtrain.telemetry.backends import check_installed
from meshtrain.trainer import Trainer
from meshtrain.validation import check_ranges


def prepare_run_dir(cfg: JobConfig, runtime: Runtime) -> None:
    if runtime.is_main:
        run_dir = pathlib.Path(cfg.train.run_dir)
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "config.yaml").write_text(dump_yaml(cfg))
        except OSError as e:
            raise ConfigError(f"train.run_dir: {describe_write_error(e, 'the run config')}") from None


def resolve(cfg: JobConfig) -> JobConfig:
    """The config as the job will run it: with model.init_from_hf, the architecture of its config.json.
    Checks what can fail late (the export target) before any work starts."""
    if cfg.model.init_from_hf is not None:
        cfg = dataclasses.replace(cfg, model=resolve_init_from_hf(cfg.model))
    check_ranges(cfg)
    if cfg.data.blend:
        parse_blend(cfg.data.blend)
    c = cfg.checkpoint
    if c.export_hf:
        check_export_target(c.export_hf)
    if c.resume not in ("auto", "never"):
        check_architecture(read_meta(pathlib.Path(c.resume)), cfg.model, pathlib.Path(c.resume))
    check_installed(cfg.logging)
    if cfg.train.float8:
        check_float8(device_type_from_env(), sequence_parallel=cfg.parallel.tp > 1 and cfg.parallel.sp,
                     emulate=cfg.train.float8_emulate)
    check_writable(cfg.train.run_dir, "train.run_dir")
    if c.dir or c.interval > 0:
        check_writable(checkpoint_dir(cfg), "checkpoint.dir")  # the default run_dir/checkpoints too
    return cfg


def plan(cfg: JobConfig) -> Layout:
    """``plan_layout`` for this job's world size; rank 0 alone prints the layout warnings."""
    with warnings.catch_warnings(record=True) as caught:
        layout = plan_layout(cfg, world_size_from_env())
    if int(os.environ.get("RANK", "0")) == 0:
        for w in caught:
            print(f"meshtrain: warning: {w.message}", file=sys.stderr)
    return layout


def dry_run(cfg: JobConfig) -> Layout:
    layout = plan(resolve(cfg))
    print(f"layout: {layout.describe()}")
    for f in dataclasses.fields(layout):
        print(f"  {f.name} = {getattr(layout, f.name)}")
    print(f"  dp = {layout.dp}, edp = {layout.edp}")
    return layout


def train(cfg: JobConfig, layout: Layout, runtime: Runtime) -> list[dict[str, float]]:
    """The job on a process group that exists: its mesh, its run dir, the Trainer's steps."""
    mesh = build_mesh(layout, runtime.device.type)
    prepare_run_dir(cfg, runtime)
    return Trainer(cfg, runtime, mesh).fit()


def run(cfg: JobConfig) -> list[dict[str, float]]:
    """Train with ``cfg`` in this process (one rank of a torchrun job, or a world of one)."""
    cfg = resolve(cfg)
    layout = plan(cfg)
    # Rank 0 holds the run and checkpoint dirs before any group exists: a refused job stops before its
    # ranks meet. A checkpoint dir that is neither written nor there to resume from is not made.
    checkpoints = checkpoint_dir(cfg)
    uses_checkpoints = cfg.checkpoint.interval > 0 or checkpoints.is_dir()
    with job_lock(cfg.train.run_dir, checkpoints if uses_checkpoints else None,
                  enabled=int(os.environ.get("RANK", "0")) == 0):
        runtime = init_distributed(cfg.parallel.timeout_s, cfg.profiling.flight_recorder)
        try:
            history = train(cfg, layout, runtime)
        except BaseException as e:
            collective = isinstance(e, RuntimeError) and is_collective_failure(e)
            # the flight record is read before the groups are torn down
            record = flight_recorder.write(cfg.train.run_dir, runtime.rank) if collective else None
            shutdown()
            if collective:
                raise collective_error(e, cfg.parallel.timeout_s, record) from None
            raise
        shutdown(synchronize=True)
    return history
