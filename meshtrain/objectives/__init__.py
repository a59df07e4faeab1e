"""What training minimises, one object per objective (``objectives/objective.py`` says what one
is): token cross-entropy for pretraining and SFT, preference losses for DPO and its variants."""

from __future__ import annotations

from meshtrain.config import JobConfig
from meshtrain.objectives.objective import Objective


def build_objective(cfg: JobConfig) -> Objective:
    """The objective of the job's data: preference pairs get the preference loss, the rest token
    cross-entropy."""
    if cfg.data.format == "preference":
        from meshtrain.objectives.preference import PreferenceObjective
        return PreferenceObjective(cfg.preference)
    from meshtrain.objectives.cross_entropy import TokenCrossEntropy
    return TokenCrossEntropy()
