"""Per-rank activation memory under context parallelism: cp1, cp2, cp4 side by side, one table.

    python bench/cp_memory.py                 # seq 4096, tiny Llama, cp 1 2 4 on as many CPU ranks
    python bench/cp_memory.py --seq-len 8192 --cps 1 2 4 8

Each rank runs one forward of one sequence inside the trainer's CP context (``sequence_sharded``:
load-balanced shards of the ids and RoPE rows, ring attention) and adds up the bytes of every
tensor autograd saves for backward (weights and the RoPE tables excluded): what a rank must hold
between forward and backward. Beside it, the planner's estimate for the same shape (its formula
with CPU's composite RMSNorm), and the forward+backward time. All cp sizes run in one invocation
on the same model, so the ratios compare like with like; times on CPU/gloo are not GPU numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]


def job_config(args: argparse.Namespace, cp: int):
    from meshtrain.config import JobConfig
    from meshtrain.config_files import from_dict

    return from_dict(JobConfig, {
        "model": {"hidden_size": args.hidden, "intermediate_size": 3 * args.hidden, "num_hidden_layers": args.layers,
                  "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 384,
                  "max_position_embeddings": args.seq_len},
        "parallel": {"cp": cp},
        "train": {"global_batch_size": 1, "micro_batch_size": 1, "seq_len": args.seq_len},
        "logging": {"progress": "off", "jsonl": False},
    })


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from meshtrain.parallel.context import sequence_sharded
    from meshtrain.parallel.runtime import exit_process, init_distributed, shutdown
    from meshtrain.parallel.layout import plan_layout
    from meshtrain.parallel.mesh import build_mesh
    from meshtrain.parallel.parallelize import build_model
    import torch.nn.functional as F

    cfg = job_config(args, args.cp)
    runtime = init_distributed(cfg.parallel.timeout_s)
    try:
        mesh = build_mesh(plan_layout(cfg, runtime.world_size), runtime.device.type)
        model = build_model(cfg, mesh, runtime.device)
        torch.manual_seed(0)
        tokens = torch.randint(0, cfg.model.vocab_size, (1, args.seq_len + 1), device=runtime.device)
        inputs, labels = tokens[:, :-1].clone(), tokens[:, 1:].clone()
        def storage(t):
            return (t.to_local() if isinstance(t, DTensor) else t).untyped_storage().data_ptr()

        skip = {storage(t) for t in [*model.parameters(), *model.buffers()]}
        # FSDP saves its all-gathered (unsharded) weights for backward: weights, not activations
        weight_shapes = {tuple(p.shape) for p in model.parameters()} | {tuple(p.shape)[::-1] for p in model.parameters()}
        saved: dict[int, int] = {}

        def pack(t):
            ptr = t.untyped_storage().data_ptr()
            if ptr not in skip and tuple(t.shape) not in weight_shapes:
                saved[ptr] = t.untyped_storage().nbytes()
            return t

        dist.barrier()
        start = time.perf_counter()
        with sequence_sharded(mesh, [inputs, labels], [model], cfg.parallel.cp_rotate_method):
            skip |= {storage(t) for t in model.buffers()}  # the sharded RoPE rows
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                loss = F.cross_entropy(model(inputs).flatten(0, 1).float(), labels.flatten())
            tokens_here = inputs.shape[1]
            loss.backward()
        elapsed = time.perf_counter() - start
        mine = {"rank": dist.get_rank(), "tokens": tokens_here, "saved_bytes": sum(saved.values()), "fwd_bwd_s": elapsed}
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        if dist.get_rank() == 0:
            pathlib.Path(args.result).write_text(json.dumps(gathered))
    except BaseException:
        shutdown()
        raise
    shutdown(synchronize=True)
    exit_process(0)  # gloo can abort in interpreter finalisation: see exit_process


def planner_estimate(args: argparse.Namespace, cp: int) -> float:
    from meshtrain.planning.memory import Sizes, layer_activation_elements
    from meshtrain.planning.shapes import shape_from_model_config

    model = job_config(args, cp).model
    shape = shape_from_model_config(model, "bench")
    sizes = Sizes(world=cp, cp=cp)
    per_layer = layer_activation_elements(shape, 0, sizes, args.seq_len, "none", fused_norm=False)
    embedding = args.seq_len / cp * model.hidden_size  # the last norm's input and output, the head's input
    logits = args.seq_len / cp * model.vocab_size * 2  # the head's output (fp32) and log-softmax's
    return 4 * (per_layer * model.num_hidden_layers + 3 * embedding + logits)


def driver(args: argparse.Namespace) -> None:
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    lines = [f"seq {args.seq_len}, one sequence, hidden {args.hidden}, {args.layers} layers, fp32", "",
             f"| cp | tokens per rank | saved activations per rank (MB) | vs cp{args.cps[0]} | planner estimate (MB) | fwd+bwd s |",
             "|---|---|---|---|---|---|"]
    results, base = {}, None
    for cp in args.cps:
        result = out / f"cp{cp}.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={cp}",
               str(pathlib.Path(__file__).resolve()), "--worker", "--cp", str(cp), "--seq-len", str(args.seq_len),
               "--hidden", str(args.hidden), "--layers", str(args.layers), "--result", str(result)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            print(proc.stdout[-3000:], proc.stderr[-3000:], sep="\n", file=sys.stderr)
            raise SystemExit(f"cp{cp} failed with exit code {proc.returncode}")
        ranks = json.loads(result.read_text())
        saved = max(r["saved_bytes"] for r in ranks)
        base = base or saved
        results[cp] = {"ranks": ranks, "planner_bytes": planner_estimate(args, cp)}
        lines.append(f"| {cp} | {ranks[0]['tokens']} | {saved / 1e6:.2f} | {saved / base:.3f} (1/{base / saved:.2f}) | "
                     f"{results[cp]['planner_bytes'] / 1e6:.2f} | {max(r['fwd_bwd_s'] for r in ranks):.2f} |")
        print(lines[-1], flush=True)
    table = "\n".join(lines)
    print("\n" + table)
    (out / "cp_memory.md").write_text(table + "\n")
    (out / "cp_memory.json").write_text(json.dumps(results, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--cps", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--out", default=str(ROOT / "runs" / "bench"))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--cp", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    worker(args) if args.worker else driver(args)


if __name__ == "__main__":
    main()
