"""Hugging Face import/export throughput beside plain safetensors reads/writes of the same files,
and the extra memory an export takes.

    python bench/hf_io.py                  # ~60M-parameter Llama in bf16, 2 CPU ranks
    python bench/hf_io.py --ranks 4 --hidden 1024 --layers 16

One invocation: write a random bf16 checkpoint with ``safetensors.torch.save_file`` (the plain
write), read it back with ``load_file`` (the plain read), then on N ranks import it into an
FSDP-sharded model (``hf.io.load_hf_weights``) and export it (``hf.io.save_hf``). Both sides run
on the same files in the same page cache, so the ratios compare like with like. "Extra export
memory" is the peak resident-set growth of each rank during the export (sampled every 5 ms) over
that rank's share of the model; it shows that an export does not gather the model on one rank.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import resource
import subprocess
import sys
import threading
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from meshtrain.config import ModelConfig  # noqa: E402
from meshtrain.hf.adapter import hf_config_from_model, hf_shapes  # noqa: E402
from meshtrain.hf.io import shard_plan  # noqa: E402


def model_config(args) -> ModelConfig:
    return ModelConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                       num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                       num_key_value_heads=max(1, args.hidden // 256))


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    """Peak resident set size while the block runs, sampled from a thread."""

    def __enter__(self):
        self.base = self.peak = rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, rss_bytes())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())


def write_plain(cfg: ModelConfig, directory: pathlib.Path, shard_bytes: int) -> float:
    """A random bf16 HF checkpoint, written with save_file; returns the seconds the writes took."""
    from safetensors.torch import save_file

    shapes = hf_shapes(cfg)
    plan = shard_plan(shapes, dict.fromkeys(shapes, torch.bfloat16), shard_bytes)
    n = max(plan.values())
    gen = torch.Generator().manual_seed(0)
    files: dict[int, dict[str, torch.Tensor]] = {}
    for key, shape in shapes.items():
        files.setdefault(plan[key], {})[key] = (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
    directory.mkdir(parents=True)
    weight_map, elapsed = {}, 0.0
    for index, tensors in files.items():
        name = f"model-{index:05d}-of-{n:05d}.safetensors"
        start = time.perf_counter()
        save_file(tensors, str(directory / name), metadata={"format": "pt"})
        elapsed += time.perf_counter() - start
        weight_map |= dict.fromkeys(tensors, name)
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (directory / "config.json").write_text(json.dumps(hf_config_from_model(cfg, torch.bfloat16)))
    return elapsed


def read_plain(directory: pathlib.Path) -> float:
    """load_file, then the same bf16 -> fp32 cast the import does (load_file alone can hand back
    tensors that have not been touched yet)."""
    from safetensors.torch import load_file

    start = time.perf_counter()
    for f in sorted(directory.glob("*.safetensors")):
        for t in load_file(str(f)).values():
            t.float()
    return time.perf_counter() - start


def worker(args) -> None:
    import torch.distributed as dist

    from meshtrain.commands.convert import build_sharded
    from meshtrain.parallel.runtime import exit_process, init_distributed, shutdown
    from meshtrain.hf.adapter import resolve_init_from_hf
    from meshtrain.hf.io import export_dtypes, load_hf_weights, save_hf

    out = pathlib.Path(args.out)
    runtime = init_distributed(600)
    try:
        cfg = resolve_init_from_hf(ModelConfig(init_from_hf=str(out / "src")))
        parts = build_sharded(cfg, runtime.device)
        local = sum(p.to_local().numel() * 4 for p in parts[0].parameters())  # fp32 shards
        dist.barrier()
        start = time.perf_counter()
        load_hf_weights(parts, str(out / "src"))
        dist.barrier()
        import_s = time.perf_counter() - start
        dtypes = export_dtypes(cfg, "auto")
        with PeakRSS() as mem:
            start = time.perf_counter()
            save_hf(parts, str(out / "exported"), dtypes, max_shard_bytes=args.shard_mb * 10**6)
            export_s = time.perf_counter() - start
        result = {"rank": runtime.rank, "import_s": import_s, "export_s": export_s, "local_shard_bytes": local,
                  "export_rss_growth": mem.peak - mem.base,
                  "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
        results = [None] * runtime.world_size
        dist.all_gather_object(results, result)
        if runtime.is_main:
            (out / "ranks.json").write_text(json.dumps(results))
    except BaseException:
        shutdown()
        raise
    shutdown(synchronize=True)
    exit_process(0)  # gloo can abort in interpreter finalisation: see exit_process


def driver(args) -> None:
    import shutil

    out = pathlib.Path(args.out)
    for name in ("src", "exported", "ranks.json"):
        shutil.rmtree(out / name, ignore_errors=True) if (out / name).is_dir() else (out / name).unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    cfg = model_config(args)
    write_s = write_plain(cfg, out / "src", args.shard_mb * 10**6)
    gb = sum(f.stat().st_size for f in (out / "src").glob("*.safetensors")) / 1e9
    read_s = read_plain(out / "src")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.ranks}",
           __file__, "--worker", *sys.argv[1:]]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"worker failed:\n{proc.stderr[-4000:]}")
    ranks = json.loads((out / "ranks.json").read_text())
    import_s = max(r["import_s"] for r in ranks)
    export_s = max(r["export_s"] for r in ranks)
    params = sum(torch.Size(s).numel() for s in hf_shapes(cfg).values())
    rows = [
        ("plain safetensors read (load_file + cast to fp32, 1 process)", read_s, 1.0),
        (f"meshtrain import, {args.ranks} ranks (DCP HF reader, bf16 -> fp32 shards)", import_s, read_s / import_s),
        ("plain safetensors write (save_file, 1 process)", write_s, 1.0),
        (f"meshtrain export, {args.ranks} ranks (DCP HF writer + consolidation)", export_s, write_s / export_s),
    ]
    lines = [f"{params / 1e6:.1f}M parameters, {gb:.3f} GB of bf16 safetensors in "
             f"{len(list((out / 'src').glob('*.safetensors')))} files, {args.ranks} ranks", "",
             "| operation | s | GB/s | speed vs plain |", "|---|---|---|---|"]
    lines += [f"| {name} | {s:.2f} | {gb / s:.2f} | {ratio:.2f}x |" for name, s, ratio in rows]
    lines += ["", "| rank | fp32 shard MB | export RSS growth MB | growth / shard |", "|---|---|---|---|"]
    lines += [f"| {r['rank']} | {r['local_shard_bytes'] / 1e6:.1f} | {r['export_rss_growth'] / 1e6:.1f} | "
              f"{r['export_rss_growth'] / r['local_shard_bytes']:.2f} |" for r in ranks]
    table = "\n".join(lines)
    print(table)
    (out / "hf_io.md").write_text(table + "\n")
    (out / "hf_io.json").write_text(json.dumps({"params": params, "gb": gb, "plain_read_s": read_s,
                                                "plain_write_s": write_s, "import_s": import_s,
                                                "export_s": export_s, "ranks": ranks}, indent=1))
    shutil.rmtree(out / "src")
    shutil.rmtree(out / "exported")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--shard-mb", type=int, default=50)
    parser.add_argument("--out", default=str(ROOT / "runs" / "bench"))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    worker(args) if args.worker else driver(args)


if __name__ == "__main__":
    main()
