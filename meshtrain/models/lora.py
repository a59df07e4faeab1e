"""LoRA: W x + (alpha / r) B A x on chosen linear layers, with W (and everything else) frozen.

The adapters live on the linear module itself (``q_proj.lora_A`` [r, in], ``q_proj.lora_B``
[out, r]), so the base weight keeps its name and PEFT's adapter names are those plus ``.weight``.
They are added after tensor parallelism, placed to follow the base layer: for a column-parallel W
(Shard(0)) A is replicated and B split like W's rows; for a row-parallel W (Shard(1)) A is split
like W's columns and B replicated, so B A x is a partial sum that joins W x's before the
row-parallel reduction. FSDP then shards them like any parameter; the frozen base needs no
gradient and no optimizer state. A starts as nn.Linear's default (uniform, bound 1/sqrt(in)), B at
zero, each from a generator seeded by (seed, name), so every layout starts from the same adapters.
"""

from __future__ import annotations

import fnmatch
import zlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from meshtrain.config import PeftConfig
from meshtrain.errors import ConfigError
from meshtrain.models.initialize import copy_full_into

ADAPTERS = ("lora_A", "lora_B")


class LoRALinear(nn.Linear):
    """An nn.Linear carrying a LoRA update (the class of a module ``add_lora`` converted)."""

    lora_A: nn.Parameter
    lora_B: nn.Parameter
    lora_scale: float
    lora_dropout: float

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        update = F.dropout(x, self.lora_dropout, self.training) if self.lora_dropout else x
        return F.linear(x, self.weight, self.bias) + F.linear(F.linear(update, self.lora_A), self.lora_B) * self.lora_scale


def lora_targets(model: nn.Module, patterns: list[str]) -> list[str]:
    """The linear layers whose names match a pattern (the output head only if named)."""
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)
             and any(fnmatch.fnmatchcase(n, p) for p in patterns)]
    return names


def _adapter(shape: tuple[int, int], like: torch.Tensor, placement) -> nn.Parameter:
    empty = torch.empty(shape, device=like.device, dtype=like.dtype)
    if isinstance(like, DTensor):
        empty = distribute_tensor(empty, like.device_mesh, [placement], src_data_rank=None)
    return nn.Parameter(empty)


def add_lora(model: nn.Module, cfg: PeftConfig) -> list[str]:
    """Add adapters to the target linears of ``model`` (after TP, before FSDP), freeze the rest;
    returns the targets' names."""
    targets = lora_targets(model, cfg.targets)
    for name in targets:
        module = model.get_submodule(name)
        out_features, in_features = module.weight.shape
        a_place, b_place = Replicate(), Replicate()
        if isinstance(module.weight, DTensor):
            (placement,) = module.weight.placements
            a_place, b_place = (Replicate(), Shard(0)) if placement == Shard(0) else (Shard(1), Replicate())
        module.lora_A = _adapter((cfg.rank, in_features), module.weight, a_place)
        module.lora_B = _adapter((out_features, cfg.rank), module.weight, b_place)
        module.lora_scale, module.lora_dropout = cfg.alpha / cfg.rank, cfg.dropout
        module.__class__ = LoRALinear
    for name, param in model.named_parameters():
        param.requires_grad_(name.rsplit(".", 1)[-1] in ADAPTERS)
    return targets


@torch.no_grad()
def init_lora(model: nn.Module, seed: int) -> None:
    for name, param in model.named_parameters():
        if name.endswith(".lora_A"):
            gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            bound = 1 / param.shape[1] ** 0.5
            full = torch.empty(param.shape).uniform_(-bound, bound, generator=gen)
        elif name.endswith(".lora_B"):
            full = torch.zeros(param.shape)
        else:
            continue
        copy_full_into(param, full.to(device=param.device, dtype=param.dtype))


def check_lora(cfg: PeftConfig, model: nn.Module) -> None:
    """Refuse targets that match nothing, or the stacked experts (not supported yet)."""
    if cfg.method != "lora":
        return
    experts = [n for n, _ in model.named_modules() if n.endswith(".experts") and
               any(fnmatch.fnmatchcase(n, p) for p in cfg.targets)]
    if experts:
        raise ConfigError(f"peft.targets match the stacked experts ({experts[0]}): LoRA on MoE experts is not "
                          "supported yet. Fix: target the attention projections (and shared experts)")
    if not lora_targets(model, cfg.targets):
        raise ConfigError(f"peft.targets={cfg.targets} match no linear layer. Fix: use module-name wildcards such as "
                          "'*.q_proj' or '*.mlp.*_proj'")


@torch.no_grad()
def merge_lora(model: nn.Module) -> int:
    """Fold every adapter into its base weight, W += (alpha / r) B A, computed in fp32 on the full
    matrices one at a time, and turn the modules back into plain linears; returns how many. Every
    rank calls it (the full adapters are gathered)."""
    merged = 0
    for module in model.modules():
        if not isinstance(module, LoRALinear):
            continue
        a, b = (t.full_tensor() if isinstance(t, DTensor) else t for t in (module.lora_A, module.lora_B))
        delta = (b.float() @ a.float()) * module.lora_scale
        w = module.weight
        if isinstance(w, DTensor):
            local = distribute_tensor(delta.to(w.device), w.device_mesh, w.placements, src_data_rank=None).to_local()
            w.to_local().add_(local.to(w.dtype))
        else:
            w.add_(delta.to(device=w.device, dtype=w.dtype))
        del module.lora_A, module.lora_B
        module.__class__ = nn.Linear
        merged += 1
    return merged


def adapter_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every adapter of this part, whole, on CPU (gathered on every rank that holds a shard)."""
    return {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().float().cpu()
            for name, p in model.named_parameters() if name.endswith((".lora_A", ".lora_B"))}
