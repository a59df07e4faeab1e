"""Blends: samples from several datasets in given proportions (``data.blend``, Megatron's
``[weight, prefix, weight, prefix, ...]``).

The blend is one dataset of N packed samples, N the largest count no component runs out for
(min over components of samples_d / weight_d). Component d contributes round(weight_d * N) of its
samples, chosen by a permutation seeded by train.seed and d, and they are interleaved evenly: the
k-th sample of d sits at position (k + 1/2) / weight_d of the merged order, so any window of the
blend holds each component in proportion. The sampler above shuffles the blend per epoch as it
does a single dataset, so the order is deterministic from the seed, a resume is exact, and the
samples of an optimizer step are the same for every dp size. The index costs 10 bytes a sample.
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

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
    def __init__(self, datasets: list[Dataset], weights: list[float], seed: int, names: list[str]):
        used = [(d, w, n) for d, w, n in zip(datasets, weights, names) if w > 0]
        empty = [n for d, _, n in used if len(d) == 0]
        if empty:
            raise ConfigError(f"data.blend: {empty[0]} holds no sample of train.seq_len+1 tokens")
        self.datasets = [d for d, _, _ in used]
        total = min(len(d) / w for d, w, _ in used)
        counts = [min(len(d), round(w * total)) for d, w, _ in used]
        which, index, position = [], [], []
        for d, ((dataset, w, _), count) in enumerate(zip(used, counts)):
            g = torch.Generator().manual_seed(seed * 1000 + d)
            index.append(torch.randperm(len(dataset), generator=g)[:count])
            which.append(torch.full((count,), d, dtype=torch.int16))
            position.append((torch.arange(count, dtype=torch.float64) + 0.5) / w)
        order = torch.argsort(torch.cat(position), stable=True)
        self.which, self.index = torch.cat(which)[order], torch.cat(index)[order]
        self.counts = dict(zip([n for _, _, n in used], counts))

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int):
        return self.datasets[int(self.which[i])][int(self.index[i])]
