"""Token cross-entropy: pretraining and SFT."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from meshtrain.errors import TrainingError
from meshtrain.objectives.objective import Objective

IGNORE = -100


class TokenCrossEntropy(Objective):
    """The step's loss is the mean token cross-entropy over its target tokens (labels other than
    -100) in every micro-batch and dp rank, so micro-batches with more targets weigh more (what
    SFT's masked labels need; with every token a target it is the plain mean). Each micro-batch's
    loss is its summed cross-entropy times ``scale``, which also undoes the averaging that follows:
    FSDP's over dp x cp, the pipeline schedule's over micro-batches. Under tp with loss parallel the
    logits are vocab shards and torch's loss_parallel computes the sum from them."""

    def __init__(self):
        super().__init__(statistics=2)  # summed cross-entropy, target tokens
        self.scale = 1.0

    def begin(self, batches, trainer, training: bool) -> None:
        super().begin(batches, trainer, training)
        if not training:
            self.scale = 1.0
            return
        targets = sum(int((b.labels != IGNORE).sum()) for b in batches)
        mesh, dp = trainer.mesh, trainer.mesh["dp"]
        if trainer.cfg.data.format == "pretrain":  # every token a target, the same number on every dp rank
            targets *= dp.size()
        elif dp.size() > 1:  # cp ranks hold the same sequences: count them once
            total = torch.tensor(targets, dtype=torch.int64, device=trainer.runtime.device)
            dist.all_reduce(total, group=dp.get_group())
            targets = int(total)
        if targets == 0:
            raise TrainingError(f"step {trainer.step + 1} has no target tokens (every label is -100): its conversations' "
                                "responses were cut off by train.seq_len, or they have none. Fix: raise train.seq_len "
                                "or use data.overlong=drop; drop conversations without an assistant turn")
        per_microbatch = trainer.stream.accum if trainer.pipeline is not None else 1
        self.scale = mesh.size("dp_cp") * per_microbatch / targets

    def target(self, batch, first_row: int) -> torch.Tensor:
        return batch.labels

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        total = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum")
        value = total.full_tensor() if isinstance(total, DTensor) else total
        return self.keep(total * self.scale, self.add([value, (labels != IGNORE).sum()]))

    def metrics(self, sums: torch.Tensor, training: bool) -> dict[str, float]:
        loss = float(sums[0] / sums[1])
        if training:
            return {"loss": loss}
        return {"val_loss": loss, "val_ppl": math.exp(min(loss, 50.0)), "val_tokens": float(sums[1])}
