"""meshtrain: hybrid-parallel (pp, dp, cp, tp, ep) LLM training on one PyTorch DeviceMesh."""

__version__ = "0.1.0"
