"""Import a Hugging Face directory into a layout, compute logits, export it again.

Writes OUT/logits.pt (the full logits, from the last pipeline stage), OUT/read_bytes_rankR (the
bytes of tensor data rank R asked the safetensors files for) and OUT/hf (the export). The forward
runs stage by stage with plain send/recv between pipeline ranks, so logits can be compared for pp
layouts too.
"""

import math

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.tensor import DTensor

from meshtrain.cli import parse
from meshtrain.config import JobConfig
from meshtrain.parallel.layout import plan_layout
from meshtrain.parallel.mesh import build_mesh
from meshtrain.commands.train import resolve
from meshtrain.trainer import Trainer

TOKENS = torch.randint(0, 384, (2, 48), generator=torch.Generator().manual_seed(0))


@torch.no_grad()
def pipelined_logits(trainer: Trainer) -> torch.Tensor | None:
    pp = trainer.mesh["pp"]
    rank, size = pp.get_local_rank(), pp.size()
    group = pp.get_group()
    (part,) = trainer.parts  # vpp=1
    if rank == 0:
        h = TOKENS
    else:
        h = torch.empty(*TOKENS.shape, trainer.cfg.model.hidden_size)
        dist.recv(h, group_src=rank - 1, group=group)
    out = part(h)
    if isinstance(out, DTensor):
        out = out.full_tensor()
    if rank < size - 1:
        dist.send(out.contiguous(), group_dst=rank + 1, group=group)
        return None
    return out


_ORIGINAL_READ = HuggingFaceStorageReader._process_read_request


def count_read_bytes() -> list[int]:
    """Wrap the reader's per-slice read to add up the bytes this rank requests (from zero, per job)."""
    total = [0]
    original = _ORIGINAL_READ

    def counting(self, f, req, planner):
        dtype = f.get_slice(req.storage_index.fqn).get_dtype()
        total[0] += math.prod(req.lengths) * {"F32": 4, "BF16": 2, "F16": 2}[dtype]
        return original(self, f, req, planner)

    HuggingFaceStorageReader._process_read_request = counting
    return total


def run(args, out, runtime) -> None:
    cfg = resolve(parse(JobConfig, [*args, "--train.run-dir", str(out / "run")], "hf job"))
    read = count_read_bytes()
    trainer = Trainer(cfg, runtime, build_mesh(plan_layout(cfg, runtime.world_size), runtime.device.type))
    (out / f"read_bytes_rank{runtime.rank}").write_text(str(read[0]))
    logits = pipelined_logits(trainer)
    if logits is not None and trainer.mesh["dp"].get_local_rank() == 0 and trainer.mesh["tp"].get_local_rank() == 0:
        torch.save(logits, out / "logits.pt")
    trainer.export_hf(str(out / "hf"))
