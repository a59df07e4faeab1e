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
over micro-batches exactly as without a pipeline. The mean loss lives on the rank of the last
stage; one all-reduce over the pp group gives it to every rank for logging.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class
from torch.distributed.tensor import DTensor

from meshtrain.parallel.layout import V_SCHEDULES
from meshtrain.models.transformer import Transformer


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
        self.parts, self.stage_ids, self.pp_mesh = parts, stage_ids, pp_mesh
        self.has_first = 0 in stage_ids
        self.has_last = num_stages - 1 in stage_ids
        group = pp_mesh.get_group()
        self.stages = [PipelineStage(part, sid, num_stages, device, group=group)
                       for part, sid in zip(parts, stage_ids)]
        cls = get_schedule_class(schedule)
        stages = self.stages[0] if issubclass(cls, PipelineScheduleSingle) else self.stages
        self.schedule = cls(stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=True)
        self.device, self.n_microbatches = device, n_microbatches

    def step(self, inputs: torch.Tensor, labels: torch.Tensor, document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Forward and backward of one optimizer step's batch; returns the mean micro-batch loss,
        on every pp rank. ``document_ids`` go to every stage (split into micro-batches like the inputs)."""
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.has_first else ()
        kwargs = {"document_ids": document_ids} if document_ids is not None else {}
        self.schedule.step(*args, target=labels if self.has_last else None, losses=losses,
                           return_outputs=False, **kwargs)
        loss = torch.zeros((), device=self.device)
        if self.has_last:
            loss += torch.stack([(x.full_tensor() if isinstance(x, DTensor) else x).detach().float()
                                 for x in losses]).mean()
        dist.all_reduce(loss, group=self.pp_mesh.get_group())
        return loss

    def eval_losses(self, inputs: torch.Tensor, labels: torch.Tensor,
                    document_ids: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Forward only, through the schedule's eval path: each micro-batch's loss (the schedule's
        loss function) on the last stage, zeros elsewhere."""
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.has_first else ()
        kwargs = {"document_ids": document_ids} if document_ids is not None else {}
        self.schedule.eval(*args, target=labels if self.has_last else None, losses=losses, return_outputs=False,
                           **kwargs)
        if not self.has_last:
            return [torch.zeros((), device=self.device)] * self.n_microbatches
        return [(x.full_tensor() if isinstance(x, DTensor) else x).detach().float() for x in losses]
