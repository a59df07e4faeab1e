"""Packed token sequences out, one shard per data-parallel rank, resumable.

The token stream (``data.sources``: memory-mapped prepared data, or raw text) is packed
into fixed-length samples of seq_len + 1 tokens (inputs and shifted labels), so no token is padding.
A ``ShuffledSampler`` over the dp ranks (``data.sampler``: DistributedSampler's contract in constant
memory) feeds a ``StatefulDataLoader``: rank r of dp takes samples r, r+dp, ..., so the samples of
one optimizer step are the same set for every dp size (what makes a dp run comparable with the
single-rank run), and the position is checkpointable.
"""

from __future__ import annotations

import warnings
from typing import Iterator

import torch
from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader

from meshtrain.data.sampler import ShuffledSampler
from meshtrain.errors import DataError, MeshtrainError

# torchdata 0.11 calls torch.set_vital, deprecated in torch 2.13: one warning per rank and loader,
# nothing a user can act on.
warnings.filterwarnings("ignore", message="'set_vital' is deprecated", category=UserWarning)


class PackedDataset(Dataset):
    """Sample i is tokens[i*seq_len : (i+1)*seq_len + 1], split into (inputs, labels). ``tokens`` may
    be a memory-mapped uint16/int32 stream (``data.indexed``): each sample is read and widened on
    demand, and checked against ``vocab_size`` (an id the embedding has no row for is a data error,
    named here rather than as an index error inside the model)."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, *, vocab_size: int | None = None, source: str = "data"):
        self.tokens = tokens
        self.seq_len = seq_len
        self.vocab_size, self.source = vocab_size, source

    def __len__(self) -> int:
        return max(0, (len(self.tokens) - 1) // self.seq_len)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.tokens[i * self.seq_len : (i + 1) * self.seq_len + 1].to(torch.int64)
        if self.vocab_size is not None and (chunk.max() >= self.vocab_size or chunk.min() < 0):
            bad = int(chunk[(chunk >= self.vocab_size) | (chunk < 0)][0])
            raise DataError(f"{self.source}: token id {bad} in sample {i} is outside model.vocab_size="
                            f"{self.vocab_size}: the data was tokenized with another tokenizer. Fix: prepare it "
                            "with the model's tokenizer, or raise model.vocab_size")
        return chunk[:-1], chunk[1:]


class BatchStream:
    """Yields the micro-batches of each optimizer step for this dp rank, epoch after epoch.

    An epoch is len(dataset) // global_batch steps; the sampler reshuffles per epoch. The state
    (epoch, steps taken in it, the loader's own state) restores the exact position.
    """

    def __init__(self, dataset: PackedDataset, *, global_batch: int, micro_batch: int, dp_size: int,
                 dp_rank: int, shuffle: bool, seed: int, num_workers: int):
        self.steps_per_epoch = len(dataset) // global_batch
        if self.steps_per_epoch == 0:
            raise DataError(
                f"the data holds {len(dataset)} sequences of train.seq_len+1 tokens, fewer than one "
                f"global batch ({global_batch}); add data or lower train.global_batch_size / train.seq_len"
            )
        self.global_batch = global_batch
        self.accum = global_batch // (micro_batch * dp_size)
        # a dataset whose order is drawn already (a blend) is taken as it is
        shuffle = shuffle and not getattr(dataset, "ordered", False)
        self.sampler = ShuffledSampler(len(dataset), num_replicas=dp_size, rank=dp_rank, shuffle=shuffle, seed=seed)
        self.loader = StatefulDataLoader(
            dataset, batch_size=micro_batch, sampler=self.sampler, drop_last=True, num_workers=num_workers
        )
        self.epoch = 0
        self.step_in_epoch = 0
        self._it: Iterator | None = None

    def next_step(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if self.step_in_epoch == self.steps_per_epoch:
            self.epoch, self.step_in_epoch, self._it = self.epoch + 1, 0, None
        if self._it is None:
            if self.step_in_epoch == 0:
                self.sampler.set_epoch(self.epoch)
            self._it = iter(self.loader)
        try:
            batches = [next(self._it) for _ in range(self.accum)]
        except MeshtrainError as e:
            raise _from_worker(e) from None
        self.step_in_epoch += 1
        return batches

    def state_dict(self) -> dict:
        """The position, as global (epoch, step in epoch) and the global batch of those steps: the same
        samples whatever the dp size."""
        return {"epoch": self.epoch, "step_in_epoch": self.step_in_epoch, "global_batch": self.global_batch}

    def load_state_dict(self, state: dict) -> str:
        """Continue at the saved position; returns what the log says about it. Under another global
        batch the position is kept in samples (the same shuffle: it depends on the data, seq_len and
        seed only), so no sample of the epoch is read twice or skipped; a position that is not a
        whole number of the new batches is refused."""
        saved_batch = state.get("global_batch", self.global_batch)
        taken = state["step_in_epoch"] * saved_batch  # samples of this epoch already trained on
        if taken % self.global_batch:
            raise DataError(
                f"the checkpoint stopped after sample {taken:,} of epoch {state['epoch']} (step "
                f"{state['step_in_epoch']} x train.global_batch_size={saved_batch}), which is not a whole number of "
                f"train.global_batch_size={self.global_batch} batches: resuming would read samples twice or skip some. "
                f"Fix: resume with a global batch size that divides {taken:,} (such as {saved_batch}), or set "
                "checkpoint.resume=never")
        self.epoch, self.step_in_epoch = state["epoch"], taken // self.global_batch
        if self.step_in_epoch >= self.steps_per_epoch:
            self.epoch, self.step_in_epoch = self.epoch + 1, 0
        self.sampler.set_epoch(self.epoch)
        # This rank's samples already taken this epoch; the sampler skips them on the next iter().
        self.sampler.load_state_dict({"yielded": self.step_in_epoch * self.accum * self.loader.batch_size})
        self._it = None
        where = f"epoch {self.epoch}, sample {self.step_in_epoch * self.global_batch:,}"
        if saved_batch == self.global_batch:
            return f"data: continues at {where}"
        return (f"data: continues at {where} (the position is kept in samples: train.global_batch_size "
                f"{saved_batch} -> {self.global_batch}, step {state['step_in_epoch']} -> {self.step_in_epoch} of the epoch)")


def _from_worker(error: MeshtrainError) -> MeshtrainError:
    """A data error raised in a DataLoader worker process, as its own one-line message: torch re-raises
    it in this process as the same type around "Caught DataError in DataLoader worker process 0.
    Original Traceback (most recent call last): ...", the worker's traceback ending in the message."""
    text = str(error)
    if not text.startswith("Caught "):
        return error
    marker = f"{type(error).__module__}.{type(error).__name__}: "
    return type(error)(text.rsplit(marker, 1)[-1].strip()) if marker in text else error
