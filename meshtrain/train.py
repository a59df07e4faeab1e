"""The training job: mesh, sharded model, data, and the optimizer-step loop.

Order matters and is the design: plan and validate the layout (no process group yet), build the
mesh, build the model on the meta device, apply TP then FSDP from the mesh, materialise and
initialise the local shards, then train. Every parallel size below is read from the mesh.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import pathlib
import sys
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

from meshtrain.checkpoint import Checkpointer, check_architecture, read_meta
from meshtrain.config import JobConfig, dump_yaml
from meshtrain.context_parallel import sequence_sharded
from meshtrain.data import BatchStream, PackedDataset, build_tokenizer, tokenize_corpus
from meshtrain.data_parallel import apply_fsdp
from meshtrain.distributed import (Runtime, collective_error, init_distributed, is_collective_failure, shutdown,
                                   world_size_from_env)
from meshtrain.errors import ConfigError, TrainingError
from meshtrain.expert_parallel import ExpertParallel, expert_parameters
from meshtrain.hf_adapter import read_hf_config, resolve_init_from_hf
from meshtrain.hf_io import check_export_target, export_dtypes, load_hf_weights, save_hf, tokenizer_files
from meshtrain.initialize import init_weights
from meshtrain.mesh import (Layout, ParallelMesh, build_mesh, plan_layout, reshard_after_forward, resolve_schedule,
                            stage_layer_counts)
from meshtrain.metrics import MetricsLogger, flops_per_token, memory_gib, peak_tflops
from meshtrain.model import Transformer, count_active_parameters, count_parameters
from meshtrain.moe import MoE
from meshtrain.pipeline import Pipeline, split_for_stage, stage_ids_for_rank
from meshtrain.optim import build_lr_scheduler, build_optimizer, clip_grad_norm_
from meshtrain.tensor_parallel import apply_tensor_parallel, grads_to_param_placements, sum_moe_grads_over_tp


def build_model(cfg: JobConfig, mesh: ParallelMesh, device: torch.device, stage: int | None = None, *,
                initialize: bool = True) -> Transformer:
    """The whole model, or pipeline stage ``stage`` of it: built on meta, sharded, then initialised
    (``initialize=False`` leaves the memory uninitialised, for weights about to be loaded)."""
    with torch.device("meta"):
        model = Transformer(cfg.model)
    if stage is not None:
        split_for_stage(model, stage, stage_layer_counts_for(cfg))
    model.activation_checkpointing = cfg.train.activation_checkpointing
    if mesh.size("tp") > 1:
        apply_tensor_parallel(model, mesh["tp"], sequence_parallel=cfg.parallel.sp,
                              loss_parallel=cfg.parallel.loss_parallel)
    if mesh.experts is not None:
        for module in model.modules():
            if isinstance(module, MoE):
                parallelize_module(module.experts, mesh.expert_grid, ExpertParallel())
    apply_fsdp(model, mesh, mixed_precision=cfg.train.mixed_precision,
               reshard_after_forward=reshard_after_forward(cfg.parallel.fsdp_reshard_after_forward, mesh.size("pp")))
    if mesh.size("dp_cp") == 1 and cfg.train.mixed_precision == "bf16":
        model.forward = torch.autocast(device.type, dtype=torch.bfloat16)(model.forward)  # FSDP's policy casts otherwise
    model.to_empty(device=device)
    model.tie_weights()
    if initialize:
        init_weights(model, cfg.train.seed)
    return model


def stage_layer_counts_for(cfg: JobConfig) -> tuple[int, ...]:
    p = cfg.parallel
    return tuple(stage_layer_counts(cfg.model.num_hidden_layers, p.pp, p.vpp, p.pp_layers_per_stage))


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


class Trainer:
    def __init__(self, cfg: JobConfig, runtime: Runtime, mesh: ParallelMesh):
        self.cfg, self.runtime, self.mesh = cfg, runtime, mesh
        t = cfg.train
        self.run_dir = pathlib.Path(t.run_dir)

        tokenizer = build_tokenizer(cfg.data)
        if tokenizer.vocab_size > cfg.model.vocab_size:
            raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's "
                              f"vocabulary ({tokenizer.vocab_size}). Fix: model.vocab_size >= {tokenizer.vocab_size}")
        dataset = PackedDataset(tokenize_corpus(cfg.data, tokenizer), t.seq_len)
        dp = mesh["dp"]
        self.stream = BatchStream(dataset, global_batch=t.global_batch_size, micro_batch=t.micro_batch_size,
                                  dp_size=dp.size(), dp_rank=dp.get_local_rank(), shuffle=cfg.data.shuffle,
                                  seed=t.seed, num_workers=cfg.data.num_workers)

        torch.manual_seed(t.seed)
        from_scratch = cfg.model.init_from_hf is None  # else the weights are loaded below
        self.pipeline: Pipeline | None = None
        if mesh.size("pp") > 1:
            schedule = resolve_schedule(cfg.parallel.pp_schedule, cfg.parallel.vpp)
            stage_ids = stage_ids_for_rank(mesh["pp"].get_local_rank(), mesh.size("pp"), cfg.parallel.vpp, schedule)
            self.parts = [build_model(cfg, mesh, runtime.device, stage=s, initialize=from_scratch) for s in stage_ids]
            self.pipeline = Pipeline(self.parts, stage_ids, mesh.size("pp") * cfg.parallel.vpp, mesh["pp"],
                                     runtime.device, schedule, self.stream.accum, cross_entropy)
        else:
            self.parts = [build_model(cfg, mesh, runtime.device, initialize=from_scratch)]
        self.params = [p for part in self.parts for p in part.parameters() if p.requires_grad]
        # One optimizer per part: torch's optimizer state dicts are per (module, optimizer) pair.
        self.optimizers = [build_optimizer([part], cfg.optimizer) for part in self.parts]
        self.schedulers = [build_lr_scheduler(opt, t.steps, cfg.lr_schedule) for opt in self.optimizers]
        self.step = 0
        if cfg.model.init_from_hf is not None:
            load_hf_weights(self.parts, cfg.model.init_from_hf)

        ckpt = cfg.checkpoint
        self.checkpointer = Checkpointer(ckpt, pathlib.Path(ckpt.dir or self.run_dir / "checkpoints"), self,
                                         layout=mesh.describe(cfg.parallel))
        self.resumed_from = self.checkpointer.resume_path()
        if self.resumed_from is not None:
            self.step = self.checkpointer.restore(self.resumed_from)

        self.loss_parallel = mesh.size("tp") > 1 and cfg.parallel.loss_parallel
        num_params = count_parameters(cfg.model)
        self.active_params = count_active_parameters(cfg.model) if cfg.model.is_moe else num_params
        self.flops_per_token = flops_per_token(cfg.model, t.seq_len, self.active_params)
        self.moe_layers = [m for part in self.parts for m in part.modules() if isinstance(m, MoE)]
        for moe in self.moe_layers:
            # Without a pipeline the loss is averaged over micro-batches here; the schedule scales
            # every gradient by 1 / micro-batches itself.
            moe.aux_loss_scale = 1.0 if self.pipeline is not None else 1.0 / self.stream.accum
            if mesh.size("cp_tp") > 1:  # the balancing loss counts whole sequences
                moe.sequence_group, moe.aux_grad_scale = mesh["cp_tp"].get_group(), mesh.size("cp")
        experts = {id(p) for part in self.parts for p in expert_parameters(part)} if mesh.experts is not None else set()
        self.tp_summed_params = [p for moe in self.moe_layers for p in moe.parameters()
                                 if id(p) not in experts] if mesh.size("tp") > 1 else []
        self.peak_tflops = peak_tflops(cfg.logging, runtime.device)
        self.num_params = num_params

    def train_step(self) -> dict[str, float]:
        t, device = self.cfg.train, self.runtime.device
        start = time.perf_counter()
        batches = self.stream.next_step()
        rotate = self.cfg.parallel.cp_rotate_method
        with loss_parallel() if self.loss_parallel else contextlib.nullcontext():
            if self.pipeline is not None:
                inputs, labels = (torch.cat(x).to(device) for x in zip(*batches))
                with sequence_sharded(self.mesh, [inputs, labels], self.parts, rotate):
                    step_loss = self.pipeline.step(inputs, labels)
            else:
                step_loss = torch.zeros((), device=device)
                (model,) = self.parts
                for inputs, labels in batches:
                    inputs, labels = inputs.to(device), labels.to(device)
                    with sequence_sharded(self.mesh, [inputs, labels], self.parts, rotate):
                        loss = cross_entropy(model(inputs), labels) / len(batches)
                        loss.backward()
                    step_loss += (loss.full_tensor() if isinstance(loss, DTensor) else loss).detach()
        dp_cp = self.mesh["dp_cp"]
        if dp_cp.size() > 1:
            dist.all_reduce(step_loss, group=dp_cp.get_group())
            step_loss /= dp_cp.size()
        loss_value = step_loss.item()
        self.step += 1
        if not math.isfinite(loss_value):
            raise TrainingError(f"the loss became {loss_value} at step {self.step}; training stopped before "
                                "the optimizer step. Fix: lower optimizer.lr, raise lr_schedule.warmup_steps, "
                                "or enable train.grad_clip")
        if self.tp_summed_params:
            sum_moe_grads_over_tp(self.tp_summed_params, self.mesh["tp"])
        grads_to_param_placements(self.params)
        grad_norm = clip_grad_norm_(self.params, t.grad_clip, self.mesh).item()
        if not math.isfinite(grad_norm):
            raise TrainingError(f"the gradient norm became {grad_norm} at step {self.step} (loss {loss_value:.4f}); "
                                "training stopped before the optimizer step. Fix: lower optimizer.lr or "
                                "raise lr_schedule.warmup_steps")
        lr = self.schedulers[0].get_last_lr()[0]
        for opt, sched in zip(self.optimizers, self.schedulers):
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
        expert_metrics = self.expert_load_step() if self.cfg.model.is_moe else {}
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - start
        tokens_per_s = t.global_batch_size * t.seq_len / elapsed
        tflops = tokens_per_s * self.flops_per_token / self.mesh.world.size() / 1e12
        metrics = {"loss": loss_value, "grad_norm": grad_norm, "lr": lr, "tokens_per_s": tokens_per_s,
                   "tflops_per_device": tflops, "step_time_s": elapsed, "memory_gib": memory_gib(device)}
        if self.peak_tflops:
            metrics["mfu"] = tflops / self.peak_tflops
        return metrics | expert_metrics

    @torch.no_grad()
    def expert_load_step(self) -> dict[str, float]:
        """The step's expert load over all ranks of the stage, per MoE layer: its imbalance (the
        busiest expert's routed tokens over the mean), aux loss and dropped fraction (of the routed
        token copies, with a capacity factor), averaged over the model's MoE layers; then the
        aux-loss-free bias update (same counts on every dp rank, so the same biases)."""
        device, experts = self.runtime.device, self.cfg.model.num_experts
        both = torch.stack([torch.cat([m.tokens_per_expert, m.dropped_per_expert]) for m in self.moe_layers]) \
            if self.moe_layers else torch.zeros(0, 2 * experts, device=device)
        stage = self.mesh["stage"]  # each rank routed its own tokens
        if stage.size() > 1:
            dist.all_reduce(both, group=stage.get_group())
        counts, dropped = both.split(experts, dim=1)
        imbalance = counts.max(dim=1).values / counts.mean(dim=1).clamp(min=1e-9)
        dropped_fraction = dropped.sum(dim=1) / counts.sum(dim=1).clamp(min=1e-9)
        aux = torch.tensor([float(m.mean_aux_loss()) for m in self.moe_layers], device=device)
        sums = torch.stack([imbalance.sum(), aux.sum(), dropped_fraction.sum(),
                            torch.tensor(float(len(self.moe_layers)), device=device)])
        if self.mesh.size("pp") > 1:  # each stage holds its own layers
            dist.all_reduce(sums, group=self.mesh["pp"].get_group())
        rate = self.cfg.model.router_bias_update_rate
        for moe, layer_counts in zip(self.moe_layers, counts):
            if rate > 0:
                moe.update_bias(layer_counts, rate)
            moe.reset_statistics()
        layers = max(sums[3].item(), 1.0)
        metrics = {"moe_imbalance": sums[0].item() / layers, "moe_aux_loss": sums[1].item() / layers}
        if self.cfg.model.capacity_factor > 0:
            metrics["moe_dropped"] = sums[2].item() / layers
        return metrics

    def fit(self) -> list[dict[str, float]]:
        cfg = self.cfg
        logger = MetricsLogger(cfg.logging, self.run_dir, cfg.train.steps, enabled=self.runtime.is_main)
        logger.info(f"layout: {self.mesh.describe(cfg.parallel)}")
        active = f" ({self.active_params / 1e6:.2f}M active)" if cfg.model.is_moe else ""
        logger.info(f"model: {cfg.model.family}, {self.num_params / 1e6:.2f}M parameters{active}, "
                    f"{self.flops_per_token / 1e6:.1f} MFLOP/token; grad accumulation "
                    f"{self.stream.accum} x micro batch {cfg.train.micro_batch_size}; "
                    f"{self.stream.steps_per_epoch} steps per epoch")
        if self.resumed_from is not None:
            logger.info(f"resumed from {self.resumed_from} at step {self.step}")
        history = []
        try:
            while self.step < cfg.train.steps:
                metrics = self.train_step()
                history.append(metrics)
                logger.log(self.step, metrics)
                if self.checkpointer.should_save(self.step):
                    path = self.checkpointer.save(self.step)
                    logger.info(f"checkpoint {path} ({'writing in the background' if cfg.checkpoint.async_save else 'saved'})")
            self.checkpointer.wait()
            if cfg.checkpoint.export_hf:
                out = self.export_hf(cfg.checkpoint.export_hf)
                logger.info(f"exported Hugging Face model to {out}")
        finally:
            logger.close()
        return history

    def export_hf(self, directory: str) -> pathlib.Path:
        cfg, source = self.cfg, self.cfg.model.init_from_hf
        extra = tokenizer_files(source)
        if not extra and cfg.data.tokenizer.endswith(".json"):
            extra = [pathlib.Path(cfg.data.tokenizer)]
        return save_hf(self.parts, directory, export_dtypes(cfg.model, cfg.checkpoint.hf_dtype),
                       max_shard_bytes=int(cfg.checkpoint.hf_max_shard_gb * 1e9),
                       base_config=read_hf_config(source) if source else None, extra_files=extra)


def prepare_run_dir(cfg: JobConfig, runtime: Runtime) -> None:
    if runtime.is_main:
        run_dir = pathlib.Path(cfg.train.run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(dump_yaml(cfg))


def resolve(cfg: JobConfig) -> JobConfig:
    """The config as the job will run it: with model.init_from_hf, the architecture of its config.json.
    Checks what can fail late (the export target) before any work starts."""
    c = cfg.checkpoint
    for name, value, ok in [("interval", c.interval, c.interval >= 0), ("keep_last", c.keep_last, c.keep_last >= 0),
                            ("hf_max_shard_gb", c.hf_max_shard_gb, c.hf_max_shard_gb > 0)]:
        if not ok:
            raise ConfigError(f"checkpoint.{name}={value} must be {'> 0' if name == 'hf_max_shard_gb' else '>= 0'}")
    if cfg.model.init_from_hf is not None:
        cfg = dataclasses.replace(cfg, model=resolve_init_from_hf(cfg.model))
    if cfg.checkpoint.export_hf:
        check_export_target(cfg.checkpoint.export_hf)
    if c.resume not in ("auto", "never"):
        check_architecture(read_meta(pathlib.Path(c.resume)), cfg.model, pathlib.Path(c.resume))
    return cfg


def plan(cfg: JobConfig) -> Layout:
    """``plan_layout`` for this job's world size; rank 0 alone prints the layout warnings."""
    with warnings.catch_warnings(record=True) as caught:
        layout = plan_layout(cfg, world_size_from_env())
    if int(os.environ.get("RANK", "0")) == 0:
        for w in caught:
            print(f"meshtrain: warning: {w.message}", file=sys.stderr)
    return layout


def dry_run(cfg: JobConfig) -> Layout:
    layout = plan(resolve(cfg))
    print(f"layout: {layout.describe()}")
    for f in dataclasses.fields(layout):
        print(f"  {f.name} = {getattr(layout, f.name)}")
    print(f"  dp = {layout.dp}, edp = {layout.edp}")
    return layout


def run(cfg: JobConfig) -> list[dict[str, float]]:
    """Train with ``cfg`` in this process (one rank of a torchrun job, or a world of one)."""
    cfg = resolve(cfg)
    layout = plan(cfg)
    runtime = init_distributed(cfg.parallel.timeout_s)
    try:
        mesh = build_mesh(layout, runtime.device.type)
        prepare_run_dir(cfg, runtime)
        history = Trainer(cfg, runtime, mesh).fit()
    except BaseException as e:
        shutdown()
        if isinstance(e, RuntimeError) and is_collective_failure(e):
            raise collective_error(e, cfg.parallel.timeout_s) from None
        raise
    shutdown(synchronize=True)
    return history
