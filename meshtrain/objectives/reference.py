"""The reference model of a preference loss: the frozen model the policy's log-ratios are measured
against, scored on each step's samples before the policy's pass.

Under peft it is the policy itself with every adapter switched off (the frozen base: no second
copy). Otherwise it is a frozen copy of the starting weights, built and sharded exactly like the
policy (the same layout, pipeline stages and schedule; the same seeded initialisation or the same
Hugging Face import), with no gradients and no optimizer state. It runs through the training step's
own loop (``micro_batches.forward_micro_batches``), forward only, in eval mode (MoE layers leave
their load statistics alone); its per-sequence log-probs stay on the rank that computes the
policy's loss (the last stage), summed over cp.
"""

from __future__ import annotations

import contextlib

import torch

from meshtrain.hf.io import load_hf_weights
from meshtrain.micro_batches import forward_micro_batches
from meshtrain.models.lora import adapters_disabled


class Reference:
    def __init__(self, trainer):
        cfg = trainer.cfg
        self.copy = not cfg.peft.adapters
        if not self.copy:
            self.parts, self.pipeline = trainer.parts, trainer.pipeline
            return
        self.parts, self.pipeline = trainer.build_model_parts()  # as the policy's: the same layout and schedule
        if cfg.model.init_from_hf is not None:
            load_hf_weights(self.parts, cfg.model.init_from_hf)
        for part in self.parts:
            part.requires_grad_(False)

    @torch.no_grad()
    def score(self, trainer, batches) -> torch.Tensor:
        """[samples, seq]: each of this rank's step samples' per-document summed log-probs (column d
        for document d), where the objective runs (the last stage)."""
        objective = trainer.objective
        samples, seq = sum(len(b.inputs) for b in batches), batches[0].inputs.shape[1]
        objective.reference_logps = torch.zeros(samples, seq, device=trainer.runtime.device)
        objective.scoring = True
        for part in self.parts:
            part.eval()
        try:
            with contextlib.nullcontext() if self.copy else adapters_disabled(self.parts):
                forward_micro_batches(trainer, self.parts, self.pipeline, batches, backward=False)
        finally:
            objective.scoring = False
            for part in self.parts:
                part.train()
        return objective.reference_logps
