"""The recommender: the reference's starting layouts (section 3), narrowed by topology, sequence
length and memory, each candidate validated by the trainer's own layout rules."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from meshtrain.config import JobConfig, ParallelConfig, TrainConfig
from meshtrain.errors import ConfigError
from meshtrain.parallel.layout import check_expert_layout, describe_sizes, layout_extras, plan_layout
from meshtrain.planning.memory import Memory, Sizes, estimate
from meshtrain.planning.options import GB, PlanConfig, USABLE_MEMORY
from meshtrain.planning.shapes import ModelShape, active_parameters, format_count, resolve, total_parameters


# ---- choosing a layout -------------------------------------------------------------------------

@dataclass(frozen=True)
class Row:
    upto: float
    label: str
    gpus: str
    tp: tuple[int, int]
    pp: tuple[int, int]
    cp: int = 1
    ep: tuple[int, int] = (1, 1)


# The reference's starting layouts (section 3). Bounds are nominal sizes with 5% slack: a "70B"
# model has 70.6B parameters and belongs to the 10-70B row.
DENSE_ROWS = (Row(1.05e9, "< 1B", "1-8", (1, 1), (1, 1)),
              Row(10.5e9, "1-10B", "8-16", (2, 4), (1, 1)),
              Row(73.5e9, "10-70B", "16-64", (4, 8), (2, 4)),
              Row(184e9, "70-175B", "64-256", (8, 8), (4, 8)),
              Row(math.inf, "175-500B", "256-1024", (8, 8), (8, 16), cp=2))
MOE_ROWS = (Row(21e9, "< 20B", "", (1, 1), (1, 1), ep=(2, 8)),
            Row(105e9, "20-100B", "", (1, 2), (2, 4), ep=(8, 16)),
            Row(525e9, "100-500B", "", (2, 4), (8, 16), ep=(8, 32)),
            Row(math.inf, "> 500B", "", (2, 2), (16, 16), ep=(32, 64)))


def row_for(params: float, rows: tuple[Row, ...]) -> Row:
    return next(r for r in rows if params <= r.upto)


def cp_for_sequence(seq_len: int) -> tuple[int, str]:
    if seq_len > 131072:
        return 8, f"seq {seq_len} > 128K: CP8"
    if seq_len > 32768:
        return 4, f"seq {seq_len} > 32K: CP4"
    if seq_len > 8192:
        return 2, f"seq {seq_len} in 8K-32K: CP2"
    return 1, ""


@dataclass
class Plan:
    shape: ModelShape
    sizes: Sizes
    schedule: str
    microbatches: int
    global_batch: int
    memory: Memory
    reasons: list[str] = field(default_factory=list)
    rejected: list[str] = field(default_factory=list)

    def describe(self) -> str:
        dims = {"pp": self.sizes.pp, "dp_replicate": 1, "dp_shard": self.sizes.dp, "cp": self.sizes.cp,
                "tp": self.sizes.tp}
        return describe_sizes(dims, self.sizes.world, ep=self.sizes.ep,
                              extras=layout_extras(self.sizes.sp, self.sizes.vpp,
                                                   self.schedule if self.sizes.pp > 1 else "", self.sizes.etp))


# Where plan_layout's messages name trainer fields, the planner's own options are meant.
_FIELD_NAMES = {"parallel.": "--", "train.seq_len": "--seq-len", "train.micro_batch_size": "--micro-batch-size",
                "train.global_batch_size": "--global-batch-size"}


def _planner_message(message: str) -> str:
    for old, new in _FIELD_NAMES.items():
        message = message.replace(old, new)
    return message


def stage_split(layers: int, stages: int) -> tuple[int, ...] | None:
    """An even split, or one giving the middle stages the remainder (the first and last stages also
    hold the embedding and the head); None when there are fewer layers than stages."""
    if layers < stages:
        return None
    base, extra = divmod(layers, stages)
    counts = [base] * stages
    middle = list(range(1, stages - 1)) or list(range(stages))
    if extra > len(middle):
        return None
    for i in middle[:extra]:
        counts[i] += 1
    return tuple(counts)


def validate(s: ModelShape, sizes: Sizes, cfg: PlanConfig, global_batch: int) -> tuple[Sizes, str, int]:
    """Run the trainer's own rules on a candidate; returns it with its stage split, the schedule and
    the micro-batch count, or raises ConfigError naming the rule."""
    split = stage_split(s.num_layers, sizes.pp * sizes.vpp)
    if split is None:
        raise ConfigError(f"{s.num_layers} layers cannot fill pp*vpp = {sizes.pp}*{sizes.vpp} stages. Fix: lower --pp or --vpp")
    even = len(set(split)) == 1
    model = dataclasses.replace(s.model, init_from_hf=None)  # the architecture is read already
    parallel = ParallelConfig(pp=sizes.pp, vpp=sizes.vpp, tp=sizes.tp, cp=sizes.cp, sp=sizes.sp,
                              pp_layers_per_stage=None if even else list(split), gpus_per_node=cfg.gpus_per_node)
    train = TrainConfig(global_batch_size=global_batch, micro_batch_size=cfg.micro_batch_size, seq_len=cfg.seq_len)
    try:
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            layout = plan_layout(JobConfig(model=model, parallel=parallel, train=train), sizes.world)
        check_expert_layout(model.family, s.num_experts, sizes.ep, sizes.etp, sizes.world, sizes.pp, sizes.tp, sizes.cp)
        if s.is_moe and s.expert_intermediate_size % sizes.etp:
            raise ConfigError(f"parallel.etp={sizes.etp} must divide the expert FFN size {s.expert_intermediate_size}")
    except ConfigError as e:
        raise ConfigError(_planner_message(str(e))) from None
    return dataclasses.replace(sizes, stage_layers=layout.stage_layers), layout.pp_schedule, layout.grad_accum_steps


def check_fixed_sizes(cfg: PlanConfig) -> None:
    for name in ("tp", "pp", "vpp", "cp", "ep"):
        value = getattr(cfg, name)
        if value is not None and value < 1:
            raise ConfigError(f"--{name}={value} must be >= 1 (or left out for the planner to choose)")
    fixed = {n: getattr(cfg, n) for n in ("tp", "pp", "cp") if getattr(cfg, n)}
    product = math.prod(fixed.values())
    if fixed and cfg.gpus % product:
        names = "*".join(f"--{n}" for n in fixed)
        raise ConfigError(f"--gpus={cfg.gpus} is not divisible by {names} = {product} (dp = gpus / (tp*pp*cp) "
                          f"must be whole). Fix: use a multiple of {product} GPUs or other sizes")


def _ordered(lo: int, hi: int, descending: bool, allowed: set[int] | None = None) -> list[int]:
    values = [v for v in range(lo, hi + 1) if allowed is None or v in allowed]
    return sorted(values, reverse=descending)


def candidate_sizes(s: ModelShape, cfg: PlanConfig, params: float, active: float) -> tuple[list[list[Sizes]], list[str]]:
    """Groups of candidates in order of preference (the table's ranges first, then beyond them),
    and why that order."""
    reasons = []
    powers = {1, 2, 4, 8, 16, 32, 64, 128, 256}
    multi_node = cfg.gpus > cfg.gpus_per_node
    if s.is_moe:
        row = row_for(params, MOE_ROWS)
        dense_row = row_for(active, DENSE_ROWS)
        tp_lo = min(max(dense_row.tp[0], row.tp[0]), row.tp[1])
        tp_hi = min(max(dense_row.tp[1], row.tp[0]), row.tp[1])
        reasons.append(f"MoE with {format_count(params)} parameters ({format_count(active)} active): the {row.label} row "
                       f"starts at TP{_rng(row.tp)} PP{_rng(row.pp)} EP{_rng(row.ep)}; TP is sized by the active "
                       f"parameters ({dense_row.label} dense: TP{_rng(dense_row.tp)}) within that: TP{_rng((tp_lo, tp_hi))}")
    else:
        row = row_for(params, DENSE_ROWS)
        tp_lo, tp_hi = row.tp
        reasons.append(f"dense {format_count(params)} parameters: the {row.label} row ({row.gpus} GPUs) starts at "
                       f"TP{_rng(row.tp)} PP{_rng(row.pp)}{' CP2' if row.cp > 1 else ''} + DP")
    tp_cap = min(8, cfg.gpus_per_node, cfg.gpus)
    prefer_small_tp = cfg.interconnect == "ethernet"
    if cfg.interconnect == "nvlink":
        reasons.append("one NVLink node: the largest TP in range, at most the node's GPUs (<= 8)")
    elif cfg.interconnect == "infiniband":
        reasons.append("InfiniBand: TP inside a node, PP across nodes" + ("" if multi_node else " (one node here)"))
    else:
        reasons.append("ethernet: TP as small as the range allows, PP preferred across nodes")

    cp_seq, why = cp_for_sequence(cfg.seq_len)
    cp = cfg.cp or max(cp_seq, row.cp)
    if why and not cfg.cp:
        reasons.append(why)
    sp_wanted = cfg.seq_len >= 2048
    tps = [cfg.tp] if cfg.tp else _ordered(tp_lo, min(tp_hi, tp_cap), not prefer_small_tp, powers) or [min(tp_lo, tp_cap)]
    pps = [cfg.pp] if cfg.pp else _ordered(row.pp[0], row.pp[1], cfg.interconnect == "ethernet")
    eps = [cfg.ep] if cfg.ep else (_ordered(row.ep[0], row.ep[1], True, powers) if s.is_moe else [1])
    # Beyond the table's ranges, for when nothing inside them fits: more PP, then more TP.
    extra_pp = [p for p in range(pps[-1] + 1, min(s.num_layers, cfg.gpus) + 1)] if not cfg.pp else []
    extra_tp = [t for t in sorted(powers) if tps[0] < t <= tp_cap] if not cfg.tp else []
    groups = []
    for tp_list, pp_list in ((tps, pps), (tps, extra_pp), (extra_tp, pps + extra_pp)):
        out = []
        groups.append(out)
        for tp in tp_list:
            for pp in pp_list:
                for ep in eps:
                    vpp = cfg.vpp or (2 if pp > 1 and s.num_layers % (2 * pp) == 0 else 1)
                    if pp == 1:
                        vpp = cfg.vpp or 1
                    out.append(Sizes(world=cfg.gpus, pp=pp, vpp=vpp, tp=tp, cp=cp, ep=ep,
                                     sp=tp > 1 and (sp_wanted or cfg.tp is not None)))
    return groups, reasons


def _rng(r: tuple[int, int]) -> str:
    return str(r[0]) if r[0] == r[1] else f"{r[0]}-{r[1]}"


def recommend(cfg: PlanConfig, shape: ModelShape | None = None, *, suggest_gpus: bool = True) -> Plan:
    """The first candidate that the trainer's rules accept and that fits in memory; when none fits,
    the error says how many GPUs would (``suggest_gpus``)."""
    if shape is None:
        cfg, shape = resolve(cfg)
    s = shape
    for name in ("gpus", "gpus_per_node", "seq_len", "micro_batch_size"):
        if getattr(cfg, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')}={getattr(cfg, name)} must be >= 1")
    if cfg.gpu_memory_gb <= 0:
        raise ConfigError(f"--gpu-memory-gb={cfg.gpu_memory_gb} must be positive")
    params, active = total_parameters(s), active_parameters(s)
    check_fixed_sizes(cfg)
    groups, reasons = candidate_sizes(s, cfg, params, active)
    budget = cfg.gpu_memory_gb * GB * USABLE_MEMORY
    checkpointing = {"full": ["full"], "selective": ["selective"], "none": ["none"],
                     "auto": ["none", "selective", "full"]}[cfg.activation_checkpointing]
    rejected: list[str] = []
    indivisible: list[str] = []
    smallest: Plan | None = None
    for index, ac, candidates in ((i, ac, group) for i, group in enumerate(groups) for ac in checkpointing):
        for c in candidates:
            if c.world % (c.pp * c.tp * c.cp):
                indivisible.append(f"TP{c.tp} PP{c.pp} CP{c.cp} needs a multiple of tp*pp*cp = {c.tp * c.pp * c.cp} GPUs")
                continue
            dp = c.world // (c.pp * c.tp * c.cp)
            gb = cfg.global_batch_size or cfg.micro_batch_size * dp * (4 * c.pp if c.pp > 1 else 1)
            try:
                sized, schedule, micro = validate(s, c, cfg, gb)
            except ConfigError as e:
                rejected.append(f"TP{c.tp} PP{c.pp} CP{c.cp} EP{c.ep}: {e}")
                continue
            mem = estimate(s, sized, cfg, schedule, micro, ac)
            plan = Plan(s, sized, schedule, micro, gb, mem, list(reasons), rejected)
            if mem.total <= budget:
                if ac != "none" and cfg.activation_checkpointing == "auto":
                    plan.reasons.append(f"{ac} activation checkpointing turned on: no candidate fits with less")
                if index > 0:
                    plan.reasons.append("nothing inside the table's ranges fits in memory: "
                                        + ("PP" if index == 1 else "TP") + " raised beyond them")
                return plan
            rejected.append(f"{plan.describe()}: {mem.total / GB:.1f} GB per GPU exceeds {USABLE_MEMORY:.0%} of "
                            f"--gpu-memory-gb={cfg.gpu_memory_gb:g}")
            if smallest is None or mem.total < smallest.memory.total:
                smallest = plan
    if smallest is None:
        if not rejected:
            raise ConfigError(f"no starting layout for {s.name} divides --gpus={cfg.gpus}: "
                              + "; ".join(unique_in_order(indivisible)[:3]) + ". Fix: use such a GPU count, or fix "
                              "--tp/--pp/--cp to sizes that divide it")
        raise ConfigError("no layout is possible: " + "; ".join(unique_in_order(rejected)[:4]))
    need = _gpus_needed(cfg, s) if suggest_gpus else None
    raise ConfigError(
        f"{s.name} does not fit on {cfg.gpus} GPUs of {cfg.gpu_memory_gb:g} GB: the smallest estimate is "
        f"{smallest.memory.total / GB:.1f} GB per GPU ({smallest.describe()}, "
        f"activation checkpointing {smallest.memory.ac}). Fix: "
        + (f"use at least {need} GPUs" if need else "use more GPUs") + ", a shorter --seq-len, or --precision bf16 "
        "--optimizer-states half")


def _gpus_needed(cfg: PlanConfig, s: ModelShape) -> int | None:
    gpus = cfg.gpus
    while gpus < 1 << 17:
        gpus *= 2
        try:
            recommend(dataclasses.replace(cfg, gpus=gpus), s, suggest_gpus=False)
            return gpus
        except ConfigError:
            continue
    return None


def unique_in_order(items: list[str]) -> list[str]:
    return list(dict.fromkeys(items))
