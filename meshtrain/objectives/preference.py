"""Preference losses over pairs of sequences: DPO, IPO, hinge and SimPO, with RPO's NLL term.

A sample holds whole pairs (``data/preference.py``): document 2k is pair k's chosen sequence and
2k + 1 its rejected one, the targets their response tokens. A sequence's log-probability is the sum
of its targets' token log-probabilities, computed in every layout without gathering the vocabulary
or the sequence:

- under tp with loss parallel the logits are vocab shards and torch's ``loss_parallel`` computes
  each token's log-probability from them (the max and the sum of exponentials over the shards, the
  target's logit from the shard that holds it);
- under cp a rank holds a share of each sequence's tokens: its partial sums are summed over the cp
  group, and the gradient flows back through each rank's own tokens only (the other ranks' share
  enters as a constant), so the ranks' gradients add up to the whole sequence's;
- under pp the loss runs on the last stage, as the schedule's loss function.

The reference model's log-probabilities (``objectives/reference.py``) are scored at the start of
each step, for the step's samples on this rank, and looked up by sample: the target carries each
token's label, document and sample index.

Each micro-batch's loss is the sum of its pairs' losses over the number of pairs in the step (every
micro-batch, every dp rank), times what undoes FSDP's averaging over dp x cp and the schedule's over
micro-batches (as ``TokenCrossEntropy``). The logged values are trl's: rewards/chosen and
rewards/rejected (beta times each log-ratio to the reference; SimPO: beta times the mean token
log-prob), their margin, the fraction of pairs whose chosen reward is higher, and the policy's
log-probs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from meshtrain.config import PreferenceConfig
from meshtrain.errors import TrainingError
from meshtrain.objectives.objective import Objective

IGNORE = -100
STATISTICS = ("loss", "pairs", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "logps/chosen",
              "logps/rejected", "nll")


def per_document(values: torch.Tensor, documents: torch.Tensor, width: int | None = None) -> torch.Tensor:
    """[batch, seq] values summed by document id: [batch, width] (document d's sum in column d;
    ``width``: the whole sequence's length, which under cp is more than a rank's share)."""
    shape = (values.shape[0], width or values.shape[1])
    return torch.zeros(shape, dtype=values.dtype, device=values.device).scatter_add(1, documents.long(), values)


def sequence_logps(logits: torch.Tensor, labels: torch.Tensor, documents: torch.Tensor,
                   cp_group: dist.ProcessGroup | None, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each document's summed target log-probabilities and its number of targets, [batch, width] each
    (column d for document d), over the whole sequence under cp."""
    batch, seq = labels.shape
    nll = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="none")
    if isinstance(nll, DTensor):  # loss parallel: every tp rank holds the same per-token values
        nll = nll.to_local()
    targets = (labels != IGNORE).to(torch.float32)
    logps = per_document(-nll.view(batch, seq) * targets, documents, width)
    counts = per_document(targets, documents, width)
    if cp_group is not None:
        whole = torch.stack([logps.detach(), counts])
        dist.all_reduce(whole, group=cp_group)
        logps = logps + (whole[0] - logps.detach())  # the value of the whole; the gradient of this rank's tokens
        counts = whole[1]
    return logps, counts


def pairs_of(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-document columns as (chosen, rejected) columns: documents 2k and 2k + 1."""
    if values.shape[1] % 2:
        values = F.pad(values, (0, 1))
    return values[:, 0::2], values[:, 1::2]


class PreferenceObjective(Objective):
    def __init__(self, cfg: PreferenceConfig):
        super().__init__(statistics=len(STATISTICS))
        self.cfg, self.reference = cfg, None
        self.scale, self.scoring = 1.0, False
        self.reference_logps: torch.Tensor | None = None
        self.cp_group, self.counts, self.width = None, True, 0
        """Under cp, the cp group; whether this rank records the pairs; the samples' whole length."""

    def attach(self, trainer) -> None:
        if self.cfg.loss != "simpo":  # SimPO needs no reference
            from meshtrain.objectives.reference import Reference
            self.reference = Reference(trainer)

    def begin(self, batches, trainer, training: bool) -> None:
        device, mesh = trainer.runtime.device, trainer.mesh
        super().begin(batches, trainer, training)
        self.cp_group = mesh["cp"].get_group() if mesh.size("cp") > 1 else None
        self.width = trainer.cfg.train.seq_len
        self.counts = mesh.size("cp") == 1 or mesh["cp"].get_local_rank() == 0  # cp ranks compute the same pairs
        if self.reference is not None:
            self.reference_logps = self.reference.score(trainer, batches)
        if not training:
            self.scale = 1.0
            return
        pairs = torch.tensor(sum(self.pair_count(b.labels, b.documents) for b in batches), device=device)
        if mesh.size("dp") > 1:
            dist.all_reduce(pairs, group=mesh["dp"].get_group())
        if int(pairs) == 0:
            raise TrainingError(f"step {trainer.step + 1} has no preference pair with a response on both sides")
        per_microbatch = trainer.stream.accum if trainer.pipeline is not None else 1
        self.scale = mesh.size("dp_cp") * per_microbatch / int(pairs)

    @staticmethod
    def pair_count(labels: torch.Tensor, documents: torch.Tensor) -> int:
        chosen, rejected = pairs_of(per_document((labels != IGNORE).float(), documents))
        return int(((chosen > 0) & (rejected > 0)).sum())

    def target(self, batch, first_row: int) -> torch.Tensor:
        rows = torch.arange(first_row, first_row + len(batch.inputs), device=batch.inputs.device)
        return torch.stack([batch.labels, batch.documents.long(), rows[:, None].expand_as(batch.labels)], dim=-1)

    def __call__(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        labels, documents, rows = target.unbind(-1)
        logps, counts = sequence_logps(logits, labels, documents, self.cp_group, self.width or labels.shape[1])
        if self.scoring:  # the reference's pass: kept for the policy's
            def store(samples=rows[:, 0].clone(), values=logps.detach()):  # (the target is restored after cp)
                self.reference_logps[samples] = values
            return self.keep(torch.zeros((), device=logps.device), store)
        (chosen, rejected), (n_chosen, n_rejected) = pairs_of(logps), pairs_of(counts)
        valid = (n_chosen > 0) & (n_rejected > 0)
        n_chosen, n_rejected = n_chosen.clamp(min=1), n_rejected.clamp(min=1)
        c = self.cfg
        if c.loss == "simpo":
            chosen_reward, rejected_reward = c.beta * chosen / n_chosen, c.beta * rejected / n_rejected
        else:
            ref_chosen, ref_rejected = pairs_of(self.reference_logps[rows[:, 0]])
            chosen_reward, rejected_reward = c.beta * (chosen - ref_chosen), c.beta * (rejected - ref_rejected)
        margin = chosen_reward - rejected_reward
        if c.loss in ("dpo", "simpo"):
            x = margin - c.simpo_gamma if c.loss == "simpo" else margin
            losses = -(1 - c.label_smoothing) * F.logsigmoid(x) - c.label_smoothing * F.logsigmoid(-x)
        elif c.loss == "hinge":
            losses = torch.relu(1 - margin)
        else:  # ipo, on per-token mean log-ratios
            ratio = (chosen - ref_chosen) / n_chosen - (rejected - ref_rejected) / n_rejected
            losses = (ratio - 1 / (2 * c.beta)) ** 2
        nll = -chosen / n_chosen
        if c.nll_weight:
            losses = losses + c.nll_weight * nll
        loss = torch.where(valid, losses, 0.0).sum() * self.scale
        if not self.counts:  # another cp rank records these pairs
            return self.keep(loss, lambda: None)
        picked = [losses, torch.ones_like(losses), chosen_reward, rejected_reward, (margin > 0).float(), chosen,
                  rejected, nll]
        return self.keep(loss, self.add([torch.where(valid, v, 0.0).sum() for v in picked]))

    def metrics(self, sums: torch.Tensor, training: bool) -> dict[str, float]:
        mean = {name: float(v / sums[1]) for name, v in zip(STATISTICS, sums) if name != "pairs"}
        mean["rewards/margins"] = mean["rewards/chosen"] - mean["rewards/rejected"]
        if not self.cfg.nll_weight:
            del mean["nll"]
        if training:
            return mean
        return {f"val_{k}": v for k, v in mean.items()} | {"val_pairs": float(sums[1])}
