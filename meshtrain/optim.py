"""AdamW, the learning-rate schedule, and gradient clipping across the whole mesh.

The global gradient norm costs one all-reduce over the world, whatever the layout: each rank sums
the squares of the gradient elements it holds, divided by how many ranks hold the same elements
(a tp-replicated norm weight is held by every tp rank), so the world-wide sum counts each element
once. That covers every mesh dim at once (pp stages included) instead of the sequential
per-dim all-reduces of ``DTensor.full_tensor`` on a multi-dim mesh.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate

from meshtrain.config import LRScheduleConfig, OptimizerConfig
from meshtrain.parallel.mesh import ParallelMesh


def build_optimizer(parts: list[nn.Module], cfg: OptimizerConfig) -> torch.optim.AdamW:
    """One AdamW over the model parts of this rank (several pipeline stages, or the whole model)."""
    # Keyed by (decays, is a DTensor): foreach kernels refuse a list mixing DTensors and plain
    # tensors, which tensor parallelism without FSDP gives (Qwen3's replicated q/k norms beside plain norms).
    # Keyed by the mesh too: expert-parallel experts are DTensors on another mesh than FSDP's.
    groups: dict[tuple[bool, str], list] = {}
    for part in parts:
        for p in (p for p in part.parameters() if p.requires_grad):  # frozen ones (under LoRA) get no state
            kind = str(p.device_mesh.mesh_dim_names) if isinstance(p, DTensor) else ""
            groups.setdefault((p.ndim >= 2, kind), []).append(p)  # norm weights are 1-D
    groups = [{"params": params, "weight_decay": cfg.weight_decay if decays else 0.0}
              for (decays, _), params in sorted(groups.items(), reverse=True)]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, foreach=True)


def lr_multiplier(step: int, total_steps: int, cfg: LRScheduleConfig) -> float:
    """Multiplier of the peak lr before optimizer step ``step`` (0-based)."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.decay == "constant":
        return 1.0
    span = max(1, total_steps - cfg.warmup_steps - 1)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if cfg.decay == "cosine" else 1 - progress
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * shape


def build_lr_scheduler(optimizer: torch.optim.Optimizer, total_steps: int, cfg: LRScheduleConfig):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_multiplier(s, total_steps, cfg))


def _replication(grad: torch.Tensor, ranks_per_stage: int) -> int:
    """How many ranks of one pipeline stage hold these same gradient elements."""
    if not isinstance(grad, DTensor):
        return ranks_per_stage
    mesh = grad.device_mesh
    factor = ranks_per_stage // mesh.size()
    for dim, placement in enumerate(grad.placements):
        if isinstance(placement, Partial):
            raise RuntimeError(f"gradient left Partial on mesh dim {dim}: a parallel plan is incomplete")
        if isinstance(placement, Replicate):
            factor *= mesh.size(dim)
    return factor


@torch.no_grad()
def clip_grad_norm_(params: list[torch.Tensor], max_norm: float, mesh: ParallelMesh,
                    counted_elsewhere: list[torch.Tensor] = ()) -> torch.Tensor:
    """Global L2 norm of all gradients (returned); scales them to ``max_norm`` if it is > 0.
    ``counted_elsewhere``: copies of a parameter held elsewhere too (a tied head under pp), scaled
    but not counted in the norm again."""
    grads = [p.grad for p in params if p.grad is not None]
    skipped = {id(p.grad) for p in counted_elsewhere if p.grad is not None}
    ranks_per_stage = mesh.world.size() // mesh.size("pp")
    device = grads[0].device if grads else torch.device(mesh.device_type)
    total = torch.zeros((), dtype=torch.float64, device=device)
    for g in (g for g in grads if id(g) not in skipped):
        local = g.to_local() if isinstance(g, DTensor) else g
        total += local.double().pow(2).sum() / _replication(g, ranks_per_stage)
    dist.all_reduce(total)
    norm = total.sqrt().float()
    if max_norm > 0:
        scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for g in grads:
            (g.to_local() if isinstance(g, DTensor) else g).mul_(scale)
    return norm
