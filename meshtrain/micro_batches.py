"""One step's micro-batches through the model, for training and evaluation alike.

Under a pipeline the step's micro-batches go to the schedule as one batch (it splits them again),
forward and backward (``training``) or forward only; otherwise they run one after another, with
FSDP told which is the last. Either way each micro-batch computes on this rank's share of the
sequence under cp (``Trainer.sharded``), with the vocab-sharded logits under tp's loss parallel,
and the objective computes its loss from the logits and its target. The objective's statistics are
then summed over the stages and the dp x cp ranks: every rank returns the step's totals.

The same loop runs a preference objective's reference model (``objectives/reference.py``) forward
only over the step's batches, before the policy's pass.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.distributed.tensor.parallel import loss_parallel

from meshtrain.data.batch import Batch
from meshtrain.parallel.fsdp import before_micro_batch


def run_micro_batches(trainer, batches: list[Batch], training: bool) -> torch.Tensor:
    """The objective's statistics of these micro-batches, summed over the mesh (``Objective.sums``).
    With ``training`` the gradients are accumulated in the parameters."""
    objective, mesh = trainer.objective, trainer.mesh
    objective.begin(batches, trainer, training)
    forward_micro_batches(trainer, trainer.parts, trainer.pipeline, batches, backward=training)
    sums = objective.sums
    if mesh.size("pp") > 1:  # the last stage computed them
        dist.all_reduce(sums, group=mesh["pp"].get_group())
    if mesh.size("dp_cp") > 1:
        dist.all_reduce(sums, group=mesh["dp_cp"].get_group())
    return sums


def forward_micro_batches(trainer, parts, pipeline, batches: list[Batch], backward: bool) -> None:
    """``parts`` (driven by ``pipeline`` where there is one) over the micro-batches, the objective's
    loss on each; with ``backward``, its gradients accumulated."""
    objective, device = trainer.objective, trainer.runtime.device
    with loss_parallel() if trainer.loss_parallel else contextlib.nullcontext():
        if pipeline is not None:
            batch = Batch.joined(batches).to(device)
            target = objective.target(batch, 0)
            with trainer.sharded(batch, target, parts) as document_ids:
                objective.commit(pipeline.run(batch.inputs, target, document_ids, backward=backward))
            return
        (model,) = parts
        row, losses = 0, []
        for i, batch in enumerate(batches):
            if backward:
                before_micro_batch(model, trainer.cfg.parallel.fsdp_accumulate, last=i == len(batches) - 1)
            batch = batch.to(device)
            target = objective.target(batch, row)
            row += len(batch.inputs)
            with trainer.sharded(batch, target, parts) as document_ids:
                loss = objective(model(batch.inputs, document_ids), target)
                if backward:
                    loss.backward()
            losses.append(loss)
        objective.commit(losses)
