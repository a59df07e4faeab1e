"""The GPU check: one prepared run for a lent single GPU (H100/H200), in under 8 minutes.

    bash bench/gpu_check.sh                  # on the GPU machine; prints the table, writes runs/gpu_check/
    python bench/gpu_check.py --tiny         # the same plumbing on CPU at toy sizes (what the tests run)

1-rank bf16 training of a ~1.2B Llama and a small Qwen3-MoE (the grouped_mm expert path), meshtrain
eager vs train.compile vs compile + train.float8, beside transformers' eager training of the same
model (compare.py's loop: AutoModelForCausalLM from meshtrain's config.json, sdpa attention, the same
AdamW settings and clipping), each in its
own process one after the other. The table gives median tokens/s after warm-up, MFU and peak memory.
Then, also each in its own process: meshtrain's and transformers' loss on the same weights and batch
(they must agree within the precision's tolerance), meshtrain's tokens/s on packed batches with
document masking (a boolean block-causal SDPA mask) beside plain causal ones at a long sequence, and
which SDPA kernel each of the two attention calls reaches (the mask may lose the flash kernel).
A variant meshtrain refuses by design (float8 off CUDA) shows the refusal; any other
failure exits non-zero.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]

MODELS = {  # meshtrain model options, full size and --tiny
    "llama-1.2b": ({"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 16,
                    "num_key_value_heads": 8, "vocab_size": 32768, "max_position_embeddings": 2048},
                   {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                    "num_key_value_heads": 2, "vocab_size": 384, "max_position_embeddings": 64}),
    "qwen3-moe-small": ({"family": "qwen3_moe", "hidden_size": 1024, "intermediate_size": 2048, "num_hidden_layers": 8,
                         "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 64, "num_experts": 16,
                         "num_experts_per_tok": 2, "moe_intermediate_size": 1024, "vocab_size": 32768,
                         "max_position_embeddings": 2048},
                        {"family": "qwen3_moe", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                         "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 4, "num_experts_per_tok": 2,
                         "moe_intermediate_size": 32, "vocab_size": 384, "max_position_embeddings": 64}),
}
VARIANTS = {"meshtrain eager": [], "meshtrain compile": ["--train.compile", "True"],
            "meshtrain compile+float8": ["--train.compile", "True", "--train.float8", "True"]}


def options(model: dict) -> list[str]:
    return [arg for k, v in model.items() for arg in (f"--model.{k.replace('_', '-')}", str(v))]


def run_meshtrain(args, model: dict, extra: list[str], run_dir: pathlib.Path) -> dict:
    cmd = [sys.executable, "-m", "meshtrain", "train", *options(model), *extra, "--train.steps", str(args.steps),
           "--train.seq-len", str(args.seq_len), "--train.global-batch-size", str(args.batch),
           "--train.micro-batch-size", str(args.batch), "--train.mixed-precision", args.precision,
           "--train.run-dir", str(run_dir), "--checkpoint.resume", "never", "--logging.jsonl", "True",
           "--logging.progress", "off", "--lr-schedule.warmup-steps", "2"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode == 2 and ("is not supported" in proc.stderr or "needs CUDA" in proc.stderr):
        return {"refused": proc.stderr.strip().splitlines()[-1].removeprefix("meshtrain: error: ")}
    if proc.returncode != 0:
        raise SystemExit(f"meshtrain {' '.join(extra)} failed:\n{proc.stderr[-4000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][args.warmup:]
    return {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in rows),
            "mfu": statistics.median(r["mfu"] for r in rows) if "mfu" in rows[0] else None,
            "memory_gib": max(r["memory_gib"] for r in rows)}


def transformers_worker(args) -> None:
    """One process: transformers' eager training of the same model and batch (compare.py's loop)."""
    import torch

    from compare import transformers_step_times  # bench/ is this script's directory
    from meshtrain.config import JobConfig, LoggingConfig
    from meshtrain.config_files import from_dict
    from meshtrain.models.transformer import count_active_parameters, count_parameters
    from meshtrain.parallel.runtime import device_type_from_env
    from meshtrain.telemetry.metrics import flops_per_token, memory_gib, peak_tflops

    cfg = from_dict(JobConfig, {"model": json.loads(args.model_json),
                                "train": {"seq_len": args.seq_len, "global_batch_size": args.batch,
                                          "micro_batch_size": args.batch}})
    times = transformers_step_times(cfg, args.precision, args.steps)
    tok_s = args.batch * args.seq_len / statistics.median(times[args.warmup:])
    m = cfg.model
    per_token = flops_per_token(m, args.seq_len, count_active_parameters(m) if m.is_moe else count_parameters(m))
    device = torch.device(device_type_from_env())
    peak = peak_tflops(LoggingConfig(), device)
    pathlib.Path(args.result).write_text(json.dumps({
        "tokens_per_s": tok_s, "mfu": tok_s * per_token / 1e12 / peak if peak else None,
        "memory_gib": memory_gib(device)}))


def loss_worker(args) -> None:
    """One process: the loss of meshtrain's model and of transformers' model loaded from meshtrain's
    HF export of the same weights (from_pretrained, so transformers' own checkpoint conversions
    apply), on one batch, in the check's precision."""
    import tempfile

    import torch
    import torch.nn.functional as F
    import transformers
    from safetensors.torch import save_file

    from meshtrain.config import ModelConfig
    from meshtrain.config_files import from_dict
    from meshtrain.hf.adapter import hf_config_from_model, to_hf
    from meshtrain.models.initialize import init_weights
    from meshtrain.models.transformer import Transformer
    from meshtrain.parallel.runtime import device_type_from_env

    device = torch.device(device_type_from_env())
    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    cfg = from_dict(ModelConfig, json.loads(args.model_json))
    with torch.device(device):
        ours = Transformer(cfg)
    init_weights(ours, 0)
    for parameter in ours.parameters():  # as FSDP2's mixed precision: parameters only, RoPE tables in fp32
        parameter.data = parameter.data.to(dtype)
    ours.eval()
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq_len + 1),
                           generator=torch.Generator().manual_seed(0)).to(device)

    def loss(logits):
        return F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten()).item()

    with tempfile.TemporaryDirectory() as directory, torch.no_grad():
        state = to_hf({name: value.detach().cpu().contiguous() for name, value in ours.state_dict().items()}, cfg)
        save_file({name: value.contiguous() for name, value in state.items()}, f"{directory}/model.safetensors")
        pathlib.Path(directory, "config.json").write_text(json.dumps(hf_config_from_model(cfg, dtype)))
        theirs = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, attn_implementation="sdpa")
        theirs = theirs.to(device).eval()
        result = {"meshtrain": loss(ours(tokens[:, :-1])), "transformers": loss(theirs(tokens[:, :-1]).logits)}
    pathlib.Path(args.result).write_text(json.dumps(result))


def sdpa_worker(args) -> None:
    """One process: which SDPA operator (flash, efficient, cuDNN, math) a causal call and a call with a
    boolean block-causal mask (two documents) reach, at the check's sequence length, as
    torch.profiler names them."""
    import torch
    import torch.nn.functional as F
    from torch.profiler import profile

    from meshtrain.parallel.runtime import device_type_from_env

    device = torch.device(device_type_from_env())
    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    heads, head_dim, seq = 16, 128, args.seq_len
    q, k, v = (torch.randn(1, heads, seq, head_dim, device=device, dtype=dtype) for _ in range(3))
    document = torch.arange(seq, device=device) >= seq // 2
    mask = torch.ones(seq, seq, dtype=torch.bool, device=device).tril() & (document[:, None] == document[None, :])
    reached = {}
    for name, kwargs in (("causal", {"is_causal": True}), ("boolean mask", {"attn_mask": mask})):
        F.scaled_dot_product_attention(q, k, v, **kwargs)  # warm-up
        with profile() as prof:
            F.scaled_dot_product_attention(q, k, v, **kwargs)
        ops = sorted({e.key for e in prof.key_averages() if e.key.startswith("aten::_scaled_dot_product")
                      or e.key.startswith("aten::_efficient_attention") or e.key.startswith("aten::_flash_attention")})
        reached[name] = ", ".join(ops) or "none seen"
    pathlib.Path(args.result).write_text(json.dumps(reached))


def run_worker(args, mode: str, model: dict | None, result: pathlib.Path, seq_len: int, what: str) -> dict:
    """One of this script's workers (--worker, --loss-worker, --sdpa-worker) in its own process."""
    result.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, __file__, f"--{mode}", "--model-json", json.dumps(model or {}), "--result", str(result),
           f"--seq-len={seq_len}", *[f"--{k.replace('_', '-')}={getattr(args, k)}" for k in ("steps", "warmup", "batch",
                                                                                               "precision")]]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    if proc.returncode != 0:
        raise SystemExit(f"{what} failed:\n{proc.stderr[-4000:]}")
    return json.loads(result.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="toy sizes (CPU): checks the plumbing, not the speed")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated meshtrain variants")
    parser.add_argument("--out", default=str(ROOT / "runs" / "gpu_check"))
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--seq-len", type=int, default=None)
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--precision", default=None)
    parser.add_argument("--timeout", type=int, default=420)
    parser.add_argument("--long-seq-len", type=int, default=None, help="document masking's sequence (4096)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--loss-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--sdpa-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model-json", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker or args.loss_worker or args.sdpa_worker:
        (transformers_worker if args.worker else loss_worker if args.loss_worker else sdpa_worker)(args)
        return
    args.steps = args.steps or (4 if args.tiny else 12)
    args.warmup = min(args.warmup, args.steps - 1)
    args.seq_len = args.seq_len or (32 if args.tiny else 2048)
    args.batch = args.batch or (2 if args.tiny else 2)
    args.precision = args.precision or ("fp32" if args.tiny else "bf16")
    args.long_seq_len = args.long_seq_len or (64 if args.tiny else 4096)
    out = pathlib.Path(args.out)
    rows = ["| model | job | tokens/s | vs transformers | MFU | peak memory GiB |", "|---|---|---|---|---|---|"]
    summary = {}
    for name, (full, tiny) in MODELS.items():
        model = tiny if args.tiny else full
        name += " (tiny)" if args.tiny else ""
        results = {"transformers eager": run_worker(args, "worker", model, out / name.split()[0] / "transformers.json",
                                                   args.seq_len, "transformers eager")}
        for variant in args.variants.split(","):
            run_dir = out / name.split()[0] / variant.replace(" ", "_")
            results[variant] = run_meshtrain(args, model, VARIANTS[variant], run_dir)
            print(f"  {name}: {variant} done", flush=True)
        base = results["transformers eager"]["tokens_per_s"]
        for job, r in results.items():
            if "refused" in r:
                rows.append(f"| {name} | {job} | refused: {r['refused'][:140]} | - | - | - |")
                continue
            mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") else "n/a"
            rows.append(f"| {name} | {job} | {r['tokens_per_s']:,.0f} | {r['tokens_per_s'] / base:.2f}x | {mfu} | "
                        f"{r['memory_gib']:.2f} |")
        summary[name] = results
    rows += ["", "| model | first-step loss: meshtrain | transformers | difference | tolerance |", "|---|---|---|---|---|"]
    tolerance = 1e-2 if args.precision == "bf16" else 1e-5  # relative; bf16 rounds each op's output
    disagree = []
    for name, (full, tiny) in MODELS.items():
        model = tiny if args.tiny else full
        losses = run_worker(args, "loss-worker", model, out / name / "loss.json", args.seq_len, "the loss check")
        difference = abs(losses["meshtrain"] - losses["transformers"])
        rows.append(f"| {name}{' (tiny)' if args.tiny else ''} | {losses['meshtrain']:.5f} | {losses['transformers']:.5f} | {difference:.2e} | "
                    f"{tolerance:g} x loss |")
        if difference > tolerance * abs(losses["transformers"]):
            disagree.append(name)
        summary.setdefault(name + (" (tiny)" if args.tiny else ""), {})["first_step_loss"] = losses
    name, (full, tiny) = next(iter(MODELS.items()))
    model = tiny if args.tiny else full
    model = {**model, "max_position_embeddings": max(model["max_position_embeddings"], args.long_seq_len)}
    long = {**vars(args), "seq_len": args.long_seq_len, "batch": 1}
    masking = {mode: run_meshtrain(argparse.Namespace(**long), model, ["--data.document-mask", mode],
                                   out / name / f"document_mask_{mode}") for mode in ("off", "on")}
    rows += ["", f"| {name}{' (tiny)' if args.tiny else ''}, seq {args.long_seq_len}, packed samples | tokens/s | vs plain causal | peak memory GiB |",
             "|---|---|---|---|"]
    for mode, label in (("off", "plain causal"), ("on", "document-masked")):
        r = masking[mode]
        rows.append(f"| {label} | {r['tokens_per_s']:,.0f} | {r['tokens_per_s'] / masking['off']['tokens_per_s']:.2f}x "
                    f"| {r['memory_gib']:.2f} |")
    backends = run_worker(args, "sdpa-worker", None, out / "sdpa.json", args.long_seq_len, "the SDPA check")
    rows += ["", f"| SDPA at seq {args.long_seq_len} ({args.precision}) | operator reached |", "|---|---|"]
    rows += [f"| {call} | {ops} |" for call, ops in backends.items()]
    summary["document_masking"] = masking
    summary["sdpa"] = backends
    table = "\n".join(rows)
    print("\n" + table)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.md").write_text(table + "\n")
    (out / "gpu_check.json").write_text(json.dumps(summary, indent=1))
    if disagree:
        raise SystemExit(f"gpu_check: meshtrain's first-step loss differs from transformers' beyond {tolerance:g} "
                         f"(relative) for {', '.join(disagree)}")


if __name__ == "__main__":
    main()
