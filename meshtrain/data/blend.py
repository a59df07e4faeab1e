"""Blends: samples from several datasets in given proportions (``data.blend``, Megatron's
``[weight, prefix, weight, prefix, ...]``), with Megatron's semantics.

A blend is the number of samples the run asks for (train.steps x train.global_batch_size).
Component d gives about weight_d of them: a dataset smaller than its share is repeated
(up-sampled), a larger one is read through, and every pass over a component (its epoch) draws its
samples in a new order (a permutation keyed by train.seed, d and the epoch; data.shuffle=false reads
them in order). The draws are interleaved evenly: the k-th draw of d sits at position
(k + 1/2) / weight_d of the merged order, so any window of the blend holds each component in
proportion, and the first N samples of a blend are the same whatever its size (a resume with more
train.steps continues the same sequence). The order is drawn here, so the sampler takes the blend
as it is (``ordered``). The index costs 6 bytes a sample.
"""

from __future__ import annotations

import math

import torch
from torch.utils.data import Dataset

from meshtrain.data.sampler import Permutation
from meshtrain.errors import ConfigError


def parse_blend(blend: list[str]) -> list[tuple[float, str]]:
    """``[weight, path, weight, path, ...]`` to (weight normalised to sum 1, path) pairs."""
    if len(blend) % 2:
        raise ConfigError(f"data.blend: {blend} has an odd number of entries; it is [weight, path, weight, path, ...] "
                          "(e.g. [0.7, data/web, 0.3, data/code])")
    pairs = []
    for i in range(0, len(blend), 2):
        try:
            weight = float(blend[i])
        except ValueError:
            raise ConfigError(f"data.blend[{i}]: {blend[i]!r} is not a weight; the list is [weight, path, weight, "
                              "path, ...]") from None
        if not weight >= 0:
            raise ConfigError(f"data.blend[{i}]: weight {blend[i]} is negative; weights are >= 0")
        pairs.append((weight, blend[i + 1]))
    total = sum(w for w, _ in pairs)
    if total <= 0:
        raise ConfigError(f"data.blend: the weights {[w for w, _ in pairs]} do not sum to a positive number; give "
                          "at least one dataset a positive weight")
    return [(w / total, path) for w, path in pairs]


class BlendedDataset(Dataset):
    ordered = True  # its order is drawn already: the sampler takes it as it is

    def __init__(self, datasets: list[Dataset], weights: list[float], seed: int, names: list[str], samples: int,
                 shuffle: bool = True):
        used = [(d, w, n) for d, w, n in zip(datasets, weights, names) if w > 0]
        empty = [n for d, _, n in used if len(d) == 0]
        if empty:
            raise ConfigError(f"data.blend: {empty[0]} holds no sample of train.seq_len+1 tokens")
        total = sum(w for _, w, _ in used)
        self.datasets, self.seed, self.shuffle = [d for d, _, _ in used], seed, shuffle
        which, draw, position = [], [], []
        for d, (_, w, _) in enumerate(used):  # enough draws of each that the first `samples` of the merge are here
            count = math.ceil(w / total * samples) + 1
            which.append(torch.full((count,), d, dtype=torch.int16))
            draw.append(torch.arange(count, dtype=torch.int32))
            position.append((torch.arange(count, dtype=torch.float64) + 0.5) / (w / total))
        order = torch.argsort(torch.cat(position), stable=True)[:samples]
        self.which, self.draw = torch.cat(which)[order], torch.cat(draw)[order]
        counts = torch.bincount(self.which.to(torch.int64), minlength=len(used)).tolist()
        self.counts = {n: c for (_, _, n), c in zip(used, counts)}
        self.epochs = {n: c / len(d) for (d, _, n), c in zip(used, counts)}
        self._permutations: dict[tuple[int, int], Permutation] = {}

    def __len__(self) -> int:
        return len(self.which)

    def __getitem__(self, i: int):
        d = int(self.which[i])
        dataset = self.datasets[d]
        epoch, j = divmod(int(self.draw[i]), len(dataset))
        if self.shuffle:
            key = (d, epoch)
            if key not in self._permutations:
                self._permutations[key] = Permutation(len(dataset), (self.seed * 1000 + d) * 1_000_003 + epoch)
            j = self._permutations[key][j]
        return dataset[j]
