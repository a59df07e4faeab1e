"""meshtrain side by side with what users would pick instead, and its communication per layout.

    python bench/compare.py                 # CPU: a small Llama, layouts on 2 gloo ranks
    python bench/compare.py --hidden 1024 --layers 8 --seq-len 1024 --global-batch 32   # on a GPU box

Throughput: the same model (meshtrain's config translated to a transformers LlamaConfig by the HF
adapter), the same global batch and micro-batch, dtype and AdamW settings, trained by
  - transformers: ``AutoModelForCausalLM`` in eager PyTorch (sdpa attention), one process;
  - meshtrain on one rank, and dp2 (FSDP2), tp2, pp2 (1F1B) at the same global batch.
The meshtrain jobs of one world size run one after the other in one launch (one process group,
each job's own groups released after it, as tests/batch.py does: the launch and imports are paid
once per world size), and the whole cycle repeats ``--repeats`` times (interleaved, so a noisy
neighbour hurts all of them alike); the table takes each job's median step time over every timed
step of every repeat. On CPU each job gets the
same cores: ``OMP_NUM_THREADS`` = cores / ranks. MFU needs a peak (looked up on CUDA, else
``--peak-tflops``).

Train options (selective / full activation checkpointing, compiled layers) beside meshtrain's 1
rank: the time ratio, and the ratio of the activations one micro-batch's forward keeps for backward
(``telemetry.allocation.activations_kept``).

Communication: for dp2 (also with no-sync accumulation, and with float8 all-gathers under torchao's
emulation), tp2, tp2+SP, pp2, cp2 (dense) and ep2 (a Qwen3-MoE of the same width), one steady-state
step is counted op by op (``meshtrain.telemetry.comm_counter``: calls and bytes each rank sends) and
set beside the analytic minimum of that parallelism, formula shown.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time
import types

ROOT = pathlib.Path(__file__).resolve().parents[1]

# name: (ranks, parallel options, MoE model?)
LAYOUTS = {
    "1 rank": (1, {}, False),
    "dp2": (2, {"dp_shard": 2}, False),
    # gradient accumulation (global / (micro x dp) = 2 micro-batches by default) without a
    # reduce-scatter per micro-batch, and also without re-gathering parameters between them
    "dp2 reduce_last": (2, {"dp_shard": 2, "fsdp_accumulate": "reduce_last"}, False),
    "dp2 reduce_last_unsharded": (2, {"dp_shard": 2, "fsdp_accumulate": "reduce_last_unsharded"}, False),
    "tp2": (2, {"tp": 2}, False),
    "1 rank selective AC": (1, {}, False),
    "1 rank full AC": (1, {}, False),
    "1 rank compiled": (1, {}, False),
    "tp2+sp": (2, {"tp": 2, "sp": True}, False),
    "pp2": (2, {"pp": 2, "pp_schedule": "1F1B"}, False),
    "cp2": (2, {"cp": 2}, False),
    "ep2": (2, {"ep": 2}, True),
    # float8 weights all-gathered in float8 (torchao's emulation on CPU: the bytes are real, the speed is not)
    "dp2 float8": (2, {"dp_shard": 2}, False),
}
THROUGHPUT = ["1 rank", "1 rank selective AC", "1 rank full AC", "1 rank compiled", "dp2", "dp2 reduce_last",
              "dp2 reduce_last_unsharded", "tp2", "pp2"]
# The options that are train settings rather than layouts, beside "1 rank" (their baseline).
TRAIN_OPTIONS = {"1 rank selective AC": {"activation_checkpointing": "selective"},
                 "1 rank full AC": {"activation_checkpointing": "full"}, "1 rank compiled": {"compile": True},
                 "dp2 float8": {"float8": True, "float8_emulate": True}}
COMMUNICATION = ["dp2", "dp2 reduce_last", "dp2 reduce_last_unsharded", "dp2 float8", "tp2", "tp2+sp", "pp2", "cp2",
                 "ep2"]


def job_config(args: argparse.Namespace, parallel: dict, moe: bool, train: dict | None = None):
    from meshtrain.config import JobConfig
    from meshtrain.config_files import from_dict

    model = {"hidden_size": args.hidden, "intermediate_size": 3 * args.hidden, "num_hidden_layers": args.layers,
             "num_attention_heads": args.heads, "num_key_value_heads": args.heads // 2, "vocab_size": 384,
             "max_position_embeddings": args.seq_len}
    if moe:
        model |= {"family": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2,
                  "moe_intermediate_size": args.hidden}
    return from_dict(JobConfig, {
        "model": model,
        "parallel": parallel,
        "train": {"global_batch_size": args.global_batch, "micro_batch_size": args.micro_batch,
                  "seq_len": args.seq_len, "steps": args.warmup + args.steps + 1,
                  "mixed_precision": "bf16" if args.dtype == "bf16" else "fp32", "run_dir": args.run_dir,
                  **(train or {})},
        "optimizer": {"lr": 1e-4},
        "logging": {"progress": "off", "jsonl": False, "peak_tflops": args.peak_tflops},
    })


# ---------------------------------------------------------------- workers (one launch per world size)

def meshtrain_worker(args: argparse.Namespace) -> None:
    """Every layout of ``--layout`` (comma-separated, one world size) in turn on one process group."""
    import gc

    from meshtrain.parallel.runtime import exit_process, init_distributed, release_groups, shutdown

    runtime = init_distributed(900)
    try:
        for name, result in zip(args.layout.split(","), args.result.split(",")):
            measure_layout(args, name, pathlib.Path(result), runtime)
            torch_distributed().barrier()
            release_groups()
            gc.collect()
    except BaseException:
        shutdown()
        raise
    shutdown(synchronize=True)
    exit_process(0)


def torch_distributed():
    import torch.distributed as dist

    return dist


def measure_layout(args: argparse.Namespace, name: str, result: pathlib.Path, runtime) -> None:
    from meshtrain.telemetry.allocation import measure_training_state, mesh_coordinates
    from meshtrain.telemetry.comm_counter import CollectiveCounter
    from meshtrain.parallel.layout import plan_layout
    from meshtrain.parallel.mesh import build_mesh
    from meshtrain.planning.memory import trainer_rank_state
    from meshtrain.commands.train import resolve
    from meshtrain.trainer import Trainer

    ranks, parallel, moe = LAYOUTS[name]
    own = argparse.Namespace(**{**vars(args), "run_dir": str(pathlib.Path(args.run_dir) / result.stem)})
    cfg = resolve(job_config(own, parallel, moe, TRAIN_OPTIONS.get(name)))
    layout = plan_layout(cfg, ranks)
    trainer = Trainer(cfg, runtime, build_mesh(layout, runtime.device.type))
    for _ in range(args.warmup):
        trainer.train_step()
    times = [trainer.train_step()["step_time_s"] for _ in range(args.steps)]
    # dynamo does not trace under the counter's dispatch mode: a compiled job's step goes uncounted
    uncounted = contextlib.nullcontext(types.SimpleNamespace(counts={}, bytes={}))
    with uncounted if cfg.train.compile else CollectiveCounter() as comm:
        trainer.train_step()
    coords = mesh_coordinates(trainer.mesh)
    mine = {"calls": dict(comm.counts), "bytes": dict(comm.bytes), "coords": coords,
            "activation_bytes": activation_bytes(trainer) if ranks == 1 and not cfg.train.compile else None,
            "state": measure_training_state(trainer), "plan": trainer_rank_state(cfg, layout, **coords)}
    every = [mine]
    if runtime.world_size > 1:
        every = [None] * runtime.world_size
        torch_distributed().all_gather_object(every, mine)
    if runtime.is_main:
        result.write_text(json.dumps({
            "layout": trainer.mesh.describe(cfg.parallel), "step_times_s": times, "ranks": every,
            "flops_per_token": trainer.flops_per_token, "peak_tflops": trainer.peak_tflops,
            "num_params": trainer.num_params, "device": str(runtime.device)}))


def activation_bytes(trainer) -> int:
    """What one micro-batch's forward keeps for backward (weights, buffers and logits not counted)."""
    import torch

    from meshtrain.telemetry.allocation import activations_kept

    (model,), t = trainer.parts, trainer.cfg.train
    ids = torch.randint(0, trainer.cfg.model.vocab_size, (t.micro_batch_size, t.seq_len), device=trainer.runtime.device)
    kept, logits = activations_kept(model, ids, exclude=[*model.parameters(), *model.buffers()])
    logits.float().sum().backward()
    model.zero_grad(set_to_none=True)
    return kept


def float8_projection_params(model_cfg) -> int:
    """The weights train.float8 converts (and FSDP then gathers at 1 byte each)."""
    import torch

    from meshtrain.models.float8 import convert_to_float8
    from meshtrain.models.transformer import Transformer

    with torch.device("meta"):
        model = Transformer(model_cfg)
    return sum(model.get_submodule(name).weight.numel() for name in convert_to_float8(model))


def transformers_step_times(cfg, dtype: str, steps: int) -> list[float]:
    """Wall time of each of ``steps`` optimizer steps of transformers' eager training of the model
    meshtrain's adapter describes for ``cfg`` (a resolved JobConfig): the same batch, micro-batch,
    AdamW settings and clipping as meshtrain's job. Also used by gpu_check.py."""
    import contextlib

    import torch
    import transformers

    from meshtrain.hf.adapter import hf_config_from_model
    from meshtrain.parallel.runtime import device_type_from_env

    device = torch.device(device_type_from_env())
    hf = hf_config_from_model(cfg.model, torch.float32)
    config = transformers.AutoConfig.for_model(hf.pop("model_type"), **hf)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(device)
    model.train()
    o = cfg.optimizer
    optimizer = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                                  weight_decay=o.weight_decay, foreach=True)
    t = cfg.train
    accum = t.global_batch_size // t.micro_batch_size
    batches = [torch.randint(0, cfg.model.vocab_size, (t.micro_batch_size, t.seq_len + 1), device=device)
               for _ in range(accum)]
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if dtype == "bf16" else contextlib.nullcontext()

    def step() -> float:
        start = time.perf_counter()
        for tokens in batches:
            with autocast:
                logits = model(input_ids=tokens[:, :-1]).logits
            loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten()) / accum
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)  # meshtrain clips too
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    return [step() for _ in range(steps)]


def transformers_worker(args: argparse.Namespace) -> None:
    from meshtrain.commands.train import resolve

    cfg = resolve(job_config(args, {}, False))
    times = transformers_step_times(cfg, args.dtype, args.warmup + args.steps)[args.warmup:]
    pathlib.Path(args.result).write_text(json.dumps({"layout": "transformers, 1 process", "step_times_s": times}))


# ---------------------------------------------------------------- analytic minima

FSDP_OPS = ("_allgather_base", "_reduce_scatter_base")


def analytic_minimum(name: str, args: argparse.Namespace) -> list[tuple[str, tuple[str, ...], float, str]]:
    """The parts of this layout's communication: (part, its ops, the bytes rank 0 must send per
    step at least, the formula)."""
    from meshtrain.models.transformer import count_parameters
    from meshtrain.commands.train import resolve

    ranks, parallel, moe = LAYOUTS[name]
    cfg = resolve(job_config(args, parallel, moe))
    m = cfg.model
    b = 2 if args.dtype == "bf16" else 4
    n = ranks
    dp = n if name.startswith(("dp2", "ep2")) else 1  # cp splits the sequence, not the batch
    micro = args.global_batch // args.micro_batch // dp
    act = args.micro_batch * args.seq_len * m.hidden_size * b  # one micro-batch's hidden states
    parts = []
    if name.startswith(("dp2", "cp2", "ep2")):
        params = count_parameters(m)
        if moe:  # the experts are outside FSDP under EP
            params -= 3 * m.num_experts * m.resolved_moe_intermediate_size * m.hidden_size * m.num_hidden_layers
        f8 = float8_projection_params(m) if "float8" in name else 0  # gathered at 1 B, reduced at 4 B
        gathered = f"({params:,} - {f8:,} float8) x 4 B + {f8:,} x 1 B" if f8 else f"{params:,} params x 4 B"
        held = {"reduce_last": f"; holds full grads, +{params * 4 / 1e6:.2f} MB/rank while accumulating",
                "reduce_last_unsharded": f"; holds full grads and params, +{2 * params * 4 / 1e6:.2f} MB/rank "
                                         "while accumulating"}.get(parallel.get("fsdp_accumulate"), "")
        parts.append(("FSDP", FSDP_OPS, (n - 1) / n * ((params - f8) * 4 + f8 + params * 4),
                      f"ZeRO-3 floor: (n-1)/n x (AG weights {gathered} + RS grads {params:,} x 4 B), once per step"
                      + held))
    if name == "cp2":
        kv = args.micro_batch * (args.seq_len // n) * m.num_key_value_heads * m.resolved_head_dim * b
        parts.append(("CP ring", ("all_gather", "all_to_all_single"), 2 * 2 * (n - 1) * kv * m.num_hidden_layers * micro,
                      f"2 (AG K,V fwd; RS dK,dV bwd) x 2 (K, V) x (n-1) x local K {kv:,} B x L x m={micro}"))
    if name == "ep2":
        tokens = args.micro_batch * args.seq_len
        parts.append(("EP all-to-all", ("all_to_all_single", "alltoall_base"),
                      4 * (n - 1) / n * tokens * m.num_experts_per_tok * m.hidden_size * b * m.num_hidden_layers * micro,
                      f"2 directions x 2 (fwd, bwd) x (n-1)/n (uniform routing) x {tokens} tokens x top_k "
                      f"{m.num_experts_per_tok} x hidden {m.hidden_size} x {b} B x L x m={micro}"))
    if name.startswith("tp2"):
        per = 2 * (n - 1) / n * act  # one all-reduce, or an all-gather + reduce-scatter pair, of the hidden states
        norms = 2 * (n - 1) / n * (2 * m.num_hidden_layers + 1) * m.hidden_size * 4 if "sp" in name else 0
        parts.append(("TP", ("all_reduce", "all_gather", "reduce_scatter"), (4 * m.num_hidden_layers + 2) * micro * per + norms,
                      f"(4L + 2) x m={micro} x 2(n-1)/n x activation {act:,} B" + (" + the norm weights' grads" if norms else "")))
    if name == "pp2":
        parts.append(("PP", ("send", "recv"), micro * act,
                      f"stage 0 sends m={micro} activations of {act:,} B (stage 1 the same in gradients)"))
    return parts


# ---------------------------------------------------------------- driver

def run_jobs(args: argparse.Namespace, kind: str, names: list[str], out: pathlib.Path, repeat: int) -> list[dict]:
    """Jobs of one world size in one launch (meshtrain), or transformers' one job in its own process."""
    ranks = LAYOUTS[names[0]][0] if kind == "meshtrain" else 1
    results = [out / f"{kind}-{name.replace(' ', '_').replace('+', '_')}-{repeat}.json" for name in names]
    cores = os.cpu_count() or 1
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(max(1, cores // ranks))}
    run_dir = out / "runs"  # each job's own below it: a run dir with checkpoints would be resumed
    worker = [str(pathlib.Path(__file__).resolve()), "--worker", kind, "--layout", ",".join(names),
              "--result", ",".join(map(str, results)), f"--run-dir={run_dir}", *args.passthrough]
    cmd = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", *worker]
           if kind == "meshtrain" else [sys.executable, *worker])
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout * len(names))
    if proc.returncode != 0:
        print(proc.stdout[-3000:], proc.stderr[-5000:], sep="\n", file=sys.stderr)
        raise SystemExit(f"{kind} {', '.join(names)} failed with exit code {proc.returncode}")
    return [json.loads(result.read_text()) for result in results]


def throughput_table(args, jobs: dict) -> tuple[list[str], dict]:
    tokens = args.global_batch * args.seq_len
    mesh_one = jobs[("meshtrain", "1 rank")][0]
    flops, peak = mesh_one["flops_per_token"], mesh_one["peak_tflops"]
    rows, summary = [], {}
    for key, runs in jobs.items():
        if key[0] == "meshtrain" and key[1] not in THROUGHPUT:
            continue
        step = statistics.median(t for r in runs for t in r["step_times_s"])
        devices = LAYOUTS[key[1]][0] if key[0] == "meshtrain" else 1
        tok_s = tokens / step
        tflops = tok_s * flops / devices / 1e12
        summary[" ".join(key)] = {"step_s": step, "tokens_per_s": tok_s, "tflops_per_device": tflops,
                                  "mfu": tflops / peak if peak else None, "devices": devices,
                                  "layout": runs[0]["layout"]}
    hf = summary["transformers 1 rank"]["tokens_per_s"]
    one = summary["meshtrain 1 rank"]["tokens_per_s"]
    rows += [f"model: {mesh_one['num_params'] / 1e6:.2f}M params, hidden {args.hidden}, {args.layers} layers, seq "
             f"{args.seq_len}, global batch {args.global_batch} (micro {args.micro_batch}), {args.dtype}, "
             f"{mesh_one['device']}, {args.repeats} repeats x {args.steps} timed steps", "",
             "| job | layout | step s (median) | tokens/s | vs transformers | vs meshtrain 1 rank | TFLOP/s/dev | MFU |",
             "|---|---|---|---|---|---|---|---|"]
    for key, s in summary.items():
        mfu = f"{100 * s['mfu']:.1f}%" if s["mfu"] is not None else "n/a"
        rows.append(f"| {key} | {s['layout']} | {s['step_s']:.3f} | {s['tokens_per_s']:,.0f} | "
                    f"{s['tokens_per_s'] / hf:.2f}x | {s['tokens_per_s'] / one:.2f}x | {s['tflops_per_device']:.4f} | {mfu} |")
        s["vs_transformers"], s["vs_meshtrain_1_rank"] = s["tokens_per_s"] / hf, s["tokens_per_s"] / one
    return rows, summary


def communication_table(args, jobs: dict) -> tuple[list[str], dict]:
    rows = ["| layout | part | ops: calls (MB) | rank 0 MB/step | max over ranks MB | analytic minimum MB | "
            "measured / minimum | the minimum's formula |", "|---|---|---|---|---|---|---|---|"]
    summary = {}
    for name in COMMUNICATION:
        if ("meshtrain", name) not in jobs:
            continue
        result = jobs[("meshtrain", name)][0]
        ranks = result["ranks"]
        parts = analytic_minimum(name, args)
        claimed = {op for _, ops, _, _ in parts for op in ops}
        parts.append(("other (loss, grad norm, counts)", tuple(op for op in ranks[0]["calls"] if op not in claimed),
                      0.0, "scalars"))
        summary[name] = {"layout": result["layout"], "parts": []}
        for part, ops, minimum, formula in parts:
            ops = [op for op in ops if op in ranks[0]["calls"]]
            sent = [sum(r["bytes"].get(op, 0) for op in ops) for r in ranks]
            calls = ", ".join(f"{op} {ranks[0]['calls'][op]} ({ranks[0]['bytes'][op] / 1e6:.3f})" for op in ops)
            ratio = f"{sent[0] / minimum:.2f}" if minimum else "-"
            summary[name]["parts"].append({"part": part, "calls": {op: ranks[0]["calls"][op] for op in ops},
                                           "rank0_bytes": sent[0], "max_bytes": max(sent), "minimum_bytes": minimum,
                                           "ratio": sent[0] / minimum if minimum else None, "formula": formula})
            rows.append(f"| {name} | {part} | {calls or '-'} | {sent[0] / 1e6:.3f} | {max(sent) / 1e6:.3f} | "
                        f"{minimum / 1e6 if minimum else 0:.3f} | {ratio} | {formula} |")
    return rows, summary


def memory_table(jobs: dict) -> tuple[list[str], dict]:
    rows = ["| layout | rank (pp, tp, fsdp) | params MB | grads MB | optimizer MB | planner estimate MB (each) | "
            "measured / estimate |", "|---|---|---|---|---|---|---|"]
    summary = {}
    for name in dict.fromkeys(THROUGHPUT + COMMUNICATION):
        if ("meshtrain", name) not in jobs:
            continue
        result = jobs[("meshtrain", name)][0]
        summary[name] = []
        for rank, r in enumerate(result["ranks"]):
            got, plan, c = r["state"], r["plan"], r["coords"]
            measured = got["param_bytes"] + got["grad_bytes"] + got["optimizer_bytes"]
            planned = plan["param_bytes"] + plan["grad_bytes"] + plan["optimizer_bytes"]
            summary[name].append({"rank": rank, **c, "measured": got, "plan": plan, "ratio": measured / planned})
            rows.append(f"| {name} | {rank} ({c['pp_rank']}, {c['tp_rank']}, {c['fsdp_rank']}) | "
                        f"{got['param_bytes'] / 1e6:.3f} | {got['grad_bytes'] / 1e6:.3f} | "
                        f"{got['optimizer_bytes'] / 1e6:.3f} | {plan['param_bytes'] / 1e6:.3f} / "
                        f"{plan['grad_bytes'] / 1e6:.3f} / {plan['optimizer_bytes'] / 1e6:.3f} | "
                        f"{measured / planned:.4f} |")
    return rows, summary


def options_table(speed: dict, jobs: dict) -> tuple[list[str], dict]:
    """The train options beside their baseline: time and activation-memory ratios (the bytes of
    dp2 float8 are in the communication table)."""
    rows = ["| option | baseline | tokens/s vs baseline | activations kept, one micro-batch MB | vs baseline |",
            "|---|---|---|---|---|"]
    base_kept = jobs[("meshtrain", "1 rank")][0]["ranks"][0]["activation_bytes"]
    summary = {}
    for name in TRAIN_OPTIONS:
        if f"meshtrain {name}" not in speed:
            continue
        kept = jobs[("meshtrain", name)][0]["ranks"][0]["activation_bytes"]
        time_ratio = speed[f"meshtrain {name}"]["vs_meshtrain_1_rank"]
        summary[name] = {"time_ratio": time_ratio, "activation_bytes": kept,
                         "activation_ratio": kept / base_kept if kept is not None else None}
        memory = (f"{kept / 1e6:.2f} | {kept / base_kept:.2f}x" if kept is not None
                  else "n/a (compiled graphs are not seen by the eager counter) | -")
        rows.append(f"| {name} | 1 rank ({base_kept / 1e6:.2f} MB) | {time_ratio:.2f}x | {memory} |")
    return rows, summary


def driver(args: argparse.Namespace) -> None:
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    args.run_dir = str(out / "runs")
    wanted = [("transformers", "1 rank")] + [("meshtrain", n) for n in dict.fromkeys(THROUGHPUT + COMMUNICATION)
                                             if n not in args.skip]
    jobs: dict = {key: [] for key in wanted}
    for repeat in range(args.repeats):
        # the communication of a step does not change between repeats
        now = [(kind, name) for kind, name in wanted if not repeat or name in THROUGHPUT]
        launches = {(kind, LAYOUTS[name][0]): [] for kind, name in now}
        for kind, name in now:
            launches[(kind, LAYOUTS[name][0])].append(name)
        for (kind, ranks), names in launches.items():
            for name, result in zip(names, run_jobs(args, kind, names, out, repeat)):
                jobs[(kind, name)].append(result)
            print(f"  {kind} on {ranks} rank(s): {', '.join(names)} (repeat {repeat + 1}/{args.repeats}) done", flush=True)
    speed_rows, speed = throughput_table(args, jobs)
    comm_rows, comm = communication_table(args, jobs)
    memory_rows, memory = memory_table(jobs)
    option_rows, options = options_table(speed, jobs)
    table = "\n".join(["## Training throughput", "", *speed_rows, "",
                       "## Train options beside their baseline", "", *option_rows, "",
                       "## Communication per step (bytes each rank sends; bandwidth-optimal algorithms)", "",
                       *comm_rows, "",
                       "## Training state per rank: measured after a step vs `meshtrain plan`'s estimate", "",
                       *memory_rows])
    print("\n" + table)
    (out / "compare.md").write_text(table + "\n")
    (out / "compare.json").write_text(json.dumps({"throughput": speed, "communication": comm, "memory": memory,
                                                   "options": options,
                                                   "args": {k: v for k, v in vars(args).items() if k != "passthrough"}},
                                                  indent=1))
    print(f"\nwrote {out / 'compare.md'} and {out / 'compare.json'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default=None, help="fp32 on CPU, bf16 on CUDA")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per job and repeat")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--peak-tflops", type=float, default=None)
    parser.add_argument("--timeout", type=int, default=900, help="seconds per job")
    parser.add_argument("--out", default=str(ROOT / "runs" / "bench"))
    parser.add_argument("--skip", nargs="+", default=[], metavar="JOB", choices=[n for n in LAYOUTS if n != "1 rank"],
                        help="meshtrain jobs to leave out of every table (\"1 rank\" is every ratio's baseline)")
    parser.add_argument("--worker", choices=["meshtrain", "transformers"], help=argparse.SUPPRESS)
    parser.add_argument("--layout", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.dtype is None:
        import torch

        args.dtype = "bf16" if torch.cuda.is_available() else "fp32"
    if args.worker:
        (meshtrain_worker if args.worker == "meshtrain" else transformers_worker)(args)
        return
    if args.global_batch % (2 * args.micro_batch):
        parser.error(f"--global-batch {args.global_batch} must be a multiple of 2 x --micro-batch "
                     f"({2 * args.micro_batch}): dp2 splits it over two ranks")
    args.passthrough = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                        if k in ("hidden", "layers", "heads", "seq_len", "global_batch", "micro_batch", "dtype",
                                 "steps", "warmup") and v is not None]
    if args.peak_tflops is not None:
        args.passthrough.append(f"--peak-tflops={args.peak_tflops}")
    driver(args)


if __name__ == "__main__":
    main()
