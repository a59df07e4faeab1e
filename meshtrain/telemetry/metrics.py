"""Per-step metrics: throughput, FLOPs and MFU, memory, and where they are written.

FLOPs per token follow the PaLM appendix B accounting used by Megatron and torchtitan:
6 * (non-embedding parameters) for the matmuls of forward + backward, plus per layer 6 * heads *
(query/key dims + value dims of a head) * seq_len for attention scores and values (12 * heads *
head_dim where both are head_dim; a sliding-window layer: its window, when shorter). MFU divides
the achieved FLOP/s per device by the device's peak, given by ``logging.peak_tflops`` or looked up from the CUDA device name.
"""

from __future__ import annotations

import json
import pathlib
import resource
import sys

import torch

from meshtrain.config import LoggingConfig, ModelConfig
from meshtrain.errors import TrainingError
from meshtrain.run_dir import describe_write_error
from meshtrain.telemetry.backends import open_backends

# Dense bf16 peak TFLOP/s by CUDA device name fragment.
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0, "B200": 2250.0}


def flops_per_token(cfg: ModelConfig, seq_len: int, num_params: int) -> float:
    embedding = cfg.vocab_size * cfg.hidden_size
    dense = num_params - embedding  # the lm_head matmul counts, the embedding lookup does not
    if cfg.tie_word_embeddings:
        dense = num_params
    # Each query meets seq_len keys (PaLM's count, causal or not), or its window's on a local layer.
    spans = sum(min(seq_len, cfg.definition.sliding_window(cfg, i) or seq_len) for i in range(cfg.num_hidden_layers))
    qk_dim, v_dim = cfg.definition.attention_dims(cfg)  # latent attention: 192 and 128 in DeepSeek-V3
    attention = 6 * cfg.num_attention_heads * (qk_dim + v_dim) * spans
    return 6 * dense + attention


def peak_tflops(cfg: LoggingConfig, device: torch.device) -> float | None:
    if cfg.peak_tflops is not None:
        return cfg.peak_tflops
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        return next((v for k, v in PEAK_TFLOPS.items() if k in name), None)
    return None


def memory_gib(device: torch.device) -> float:
    """Peak device memory (CUDA) or peak resident memory of this process (CPU), in GiB."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # ru_maxrss is KiB on Linux


class MetricsLogger:
    """Rank 0 writes: a progress bar on a terminal or plain lines, metrics.jsonl, and the dashboards
    of telemetry/backends.py (TensorBoard, W&B), which get ``config`` and the ``layout`` line too."""

    def __init__(self, cfg: LoggingConfig, run_dir: pathlib.Path, total_steps: int, enabled: bool,
                 start_step: int = 0, config: dict | None = None, layout: str = ""):
        self.cfg, self.total_steps, self.enabled = cfg, total_steps, enabled
        self.bar = cfg.progress == "on" or (cfg.progress == "auto" and sys.stdout.isatty())
        self._jsonl, self._backends = None, []
        if not enabled:
            return
        if cfg.jsonl:
            try:
                keep_steps_up_to(run_dir / "metrics.jsonl", start_step)
                self._jsonl = (run_dir / "metrics.jsonl").open("a")
            except OSError as e:
                raise TrainingError(describe_write_error(e, "metrics")) from None
        self._backends = open_backends(cfg, run_dir, config or {}, layout)

    def info(self, message: str) -> None:
        if self.enabled:
            if self.bar:
                sys.stdout.write("\r\033[K")
            print(message, flush=True)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        if self._jsonl:
            try:
                self._jsonl.write(json.dumps({"step": step, **metrics}) + "\n")
                self._jsonl.flush()
            except OSError as e:
                raise TrainingError(describe_write_error(e, "metrics", self._jsonl.name)) from None
        for backend in self._backends:
            backend.log(step, metrics)
        if step % self.cfg.log_every and step != self.total_steps:
            return
        line = format_metrics(step, self.total_steps, metrics)
        if self.bar:
            done = int(30 * step / self.total_steps)
            sys.stdout.write(f"\r\033[K[{'#' * done}{'.' * (30 - done)}] {line}")
            sys.stdout.flush()
            if step == self.total_steps:
                sys.stdout.write("\n")
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        for backend in self._backends:
            backend.close()


def keep_steps_up_to(path: pathlib.Path, step: int) -> None:
    """Drop the records of steps after ``step`` (the step a run starts from): a resumed run replays
    them, and the file keeps each step once, as the run that led to the current weights saw it.
    A torn last line (a crash mid-write) goes too."""
    if not path.is_file():
        return
    lines = path.read_text().splitlines(keepends=True)
    kept = [line for line in lines if (s := _step_of(line)) is not None and s <= step]
    if len(kept) != len(lines):
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(kept))
        tmp.replace(path)


def _step_of(line: str) -> int | None:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None


def format_metrics(step: int, total: int, m: dict[str, float]) -> str:
    mfu = f"{100 * m['mfu']:.1f}%" if "mfu" in m else "n/a"
    return (f"step {step:>{len(str(total))}}/{total}  loss {m['loss']:.4f}  grad_norm {m['grad_norm']:.3f}  "
            f"lr {m['lr']:.2e}  tok/s {m['tokens_per_s']:,.0f}  TFLOP/s/dev {m['tflops_per_device']:.3f}  "
            f"MFU {mfu}  mem {m['memory_gib']:.2f}GiB"
            + (f"  aux {m['moe_aux_loss']:.3f}  imbalance {m['moe_imbalance']:.2f}" if "moe_imbalance" in m else "")
            + (f"  dropped {100 * m['moe_dropped']:.1f}%" if "moe_dropped" in m else "")
            + (f"  reward acc {m['rewards/accuracies']:.2f}  margin {m['rewards/margins']:.3f}"
               if "rewards/margins" in m else "")
            + (f"  val_loss {m['val_loss']:.4f}" if "val_loss" in m else "")
            + (f"  val_ppl {m['val_ppl']:.2f}" if "val_ppl" in m else "")
            + (f"  val_reward_acc {m['val_rewards/accuracies']:.2f}" if "val_rewards/accuracies" in m else ""))
