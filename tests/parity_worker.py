"""Run on every rank by torchrun: train a few steps with the CLI's options, save what rank 0 sees.

    torchrun ... tests/parity_worker.py OUT.pt [meshtrain train options ...]

OUT.pt holds the per-step losses and grad norms, the full (unsharded) final weights, and the
collectives of the first and second steps by op name.
"""

import sys

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from meshtrain.cli import parse
from meshtrain.config import JobConfig
from meshtrain.parallel.runtime import exit_process, init_distributed, shutdown, world_size_from_env
from meshtrain.parallel.layout import plan_layout
from meshtrain.parallel.mesh import build_mesh
from meshtrain.trainer import Trainer
from meshtrain.telemetry.comm_counter import CollectiveCounter


def main() -> None:
    out, args = sys.argv[1], sys.argv[2:]
    cfg = parse(JobConfig, args, "parity_worker")
    layout = plan_layout(cfg, world_size_from_env())
    runtime = init_distributed(cfg.parallel.timeout_s)
    try:
        mesh = build_mesh(layout, runtime.device.type)
        trainer = Trainer(cfg, runtime, mesh)
        with CollectiveCounter() as comm:
            history = [trainer.train_step()]
        with CollectiveCounter() as comm2:  # steady state: step 1 also holds one-off set-up (pipeline shapes)
            history.append(trainer.train_step())
        history += [trainer.train_step() for _ in range(cfg.train.steps - 2)]
        # Each pipeline stage gathers its own full weights; rank 0 merges the stages' global names.
        state = {}
        for part in trainer.parts:
            part_state = get_model_state_dict(part, options=StateDictOptions(full_state_dict=True))
            state |= {name: value.cpu() for name, value in part_state.items()}
        states = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(states, state)
        state = {name: value for s in states for name, value in s.items()}
        if runtime.is_main:
            torch.save({
                "layout": mesh.describe(cfg.parallel),
                "losses": [m["loss"] for m in history],
                "grad_norms": [m["grad_norm"] for m in history],
                "state": state,
                "comm_counts": dict(comm.counts),
                "comm_counts_step2": dict(comm2.counts),
            }, out)
    except BaseException:
        shutdown()
        raise
    shutdown(synchronize=True)
    exit_process(0)  # see exit_process: a clean exit without gloo's teardown race


if __name__ == "__main__":
    main()
