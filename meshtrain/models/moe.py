"""The mixture-of-experts MLP (Qwen3-MoE, Mixtral, DeepSeek-V3, GPT-OSS): router, token-choice top-k
dispatch, grouped experts.

Routing: softmax over the router's logits (fp32), the top-k experts per token, their weights
renormalised to sum to one when ``norm_topk_prob``; or, as the family says (``Router``), a softmax
over the chosen logits only (GPT-OSS), or sigmoid scores chosen within the best groups and scaled
(DeepSeek-V3). By default no token is dropped: every expert
computes every token routed to it. With ``capacity_factor`` each expert takes at most
ceil(capacity_factor * S * k / E) copies of each sequence of S tokens (``capacity_mask``); per
sequence, so which copies drop does not depend on how sequences are grouped into micro-batches and
dp/ep ranks. With aux-loss-free balancing a per-expert bias is added to the scores
for choosing the experts only (DeepSeek-V3, whose checkpoints carry it); the weights stay the scores.

Dispatch: the token copies are sorted by expert, each expert runs its SwiGLU on its contiguous
group (``ExpertGroups``: ``F.grouped_mm`` over the jagged groups on CUDA bf16, SM >= 80; elsewhere a
loop over the groups, which tests/test_moe.py checks against the grouped path on CPU), and the
weighted outputs are summed back into token order. Experts are stacked weights [E, ...] so that
expert parallelism can shard dim 0.

Load balancing: the Switch Transformer loss E * sum_i f_i * P_i (f_i: the fraction of token copies
routed to expert i, P_i: its mean router probability), per sequence, averaged; scaled by
``router_aux_loss_coef`` / (MoE layers) and added to the gradient directly (``AuxLoss``) rather
than to the returned loss, so that it works unchanged inside pipeline stages. Each layer records
its tokens per expert for the step's load metrics.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from meshtrain.config import ModelConfig


class AuxLoss(torch.autograd.Function):
    """Identity on ``x`` in forward; in backward also sends gradient ``scale`` into ``aux`` (Megatron's
    MoEAuxLossAutoScaler): adds scale * aux to the objective without returning it."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, aux: torch.Tensor, scale: float):
        ctx.save_for_backward(aux)
        ctx.scale = scale
        return x

    @staticmethod
    def backward(ctx, grad):
        (aux,) = ctx.saved_tensors
        return grad, torch.full_like(aux, ctx.scale), None


def sequence_balance_loss(probs: torch.Tensor, indices: torch.Tensor, num_experts: int,
                          sequence_group: dist.ProcessGroup | None = None,
                          grad_scale: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """E * sum_i f_i * P_i per sequence, averaged over the sequences: probs [B, S, E], indices
    [B, S * k]. Per sequence (DeepSeek-V3's sequence-wise form) rather than per micro-batch, so the
    loss does not depend on how sequences are grouped into micro-batches and data-parallel ranks.

    Returns (the term to differentiate, the loss's value). Under context parallelism or in a
    tensor-parallel MoE block (``sequence_group``: cp x tp) each rank holds a part of every sequence:
    f_i and P_i are sums over the whole sequence, all-reduced over the group without autograd; the
    rank differentiates only its own tokens' share of P_i (the shares sum to the loss), times
    ``grad_scale`` = cp, because the data-parallel gradient reduction averages over the cp ranks
    (and the tp ranks' summands are added, not averaged)."""
    counts = torch.zeros(probs.shape[0], num_experts, device=probs.device).scatter_add_(
        1, indices, torch.ones_like(indices, dtype=torch.float))
    prob_sums = probs.sum(dim=1)
    ranks = 1
    total_counts, total_probs = counts, prob_sums.detach()
    if sequence_group is not None:
        ranks = dist.get_world_size(sequence_group)
        totals = torch.cat([counts, prob_sums.detach()], dim=1)
        dist.all_reduce(totals, group=sequence_group)
        total_counts, total_probs = totals.split(num_experts, dim=1)
    tokens = probs.shape[1] * ranks
    fraction = total_counts / (indices.shape[1] * ranks)
    mine = num_experts * (fraction * prob_sums / tokens).sum(dim=-1).mean()
    value = num_experts * (fraction * total_probs / tokens).sum(dim=-1).mean()
    return mine * grad_scale, value


def capacity_mask(indices: torch.Tensor, num_experts: int, capacity: int) -> torch.Tensor:
    """indices [B, S, k] -> which copies each expert keeps [B, S, k]: per sequence, the first
    ``capacity`` copies routed to it, counting every token's first choice (in token order) before
    any second choice (GShard's priority: a token loses its k-th choice before another its first)."""
    b, s, k = indices.shape
    by_priority = indices.transpose(1, 2).reshape(b, k * s)
    seen = F.one_hot(by_priority, num_experts).cumsum(dim=1)  # copies each expert got so far
    position = seen.gather(-1, by_priority.unsqueeze(-1)).squeeze(-1) - 1
    return (position < capacity).view(b, k, s).transpose(1, 2)


class Router(nn.Module):
    """HF's ``mlp.gate``: a linear map from hidden states to one logit per expert (with a bias where
    the family has one, GPT-OSS), and the family's scoring (``Family.router_scoring``): softmax over
    the experts; softmax over the top-k logits only (GPT-OSS); or DeepSeek-V3's independent
    sigmoids, computed in fp32 as transformers does, with group-limited choice (``n_group`` > 1:
    only the ``topk_group`` groups whose two best scores sum highest) and ``routed_scaling_factor``
    on the weights."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        family = cfg.definition
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        self.top_k = cfg.num_experts_per_tok
        self.normalize = cfg.norm_topk_prob or family.topk_always_normalized
        self.bias = nn.Parameter(torch.empty(cfg.num_experts)) if family.router_bias else None
        self.scoring = family.router_scoring
        self.groups, self.top_groups, self.weight_scale = cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor
        # Aux-loss-free balancing: persistent (it is training state, and DeepSeek-V3's checkpoints
        # carry it as e_score_correction_bias), updated outside autograd.
        self.register_buffer("expert_bias", torch.zeros(cfg.num_experts),
                             persistent=cfg.router_bias_update_rate > 0 or "mlp.gate.expert_bias" in family.hf_buffers)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [tokens, hidden] -> router probabilities [tokens, E] (fp32; what the balancing loss
        averages: the softmax, or the sigmoid scores normalised over the experts), top-k weights and
        indices."""
        sigmoid = self.scoring == "sigmoid"
        if sigmoid:
            scores = F.linear(x.float(), self.weight.float()).sigmoid()
            probs = scores / scores.sum(dim=-1, keepdim=True)
        elif self.scoring == "topk_softmax":  # the weights are the softmax of the chosen logits alone
            logits = F.linear(x, self.weight, self.bias)
            indices = torch.topk(logits.float() + self.expert_bias, self.top_k, dim=-1).indices
            weights = logits.gather(-1, indices).softmax(dim=-1)
            return logits.float().softmax(dim=-1), weights.to(x.dtype), indices
        else:
            scores = probs = F.linear(x, self.weight).float().softmax(dim=-1)
        if sigmoid or self.expert_bias.any():
            indices = torch.topk(self.limit_to_groups(scores + self.expert_bias), self.top_k, dim=-1).indices
            weights = scores.gather(-1, indices)
        else:
            weights, indices = torch.topk(scores, self.top_k, dim=-1)
        if self.normalize:
            # the sigmoid's weights may all be tiny: transformers' epsilon keeps the sum off zero
            weights = weights / (weights.sum(dim=-1, keepdim=True) + (1e-20 if sigmoid else 0.0))
        if self.weight_scale != 1.0:
            weights = weights * self.weight_scale
        return probs, weights.to(x.dtype), indices

    def limit_to_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """``choice`` [tokens, E] with the experts outside each token's best ``top_groups`` groups at
        -inf; a group's score is the sum of its two best experts' (DeepSeek-V3)."""
        if self.groups == 1:
            return choice
        grouped = choice.view(choice.shape[0], self.groups, -1)
        best = torch.topk(grouped.topk(2, dim=-1).values.sum(dim=-1), self.top_groups, dim=-1).indices
        keep = torch.zeros_like(grouped[..., 0], dtype=torch.bool).scatter_(1, best, True)
        return grouped.masked_fill(~keep[..., None], float("-inf")).view_as(choice)


class Experts(nn.Module):
    """E SwiGLU experts as stacked weights: gate_proj/up_proj [E, I, hidden], down_proj [E, hidden, I]."""

    PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
    ETP_DIMS = {"gate_proj": 1, "up_proj": 1, "down_proj": 2}
    """The dim of each stacked weight that expert tensor parallelism splits: the FFN width."""
    SAVED_PER_ROW = 4
    """Elements of the FFN width autograd keeps per token copy (gate, up, silu(gate), product: the planner's)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        e, i, h = cfg.num_experts, cfg.resolved_moe_intermediate_size, cfg.hidden_size
        self.gate_proj = nn.Parameter(torch.empty(e, i, h))
        self.up_proj = nn.Parameter(torch.empty(e, i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x [N, hidden]: token copies sorted by expert, ``counts[e]`` of them for local expert e."""
        # Under expert parallelism the weights are DTensors sharded over experts: compute on this
        # rank's experts (to_local is differentiable, so the gradients land in the DTensors).
        gate, up, down = (local(getattr(self, name)) for name in self.PROJECTIONS)
        groups = ExpertGroups(counts, use_grouped_mm(x, gate, up, down, *self.extra_operands()))
        hidden = F.silu(self.project(x, "gate_proj", gate, groups)) * self.project(x, "up_proj", up, groups)
        return self.project(hidden, "down_proj", down, groups)

    def weight(self, name: str) -> torch.Tensor:
        """Projection ``name`` as [E, out, in] (a view of the stored parameter, for LoRA)."""
        return getattr(self, name)

    def project(self, x: torch.Tensor, name: str, weight: torch.Tensor, groups: ExpertGroups) -> torch.Tensor:
        """x times each expert's slice of projection ``name`` (LoRA adds its update here)."""
        return groups.linear(x, weight)

    def extra_operands(self) -> tuple[torch.Tensor, ...]:
        """Further matrices ``project`` multiplies by (they must suit the grouped GEMM too)."""
        return ()


def local(weight: torch.Tensor) -> torch.Tensor:
    return weight.to_local() if isinstance(weight, DTensor) else weight


class ExpertGroups:
    """Rows sorted by expert, ``counts[e]`` for expert e, multiplied by each expert's own matrix:
    one grouped GEMM over the jagged groups (no loop, no host sync), or a loop over the groups
    (any device and dtype; needs the counts on the host)."""

    def __init__(self, counts: torch.Tensor, grouped: bool):
        self.offsets = torch.cumsum(counts, 0, dtype=torch.int32) if grouped else None
        self.sizes = None if grouped else counts.tolist()

    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x [N, in], weight [E, out, in] -> [N, out]."""
        if self.offsets is not None:
            return F.grouped_mm(x, weight.transpose(-2, -1), offs=self.offsets)
        outs = [group @ weight[e].t() for e, group in enumerate(torch.split(x, self.sizes))]
        return torch.cat(outs) if outs else x.new_zeros(0, weight.shape[-2])


def use_grouped_mm(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """The fast path: CUDA bf16 on SM >= 80 (the grouped GEMM kernels). On CPU torch's grouped_mm
    is a composite of per-group GEMMs and measured slower than the loop in training (0.074 vs
    0.064 s for a 4096-token, 8-expert fwd+bwd on 2 cores), so CPU keeps the loop."""
    return (x.device.type == "cuda" and x.dtype == torch.bfloat16
            and torch.cuda.get_device_capability(x.device) >= (8, 0) and grouped_mm_supported(x, *weights))


def grouped_mm_supported(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether ``F.grouped_mm`` takes these operands: one dtype, every row stride a multiple of 16 bytes."""
    return all(t.dtype == x.dtype and t.stride(-2) * t.element_size() % 16 == 0 for t in (x, *weights))


class MoE(nn.Module):
    recording = True
    """Whether a forward adds to the step's statistics (``statistics_paused``)."""

    def __init__(self, cfg: ModelConfig, shared_expert: nn.Module | None = None):
        """``shared_expert``: a dense MLP every token also goes through (the model builds it)."""
        super().__init__()
        self.num_experts, self.top_k = cfg.num_experts, cfg.num_experts_per_tok
        self.capacity_factor = cfg.capacity_factor
        self.gate = Router(cfg)
        self.experts = cfg.definition.experts_module(cfg)
        # GPT-OSS: each expert's down_proj bias, kept beside the router (whole on every rank, like
        # it) rather than with its expert: added to the expert's output before the routing weight
        self.expert_output_bias = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size)) \
            if cfg.definition.expert_biases else None
        self.shared_expert = shared_expert
        moe_layers = sum(cfg.is_sparse_layer(i) for i in range(cfg.num_hidden_layers))
        self.aux_coef = cfg.router_aux_loss_coef / max(1, moe_layers)
        self.aux_loss_scale = 1.0
        """Set by the trainer: 1 / micro-batches without a pipeline (the loss is averaged over them
        there), 1 under a pipeline (the schedule scales every gradient by 1 / micro-batches)."""
        self.sequence_group: dist.ProcessGroup | None = None
        self.aux_grad_scale = 1
        """Set by the trainer under cp or tp: the ranks that share each sequence, and cp (see
        ``sequence_balance_loss``)."""
        # The step's statistics, for the load metrics (reset by the trainer after each step).
        self.register_buffer("tokens_per_expert", torch.zeros(cfg.num_experts), persistent=False)
        self.register_buffer("dropped_per_expert", torch.zeros(cfg.num_experts), persistent=False)
        self.aux_loss_sum, self.aux_loss_count = 0.0, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        probs, weights, indices = self.gate(flat)
        expert_of_copy = indices.reshape(-1)
        routed = torch.bincount(expert_of_copy, minlength=self.num_experts)
        if self.capacity_factor > 0:
            capacity = math.ceil(self.capacity_factor * shape[1] * self.top_k / self.num_experts)
            kept = capacity_mask(indices.view(shape[0], shape[1], self.top_k), self.num_experts, capacity).reshape(-1)
            copies = kept.nonzero().squeeze(1)
            order = copies[torch.argsort(expert_of_copy[copies], stable=True)]
            counts = torch.bincount(expert_of_copy[copies], minlength=self.num_experts)
        else:
            order, counts = torch.argsort(expert_of_copy, stable=True), routed
        token_of_copy = order // self.top_k
        out = self.experts(flat[token_of_copy], counts)
        if self.expert_output_bias is not None:
            out = out + self.expert_output_bias[expert_of_copy[order]]
        out = out * weights.reshape(-1, 1)[order]
        combined = torch.zeros_like(flat).index_add_(0, token_of_copy, out)
        if self.shared_expert is not None:
            combined = combined + self.shared_expert(flat)
        # activation checkpointing's recomputation in backward, or a pipeline stage's shape inference
        recompute = torch._C._current_graph_task_id() != -1 or not self.recording
        if not recompute and self.training:  # training's load; evaluation leaves it (and bias balancing) alone
            with torch.no_grad():
                self.tokens_per_expert += routed.to(self.tokens_per_expert.dtype)  # routed, dropped or not
                self.dropped_per_expert += (routed - counts).to(self.dropped_per_expert.dtype)
        if self.training and torch.is_grad_enabled() and self.aux_coef > 0:
            aux, value = sequence_balance_loss(probs.view(shape[0], -1, self.num_experts),
                                               indices.view(shape[0], -1), self.num_experts, self.sequence_group,
                                               self.aux_grad_scale)
            if not recompute:
                self.aux_loss_sum += value
                self.aux_loss_count += 1
            combined = AuxLoss.apply(combined, aux, self.aux_coef * self.aux_loss_scale)
        return combined.reshape(shape)

    @torch.no_grad()
    def reset_state(self) -> None:
        self.reset_statistics()
        self.gate.expert_bias.zero_()

    def reset_statistics(self) -> None:
        self.tokens_per_expert.zero_()
        self.dropped_per_expert.zero_()
        self.aux_loss_sum, self.aux_loss_count = 0.0, 0

    def mean_aux_loss(self) -> float | torch.Tensor:
        return self.aux_loss_sum / max(1, self.aux_loss_count)

    @torch.no_grad()
    def update_bias(self, tokens_per_expert: torch.Tensor, rate: float) -> None:
        """Aux-loss-free balancing step: raise the bias of under-loaded experts, lower the others'."""
        self.gate.expert_bias += rate * torch.sign(tokens_per_expert.mean() - tokens_per_expert)

    def tp_plan(self, tp) -> dict:
        """Not split by tp: each tp rank routes its own slice of the sequence through the whole router
        and experts (free under SP; a slice in and an all-gather out without it), and
        parallel/tensor.py's sum_moe_grads_over_tp adds up their gradients."""
        from torch.distributed.tensor import Shard
        from torch.distributed.tensor.parallel import PrepareModuleInputOutput

        return {"": PrepareModuleInputOutput(
            input_layouts=(tp.residual,), desired_input_layouts=(Shard(1),), use_local_input=True,
            output_layouts=(Shard(1),), desired_output_layouts=(tp.residual,), use_local_output=True)}


@contextlib.contextmanager
def statistics_paused(model: nn.Module) -> Iterator[None]:
    """Forwards of ``model`` inside leave its MoE layers' statistics (load, aux loss) alone."""
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    for m in layers:
        m.recording = False
    try:
        yield
    finally:
        for m in layers:
            m.recording = True
