"""Run on every rank by torchrun: import a Hugging Face directory into a layout, compute logits,
export it again.

    torchrun ... tests/hf_worker.py OUT_DIR [meshtrain train options, --model.init-from-hf SRC ...]

Writes OUT_DIR/logits.pt (the full logits, from the last pipeline stage), OUT_DIR/read_bytes_rankR
(the bytes of tensor data rank R asked the safetensors files for) and OUT_DIR/hf (the export). The forward runs stage by stage with plain send/recv between pipeline ranks, so logits
can be compared for pp layouts too.
"""

import math
import pathlib
import sys

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.tensor import DTensor

from meshtrain.cli import parse
from meshtrain.config import JobConfig
from meshtrain.parallel.runtime import exit_process, init_distributed, shutdown, world_size_from_env
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


def count_read_bytes() -> list[int]:
    """Wrap the reader's per-slice read to add up the bytes this rank requests."""
    total = [0]
    original = HuggingFaceStorageReader._process_read_request

    def counting(self, f, req, planner):
        dtype = f.get_slice(req.storage_index.fqn).get_dtype()
        total[0] += math.prod(req.lengths) * {"F32": 4, "BF16": 2, "F16": 2}[dtype]
        return original(self, f, req, planner)

    HuggingFaceStorageReader._process_read_request = counting
    return total


def main() -> None:
    out, args = pathlib.Path(sys.argv[1]), sys.argv[2:]
    cfg = resolve(parse(JobConfig, args, "hf_worker"))
    layout = plan_layout(cfg, world_size_from_env())
    runtime = init_distributed(cfg.parallel.timeout_s)
    try:
        read = count_read_bytes()
        trainer = Trainer(cfg, runtime, build_mesh(layout, runtime.device.type))
        (out / f"read_bytes_rank{runtime.rank}").write_text(str(read[0]))
        logits = pipelined_logits(trainer)
        if logits is not None and trainer.mesh["dp"].get_local_rank() == 0 and trainer.mesh["tp"].get_local_rank() == 0:
            torch.save(logits, out / "logits.pt")
        trainer.export_hf(str(out / "hf"))
    except BaseException:
        shutdown()
        raise
    shutdown(synchronize=True)
    exit_process(0)  # see exit_process: a clean exit without gloo's teardown race


if __name__ == "__main__":
    main()
