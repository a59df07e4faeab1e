"""Run on every rank by torchrun: import a Hugging Face directory into a layout, compute logits,
export it again.

    torchrun ... tests/hf_worker.py OUT_DIR [meshtrain train options, --model.init-from-hf SRC ...]

Writes OUT_DIR/logits.pt (the full logits, from the last pipeline stage) and OUT_DIR/hf (the
export). The forward runs stage by stage with plain send/recv between pipeline ranks, so logits
can be compared for pp layouts too.
"""

import pathlib
import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from meshtrain.cli import parse
from meshtrain.config import JobConfig
from meshtrain.distributed import init_distributed, shutdown, world_size_from_env
from meshtrain.mesh import build_mesh, plan_layout
from meshtrain.train import Trainer, resolve

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


def main() -> None:
    out, args = pathlib.Path(sys.argv[1]), sys.argv[2:]
    cfg = resolve(parse(JobConfig, args, "hf_worker"))
    layout = plan_layout(cfg, world_size_from_env())
    runtime = init_distributed(cfg.parallel.timeout_s)
    try:
        trainer = Trainer(cfg, runtime, build_mesh(layout, runtime.device.type))
        logits = pipelined_logits(trainer)
        if logits is not None and trainer.mesh["dp"].get_local_rank() == 0 and trainer.mesh["tp"].get_local_rank() == 0:
            torch.save(logits, out / "logits.pt")
        trainer.export_hf(str(out / "hf"))
    finally:
        shutdown()


if __name__ == "__main__":
    main()
