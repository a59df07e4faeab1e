"""The Trainer: one rank's share of the job, from a mesh to the optimizer-step loop.

Order matters and is the design: the data stream for this dp rank, then the model parts (the whole
model, or this rank's pipeline stages) built sharded by ``parallel.parallelize.build_model``, then
their optimizers and schedules, then the weights (a Hugging Face import or a checkpoint restore),
then the MoE bookkeeping. Every parallel size below is read from the mesh.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import pathlib
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.utils.data import Subset

from meshtrain.checkpoint.checkpointer import Checkpointer
from meshtrain.config import JobConfig
from meshtrain.config_files import to_dict
from meshtrain.data.batch import Batch
from meshtrain.data.loader import BatchStream
from meshtrain.data.sources import end_of_document_id, training_dataset
from meshtrain.errors import ConfigError, TrainingError
from meshtrain.evaluation import Evaluator
from meshtrain.micro_batches import run_micro_batches
from meshtrain.objectives import build_objective
from meshtrain.hf.adapter import read_hf_config
from meshtrain.hf.peft import save_peft_adapter
from meshtrain.hf.io import check_finite, export_dtypes, load_hf_weights, save_hf, tokenizer_files
from meshtrain.models.float8 import precompute_fsdp_scales
from meshtrain.models.documents import document_ids
from meshtrain.models.lora import init_dora_magnitudes, merge_lora
from meshtrain.models.moe import MoE
from meshtrain.models.transformer import count_active_parameters, count_parameters
from meshtrain.optim import build_lr_scheduler, build_optimizer, clip_grad_norm_
from meshtrain.parallel.context import sequence_sharded
from meshtrain.parallel._torch_private import compiled_graph_count
from meshtrain.parallel.expert import expert_parameters
from meshtrain.parallel.layout import resolve_schedule
from meshtrain.parallel.mesh import ParallelMesh
from meshtrain.parallel.parallelize import build_model, float8_all_gather
from meshtrain.parallel.pipeline import Pipeline, stage_ids_for_rank
from meshtrain.parallel.runtime import Runtime
from meshtrain.parallel.tensor import grads_to_param_placements, sum_moe_grads_over_tp
from meshtrain.parallel.tied import tied_copies
from meshtrain.run_dir import checkpoint_dir
from meshtrain.telemetry.metrics import MetricsLogger, flops_per_token, memory_gib, peak_tflops
from meshtrain.telemetry.profiling import MemorySnapshots, PhaseClock, format_phases, trace_path, trace_window


class Trainer:
    def __init__(self, cfg: JobConfig, runtime: Runtime, mesh: ParallelMesh):
        self.cfg, self.runtime, self.mesh = cfg, runtime, mesh
        self.run_dir = pathlib.Path(cfg.train.run_dir)
        self.step = 0
        self.stream = self._build_data()
        self.objective = build_objective(cfg)
        torch.manual_seed(cfg.train.seed)
        self.parts, self.pipeline = self.build_model_parts()
        self.params = [p for part in self.parts for p in part.parameters() if p.requires_grad]
        self.tied_copies = tied_copies(cfg, self.parts, mesh) if self.pipeline is not None else None
        self.float8_fsdp_scales = float8_all_gather(cfg, mesh)
        # One optimizer per part: torch's optimizer state dicts are per (module, optimizer) pair.
        self.optimizers = [build_optimizer([part], cfg.optimizer) for part in self.parts]
        self.schedulers = [build_lr_scheduler(opt, cfg.train.steps, cfg.lr_schedule) for opt in self.optimizers]
        if cfg.model.init_from_hf is not None:
            load_hf_weights(self.parts, cfg.model.init_from_hf)
            check_finite(self.parts, cfg.model.init_from_hf)
            for part in self.parts:  # DoRA's magnitudes are the loaded weights' row norms
                init_dora_magnitudes(part)
        self.checkpointer, self.resumed_from = self._restore_checkpoint()
        self.moe_layers, self.tp_summed_params = self._setup_moe()
        self.loss_parallel = mesh.size("tp") > 1 and cfg.parallel.loss_parallel
        self.objective.attach(self)  # the weights are in place: a preference loss's reference is built from them
        self.num_params = count_parameters(cfg.model)
        self.active_params = count_active_parameters(cfg.model) if cfg.model.is_moe else self.num_params
        self.flops_per_token = flops_per_token(cfg.model, cfg.train.seq_len, self.active_params)
        self.peak_tflops = peak_tflops(cfg.logging, runtime.device)
        self.clock = PhaseClock(runtime.device)
        self.compiled_graphs: list[int] = []
        """With train.compile: graphs compiled by the end of each step (growth after step 1 = recompiles)."""
        self.evaluator = Evaluator(self, *self.eval_data) if self.eval_data else None

    def _build_data(self) -> BatchStream:
        """This dp rank's share of every optimizer step's batches."""
        cfg, t = self.cfg, self.cfg.train
        fix = None
        if cfg.model.init_from_hf is not None:  # the vocabulary is the checkpoint's: the tokenizer has to fit it
            own = tokenizer_files(cfg.model.init_from_hf).get("tokenizer.json")
            fix = (f"use the model's own tokenizer, data.tokenizer={own}" if own else
                   f"use the tokenizer {cfg.model.init_from_hf} was trained with (a tokenizer.json of at most "
                   f"{cfg.model.vocab_size} tokens)")
        dataset, self.data_description = training_dataset(cfg.data, t, cfg.model.vocab_size, fix)
        self.document_eos, masking = self._document_masking()
        self.masked_cp = self.mesh.size("cp") > 1 and cfg.model.definition.needs_masked_attention(cfg.model, t.seq_len)
        self.data_description += f"; {masking}"
        self.eval_data = None
        if cfg.eval.interval and cfg.eval.data:
            held_out = dataclasses.replace(cfg.data, path=cfg.eval.data, blend=[])
            self.eval_data = (training_dataset(held_out, t, cfg.model.vocab_size, fix)[0], cfg.eval.data)
        elif cfg.eval.interval:  # the last samples, never trained on
            keep = len(dataset) - int(len(dataset) * cfg.eval.split)
            self.eval_data = (Subset(dataset, range(keep, len(dataset))), f"eval.split={cfg.eval.split} of the data")
            self.data_description += f"; the last {len(dataset) - keep:,} held out for evaluation"
            dataset = Subset(dataset, range(keep))
        dp = self.mesh["dp"]
        return BatchStream(dataset, global_batch=t.global_batch_size, micro_batch=t.micro_batch_size,
                           dp_size=dp.size(), dp_rank=dp.get_local_rank(), shuffle=cfg.data.shuffle,
                           seed=t.seed, num_workers=cfg.data.num_workers)

    def _document_masking(self) -> tuple[int | None, str]:
        """The EOS id that separates documents when attention is document-masked (else None); the log's words."""
        d = self.cfg.data
        if d.document_mask == "off":
            return None, "document masking off"
        if d.format != "pretrain":
            return None, f"document masking on: each {'sequence' if d.format == 'preference' else 'conversation'} " \
                         "attends to itself"
        eos = end_of_document_id(d)
        if eos is None:
            if d.document_mask == "on":
                raise ConfigError("data.document_mask=on needs the end-of-document token, and neither the tokenizer "
                                  "nor the data names one. Fix: set data.eos_id")
            return None, "document masking off: no EOS id known (set data.eos_id)"
        return eos, (f"document masking on (EOS {eos}"
                     f"{', positions restart per document' if d.reset_position_ids else ''})")

    def build_model_parts(self) -> tuple[list[torch.nn.Module], Pipeline | None]:
        """The whole model, or this pp rank's stages and the schedule that drives them (the objective
        its loss function); initialised, unless the weights come from model.init_from_hf."""
        cfg, mesh, device = self.cfg, self.mesh, self.runtime.device
        from_scratch = cfg.model.init_from_hf is None  # else the weights are loaded after this
        if mesh.size("pp") == 1:
            return [build_model(cfg, mesh, device, initialize=from_scratch)], None
        schedule = resolve_schedule(cfg.parallel.pp_schedule, cfg.parallel.vpp)
        stage_ids = stage_ids_for_rank(mesh["pp"].get_local_rank(), mesh.size("pp"), cfg.parallel.vpp, schedule)
        parts = [build_model(cfg, mesh, device, stage=s, initialize=from_scratch) for s in stage_ids]
        pipeline = Pipeline(parts, stage_ids, mesh.size("pp") * cfg.parallel.vpp, mesh["pp"], device, schedule,
                            self.stream.accum, self.objective)
        return parts, pipeline

    def _restore_checkpoint(self) -> tuple[Checkpointer, pathlib.Path | None]:
        """The checkpointer, and the checkpoint this run resumed from (its step restored), if any."""
        ckpt = self.cfg.checkpoint
        checkpointer = Checkpointer(ckpt, checkpoint_dir(self.cfg), self,
                                    layout=self.mesh.describe(self.cfg.parallel))
        resumed_from = checkpointer.resume_path()
        if resumed_from is not None:
            self.step = checkpointer.restore(resumed_from)
        return checkpointer, resumed_from

    def _setup_moe(self) -> tuple[list[MoE], list[torch.nn.Parameter]]:
        """The MoE layers with their loss scaling and sequence group set, and the parameters whose
        gradients are summed over tp (router, shared expert and experts not sharded by ep)."""
        mesh = self.mesh
        moe_layers = [m for part in self.parts for m in part.modules() if isinstance(m, MoE)]
        for moe in moe_layers:
            # Without a pipeline the loss is averaged over micro-batches here; the schedule scales
            # every gradient by 1 / micro-batches itself.
            moe.aux_loss_scale = 1.0 if self.pipeline is not None else 1.0 / self.stream.accum
            if mesh.size("cp_tp") > 1:  # the balancing loss counts whole sequences
                moe.sequence_group, moe.aux_grad_scale = mesh["cp_tp"].get_group(), mesh.size("cp")
        if mesh.size("tp") == 1:
            return moe_layers, []
        experts = {id(p) for part in self.parts for p in expert_parameters(part)} if mesh.experts is not None else set()
        return moe_layers, [p for moe in moe_layers for p in moe.parameters() if id(p) not in experts]

    def train_step(self) -> dict[str, float]:
        t, device = self.cfg.train, self.runtime.device
        start = time.perf_counter()
        batches = [Batch.of(b) for b in self.stream.next_step()]
        self.clock.mark("data")
        step_metrics = self.objective.metrics(run_micro_batches(self, batches, training=True), training=True)
        loss_value = step_metrics["loss"]
        self.clock.mark("forward_backward")
        self.step += 1
        if not math.isfinite(loss_value):
            raise TrainingError(f"the loss became {loss_value} at step {self.step}; training stopped before "
                                "the optimizer step. Fix: lower optimizer.lr, raise lr_schedule.warmup_steps, "
                                "or enable train.grad_clip")
        if self.tp_summed_params:
            sum_moe_grads_over_tp(self.tp_summed_params, self.mesh["tp"])
        grads_to_param_placements(self.params)
        if self.tied_copies is not None:
            self.tied_copies.sum_grads()
        grad_norm = clip_grad_norm_(self.params, t.grad_clip, self.mesh,
                                    self.tied_copies.counted_elsewhere if self.tied_copies else ()).item()
        if not math.isfinite(grad_norm):
            raise TrainingError(f"the gradient norm became {grad_norm} at step {self.step} (loss {loss_value:.4f}); "
                                "training stopped before the optimizer step. Fix: lower optimizer.lr or "
                                "raise lr_schedule.warmup_steps")
        lr = self.schedulers[0].get_last_lr()[0]
        for opt, sched in zip(self.optimizers, self.schedulers):
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
        if self.float8_fsdp_scales:
            for part in self.parts:
                precompute_fsdp_scales(part)
        expert_metrics = self.expert_load_step() if self.cfg.model.is_moe else {}
        self.clock.mark("optimizer")
        if self.cfg.train.compile:
            self.compiled_graphs.append(compiled_graph_count())
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - start
        tokens_per_s = t.global_batch_size * t.seq_len / elapsed
        tflops = tokens_per_s * self.flops_per_token / self.mesh.world.size() / 1e12
        metrics = step_metrics | {"grad_norm": grad_norm, "lr": lr, "tokens_per_s": tokens_per_s,
                   "tflops_per_device": tflops, "step_time_s": elapsed, "memory_gib": memory_gib(device)}
        if self.peak_tflops:
            metrics["mfu"] = tflops / self.peak_tflops
        return metrics | expert_metrics

    @contextlib.contextmanager
    def sharded(self, batch: Batch, target: torch.Tensor, parts: list[torch.nn.Module]) -> Iterator[torch.Tensor | None]:
        """Within: the batch's inputs and the objective's target as this rank computes on them (its
        share of the sequence under cp, and so the RoPE tables of the model ``parts``), and the
        document ids when attention is document-masked (else None): the batch's own (SFT's
        conversations, preference pairs' sequences), or found from EOS."""
        inputs = batch.inputs
        if batch.documents is not None:
            ids = batch.documents if self.cfg.data.document_mask != "off" else None
        else:
            ids = document_ids(inputs, self.document_eos) if self.document_eos is not None else None
        if ids is not None and not bool(ids[:, -1].any()):  # one document per sample: plain causal attention
            ids = None  # (every rank of a cp or pp group holds the same batch here, so they agree)
        if ids is None and self.masked_cp:  # a window shorter than the sequence, soft-capping: cp's masked route
            ids = torch.zeros_like(inputs, dtype=torch.int32)
        tensors = [inputs, target] if ids is None else [inputs, target, ids]
        with sequence_sharded(self.mesh, tensors, parts, self.cfg.parallel.cp_rotate_method,
                              documents=ids is not None):
            yield ids

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
        layout = self.mesh.describe(cfg.parallel)
        logger = MetricsLogger(cfg.logging, self.run_dir, cfg.train.steps, enabled=self.runtime.is_main,
                               start_step=self.step, config=to_dict(cfg), layout=layout)
        logger.info(f"layout: {layout}")
        logger.info(self.data_description)
        active = f" ({self.active_params / 1e6:.2f}M active)" if cfg.model.is_moe else ""
        logger.info(f"model: {cfg.model.family}, {self.num_params / 1e6:.2f}M parameters{active}, "
                    f"{self.flops_per_token / 1e6:.1f} MFLOP/token; grad accumulation "
                    f"{self.stream.accum} x micro batch {cfg.train.micro_batch_size}; "
                    f"{self.stream.steps_per_epoch} steps per epoch")
        if self.resumed_from is not None:
            logger.info(f"resumed from {self.resumed_from} at step {self.step}; {self.checkpointer.data_position}")
        history = []
        rank, device = self.runtime.rank, self.runtime.device
        snapshots = MemorySnapshots(cfg.profiling, self.run_dir, rank, device)
        if cfg.profiling.memory_snapshot_steps and not snapshots.enabled:
            logger.info(f"profiling.memory_snapshot_steps: memory snapshots need CUDA; none on {device.type}")
        try:
            with trace_window(cfg.profiling, self.run_dir, rank, device) as profiler:
                while self.step < cfg.train.steps:
                    every = cfg.logging.phase_every
                    self.clock.start(enabled=every > 0 and (self.step + 1) % every == 0)
                    try:
                        metrics = self.train_step()
                    except torch.OutOfMemoryError:
                        if (path := snapshots.dump(f"oom_step{self.step + 1}")) is not None:
                            print(f"[rank {rank}] out of memory: memory snapshot in {path}", flush=True)
                        raise
                    if self.evaluator and (self.step % cfg.eval.interval == 0 or self.step == cfg.train.steps):
                        metrics |= self.evaluator.evaluate()
                        self.clock.mark("eval")
                    if self.checkpointer.should_save(self.step):
                        path = self.checkpointer.save(self.step)
                        self.clock.mark("checkpoint")
                        logger.info(f"checkpoint {path} "
                                    f"({'writing in the background' if cfg.checkpoint.async_save else 'saved'})")
                    metrics |= {f"time_{phase}_s": s for phase, s in self.clock.seconds.items()}
                    history.append(metrics)
                    logger.log(self.step, metrics)
                    if self.clock.enabled:
                        logger.info(format_phases(self.step, self.clock.seconds))
                    if (path := snapshots.after_step(self.step)) is not None:
                        logger.info(f"memory snapshot {path}")
                    if profiler is not None:
                        profiler.step()
                    if len(self.compiled_graphs) > 1 and self.compiled_graphs[-1] > self.compiled_graphs[-2]:
                        logger.info(f"torch.compile recompiled during step {self.step}: {self.compiled_graphs[-1]} "
                                    f"graphs, {self.compiled_graphs[-2]} before (shapes or guards changed)")
            if self.compiled_graphs:
                logger.info(f"torch.compile: {self.compiled_graphs[0]} graph(s) compiled in the first step, "
                            f"{self.compiled_graphs[-1] - self.compiled_graphs[0]} recompiled after it")
            if cfg.profiling.trace:
                trace = trace_path(self.run_dir, rank)
                logger.info(f"profiler trace {trace} (one per rank; open in https://ui.perfetto.dev)" if trace.is_file()
                            else "profiling.trace: the run ended before the trace window began; no trace written "
                                 "(lower profiling.trace_wait or raise train.steps)")
            self.checkpointer.wait()
            if cfg.peft.export_adapter:
                out = save_peft_adapter(self.parts, cfg.peft.export_adapter, cfg.peft, cfg.model,
                                        cfg.model.init_from_hf, torch.float32)
                logger.info(f"exported the LoRA adapters as a PEFT adapter to {out}")
            if cfg.checkpoint.export_hf:
                merged = sum(merge_lora(part) for part in self.parts)  # in place: training is over
                out = self.export_hf(cfg.checkpoint.export_hf)
                logger.info(f"exported Hugging Face model to {out}"
                            + (f" ({merged} LoRA adapters merged into their weights)" if merged else ""))
        finally:
            logger.close()
        return history

    def export_hf(self, directory: str) -> pathlib.Path:
        cfg, source = self.cfg, self.cfg.model.init_from_hf
        # The tokenizer the model was trained with goes along; with the byte tokenizer, the source's.
        extra = tokenizer_files(source if cfg.data.tokenizer == "byte" else cfg.data.tokenizer)
        return save_hf(self.parts, directory, export_dtypes(cfg.model, cfg.checkpoint.hf_dtype),
                       max_shard_bytes=int(cfg.checkpoint.hf_max_shard_gb * 1e9),
                       base_config=read_hf_config(source) if source else None, extra_files=extra)
