"""GPT-OSS's experts, stored as its checkpoints store them: ``gate_up_proj`` [E, hidden, 2 I] (input
rows, gate and up columns interleaved: gate_0, up_0, gate_1, ...) with ``gate_up_proj_bias``
[E, 2 I], and ``down_proj`` [E, I, hidden]; the activation is the clamped SwiGLU, gate clamped
above and up on both sides at ``swiglu_limit``, then (up + 1) * gate * sigmoid(alpha * gate). The
down projection's bias lives in the MoE block (``MoE.expert_output_bias``), whole on every rank.

LoRA's per-expert adapters follow ``weight``'s [E, out, in] view (B's rows in the interleaved
column order), as peft's adapters of these parameters do. Keeping the checkpoint's layout makes
import and export a rename, and still splits cleanly:
expert parallelism shards dim 0; expert tensor parallelism takes a contiguous slice of the
interleaved columns (whole gate/up pairs, 2 I / etp of them) and the matching rows of down_proj.
"""

from __future__ import annotations

import torch
from torch import nn

from meshtrain.models.config import ModelConfig
from meshtrain.models.moe import ExpertGroups, Experts, local, use_grouped_mm


class InterleavedExperts(Experts):
    PROJECTIONS = ("gate_up_proj", "down_proj")
    ETP_DIMS = {"gate_up_proj": 2, "gate_up_proj_bias": 1, "down_proj": 1}
    SAVED_PER_ROW = 7  # gate_up (2), the clamped gate, its sigmoid, their product, up + 1, the product

    def __init__(self, cfg: ModelConfig):
        nn.Module.__init__(self)
        e, i, h = cfg.num_experts, cfg.resolved_moe_intermediate_size, cfg.hidden_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, h, 2 * i))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(e, 2 * i))
        self.down_proj = nn.Parameter(torch.empty(e, i, h))
        self.alpha, self.limit = cfg.swiglu_alpha, cfg.swiglu_limit

    def weight(self, name: str) -> torch.Tensor:
        return getattr(self, name).transpose(-2, -1)  # stored [E, in, out]

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        # ExpertGroups (and LoRA's update) multiply by [E, out, in] weights: these are stored [E, in, out]
        gate_up, down = (local(getattr(self, n)).transpose(-2, -1) for n in self.PROJECTIONS)
        groups = ExpertGroups(counts, use_grouped_mm(x, gate_up, down, *self.extra_operands()))
        expert = torch.repeat_interleave(torch.arange(counts.numel(), device=x.device), counts, output_size=x.shape[0])
        h = self.project(x, "gate_up_proj", gate_up, groups) + local(self.gate_up_proj_bias)[expert]
        gate, up = h[..., ::2].clamp(max=self.limit), h[..., 1::2].clamp(min=-self.limit, max=self.limit)
        return self.project((up + 1) * (gate * torch.sigmoid(gate * self.alpha)), "down_proj", down, groups)
