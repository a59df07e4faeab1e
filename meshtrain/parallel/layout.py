"""The layout: derived sizes and every layout rule, before any process group exists.

``plan_layout`` is pure: it turns the config and a world size into a ``Layout`` or raises a
``ConfigError`` naming the rule, the values and a fix. ``meshtrain.parallel.mesh.build_mesh``
then turns the Layout into the DeviceMesh that every parallel decision reads afterwards (its dims
and flattened submeshes are listed there).
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass

from meshtrain.config import JobConfig
from meshtrain.errors import ConfigError

DENSE_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
# torch.distributed.pipelining schedules by how they place stages: one per rank; several per rank
# in a loop (stage s on rank s % pp); two per rank in a V (rank r holds stages r and 2*pp-1-r).
SINGLE_STAGE_SCHEDULES = ("GPipe", "1F1B")
LOOPED_SCHEDULES = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble")
V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")
# Schedules that split backward into input-grad and weight-grad passes.
SPLIT_BACKWARD_SCHEDULES = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


@dataclass(frozen=True)
class Layout:
    """Every parallel size, derived and checked. Only ``build_mesh`` and the layout line read it;
    after the mesh exists, code reads sizes from the mesh."""

    world_size: int
    pp: int
    vpp: int
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    sp: bool
    ep: int
    etp: int
    grad_accum_steps: int
    """Micro-batches per optimizer step on each rank; with pp > 1, the pipeline's n_microbatches."""
    pp_schedule: str
    stage_layers: tuple[int, ...]
    """Decoder layers in each of the pp*vpp pipeline stages, in stage order."""
    timeout_s: int = 600
    """How long every process group of the mesh waits in a collective (parallel.timeout_s)."""

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def edp(self) -> int:
        return self.world_size // (self.pp * self.ep * self.etp)

    def describe(self) -> str:
        sizes = {d: getattr(self, d) for d in DENSE_DIMS}
        return describe_sizes(sizes, self.world_size, ep=self.ep,
                              extras=layout_extras(self.sp, self.vpp, self.pp_schedule if self.pp > 1 else "", self.etp))


def layout_extras(sp: bool, vpp: int, schedule: str, etp: int = 1) -> list[str]:
    """The bracketed part of the layout line: what the dim sizes alone do not show."""
    extras = ["SP" if sp else "", f"VPP{vpp}" if vpp > 1 else "", f"ETP{etp}" if etp > 1 else "", schedule]
    return [e for e in extras if e]


def describe_sizes(sizes: dict[str, int], world: int, ep: int = 1, extras: list[str] = ()) -> str:
    """The layout line every run logs, e.g. ``TP2 PP2 DP1 CP1 EP1 (world 4)``."""
    dp = sizes["dp_replicate"] * sizes["dp_shard"]
    line = f"TP{sizes['tp']} PP{sizes['pp']} DP{dp} CP{sizes['cp']} EP{ep}"
    extras = list(extras)
    if sizes["dp_replicate"] > 1:
        extras.append(f"HSDP {sizes['dp_replicate']}x{sizes['dp_shard']}")
    return f"{line}{' [' + ', '.join(extras) + ']' if extras else ''} (world {world})"


def _fail(rule: str, fix: str) -> None:
    raise ConfigError(f"{rule}. Fix: {fix}")


def plan_layout(cfg: JobConfig, world_size: int) -> Layout:
    """Derive every parallel size from ``cfg.parallel`` and the world size, enforcing each rule."""
    p, m, t = cfg.parallel, cfg.model, cfg.train
    for name in ("pp", "vpp", "dp_replicate", "cp", "tp", "ep", "etp"):
        if getattr(p, name) < 1:
            _fail(f"parallel.{name}={getattr(p, name)} must be >= 1", f"set parallel.{name} to a positive size")
    if p.timeout_s <= 0:
        _fail(f"parallel.timeout_s={p.timeout_s} must be > 0 (seconds a collective waits for the slowest rank)",
              "set parallel.timeout_s to e.g. 600")
    if p.dp_shard == 0 or p.dp_shard < -1:
        _fail(f"parallel.dp_shard={p.dp_shard} must be >= 1, or -1 for auto", "set parallel.dp_shard=-1")

    non_dp = p.pp * p.dp_replicate * p.cp * p.tp
    if p.dp_shard == -1:
        if world_size % non_dp:
            _fail(
                f"world size {world_size} is not divisible by pp*dp_replicate*cp*tp = "
                f"{p.pp}*{p.dp_replicate}*{p.cp}*{p.tp} = {non_dp} (dp = world / (tp*pp*cp) must be whole)",
                f"launch a multiple of {non_dp} ranks or change the sizes",
            )
        dp_shard = world_size // non_dp
    else:
        dp_shard = p.dp_shard
        if non_dp * dp_shard != world_size:
            _fail(
                f"pp*dp_replicate*dp_shard*cp*tp = {p.pp}*{p.dp_replicate}*{dp_shard}*{p.cp}*{p.tp} = "
                f"{non_dp * dp_shard} does not equal the world size {world_size}",
                "set parallel.dp_shard=-1 to derive it, or launch that many ranks",
            )
    dp = p.dp_replicate * dp_shard

    if p.sp and p.tp == 1:
        _fail("parallel.sp=true requires parallel.tp > 1 (sequence parallel splits along the tp group)",
              "set parallel.tp >= 2 or parallel.sp=false")
    if p.cp > 1 and t.seq_len % (2 * p.cp):
        _fail(
            f"train.seq_len={t.seq_len} must be divisible by 2*cp = {2 * p.cp} "
            "(load-balanced causal sharding cuts the sequence into 2*cp chunks)",
            f"use a seq_len that is a multiple of {2 * p.cp}",
        )

    if m.is_moe and p.tp > 1 and (t.seq_len // p.cp) % p.tp:
        _fail(f"train.seq_len={t.seq_len} / cp={p.cp} must be divisible by tp={p.tp} for the MoE family {m.family} "
              "(each tp rank routes its own slice of the sequence through the experts)",
              f"use a seq_len that is a multiple of {p.cp * p.tp * (2 if p.cp > 1 else 1)}")
    check_moe_model(m)
    if m.is_moe and m.capacity_factor > 0 and p.cp * p.tp > 1:
        _fail(f"model.capacity_factor={m.capacity_factor} with cp*tp = {p.cp}*{p.tp} > 1 is not supported (capacity "
              "counts each sequence's token copies in order, and cp and tp give each rank only part of a sequence)",
              "set model.capacity_factor=0 (no dropping), or use dp/ep/pp instead of cp/tp")
    check_expert_layout(m.family, m.num_experts, p.ep, p.etp, world_size, p.pp, p.tp, p.cp)

    # Tensor parallel shapes.
    if m.num_attention_heads % p.tp:
        _fail(f"parallel.tp={p.tp} must divide model.num_attention_heads={m.num_attention_heads}",
              "pick a tp that divides the head count")
    if m.num_key_value_heads % p.tp:
        _fail(
            f"parallel.tp={p.tp} must divide model.num_key_value_heads={m.num_key_value_heads} "
            "(replicating key/value heads across tp ranks is not supported)",
            f"use tp <= {m.num_key_value_heads} that divides it",
        )
    dense_mlp = any(not m.is_sparse_layer(i) for i in range(m.num_hidden_layers))  # tp splits dense MLPs only
    if dense_mlp and m.intermediate_size % p.tp:
        _fail(f"parallel.tp={p.tp} must divide model.intermediate_size={m.intermediate_size}",
              "pick a tp that divides the FFN size")
    if m.vocab_size % p.tp:
        padded = -(-m.vocab_size // p.tp) * p.tp
        _fail(f"parallel.tp={p.tp} must divide model.vocab_size={m.vocab_size}",
              f"pad the vocabulary: model.vocab_size={padded}")

    # Pipeline (stage split here; schedule rules need the micro-batch count, below).
    stage_layers = stage_layer_counts(m.num_hidden_layers, p.pp, p.vpp, p.pp_layers_per_stage)
    if p.vpp > 1 and p.pp == 1:
        _fail(f"parallel.vpp={p.vpp} needs parallel.pp > 1 (virtual stages interleave over pipeline ranks)",
              "set parallel.vpp=1 or parallel.pp >= 2")

    # Batch.
    if t.global_batch_size % (t.micro_batch_size * dp):
        _fail(
            f"train.global_batch_size={t.global_batch_size} must be divisible by "
            f"micro_batch_size*dp = {t.micro_batch_size}*{dp} = {t.micro_batch_size * dp}",
            f"use a global batch that is a multiple of {t.micro_batch_size * dp}",
        )
    grad_accum = t.global_batch_size // (t.micro_batch_size * dp)
    schedule = resolve_schedule(p.pp_schedule, p.vpp)
    if p.pp > 1:
        check_schedule(schedule, p.pp, p.vpp, grad_accum,
                       f"global/(micro*dp) = {t.global_batch_size}/({t.micro_batch_size}*{dp}) = {grad_accum}")
    if schedule in SPLIT_BACKWARD_SCHEDULES and p.pp > 1 and dp_shard * p.cp > 1 \
            and p.fsdp_reshard_after_forward == "always":
        # Measured with torch 2.13.0: the weight-grad pass then computes gradients that differ from
        # the single-process ones (~0.4% on the loss after one step), silently.
        _fail(f"parallel.fsdp_reshard_after_forward=always with parallel.pp_schedule={schedule} and FSDP "
              "gives wrong gradients in torch 2.13 (the deferred weight-grad pass meets resharded "
              "parameters)", "use parallel.fsdp_reshard_after_forward=default (never under a pipeline)")
    if t.seq_len > m.max_position_embeddings:
        _fail(f"train.seq_len={t.seq_len} exceeds model.max_position_embeddings={m.max_position_embeddings}",
              "shorten seq_len or raise max_position_embeddings")

    layout = Layout(world_size, p.pp, p.vpp, p.dp_replicate, dp_shard, p.cp, p.tp, p.sp, p.ep, p.etp, grad_accum,
                    schedule, tuple(stage_layers), p.timeout_s)
    messages = layout_warnings(layout, p.gpus_per_node)
    if p.pp > 1 and p.fsdp_accumulate != "reduce_each":
        messages.append(f"parallel.fsdp_accumulate={p.fsdp_accumulate} has no effect with pp > 1: the pipeline "
                        "schedule already reduces FSDP gradients once per step")
    if p.pp == 1 and p.pp_schedule != "auto":
        messages.append(f"parallel.pp_schedule={p.pp_schedule} has no effect with pp=1")
    for message in messages:
        warnings.warn(message, stacklevel=2)
    return layout


def check_moe_model(m) -> None:
    """The family's own rules (models/family.py: Family.check), and the MoE fields consistent."""
    for problem, fix in m.definition.check(m):
        _fail(problem, fix)
    if not m.is_moe:
        return
    if not 1 <= m.num_experts_per_tok <= m.num_experts:
        _fail(f"model.num_experts_per_tok={m.num_experts_per_tok} must be between 1 and model.num_experts="
              f"{m.num_experts}", "route each token to at most num_experts experts")
    if m.decoder_sparse_step < 1:
        _fail(f"model.decoder_sparse_step={m.decoder_sparse_step} must be >= 1", "set it to 1 for MoE in every layer")
    bad = [i for i in m.mlp_only_layers if not 0 <= i < m.num_hidden_layers]
    if bad:
        _fail(f"model.mlp_only_layers={m.mlp_only_layers} names layers {bad} outside 0..{m.num_hidden_layers - 1}",
              "list existing layer indices")
    if m.router_aux_loss_coef < 0 or m.router_bias_update_rate < 0:
        _fail("model.router_aux_loss_coef and model.router_bias_update_rate must be >= 0", "use 0 to disable either")
    if m.capacity_factor < 0:
        _fail(f"model.capacity_factor={m.capacity_factor} must be >= 0", "use 0 for no token dropping, or e.g. 1.25")


def check_expert_layout(family: str, num_experts: int, ep: int, etp: int, world_size: int, pp: int, tp: int,
                        cp: int) -> None:
    """The expert grid's rules (shared with the planner, which sees MoE shapes the model lacks yet)."""
    if (ep > 1 or etp > 1) and num_experts == 0:
        _fail(f"parallel.ep={ep}, etp={etp} on the dense model family {family!r}: "
              "expert parallelism needs an MoE model", "set parallel.ep=1 and parallel.etp=1")
    if num_experts and num_experts % ep:
        _fail(f"model.num_experts={num_experts} is not divisible by parallel.ep={ep}",
              "choose an ep that divides the number of experts")
    stage = world_size // pp
    if (ep * etp) > stage or stage % (ep * etp):
        _fail(
            f"ep*etp = {ep}*{etp} must divide the ranks of one pipeline stage, world/pp = {stage} "
            f"(the expert grid ep x etp and the dense grid tp x cp share each stage's ranks, so the "
            f"minimum world is pp*max(tp*cp, ep*etp) = {pp * max(tp * cp, ep * etp)})",
            "launch more ranks or lower ep/etp",
        )


def reshard_after_forward(policy: str, pp: int) -> bool:
    """FSDP's reshard-after-forward: by default not under a pipeline, where each micro-batch's
    forward and backward would otherwise gather every block's parameters again."""
    return policy == "always" or (policy == "default" and pp == 1)


def resolve_schedule(name: str, vpp: int) -> str:
    if name != "auto":
        return name
    return "1F1B" if vpp == 1 else "Interleaved1F1B"


def stage_layer_counts(num_layers: int, pp: int, vpp: int, explicit: list[int] | None) -> list[int]:
    """Layers per pipeline stage: ``explicit`` checked, or an even split."""
    stages = pp * vpp
    if explicit is None:
        if num_layers % stages:
            _fail(f"model.num_hidden_layers={num_layers} cannot be split evenly into pp*vpp = {pp}*{vpp} = "
                  f"{stages} stages", "choose pp and vpp whose product divides the layer count, or give "
                  "parallel.pp_layers_per_stage")
        return [num_layers // stages] * stages
    if len(explicit) != stages:
        _fail(f"parallel.pp_layers_per_stage has {len(explicit)} entries but there are pp*vpp = {pp}*{vpp} = "
              f"{stages} stages", f"give {stages} layer counts, one per stage in stage order")
    if sum(explicit) != num_layers or min(explicit) < 0:
        _fail(f"parallel.pp_layers_per_stage={explicit} must be non-negative counts summing to "
              f"model.num_hidden_layers={num_layers} (they sum to {sum(explicit)})", "fix the counts")
    empty_middle = [i for i, n in enumerate(explicit) if n == 0 and 0 < i < stages - 1]
    if empty_middle:
        _fail(f"parallel.pp_layers_per_stage={explicit}: middle stage(s) {empty_middle} have no layers "
              "(only the first and last stages hold the embedding and the output head)",
              "give every middle stage at least one layer")
    return list(explicit)


def check_schedule(schedule: str, pp: int, vpp: int, n_microbatches: int, where: str) -> None:
    """The pipeline schedule's own constraints, stated before torch would raise them mid-setup."""
    field = "parallel.pp_schedule"
    if schedule in SINGLE_STAGE_SCHEDULES and vpp > 1:
        _fail(f"{field}={schedule} runs one stage per rank but parallel.vpp={vpp}",
              "use Interleaved1F1B, LoopedBFS or InterleavedZeroBubble, or set parallel.vpp=1")
    if schedule in V_SCHEDULES and vpp != 2:
        _fail(f"{field}={schedule} places exactly two stages per rank in a V, so it needs parallel.vpp=2, "
              f"not {vpp}", "set parallel.vpp=2")
    if schedule == "1F1B" and n_microbatches < pp:
        _fail(f"{field}=1F1B needs n_microbatches >= pp, but {where} < pp={pp}",
              "raise train.global_batch_size or lower train.micro_batch_size, or use GPipe")
    if schedule in LOOPED_SCHEDULES:
        if n_microbatches < pp:
            _fail(f"interleaved pipeline schedules need n_microbatches >= pp, but {where} < pp={pp}",
                  "raise train.global_batch_size or lower train.micro_batch_size")
        rounds = n_microbatches // pp
        if schedule != "LoopedBFS" and n_microbatches % rounds:
            _fail(f"{field}={schedule} runs n_microbatches in rounds of pp: {where} is not a multiple of "
                  f"{n_microbatches}//pp = {rounds} rounds", f"use a multiple of pp={pp} micro-batches")
    if schedule == "DualPipeV" and n_microbatches < 2 * pp:
        _fail(f"{field}=DualPipeV needs n_microbatches >= pp*vpp = {2 * pp} stages, but {where}",
              "raise train.global_batch_size or lower train.micro_batch_size")


def layout_warnings(layout: Layout, gpus_per_node: int | None) -> list[str]:
    out = []
    per_node = gpus_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", layout.world_size))
    if layout.tp > per_node:
        out.append(f"tp={layout.tp} is larger than the {per_node} ranks of one node: tensor parallel "
                   "traffic would cross nodes and collapse throughput; keep tp inside a node")
    if layout.pp > 1 and layout.vpp == 1:
        out.append(f"pp={layout.pp} without virtual stages (vpp=1): the pipeline bubble is "
                   "(pp-1)/(m+pp-1) of each step; set parallel.vpp > 1 for an interleaved schedule")
    return out
