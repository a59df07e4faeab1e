"""The single-process reference run every parallel layout is compared with.

Plain modules, torch's own clip_grad_norm_, no mesh, no DTensor: only the building blocks that
have nothing parallel in them (model, init, data order, optimizer groups, schedule) are shared.
"""

import dataclasses

import torch
import torch.nn.functional as F

from meshtrain.config import JobConfig
from meshtrain.data.loader import BatchStream
from meshtrain.data.sources import end_of_document_id, training_dataset
from meshtrain.models.documents import document_ids
from meshtrain.models.float8 import convert_to_float8
from meshtrain.models.initialize import init_weights
from meshtrain.models.lora import add_lora, init_lora
from meshtrain.models.transformer import Transformer
from meshtrain.models.moe import MoE
from meshtrain.optim import build_lr_scheduler, build_optimizer


def reference_run(cfg: JobConfig) -> dict:
    t = cfg.train
    torch.manual_seed(t.seed)
    model = Transformer(cfg.model)
    model.reset_position_ids = cfg.data.reset_position_ids
    eos = end_of_document_id(cfg.data) if cfg.data.document_mask != "off" and cfg.data.format == "pretrain" else None

    def documents(x):
        return document_ids(x, eos) if eos is not None else None
    if t.float8:
        convert_to_float8(model, emulate=t.float8_emulate)
    if cfg.peft.adapters:
        add_lora(model, cfg.peft)
    init_weights(model, t.seed)
    if cfg.peft.adapters:
        init_lora(model, t.seed)
    dataset, _ = training_dataset(cfg.data, t, cfg.model.vocab_size)
    stream = BatchStream(dataset, global_batch=t.global_batch_size, micro_batch=t.micro_batch_size, dp_size=1,
                         dp_rank=0, shuffle=cfg.data.shuffle, seed=t.seed, num_workers=0)
    moe_layers = [m for m in model.modules() if isinstance(m, MoE)]
    for moe in moe_layers:
        moe.aux_loss_scale = 1.0 / stream.accum  # the loss below is averaged over the micro-batches
    optimizer = build_optimizer([model], cfg.optimizer)
    scheduler = build_lr_scheduler(optimizer, t.steps, cfg.lr_schedule)
    losses, grad_norms, val_losses = [], [], []
    held_out = None
    if cfg.eval.interval:
        held_out = training_dataset(dataclasses.replace(cfg.data, path=cfg.eval.data, blend=[]), t,
                                    cfg.model.vocab_size)[0]
    for step in range(1, t.steps + 1):
        batches = stream.next_step()
        total = 0.0
        targets = sum(int((y != -100).sum()) for _, y, *_ in batches)  # the step's loss: the mean over its targets
        for x, y, *ids in batches:
            ids = (ids[0] if ids else documents(x)) if cfg.data.document_mask != "off" else None
            loss = F.cross_entropy(model(x, ids).flatten(0, 1), y.flatten(), reduction="sum") / targets
            loss.backward()
            total += loss.item()
        grad_norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip).item())
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        for moe in moe_layers:  # aux-loss-free balancing, from this step's load
            if cfg.model.router_bias_update_rate > 0:
                moe.update_bias(moe.tokens_per_expert, cfg.model.router_bias_update_rate)
            moe.reset_statistics()
        losses.append(total)
        if held_out is not None and (step % cfg.eval.interval == 0 or step == t.steps):
            val_losses.append(evaluate(model, held_out, cfg.eval.steps * t.global_batch_size, documents))
    return {"losses": losses, "grad_norms": grad_norms, "state": model.state_dict(), "val_losses": val_losses}


@torch.no_grad()
def evaluate(model, dataset, samples: int, documents) -> float:
    """The mean token loss over the first ``samples`` held-out samples, in order."""
    model.eval()
    total = count = 0.0
    for i in range(samples):
        x, y, *ids = dataset[i]
        ids = ids[0][None] if ids else documents(x[None])
        total += F.cross_entropy(model(x[None], ids).flatten(0, 1), y, reduction="sum").item()
        count += int((y != -100).sum())
    model.train()
    return total / count
