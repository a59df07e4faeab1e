"""Training checkpoints with torch.distributed.checkpoint: atomic, keep-last-k, async, resharding.

A checkpoint is a directory ``step-000120/`` under ``checkpoint.dir``: DCP's files plus
``meshtrain.json`` (step, architecture, layout, data position, lr schedule). It is written as
``step-000120.incomplete/`` and renamed by rank 0 once every rank's data and DCP's metadata are
on disk, so a crash mid-save leaves an ``.incomplete`` directory that resume never picks (and the
next save of that step clears), while the previous checkpoint stays loadable.

Model and optimizer state are keyed by global parameter name and keep their DTensor placements
(the optimizer's in torch's flattened form, one entry per parameter), so DCP reshards them for
any other layout on load. The data position is (epoch, step in epoch), the same samples for any
dp size. The RNG states are per rank and come back only under the same world size; nothing in
training draws random numbers today, so a resharded resume loses nothing by it.
"""

from __future__ import annotations

import datetime
import errno
import functools
import json
import os
import pathlib
import re
import shutil
import threading
from concurrent.futures import Future

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)

from meshtrain.config import CheckpointConfig, ModelConfig
from meshtrain.errors import CheckpointError, CheckpointWriteError
from meshtrain.checkpoint.frozen_base import check_base_given, check_frozen_base, frozen_base_of
from meshtrain.hf.adapter import architecture_fields
from meshtrain.run_dir import describe_write_error

META = "meshtrain.json"
INCOMPLETE = ".incomplete"
FORMAT_VERSION = 1
STEP_DIR = re.compile(r"step-(\d+)$")
OPTIM_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


def complete_checkpoints(root: pathlib.Path) -> list[tuple[int, pathlib.Path]]:
    """Published checkpoints under ``root``, oldest first (``.incomplete`` ones are not)."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name)) and (p / META).is_file()]
    return sorted(found)


def read_meta(path: pathlib.Path) -> dict:
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint directory (checkpoint.resume)")
    meta_path = path / META
    if not meta_path.is_file():
        hint = " (an interrupted save)" if path.name.endswith(INCOMPLETE) else ""
        raise CheckpointError(f"{path}: not a complete meshtrain checkpoint, {META} is missing{hint}. "
                              "Fix: point checkpoint.resume at a published step-N directory")
    try:
        meta = json.loads(meta_path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{meta_path}: not valid JSON ({e})") from None
    if meta.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"{meta_path}: format {meta.get('format')!r}, this meshtrain reads {FORMAT_VERSION}")
    return meta


def check_architecture(meta: dict, model: ModelConfig, where: pathlib.Path) -> None:
    check_base_given(meta, model, where)
    saved = meta["model"]
    for name, mine in architecture_fields(model).items():
        if saved.get(name) != mine:
            raise CheckpointError(f"{where}: written for model.{name}={saved.get(name)!r}, this run has "
                                  f"model.{name}={mine!r}. Fix: use the checkpoint's model settings or "
                                  "checkpoint.resume=never")


def check_sequence_length(data: dict, seq_len: int, where: pathlib.Path) -> None:
    """The data position counts samples of seq_len + 1 tokens: under another seq_len the same count
    points elsewhere in another shuffle, so some tokens of the epoch would be read twice and others
    skipped. Refused rather than guessed."""
    saved = data.get("seq_len", seq_len)
    if saved != seq_len:
        raise CheckpointError(f"{where}: its data position counts samples of train.seq_len={saved}; this run has "
                              f"train.seq_len={seq_len}, whose samples are other spans in another order, so some tokens "
                              f"would be trained on twice this epoch and others skipped. Fix: resume with "
                              f"train.seq_len={saved}, or start a new run from its weights (meshtrain convert "
                              f"--src {where} --dst DIR, then model.init_from_hf=DIR)")


def model_state(parts: list[nn.Module]) -> dict:
    """The parts' trainable weights and buffers: under LoRA only the adapters (a small checkpoint;
    the frozen base comes from model.init_from_hf again on resume)."""
    frozen = any(not p.requires_grad for part in parts for p in part.parameters())
    options = StateDictOptions(ignore_frozen_params=frozen)
    state = {}
    for part in parts:
        state.update(get_model_state_dict(part, options=options))
    return state


def optimizer_state(parts: list[nn.Module], optimizers: list[torch.optim.Optimizer]) -> dict:
    """The parts' AdamW state by global parameter name; a pipeline's copy of a tied embedding
    (``parallel/tied.py``) under the embedding's name, as one model keeps it: the same state."""
    state = {}
    for part, opt in zip(parts, optimizers):
        own = get_optimizer_state_dict(part, opt, options=OPTIM_OPTIONS)
        if _holds_tied_copy(part):
            own = {_TIED_HEAD_STATE.sub(r"\1.embed_tokens.weight.", k): v for k, v in own.items()}
        state.update(own)
    return state


_TIED_HEAD_STATE = re.compile(r"^(state|param_groups)\.lm_head\.weight\.")
_TIED_EMBEDDING_STATE = re.compile(r"^(state|param_groups)\.embed_tokens\.weight\.")


def _holds_tied_copy(part: nn.Module) -> bool:
    """A pipeline's last stage, whose head is its own copy of the tied embedding."""
    return part.cfg.tie_word_embeddings and part.lm_head is not None and part.embed_tokens is None


def _own_optimizer_state(part: nn.Module, loaded: dict) -> dict:
    """What ``set_optimizer_state_dict`` takes for ``part``: a tied copy's state renamed back (cloned:
    under a V schedule the first stage on this rank loads the same tensors)."""
    if not _holds_tied_copy(part):
        return loaded
    return loaded | {_TIED_EMBEDDING_STATE.sub(r"\1.lm_head.weight.", k): v.clone() if isinstance(v, torch.Tensor) else v
                     for k, v in loaded.items() if _TIED_EMBEDDING_STATE.match(k)}


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _write_failure(error: BaseException, path: pathlib.Path) -> str:
    """Which ranks could not write what: DCP reports every rank's failure, an OSError is this rank's."""
    if isinstance(error, CheckpointException):
        failures = [(rank, exc) for rank, (exc, _) in sorted(error.failures.items())]
    else:
        failures = [(dist.get_rank() if dist.is_initialized() else 0, error)]
    by_cause: dict[str, list[int]] = {}
    for rank, exc in failures:
        if not isinstance(exc, OSError) and "unexpected pos" in str(exc) and _disk_is_full(path):
            # torch's zip writer reports a short write on a full disk as "unexpected pos N vs M"
            exc = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        cause = (describe_write_error(exc, "checkpoint", path) if isinstance(exc, OSError)
                 else f"failed writing checkpoint {path}: {type(exc).__name__}: {exc}")
        by_cause.setdefault(cause, []).append(rank)
    return "; ".join(f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} {cause}"
                     for cause, ranks in by_cause.items())


def _disk_is_full(path: pathlib.Path) -> bool:
    """Less than 1 MiB free where ``path`` is (or would be)."""
    existing = next((p for p in (path, *path.parents) if p.exists()), None)
    if existing is None:
        return False
    stats = os.statvfs(existing)
    return stats.f_bavail * stats.f_frsize < 1 << 20


def _load(state: dict, parts: list[nn.Module], path: pathlib.Path) -> None:
    """dcp.load into ``state`` (which holds the parts' own tensors), then hand it to the parts."""
    try:
        dcp.load(state, checkpoint_id=str(path))
    except CheckpointException as e:
        first = next(iter(e.failures.values()), e)
        first = first[0] if isinstance(first, tuple) else first  # a rank's (exception, traceback)
        detail = str(first).strip().splitlines()[-1] if str(first).strip() else ""
        raise CheckpointError(f"{path}: could not be read: truncated, corrupted or written for another model "
                              f"({type(first).__name__}: {detail})") from None
    for part in parts:  # strict=False: ``state`` holds every part of this rank
        set_model_state_dict(part, state["model"], options=StateDictOptions(strict=False,
                                                                             ignore_frozen_params=True))
        part.reset_buffers(keep_loaded=True)


class Checkpointer:
    """Saves and restores a Trainer's state. Every rank calls every method."""

    def __init__(self, cfg: CheckpointConfig, root: pathlib.Path, trainer, *, layout: str):
        self.cfg, self.root, self.trainer, self.layout = cfg, root, trainer, layout
        self.is_main = not dist.is_initialized() or dist.get_rank() == 0
        self.hf_origin = hf_origin_of(trainer.cfg.model)
        self.data_position = ""
        """What a resume did with the data position (for the log)."""
        self.pending: tuple[Future, pathlib.Path, pathlib.Path, dict] | None = None
        self._publish_lock = threading.Lock()
        # Async saves run collectives from a background thread: a group of their own (gloo, since
        # the staged copy lives in CPU memory) keeps them apart from training's, with the job's timeout.
        timeout = datetime.timedelta(seconds=trainer.cfg.parallel.timeout_s)
        self.async_group = (dist.new_group(backend="gloo", timeout=timeout, group_desc="async_checkpoint")
                            if cfg.async_save and dist.is_initialized() else None)

    @functools.cached_property
    def frozen_base(self) -> dict | None:
        """A LoRA run's base (``frozen_base``), asked for by the first save or resume only, on every
        rank together: a run that neither saves nor resumes never hashes its base's safetensors."""
        return frozen_base_of(self.trainer.cfg, [p for part in self.trainer.parts for p in part.parameters()])

    # --- save ------------------------------------------------------------------------------
    def _state(self, with_optimizer: bool) -> dict:
        t = self.trainer
        state = {"model": model_state(t.parts)}
        if with_optimizer:
            state["optimizer"] = optimizer_state(t.parts, t.optimizers)
            rank = dist.get_rank() if dist.is_initialized() else 0
            state[f"rng_rank{rank}"] = torch.get_rng_state()
        return state

    def _meta(self, step: int) -> dict:
        t = self.trainer
        return {"format": FORMAT_VERSION, "kind": "train", "step": step,
                "model": architecture_fields(t.cfg.model), "layout": self.layout,
                "world_size": dist.get_world_size() if dist.is_initialized() else 1,
                "data": {**t.stream.state_dict(), "seq_len": t.cfg.train.seq_len}, "lr_scheduler": t.schedulers[0].state_dict(),
                **self.hf_origin, **({"frozen_base": self.frozen_base} if self.frozen_base else {})}

    def should_save(self, step: int) -> bool:
        every = self.cfg.interval
        return every > 0 and (step % every == 0 or step == self.trainer.cfg.train.steps)

    def save(self, step: int) -> pathlib.Path:
        self.wait()  # one save in flight at a time
        final = self.root / step_dir_name(step)
        tmp = final.with_name(final.name + INCOMPLETE)
        self._on_every_rank(lambda: self._make_tmp(tmp), tmp, final)
        state, meta = self._state(with_optimizer=True), self._meta(step)
        if self.cfg.async_save:
            future = dcp.async_save(state, checkpoint_id=str(tmp), process_group=self.async_group)
            self.pending = (future, tmp, final, meta)
            # Publish the moment the write completes, not at the next save: a crash in between
            # would otherwise lose a checkpoint whose data is all on disk.
            future.add_done_callback(lambda done: self._publish_when_written(done, tmp, final, meta))
        else:
            self._on_every_rank(lambda: (dcp.save(state, checkpoint_id=str(tmp)), self._publish(tmp, final, meta)),
                                tmp, final)
        return final

    def _make_tmp(self, tmp: pathlib.Path) -> None:
        if self.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)

    def _on_every_rank(self, action, tmp: pathlib.Path, final: pathlib.Path) -> None:
        """Run one part of a save on every rank, then agree on its outcome: if any rank failed (a full
        disk, a lost permission), every rank raises together, naming that rank, instead of the
        others hanging in their next collective. Nothing is published then; the partial
        ``.incomplete`` directory is removed to give the space back."""
        failure = None
        try:
            action()
        except (OSError, CheckpointException) as e:
            failure = _write_failure(e, tmp)
        failures = [failure]
        if dist.is_initialized() and dist.get_world_size() > 1:
            failures = [None] * dist.get_world_size()
            dist.all_gather_object(failures, failure)
        first = next((f for f in failures if f), None)
        if first is not None:
            if self.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointWriteError(f"checkpoint {final.name} was not saved: {first}. "
                                       "The checkpoints saved before it are untouched")

    def wait(self) -> None:
        """Wait for the save in flight; raise its error, or publish it if the background publish failed."""
        if self.pending is not None:
            future, tmp, final, meta = self.pending
            self.pending = None
            # On rank 0 result() returns after DCP's metadata is written: all ranks are done.
            self._on_every_rank(lambda: (future.result(), self._publish(tmp, final, meta)), tmp, final)

    def _publish_when_written(self, future: Future, tmp: pathlib.Path, final: pathlib.Path, meta: dict) -> None:
        """Runs on DCP's background thread as the async write ends. Errors are left for ``wait``,
        which raises the write's error or retries the publish on the training thread."""
        if future.exception() is None:
            try:
                self._publish(tmp, final, meta)
            except OSError:
                pass

    def _publish(self, tmp: pathlib.Path, final: pathlib.Path, meta: dict) -> None:
        """Rank 0 makes ``tmp`` the checkpoint ``final`` (once: the background thread and ``wait``
        may both get here)."""
        if not self.is_main:
            return
        with self._publish_lock:
            if not tmp.exists() and (final / META).is_file():
                return  # published already
            (tmp / META).write_text(json.dumps(meta, indent=1))
            shutil.rmtree(final, ignore_errors=True)  # an older save of the same step
            tmp.rename(final)
            if self.cfg.keep_last > 0:
                for _, old in complete_checkpoints(self.root)[:-self.cfg.keep_last]:
                    shutil.rmtree(old, ignore_errors=True)

    # --- restore ---------------------------------------------------------------------------
    def resume_path(self) -> pathlib.Path | None:
        choice = self.cfg.resume
        if choice == "never":
            return None
        if choice == "auto":
            found = complete_checkpoints(self.root)
            return found[-1][1] if found else None
        return pathlib.Path(choice)

    def restore(self, path: pathlib.Path) -> int:
        """Load ``path`` into the trainer; returns the step to continue from (0 for weights only)."""
        t = self.trainer
        meta = read_meta(path)
        check_architecture(meta, t.cfg.model, path)
        if self.frozen_base is not None:
            check_frozen_base(meta, self.frozen_base, path)
        full = meta["kind"] == "train"
        if full:
            check_sequence_length(meta["data"], t.cfg.train.seq_len, path)
        same_world = meta.get("world_size") == (dist.get_world_size() if dist.is_initialized() else 1)
        state = self._state(with_optimizer=full)
        if full and not same_world:
            state = {k: v for k, v in state.items() if not k.startswith("rng_rank")}
        _load(state, t.parts, path)
        if not full:
            return 0
        for part, opt in zip(t.parts, t.optimizers):
            set_optimizer_state_dict(part, opt, _own_optimizer_state(part, state["optimizer"]), options=OPTIM_OPTIONS)
        for sched in t.schedulers:
            restore_schedule(sched, meta["lr_scheduler"])
        self.data_position = t.stream.load_state_dict(meta["data"])
        rank = dist.get_rank() if dist.is_initialized() else 0
        if same_world:
            torch.set_rng_state(state[f"rng_rank{rank}"])
        return meta["step"]


def hf_origin_of(model: ModelConfig) -> dict:
    """What a checkpoint keeps of the Hugging Face model it started from (``model.init_from_hf``):
    each tensor's dtype and the config.json, so that an export from it gives back the same files."""
    if model.init_from_hf is None:
        return {}
    from meshtrain.hf.adapter import read_hf_config
    from meshtrain.hf.io import dtype_names, export_dtypes

    return {"hf_dtypes": dtype_names(export_dtypes(model, "auto")), "hf_config": read_hf_config(model.init_from_hf)}


def model_config_of(path: pathlib.Path) -> ModelConfig:
    """The architecture a checkpoint was written for (for tools that start from the checkpoint)."""
    from meshtrain.config_files import from_dict

    return from_dict(ModelConfig, read_meta(path)["model"])


def restore_schedule(sched: torch.optim.lr_scheduler.LRScheduler, saved: dict) -> None:
    """Load the schedule's position, not its per-param-group lists: the layout decides the groups
    (expert-parallel experts get their own), and every group has the same lr here, so the saved
    lists are re-expanded to this optimizer's groups."""
    groups = len(sched.optimizer.param_groups)
    sched.load_state_dict(saved | {"base_lrs": saved["base_lrs"][:1] * groups,
                                   "_last_lr": saved["_last_lr"][:1] * groups})
