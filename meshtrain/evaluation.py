"""Validation: the loss over held-out data, in every layout, without touching training's state.

Every ``eval.interval`` steps (and after the last) the model runs forward only, in eval mode and
without gradients, over the same ``eval.steps`` global batches each time: the held-out dataset
from its start, or the split of the training samples held out of training. The loss is weighted by
the number of valid tokens (labels other than -100): the summed token cross-entropy over
micro-batches, pipeline stages and dp x cp ranks, divided by their count. The trainer's loss
function (the pipeline schedule's too) computes that sum while its scale is held at 1. Under PP the
schedule's own eval path runs the micro-batches; under CP and TP the loss is computed on the
sharded sequence and logits as in training. Nothing random runs and the training data stream is
not read, so a run with evaluation trains exactly as one without.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel
from torch.utils.data import Dataset

from meshtrain.data.loader import BatchStream
from meshtrain.errors import DataError

IGNORE = -100


class Evaluator:
    def __init__(self, trainer, dataset: Dataset, source: str):
        cfg = trainer.cfg
        t, e = cfg.train, cfg.eval
        need = e.steps * t.global_batch_size
        if len(dataset) < need:
            raise DataError(f"eval: {source} holds {len(dataset):,} samples of train.seq_len+1 tokens; eval.steps="
                            f"{e.steps} x train.global_batch_size={t.global_batch_size} needs {need:,}. Fix: give "
                            "more held-out data (eval.data / eval.split) or lower eval.steps")
        dp = trainer.mesh["dp"]
        self.trainer, self.steps = trainer, e.steps
        self.stream = BatchStream(dataset, global_batch=t.global_batch_size, micro_batch=t.micro_batch_size,
                                  dp_size=dp.size(), dp_rank=dp.get_local_rank(), shuffle=False, seed=t.seed,
                                  num_workers=0)

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        trainer = self.trainer
        mesh, device = trainer.mesh, trainer.runtime.device
        self.stream.load_state_dict({"epoch": 0, "step_in_epoch": 0})  # the same batches every time
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        tokens = torch.zeros((), dtype=torch.float64, device=device)
        for part in trainer.parts:
            part.eval()
        # The training step's scale (its target count, FSDP's and the schedule's averaging) does not
        # apply here: every micro-batch's loss is its plain sum.
        train_scale, trainer.loss_fn.scale = trainer.loss_fn.scale, 1.0
        try:
            for _ in range(self.steps):
                batches = self.stream.next_step()
                with loss_parallel() if trainer.loss_parallel else contextlib.nullcontext():
                    s, n = self._batch_loss(batches, device)
                loss_sum += s
                tokens += n
        finally:
            trainer.loss_fn.scale = train_scale
            for part in trainer.parts:
                part.train()
        if trainer.pipeline is not None:  # the last stage holds the loss; every stage the token count
            dist.all_reduce(loss_sum, group=mesh["pp"].get_group())
        totals = torch.stack([loss_sum, tokens])
        if mesh["dp_cp"].size() > 1:
            dist.all_reduce(totals, group=mesh["dp_cp"].get_group())
        loss = float(totals[0] / totals[1])
        return {"val_loss": loss, "val_ppl": math.exp(min(loss, 50.0)), "val_tokens": float(totals[1])}

    def _batch_loss(self, batches, device) -> tuple[torch.Tensor, torch.Tensor]:
        trainer = self.trainer
        if trainer.pipeline is not None:
            inputs, labels, *documents = (torch.cat(x).to(device) for x in zip(*batches))
            with trainer.sharded(inputs, labels, *documents) as document_ids:
                sums = trainer.pipeline.eval_losses(inputs, labels, document_ids)
                valid = (labels != IGNORE).sum()
            return torch.stack(sums).double().sum(), valid.double()
        (model,) = trainer.parts
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        count = torch.zeros((), dtype=torch.float64, device=device)
        for inputs, labels, *documents in batches:
            inputs, labels = inputs.to(device), labels.to(device)
            with trainer.sharded(inputs, labels, *documents) as document_ids:
                total = trainer.loss_fn(model(inputs, document_ids), labels)
                valid = (labels != IGNORE).sum()
            loss_sum += (total.full_tensor() if isinstance(total, DTensor) else total).double()
            count += valid
        return loss_sum, count
