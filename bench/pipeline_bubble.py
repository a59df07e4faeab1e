"""Pipeline bubble per schedule: per-rank busy vs idle time of one training step, beside the theory.

    python bench/pipeline_bubble.py            # pp2 on 2 CPU ranks, every schedule, one table
    python bench/pipeline_bubble.py --pp 4 --microbatches 8

Busy time is what the stage's own compute takes: the schedule's calls of ``forward_one_chunk``,
``backward_one_chunk`` and ``backward_weight_one_chunk`` on each ``PipelineStage``, timed on the rank
that runs them. Idle is the rest of the pipelined part of the step (waiting on point-to-point
transfers from neighbours): idle fraction = 1 - busy / step. The optimizer step is outside both.

Theory, with p stages per pipeline, m micro-batches and v virtual stages per rank:
single-stage schedules (GPipe, 1F1B) (p-1)/(m+p-1); looped/interleaved (p-1)/(v*m+p-1);
zero-bubble schedules fill most of it with deferred weight gradients (0 in the ideal cost model).
All schedules run one after the other in one invocation on the same model and data, so ratios
compare like with like on a noisy machine; absolute times on CPU/gloo are not GPU numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

from meshtrain.parallel.layout import LOOPED_SCHEDULES, SINGLE_STAGE_SCHEDULES, SPLIT_BACKWARD_SCHEDULES, V_SCHEDULES

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCHEDULES = [(name, 1) for name in SINGLE_STAGE_SCHEDULES] + [(name, 2) for name in LOOPED_SCHEDULES + V_SCHEDULES]
"""Every schedule the trainer accepts; the multi-stage ones with two virtual stages per rank."""


def theoretical_bubble(schedule: str, pp: int, vpp: int, m: int) -> str:
    if schedule in SINGLE_STAGE_SCHEDULES:
        return f"{(pp - 1) / (m + pp - 1):.1%}"
    if schedule not in SPLIT_BACKWARD_SCHEDULES:
        return f"{(pp - 1) / (vpp * m + pp - 1):.1%}"
    return f"~0 (ZB; interleaved bound {(pp - 1) / (vpp * m + pp - 1):.1%})"


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining.stage import _PipelineStageBase

    from meshtrain.config import JobConfig
    from meshtrain.config_files import from_dict
    from meshtrain.parallel.runtime import exit_process, init_distributed, shutdown
    from meshtrain.parallel.layout import plan_layout
    from meshtrain.parallel.mesh import build_mesh
    from meshtrain.trainer import Trainer

    busy = [0.0]

    def timed(method):
        def wrapper(self, *a, **kw):
            start = time.perf_counter()
            try:
                return method(self, *a, **kw)
            finally:
                busy[0] += time.perf_counter() - start
        return wrapper

    for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
        setattr(_PipelineStageBase, name, timed(getattr(_PipelineStageBase, name)))

    cfg = from_dict(JobConfig, {
        "model": {"hidden_size": args.hidden, "intermediate_size": 3 * args.hidden,
                  "num_hidden_layers": args.layers, "num_attention_heads": 8, "num_key_value_heads": 4,
                  "vocab_size": 384},
        "parallel": {"pp": args.pp, "vpp": args.vpp, "pp_schedule": args.schedule},
        "train": {"steps": args.warmup + args.steps, "global_batch_size": args.microbatches,
                  "micro_batch_size": 1, "seq_len": args.seq_len, "run_dir": args.run_dir},
        "logging": {"progress": "off", "jsonl": False},
    })
    runtime = init_distributed(cfg.parallel.timeout_s)
    try:
        mesh = build_mesh(plan_layout(cfg, runtime.world_size), runtime.device.type)
        trainer = Trainer(cfg, runtime, mesh)
        pipeline = trainer.pipeline
        inner_step = pipeline.run
        pipelined = [0.0]

        def timed_step(*a, **kw):
            dist.barrier()  # every rank starts the pipeline together, so idle is the schedule's, not skew
            start = time.perf_counter()
            out = inner_step(*a, **kw)
            pipelined[0] += time.perf_counter() - start
            return out
        pipeline.run = timed_step

        rows = []
        for step in range(args.warmup + args.steps):
            busy[0] = pipelined[0] = 0.0
            trainer.train_step()
            if step >= args.warmup:
                rows.append((busy[0], pipelined[0]))
        busy_s = sum(b for b, _ in rows) / len(rows)
        step_s = sum(p for _, p in rows) / len(rows)
        mine = {"rank": dist.get_rank(), "busy_s": busy_s, "step_s": step_s, "idle": 1 - busy_s / step_s}
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        if dist.get_rank() == 0:
            pathlib.Path(args.result).write_text(json.dumps(gathered))
    except BaseException:
        shutdown()
        raise
    shutdown(synchronize=True)
    exit_process(0)  # gloo can abort in interpreter finalisation: see exit_process


def driver(args: argparse.Namespace) -> None:
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    m = args.microbatches
    lines = [f"pp={args.pp}, m={m} micro-batches of 1 x {args.seq_len} tokens, hidden {args.hidden}, "
             f"{args.layers} layers, {args.steps} measured steps after {args.warmup} warm-up",
             "", "| schedule | vpp | step ms | idle per rank | mean idle | theory |",
             "|---|---|---|---|---|---|"]
    results = {}
    for schedule, vpp in SCHEDULES:
        if args.only and schedule not in args.only:
            continue
        result = out / f"{schedule}.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.pp}",
               str(pathlib.Path(__file__).resolve()), "--worker", "--schedule", schedule, "--vpp", str(vpp),
               "--pp", str(args.pp), "--microbatches", str(m), "--hidden", str(args.hidden),
               "--layers", str(args.layers), "--seq-len", str(args.seq_len), "--steps", str(args.steps),
               "--warmup", str(args.warmup), "--result", str(result), "--run-dir", str(out / "run")]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            print(proc.stdout[-3000:], proc.stderr[-3000:], sep="\n", file=sys.stderr)
            raise SystemExit(f"{schedule} failed with exit code {proc.returncode}")
        ranks = json.loads(result.read_text())
        results[schedule] = {"vpp": vpp, "ranks": ranks}
        idle = [r["idle"] for r in ranks]
        step_ms = max(r["step_s"] for r in ranks) * 1e3
        lines.append(f"| {schedule} | {vpp} | {step_ms:.0f} | {' / '.join(f'{x:.1%}' for x in idle)} | "
                     f"{sum(idle) / len(idle):.1%} | {theoretical_bubble(schedule, args.pp, vpp, m)} |")
        print(lines[-1], flush=True)
    table = "\n".join(lines)
    print("\n" + table)
    (out / "pipeline_bubble.md").write_text(table + "\n")
    (out / "pipeline_bubble.json").write_text(json.dumps(results, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--only", nargs="*", help="run only these schedules")
    parser.add_argument("--out", default=str(ROOT / "runs" / "bench"))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--schedule", help=argparse.SUPPRESS)
    parser.add_argument("--vpp", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    worker(args) if args.worker else driver(args)


if __name__ == "__main__":
    main()
