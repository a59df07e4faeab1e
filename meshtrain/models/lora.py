"""LoRA: W x + (alpha / r) B A x on chosen linear layers and stacked experts, with W (and
everything else) frozen.

The adapters live on the module that holds W: a linear's ``q_proj.lora_A`` [r, in] and
``q_proj.lora_B`` [out, r] (the base weight keeps its name; PEFT's names are these plus
``.weight``), and the stacked experts' ``gate_proj_lora_A`` [E, r, in] and ``gate_proj_lora_B``
[E, out, r]: one adapter per expert, computed per expert group like the experts themselves.
They are added after tensor and expert parallelism, placed to follow the base weight on every mesh
dim: where W is split on its output dim (column-parallel), A is replicated and B split the same
way; where W is split on its input dim (row-parallel), A is split like W's columns and B
replicated, so B A x is a partial sum that joins W x's before the reduction; where W is split over
experts, both are. FSDP then shards them like any parameter; the frozen base needs no gradient and
no optimizer state. A starts as nn.Linear's default (uniform, bound 1/sqrt(in)), B at zero, each
from a generator seeded by (seed, name), so every layout starts from the same adapters.

DoRA (``peft.method dora``, ``DoRALinear``) adds a trained magnitude per output row of a linear,
starting at the row norms of its weight (so after the base weights are loaded).
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import zlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed._functional_collectives import all_reduce
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

from meshtrain.config import PeftConfig
from meshtrain.errors import ConfigError
from meshtrain.models.initialize import copy_full_into
from meshtrain.models.moe import ExpertGroups, Experts, local

ADAPTERS = ("lora_A", "lora_B")
MAGNITUDE = "lora_magnitude"


def is_adapter(name: str) -> bool:
    return name.endswith(ADAPTERS + (MAGNITUDE,))


class LoRALinear(nn.Linear):
    """An nn.Linear carrying a LoRA update (the class of a module ``add_lora`` converted)."""

    lora_A: nn.Parameter
    lora_B: nn.Parameter
    lora_scale: float
    lora_dropout: float

    adapters_on = True
    """False inside ``adapters_disabled``: the base linear alone (a preference objective's reference)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.adapters_on:
            return F.linear(x, self.weight, self.bias)
        update = F.dropout(x, self.lora_dropout, self.training) if self.lora_dropout else x
        lora = F.linear(F.linear(update, self.lora_A), self.lora_B)
        return F.linear(x, self.weight, self.bias) + lora * self.lora_scale


class DoRALinear(LoRALinear):
    """LoRA with weight decomposition (``peft.method dora``): the adapted weight W' = W + s B A, each
    of its output rows rescaled to a trained magnitude m: y = (m / ||W'||_row) (x W^T + s x A^T B^T),
    written as PEFT's DoRA writes it, x W^T + (g - 1) x_d W^T + g s x_d A^T B^T with g = m / ||W'||_row
    and x_d the adapters' (dropped-out) input. The row norms are a constant to autograd (the DoRA
    paper's section 4.3). Under tensor parallelism m is split like W's rows or replicated, and DTensor
    sums a row-parallel W's squared norms over tp."""

    lora_magnitude: nn.Parameter

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.adapters_on:
            return F.linear(x, self.weight, self.bias)
        update = F.dropout(x, self.lora_dropout, self.training) if self.lora_dropout else x
        base = F.linear(x, self.weight)
        plain = base if update is x else F.linear(update, self.weight)
        gain = self.lora_magnitude / self.row_norms()
        out = base + (gain - 1) * plain + gain * F.linear(F.linear(update, self.lora_A), self.lora_B) * self.lora_scale
        return out if self.bias is None else out + self.bias

    def row_norms(self) -> torch.Tensor:
        with torch.no_grad():
            return torch.linalg.vector_norm(self.weight + self.lora_scale * (self.lora_B @ self.lora_A), dim=1)


class LoRAExperts(Experts):
    """Stacked experts with a LoRA update on each of ``lora_projections``, one adapter per expert."""

    lora_projections: tuple[str, ...]
    lora_scale: float
    lora_dropout: float

    adapters_on = True

    def project(self, x: torch.Tensor, name: str, weight: torch.Tensor, groups: ExpertGroups) -> torch.Tensor:
        out = groups.linear(x, weight)
        if name not in self.lora_projections or not self.adapters_on:
            return out
        base = getattr(self, name)
        a, b = (_local_adapter(getattr(self, f"{name}_{kind}"), base) for kind in ADAPTERS)
        update = F.dropout(x, self.lora_dropout, self.training) if self.lora_dropout else x
        return out + groups.linear(groups.linear(update, a), b) * self.lora_scale

    def extra_operands(self) -> tuple[torch.Tensor, ...]:
        return tuple(local(getattr(self, f"{name}_{kind}")) for name in self.lora_projections for kind in ADAPTERS)


EXPERT_PROJECTIONS = frozenset({"gate_proj", "up_proj", "down_proj", "gate_up_proj"})
"""The stacked experts' projections of every family (GPT-OSS's gate_up_proj)."""


@functools.cache
def _with_lora(experts_class: type) -> type:
    """The class of ``experts_class`` modules carrying adapters (LoRAExperts' ``project`` first)."""
    if issubclass(experts_class, LoRAExperts):  # adapters on a second projection of the same experts
        return experts_class
    if experts_class is Experts:
        return LoRAExperts
    return type(f"LoRA{experts_class.__name__}", (LoRAExperts, experts_class), {})


class _SumGradient(torch.autograd.Function):
    """Identity forward; backward sums the gradient over ``group`` (each rank's is a partial sum)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad.contiguous(), "sum", ctx.group), None


def _local_adapter(adapter: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """This rank's part of a stacked adapter, for computing outside DTensor (as the experts do).
    Where the adapter is replicated over a mesh dim that splits its base weight (A of a gate/up
    projection, B of down, under expert tensor parallelism), each rank's gradient covers only its
    slice of the FFN: it is summed over that dim in backward."""
    if not isinstance(adapter, DTensor):
        return adapter
    mine = adapter.to_local()
    for dim, (own, of_base) in enumerate(zip(adapter.placements, base.placements)):
        if own.is_replicate() and not of_base.is_replicate():
            mine = _SumGradient.apply(mine, adapter.device_mesh.get_group(dim))
    return mine


@contextlib.contextmanager
def adapters_disabled(parts: list[nn.Module]) -> Iterator[None]:
    """Within: every adapter of these parts switched off, the frozen base model computing alone."""
    adapted = [m for part in parts for m in part.modules() if isinstance(m, (LoRALinear, LoRAExperts))]
    for m in adapted:
        m.adapters_on = False
    try:
        yield
    finally:
        for m in adapted:
            del m.adapters_on  # back to the class's True


def targeted(name: str, patterns: list[str] | tuple[str, ...]) -> bool:
    """Whether a linear layer ``name``, or a stacked experts' projection ``...experts.gate_proj``, gets
    adapters: its own name matches a pattern, or (a projection) its experts' name does."""
    owner, _, projection = name.rpartition(".")
    names = [name, owner] if owner.rpartition(".")[2] == "experts" and projection in EXPERT_PROJECTIONS else [name]
    return any(fnmatch.fnmatchcase(n, p) for n in names for p in patterns)


def lora_targets(model: nn.Module, patterns: list[str]) -> list[str]:
    """The linear layers and stacked experts' projections ``targeted`` chooses (the output head only if named)."""
    names = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and targeted(name, patterns):
            names.append(name)
        elif isinstance(module, Experts):
            names += [f"{name}.{p}" for p in module.PROJECTIONS if targeted(f"{name}.{p}", patterns)]
    return names


def _adapters_for(weight: torch.Tensor, rank: int, magnitude: bool = False) -> list[nn.Parameter]:
    """Empty A [..., r, in], B [..., out, r] (and DoRA's magnitude [..., out]) for a weight [..., out, in],
    placed to follow it."""
    *lead, out_features, in_features = weight.shape
    shapes = [(*lead, rank, in_features), (*lead, out_features, rank)] + ([(*lead, out_features)] if magnitude else [])
    made = [torch.empty(shape, device=weight.device, dtype=weight.dtype) for shape in shapes]
    if isinstance(weight, DTensor):
        a_place, b_place = [], []
        for placement in weight.placements:
            if placement.is_shard(weight.ndim - 2):  # output dim: column-parallel
                a_place.append(Replicate()), b_place.append(placement)
            elif placement.is_shard(weight.ndim - 1):  # input dim: row-parallel
                a_place.append(placement), b_place.append(Replicate())
            else:  # replicated, or split over experts
                a_place.append(placement), b_place.append(placement)
        placements = (a_place, b_place, b_place)  # the magnitude's rows are B's
        made = [distribute_tensor(t, weight.device_mesh, p, src_data_rank=None) for t, p in zip(made, placements)]
    return [nn.Parameter(t) for t in made]


def add_lora(model: nn.Module, cfg: PeftConfig) -> list[str]:
    """Add adapters to the targets of ``model`` (after TP and EP, before FSDP), freeze the rest;
    returns the targets' names."""
    targets = lora_targets(model, cfg.targets)
    for name in targets:
        owner, _, projection = name.rpartition(".")
        module = model.get_submodule(owner)
        if not isinstance(module, Experts):
            module = model.get_submodule(name)
            dora = cfg.method == "dora"
            module.lora_A, module.lora_B, *magnitude = _adapters_for(module.weight, cfg.rank, dora)
            if dora:
                module.lora_magnitude = magnitude[0]
            module.__class__ = DoRALinear if dora else LoRALinear
        else:
            a, b = _adapters_for(module.weight(projection), cfg.rank)
            module.register_parameter(f"{projection}_lora_A", a)
            module.register_parameter(f"{projection}_lora_B", b)
            module.lora_projections = getattr(module, "lora_projections", ()) + (projection,)
            module.__class__ = _with_lora(type(module))
        module.lora_scale, module.lora_dropout = cfg.alpha / cfg.rank, cfg.dropout
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter(name))
    return targets


@torch.no_grad()
def init_lora(model: nn.Module, seed: int) -> None:
    """A and B as the module docstring says, then DoRA's magnitudes from the weights as they are."""
    for name, param in model.named_parameters():
        if name.endswith("lora_A"):
            gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            bound = 1 / param.shape[-1] ** 0.5
            full = torch.empty(param.shape).uniform_(-bound, bound, generator=gen)
        elif name.endswith("lora_B"):
            full = torch.zeros(param.shape)
        else:
            continue
        copy_full_into(param, full.to(device=param.device, dtype=param.dtype))
    init_dora_magnitudes(model)


@torch.no_grad()
def init_dora_magnitudes(model: nn.Module) -> None:
    """m = ||W + s B A||_row, so that DoRA starts as the base model; again after the base weights
    are loaded (every rank calls it: the full weights are gathered, one at a time)."""
    for module in model.modules():
        if isinstance(module, DoRALinear):
            magnitude = module.lora_magnitude
            norms = torch.linalg.vector_norm(_adapted_weight(module), dim=1)
            copy_full_into(magnitude, norms.to(magnitude.device, magnitude.dtype))


def _adapted_weight(module: DoRALinear) -> torch.Tensor:
    """W + s B A, whole, in fp32."""
    a, b = _full(module.lora_A).float(), _full(module.lora_B).float()
    return _full(module.weight).float() + module.lora_scale * (b @ a)


def check_lora(cfg: PeftConfig, model: nn.Module) -> None:
    """Refuse targets that match nothing, and expert gate/up adapters apart when a PEFT adapter is
    to be exported (transformers 5 fuses them into one gate_up_proj, and peft refuses one alone)."""
    if not cfg.adapters:
        return
    targets = lora_targets(model, cfg.targets)
    if not targets:
        raise ConfigError(f"peft.targets={cfg.targets} match no linear layer. Fix: use module-name wildcards such as "
                          "'*.q_proj', '*.mlp.*_proj' or '*.experts'")
    experts = {t.rsplit(".", 1)[-1] for t in targets if t.rsplit(".", 2)[-2] == "experts"}
    if cfg.method == "dora" and experts:
        first = next(t for t in targets if t.rsplit(".", 2)[-2] == "experts")
        raise ConfigError(f"peft.method=dora with peft.targets={cfg.targets}, which match the stacked experts "
                          f"({first}): DoRA is not supported on experts (nor is it in peft's fused-expert LoRA). Fix: target the "
                          "attention and dense projections only (e.g. '*.self_attn.*'), or use peft.method=lora")
    dense_mlp = [t for t in targets if t.rsplit(".", 2)[-2] != "experts"
                 and t.rsplit(".", 1)[-1] in ("gate_proj", "up_proj", "down_proj")]
    if cfg.method == "dora" and cfg.export_adapter and model.cfg.is_moe and dense_mlp:
        raise ConfigError(f"peft.method=dora with peft.export_adapter and peft.targets={cfg.targets}, which match a dense "
                          f"MLP of this MoE model ({dense_mlp[0]}): peft loads those adapters only as target_parameters "
                          "(its fused-expert conversion takes every gate/up/down_proj target), which it does not "
                          "support with DoRA. Fix: target the attention projections only ('*.self_attn.*'), use "
                          "peft.method=lora, or leave peft.export_adapter unset (checkpoint.export_hf still writes "
                          "the merged model)")
    if cfg.method == "dora" and cfg.export_adapter:
        for fused, parts in model.cfg.definition.fused.items():
            for layer in {t.split(".")[1] for t in targets if t.startswith("layers.")}:
                have = [p for p in parts if f"layers.{layer}.{p}" in targets]
                if have and len(have) < len(parts):
                    raise ConfigError(
                        f"peft.method=dora with peft.export_adapter and peft.targets={cfg.targets}, which adapt "
                        f"layers.{layer}.{have[0]} but not all of {', '.join(parts)}: the checkpoint holds them as one "
                        f"{fused.rsplit('.', 1)[-1]}, and a DoRA adapter of it rescales every row. Fix: target all of "
                        f"{', '.join('*.' + p.rsplit('.', 1)[-1] for p in parts)}, use peft.method=lora, or leave "
                        "peft.export_adapter unset (checkpoint.export_hf still writes the merged model)")
    if cfg.export_adapter and len(experts & {"gate_proj", "up_proj"}) == 1:
        raise ConfigError(f"peft.targets={cfg.targets} adapt the experts' {experts & {'gate_proj', 'up_proj'}} "
                          "without the other, but peft.export_adapter is set and peft loads expert adapters onto "
                          "transformers' fused gate_up_proj only as a pair. Fix: target both '*.experts.gate_proj' "
                          "and '*.experts.up_proj' (or '*.experts'), or leave peft.export_adapter unset")


@torch.no_grad()
def merge_lora(model: nn.Module) -> int:
    """Fold every adapter into its base weight, W += (alpha / r) B A, computed in fp32 on the full
    matrices one at a time, and turn the modules back into plain linears and experts; returns how
    many weights took an update. Every rank calls it (the full adapters are gathered)."""
    merged = 0
    for module in model.modules():
        if isinstance(module, DoRALinear):  # W' = (m / ||W + s B A||_row) (W + s B A)
            adapted = _adapted_weight(module)
            gain = _full(module.lora_magnitude).float() / torch.linalg.vector_norm(adapted, dim=1)
            _add_full(module.weight, gain[:, None] * adapted - _full(module.weight).float())
            for name in ADAPTERS + (MAGNITUDE,):
                delattr(module, name)
            module.__class__ = nn.Linear
            merged += 1
            continue
        if isinstance(module, LoRALinear):
            pairs, plain = {"weight": ("lora_A", "lora_B")}, nn.Linear
        elif isinstance(module, LoRAExperts):
            pairs = {p: (f"{p}_lora_A", f"{p}_lora_B") for p in module.lora_projections}
            plain = next(c for c in type(module).__mro__ if issubclass(c, Experts) and not issubclass(c, LoRAExperts))
        else:
            continue
        for weight_name, (a_name, b_name) in pairs.items():
            a, b = (_full(getattr(module, n)) for n in (a_name, b_name))
            weight = module.weight(weight_name) if isinstance(module, LoRAExperts) else getattr(module, weight_name)
            _add_full(weight, (b.float() @ a.float()) * module.lora_scale)  # [E, out, in] views add in place
            delattr(module, a_name)
            delattr(module, b_name)
            merged += 1
        module.__class__ = plain
    return merged


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _add_full(weight: torch.Tensor, delta: torch.Tensor) -> None:
    if isinstance(weight, DTensor):
        local_delta = distribute_tensor(delta.to(weight.device), weight.device_mesh, weight.placements,
                                        src_data_rank=None).to_local()
        weight.to_local().add_(local_delta.to(weight.dtype))
    else:
        weight.add_(delta.to(device=weight.device, dtype=weight.dtype))


def adapter_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every adapter of this part, whole, on CPU (gathered on every rank that holds a shard)."""
    return {name: _full(p).detach().float().cpu() for name, p in model.named_parameters() if is_adapter(name)}
