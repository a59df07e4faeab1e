"""Validation: the objective on held-out data, in every layout, without touching training's state.

Every ``eval.interval`` steps (and after the last) the model runs forward only, in eval mode and
without gradients, over the same ``eval.steps`` global batches each time: the held-out dataset
from its start, or the split of the training samples held out of training. The micro-batches go
through the training step's own loop (``micro_batches.py``: the pipeline schedule's eval path
under PP, the sharded sequence and logits under CP and TP) and the objective's statistics are
summed over every batch, so the loss is weighted as training weighs it (cross-entropy: by target
tokens). Nothing random runs and the training data stream is not read, so a run with evaluation
trains exactly as one without.
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

from meshtrain.data.batch import Batch
from meshtrain.data.loader import BatchStream
from meshtrain.errors import DataError
from meshtrain.micro_batches import run_micro_batches


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
        self.stream.load_state_dict({"epoch": 0, "step_in_epoch": 0})  # the same batches every time
        for part in trainer.parts:
            part.eval()
        try:
            total = sum(run_micro_batches(trainer, [Batch.of(b) for b in self.stream.next_step()], training=False)
                        for _ in range(self.steps))
        finally:
            for part in trainer.parts:
                part.train()
        return trainer.objective.metrics(total, training=False)
