"""tests/workers/train.py with every MoE router forced to choose experts 0..k-1 (a selection bias of one
on them; the weights stay the router's probabilities): every other expert, and under expert
parallelism every other ep rank's experts, receive no token in any step (tests/test_moe.py)."""

import torch

from meshtrain.models.moe import Router
from tests.workers import train


def run(args, out, runtime) -> None:
    choose = Router.forward

    def forced(self, x):
        with torch.no_grad():
            self.expert_bias.zero_()
            self.expert_bias[: self.top_k] = 1.0
        return choose(self, x)

    Router.forward = forced
    try:
        train.run(args, out, runtime)
    finally:
        Router.forward = choose
