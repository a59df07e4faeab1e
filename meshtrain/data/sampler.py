"""The per-dp-rank sample order, shuffled without materialising a permutation.

torch's ``DistributedSampler`` draws ``randperm(len(dataset)).tolist()`` each epoch: a Python list of
every sample index on every rank, ~36 bytes a sample (52 MB per rank for the 1.5M samples of a
1.5 GB corpus at seq_len 512, 4.5 GB for a trillion-token one). Here sample ``i`` of an epoch is
``permutation(i)``, a keyed bijection of [0, n) computed on demand: a 4-round Feistel network over
the next even power of two, walked back into range (cycle walking), keyed by seed + epoch. Memory
is constant; the contract is DistributedSampler's with drop_last: dp rank r takes positions
r, r + dp, ... of the epoch's order, so an optimizer step's samples (positions
[step * global_batch, (step + 1) * global_batch)) are the same for every dp size, and ``yielded``
resumes a rank mid-epoch.
"""

from __future__ import annotations

from typing import Iterator

from torch.utils.data import Sampler

_M64 = (1 << 64) - 1


def _mix(x: int) -> int:
    """splitmix64's finaliser: a well-mixed 64-bit hash of x."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


class Permutation:
    """A pseudo-random bijection of range(n), keyed by ``seed``, in constant memory."""

    ROUNDS = 4

    def __init__(self, n: int, seed: int):
        self.n = n
        bits = max(2, (n - 1).bit_length())
        self.half = (bits + 1) // 2
        self.mask = (1 << self.half) - 1
        self.keys = [_mix((seed << 8) + r) for r in range(self.ROUNDS)]

    def _feistel(self, x: int) -> int:
        left, right = x >> self.half, x & self.mask
        for key in self.keys:
            left, right = right, left ^ (_mix(right ^ key) & self.mask)
        return (left << self.half) | right

    def __getitem__(self, i: int) -> int:
        x = self._feistel(i)
        while x >= self.n:  # at most ~3 steps on average: the domain is under 4n
            x = self._feistel(x)
        return x


class ShuffledSampler(Sampler[int]):
    def __init__(self, size: int, *, num_replicas: int, rank: int, shuffle: bool, seed: int):
        self.size, self.num_replicas, self.rank = size, num_replicas, rank
        self.shuffle, self.seed, self.epoch = shuffle, seed, 0
        self.num_samples = size // num_replicas
        self.yielded, self._resume_at = 0, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.num_samples

    def __iter__(self) -> Iterator[int]:
        order = Permutation(self.size, self.seed + self.epoch) if self.shuffle else None
        start, self._resume_at = self._resume_at, 0
        for k in range(start, self.num_samples):
            position = self.rank + k * self.num_replicas
            self.yielded = k + 1
            yield order[position] if order is not None else position

    def state_dict(self) -> dict:
        return {"yielded": self.yielded}

    def load_state_dict(self, state: dict) -> None:
        """The next ``iter`` starts after the first ``yielded`` samples of this rank's epoch."""
        self._resume_at = self.yielded = state["yielded"]
