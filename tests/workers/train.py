"""Train a few steps with the CLI's options and save what rank 0 sees: OUT/out.pt holds the per-step
losses and grad norms, the full (unsharded) final weights, and the collectives of the first and
second steps by op name."""

import contextlib
from types import SimpleNamespace

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from meshtrain.cli import parse
from meshtrain.config import JobConfig
from meshtrain.parallel.layout import plan_layout
from meshtrain.parallel.mesh import build_mesh
from meshtrain.telemetry.comm_counter import CollectiveCounter
from meshtrain.trainer import Trainer


def run(args, out, runtime) -> None:
    cfg = parse(JobConfig, [*args, "--train.run-dir", str(out / "run")], "train job")
    mesh = build_mesh(plan_layout(cfg, runtime.world_size), runtime.device.type)
    trainer = Trainer(cfg, runtime, mesh)

    def counting():  # dynamo does not trace under a Python dispatch mode: compiled jobs go uncounted
        return contextlib.nullcontext(SimpleNamespace(counts={}, bytes={})) if cfg.train.compile else CollectiveCounter()

    val_losses = []

    def step() -> dict:
        metrics = trainer.train_step()
        if trainer.evaluator and (trainer.step % cfg.eval.interval == 0 or trainer.step == cfg.train.steps):
            val_losses.append(trainer.evaluator.evaluate()["val_loss"])
        return metrics

    with counting() as comm:
        history = [step()]
    with counting() as comm2:  # steady state: step 1 also holds one-off set-up (pipeline shapes)
        history.append(step())
    history += [step() for _ in range(cfg.train.steps - 2)]
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
            # this rank's AdamW state (moments, not the step counters) and trainable elements
            "optimizer_bytes": sum(v.to_local().nbytes if isinstance(v, DTensor) else v.nbytes
                                   for opt in trainer.optimizers for st in opt.state.values()
                                   for v in st.values() if isinstance(v, torch.Tensor) and v.ndim > 0),
            "trainable_elements": sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel()
                                      for p in trainer.params),
            "comm_counts": dict(comm.counts),
            "comm_bytes": dict(comm.bytes),
            "compiled_graphs": trainer.compiled_graphs,
            "val_losses": val_losses,
            "comm_counts_step2": dict(comm2.counts),
        }, out / "out.pt")
