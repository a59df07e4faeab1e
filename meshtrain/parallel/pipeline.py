"""Pipeline parallelism: the model cut into pp x vpp stages, run by a ``torch.distributed.pipelining``
schedule over the mesh's "pp" dim.

Each stage is a ``Transformer`` built on the meta device and pruned to its layers (``keep_only``):
the first stage keeps the embedding, the last the final norm and output head, and every kept layer
its global index, so a stage's parameter names are the whole model's names and checkpoints see
one global model however it was split. Stages are then tensor-parallelised, FSDP-sharded and
initialised like a whole model (``parallel.parallelize.build_model``), and wrapped in ``PipelineStage``.

Placement of the pp*vpp stages on the pp ranks follows the schedule: one per rank (GPipe, 1F1B),
looped (rank r holds r, r+pp, ...; Interleaved1F1B, LoopedBFS, InterleavedZeroBubble), or a V for
ZBVZeroBubble and DualPipeV (rank r holds r and 2*pp-1-r, so rank 0 has both the first and the
last stage).

The schedule splits each step's batch into n_microbatches = global / (micro * dp) chunks, and
divides the accumulated gradients by that count (``scale_grads``), so the gradients are the mean
over micro-batches exactly as without a pipeline. The loss function (the objective) runs on the
rank of the last stage; what it records for the logs is summed over the pp group afterwards.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

from meshtrain.parallel._torch_private import pipeline_stage_class
from meshtrain.parallel.layout import V_SCHEDULES
from meshtrain.models.moe import statistics_paused
from meshtrain.models.transformer import Transformer

PipelineStage = pipeline_stage_class(statistics_paused)
"""torch's, whose extra forward to learn a stage's shapes (on the first step) leaves the experts'
load statistics, and so the aux-loss-free routing biases, alone."""


def stage_ids_for_rank(pp_rank: int, pp: int, vpp: int, schedule: str) -> list[int]:
    """The pipeline stages that pp rank ``pp_rank`` runs, in the order the schedule expects."""
    if schedule in V_SCHEDULES:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + v * pp for v in range(vpp)]


def layer_range(stage: int, stage_layers: tuple[int, ...]) -> range:
    start = sum(stage_layers[:stage])
    return range(start, start + stage_layers[stage])


def split_for_stage(model: Transformer, stage: int, stage_layers: tuple[int, ...]) -> None:
    """Prune a (meta) whole model to what pipeline stage ``stage`` runs."""
    model.keep_only(layer_range(stage, stage_layers), embedding=stage == 0, head=stage == len(stage_layers) - 1)


class Pipeline:
    """This rank's stages and the schedule that drives them."""

    def __init__(self, parts: list[Transformer], stage_ids: list[int], num_stages: int, pp_mesh: DeviceMesh,
                 device: torch.device, schedule: str, n_microbatches: int,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
        self.parts, self.stage_ids = parts, stage_ids
        self.has_first = 0 in stage_ids
        self.has_last = num_stages - 1 in stage_ids
        group = pp_mesh.get_group()
        self.stages = [PipelineStage(part, sid, num_stages, device, group=group)
                       for part, sid in zip(parts, stage_ids)]
        cls = get_schedule_class(schedule)
        stages = self.stages[0] if issubclass(cls, PipelineScheduleSingle) else self.stages
        self.schedule = cls(stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=True)

    def run(self, inputs: torch.Tensor, target: torch.Tensor, document_ids: torch.Tensor | None = None,
            backward: bool = True) -> list[torch.Tensor]:
        """One step's batch through the schedule: forward and backward, or (``backward=False``) forward
        only through the schedule's eval path. The loss function sees each micro-batch's logits and
        target on the last stage; returns those micro-batches' losses there (nothing elsewhere).
        ``document_ids`` go to every stage (split into micro-batches like the inputs)."""
        args = (inputs,) if self.has_first else ()
        kwargs = {"document_ids": document_ids} if document_ids is not None else {}
        target = target if self.has_last else None
        losses: list[torch.Tensor] = []
        run = self.schedule.step if backward else self.schedule.eval
        run(*args, target=target, losses=losses, return_outputs=False, **kwargs)
        return losses
