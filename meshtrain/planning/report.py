"""What ``meshtrain plan`` prints: the layout, why, and each GPU's memory with the formulas used."""

from __future__ import annotations

import dataclasses

from meshtrain.planning.memory import Memory, Sizes, estimate
from meshtrain.planning.options import GB, PlanConfig
from meshtrain.planning.recommend import Plan, unique_in_order, recommend
from meshtrain.planning.shapes import active_parameters, format_count, resolve, total_parameters, trainable_parameters



# ---- the report --------------------------------------------------------------------------------

def unsharded(plan: Plan, cfg: PlanConfig) -> Memory:
    """The same model with no parallelism at all: one device holds everything."""
    one = Sizes(world=1, stage_layers=(plan.shape.num_layers,))
    return estimate(plan.shape, one, cfg, "1F1B", 1, plan.memory.ac)


def report(plan: Plan, cfg: PlanConfig) -> str:
    s, z, m = plan.shape, plan.sizes, plan.memory
    p = m.precision
    params, active = total_parameters(s), active_parameters(s)
    single = unsharded(plan, cfg)
    unit, scale = ("GB", GB) if single.total >= 0.1 * GB else ("MB", 1e6)

    def _gb(x: float) -> str:
        return f"{x / scale:8.2f}"

    lines = [f"model: {s.name}: {format_count(params)} parameters"
             + (f", {format_count(active)} active ({s.num_experts} experts, top-{s.experts_per_token})" if s.is_moe else "")
             + f"; {s.num_layers} layers, hidden {s.hidden_size}, heads {s.num_heads}/{s.num_kv_heads} kv, vocab {s.vocab_size}",
             f"cluster: {cfg.gpus} GPUs ({cfg.gpus_per_node} per node, {cfg.interconnect}), {cfg.gpu_memory_gb:g} GB each; "
             f"seq {cfg.seq_len} x micro batch {cfg.micro_batch_size}; {cfg.precision}", "",
             f"recommended layout: {plan.describe()}"]
    if z.stage_layers and len(set(z.stage_layers)) > 1:
        lines.append(f"  layers per stage: {list(z.stage_layers)}")
    overrides = [f"--parallel.{k} {v}" for k, v in (("tp", z.tp), ("pp", z.pp), ("vpp", z.vpp), ("cp", z.cp),
                                                      ("ep", z.ep)) if v > 1]
    if z.sp:
        overrides.append("--parallel.sp True")
    if z.stage_layers and len(set(z.stage_layers)) > 1:
        overrides.append("--parallel.pp-layers-per-stage " + " ".join(map(str, z.stage_layers)))
    overrides.append(f"--train.global-batch-size {plan.global_batch} --train.micro-batch-size {cfg.micro_batch_size}")
    if m.ac != "none":
        overrides.append(f"--train.activation-checkpointing {m.ac}")
    lines.append("  meshtrain train " + " ".join(overrides))
    lines.append("why:")
    lines += [f"  - {r}" for r in plan.reasons]
    if z.pp > 1:
        bubble = (z.pp - 1) / (z.vpp * plan.microbatches + z.pp - 1)
        lines.append(f"  - pipeline: {plan.microbatches} micro-batches per step, {plan.schedule}; bubble "
                     f"(pp-1)/(vpp*m+pp-1) = {bubble:.1%}")
    if plan.rejected:
        lines.append("passed over (first ones):")
        lines += [f"  - {r}" for r in unique_in_order(plan.rejected)[:5]]

    lines += ["", f"memory per GPU ({unit}), busiest rank (pp rank {m.pp_rank}: {m.layers_on_rank} layers; {p.note}):",
              f"  {'':34}{'no parallelism':>16}{'this layout':>14}{'+ FSDP':>10}"]
    fsdp = z.dp * z.cp > 1
    rows = [("weights", p.weights, False), ("gradients", p.grads, True), ("optimizer state", p.optimizer, True)]
    if m.reference:
        rows.insert(1, ("reference copy, frozen", p.weights, False))
    for name, b, trained in rows:
        counts = (single.trained, m.trained_no_fsdp, m.trained) if trained else (single.params, m.params_no_fsdp,
                                                                                  m.params)
        lines.append(f"  {name + f' ({b} B/param)':34}{_gb(counts[0] * b):>16}{_gb(counts[1] * b):>14}"
                     f"{_gb(counts[2] * b):>10}")
    lines.append(f"  {'activations':34}{_gb(single.activations):>16}{_gb(m.activations):>14}{_gb(m.activations):>10}")
    lines.append(f"  {'logits and loss':34}{_gb(single.logits):>16}{_gb(m.logits):>14}{_gb(m.logits):>10}")
    lines.append(f"  {'total':34}{_gb(single.total):>16}{_gb(m.total_no_fsdp):>14}{_gb(m.total):>10}")
    if not fsdp:
        lines.append("  (dp*cp = 1: nothing for FSDP to shard)")
    if s.lora_rank:
        trainable = trainable_parameters(s)
        lines.append(f"  {'DoRA' if s.lora_magnitudes else 'LoRA'} rank {s.lora_rank} on {', '.join(s.lora_targets)}: "
                     f"{format_count(trainable)} of the parameters train ({trainable / params:.2%}); gradients and "
                     f"optimizer state are the adapters' only ({format_count(m.trained)} on this rank), the frozen base "
                     "keeps its weights")
    naive = single.total / (z.tp * z.pp)
    lines.append(f"  no-parallelism total / (tp*pp) = {naive / scale:.2f} {unit}: the naive split; this layout differs by "
                 f"the {m.in_flight:g} micro-batch(es) in flight on that rank, by the embedding or head it holds, "
                 "and by what tp does not shard (norms, the gathered SP inputs)")

    variants = []
    for label, sp, ac in (("no SP, no AC", False, "none"), ("SP", True, "none"), ("selective AC", z.sp, "selective"),
                          ("full AC", z.sp, "full")):
        if sp and z.tp == 1:
            continue
        alt = estimate(s, dataclasses.replace(z, sp=sp), cfg, plan.schedule, plan.microbatches, ac)
        variants.append(f"{label}: {alt.activations / scale:.2f}")
    if z.cp == 1 and cfg.seq_len % 4 == 0:
        alt = estimate(s, dataclasses.replace(z, cp=2), cfg, plan.schedule, plan.microbatches, m.ac)
        variants.append(f"CP2: {alt.activations / scale:.2f}")
    lines.append(f"  activations per GPU ({unit}) by option: " + "; ".join(variants)
                 + (f"; CP{z.cp} divides every term by {z.cp}" if z.cp > 1 else ""))

    T = cfg.micro_batch_size * cfg.seq_len
    lines += ["", "formulas (P = parameters on the rank, T = micro * seq / cp tokens, h hidden, i FFN, t = tp):",
              f"  weights + grads + optimizer = P x ({p.weights} + {p.grads} + {p.optimizer}) B; P = its stages' "
              "tensors, tp-sliced (column: rows, row: columns, vocab: rows), experts / ep, then / (dp_shard*cp) "
              "by FSDP (experts / edp)",
              f"  activations per layer = [2Th (/t with SP) + 2Th + T(2q + 2kv)/t + 4Ti/t] x {p.activations} B "
              f"= {m.activations_per_layer / 1e6:.1f} MB here (T = {T // z.cp}); x {m.layers_on_rank} layers x "
              f"{m.in_flight:g} micro-batches in flight (fused RMSNorm as on CUDA; CPU's composite one keeps 2Th more); "
              "full AC keeps T h (/t with SP) per layer + one layer recomputed",
              f"  logits = T x vocab / t x ({p.activations} + 4 + 4) B (logits, fp32 copy, log-softmax), last stage only"]
    return "\n".join(lines)


def plan_main(cfg: PlanConfig) -> Plan:
    cfg, shape = resolve(cfg)
    plan = recommend(cfg, shape)
    print(report(plan, cfg))
    return plan
