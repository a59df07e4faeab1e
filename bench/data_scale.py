"""Data at scale: per-rank memory against corpus size, the loader against the step, and
``meshtrain prepare`` against ``tokenizers``' own batch encoding.

    python bench/data_scale.py                      # ~5 min on 2 CPU cores: corpora of 0.01, 0.5, 1.5 GB
    python bench/data_scale.py --sizes-gb 0.01 0.05 --prepare-mb 2 --ranks 2    # what the tests run

1. RSS per rank: token corpora of each size are generated (random ids, documents of 500-4000 tokens,
   written by ``data.indexed.IndexedWriter``), then a tiny model trains on each with ``--ranks``
   CPU ranks from ``data.path=PREFIX``. Every rank reports its resident memory after the steps:
   anonymous (what the process allocated) and file-backed (mapped corpus pages it touched, shared
   page cache), and the seconds from process start to the end of its first step.
2. Loader vs step: the same runs time ``BatchStream.next_step()`` (the data of one optimizer step)
   beside a whole training step.
3. Prepare: jsonl text is tokenized with a BPE ``tokenizer.json`` (trained here on the bundled
   corpus) by ``meshtrain prepare`` (its worker processes plus the writer), and by ``tokenizers``'
   ``encode_batch`` in one process over the same documents, output discarded: tokens/s side by side.
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
START = time.time()


def generate(prefix: pathlib.Path, gigabytes: float, vocab: int) -> int:
    """Random uint16 ids in documents of 500-4000 tokens; returns the token count."""
    import torch

    from meshtrain.data.indexed import IndexedWriter

    if pathlib.Path(f"{prefix}.idx").is_file():
        return pathlib.Path(f"{prefix}.bin").stat().st_size // 2
    total, g = int(gigabytes * 1e9) // 2, torch.Generator().manual_seed(0)
    writer = IndexedWriter(prefix, torch.uint16)
    written = 0
    while written < total:
        n = min(1 << 24, total - written)
        sizes = torch.randint(500, 4001, (n // 500 + 1,), generator=g)
        sizes = sizes[: int((sizes.cumsum(0) < n).sum()) + 1]
        sizes[-1] -= int(sizes.sum()) - n
        writer.add_documents(torch.randint(0, vocab, (n,), generator=g, dtype=torch.int32), sizes.tolist())
        written += n
    writer.close()
    return written


def rss() -> dict:
    fields = {}
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
            fields[key] = int(value.split()[0]) * 1024
    return fields


def train_worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    from meshtrain.cli import parse
    from meshtrain.commands.train import resolve
    from meshtrain.config import JobConfig
    from meshtrain.parallel.layout import plan_layout
    from meshtrain.parallel.mesh import build_mesh
    from meshtrain.parallel.runtime import exit_process, init_distributed, shutdown
    from meshtrain.trainer import Trainer

    cfg = resolve(parse(JobConfig, [
        "--data.path", args.data, "--train.run-dir", args.run_dir, "--train.steps", str(args.steps),
        "--model.hidden-size", "64", "--model.intermediate-size", "128", "--model.num-hidden-layers", "2",
        "--model.num-attention-heads", "4", "--model.num-key-value-heads", "2", "--model.vocab-size", str(args.vocab),
        "--train.seq-len", "512", "--train.global-batch-size", str(4 * args.ranks), "--train.micro-batch-size", "2",
        "--logging.progress", "off", "--logging.jsonl", "False"], "bench"))
    runtime = init_distributed(cfg.parallel.timeout_s)
    trainer = Trainer(cfg, runtime, build_mesh(plan_layout(cfg, runtime.world_size), runtime.device.type))
    steps = [trainer.train_step()["step_time_s"]]
    first_step_done = time.time() - START
    steps += [trainer.train_step()["step_time_s"] for _ in range(args.steps - 1)]
    loads = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        trainer.stream.next_step()
        loads.append(time.perf_counter() - t0)
    mine = {"rss": rss(), "first_step_s": first_step_done, "step_s": sorted(steps[1:])[len(steps[1:]) // 2],
            "load_s": sorted(loads)[len(loads) // 2]}
    every = [None] * runtime.world_size
    dist.all_gather_object(every, mine)
    if runtime.is_main:
        pathlib.Path(args.result).write_text(json.dumps(every))
    shutdown(synchronize=True)
    exit_process(0)


def run_training(args, prefix: pathlib.Path, out: pathlib.Path) -> list[dict]:
    result = out / f"result-{prefix.name}.json"  # not PREFIX.json: that is the dataset's metadata
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.ranks}",
           str(pathlib.Path(__file__).resolve()), "--worker", "--data", str(prefix), "--result", str(result),
           "--run-dir", str(out / "runs" / prefix.name), "--steps", str(args.steps), "--vocab", str(args.vocab),
           "--ranks", str(args.ranks)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode:
        print(proc.stderr[-4000:], file=sys.stderr)
        raise SystemExit(f"training on {prefix} failed")
    return json.loads(result.read_text())


def prepare_side_by_side(args, out: pathlib.Path) -> dict:
    import tokenizers
    from tokenizers import models, pre_tokenizers, trainers

    from meshtrain.commands.prepare import PrepareConfig, prepare
    from meshtrain.config import DataConfig

    text = pathlib.Path(DataConfig().path).read_text()
    tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator([text], trainers.BpeTrainer(vocab_size=8000, special_tokens=["<unk>", "<|endoftext|>"]))
    tok.save(str(out / "tokenizer.json"))
    paragraphs = [p for p in text.split("\n\n") if p.strip()]
    src = out / "text"
    src.mkdir(exist_ok=True)
    documents, size = [], 0
    with open(src / "docs.jsonl", "w") as f:
        while size < args.prepare_mb * 1e6:
            for p in paragraphs:
                documents.append(p)
                line = json.dumps({"text": p}) + "\n"
                f.write(line)
                size += len(line)
    t0 = time.perf_counter()
    meta = prepare(PrepareConfig(input=str(src), output=str(out / "prepared"), tokenizer=str(out / "tokenizer.json"),
                                 force=True))
    prepare_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    tokens = 0
    for i in range(0, len(documents), 256):
        tokens += sum(len(e.ids) for e in tok.encode_batch(documents[i:i + 256], add_special_tokens=False))
    encode_s = time.perf_counter() - t0
    return {"mb": size / 1e6, "documents": len(documents), "tokens": meta["tokens"], "prepare_s": prepare_s,
            "prepare_tokens_per_s": meta["tokens"] / prepare_s, "workers": meta["workers"],
            "encode_batch_s": encode_s, "encode_batch_tokens_per_s": tokens / encode_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-gb", type=float, nargs="+", default=[0.01, 0.5, 1.5])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--vocab", type=int, default=384)
    parser.add_argument("--prepare-mb", type=float, default=20)
    parser.add_argument("--out", default=str(ROOT / "runs" / "data_scale"))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        train_worker(args)
        return
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = ["| corpus | tokens | rank | RSS MB | anonymous MB | file-backed MB | start to step 1 s | "
            "loader s/step | train s/step | loader / step |", "|---|---|---|---|---|---|---|---|---|---|"]
    results = {}
    for gb in args.sizes_gb:
        prefix = out / f"corpus_{gb:g}gb"
        tokens = generate(prefix, gb, args.vocab)
        ranks = run_training(args, prefix, out)
        results[f"{gb:g}"] = {"tokens": tokens, "ranks": ranks}
        for rank, r in enumerate(ranks):
            m = r["rss"]
            rows.append(f"| {gb:g} GB | {tokens:,} | {rank} | {m['VmRSS'] / 1e6:.0f} | {m['RssAnon'] / 1e6:.0f} | "
                        f"{m['RssFile'] / 1e6:.0f} | {r['first_step_s']:.1f} | {r['load_s'] * 1e3:.2f} ms | "
                        f"{r['step_s'] * 1e3:.0f} ms | {r['load_s'] / r['step_s']:.3f} |")
        print(f"  {gb:g} GB done", flush=True)
    results["prepare"] = p = prepare_side_by_side(args, out)
    table = "\n".join(["## Per-rank memory and the loader, by corpus size", "", *rows, "",
                       "## meshtrain prepare beside tokenizers' encode_batch", "",
                       "| input | documents | tokens | meshtrain prepare tokens/s | encode_batch tokens/s (1 process, "
                       "nothing written) | ratio |", "|---|---|---|---|---|---|",
                       f"| {p['mb']:.1f} MB jsonl | {p['documents']:,} | {p['tokens']:,} | "
                       f"{p['prepare_tokens_per_s']:,.0f} ({p['workers']} workers) | "
                       f"{p['encode_batch_tokens_per_s']:,.0f} | {p['prepare_tokens_per_s'] / p['encode_batch_tokens_per_s']:.2f}x |"])
    print("\n" + table)
    (out / "data_scale.md").write_text(table + "\n")
    (out / "data_scale.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
