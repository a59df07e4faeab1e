"""The shuffled distributed sampler: a true permutation per epoch, DistributedSampler's split over
dp ranks, exact resume, and constant memory whatever the dataset size."""

import itertools

import pytest

from meshtrain.data.sampler import Permutation, ShuffledSampler


@pytest.mark.parametrize("n", [1, 2, 3, 7, 64, 1000, 4097])
def test_each_epoch_is_a_permutation_keyed_by_seed(n):
    order = [Permutation(n, 5)[i] for i in range(n)]
    assert sorted(order) == list(range(n))
    if n > 7:
        assert order != list(range(n)) and order != [Permutation(n, 6)[i] for i in range(n)]


def test_a_steps_samples_are_the_same_for_every_dp_size():
    n, global_batch = 1000, 8

    def step_samples(dp: int, step: int) -> set[int]:
        per_rank = global_batch // dp
        samples = set()
        for rank in range(dp):
            it = iter(ShuffledSampler(n, num_replicas=dp, rank=rank, shuffle=True, seed=3))
            samples |= set(itertools.islice(it, step * per_rank, (step + 1) * per_rank))
        return samples

    for step in (0, 7, 100):
        assert step_samples(1, step) == step_samples(2, step) == step_samples(4, step)


def test_a_resumed_rank_continues_where_it_stopped():
    sampler = ShuffledSampler(500, num_replicas=2, rank=1, shuffle=True, seed=0)
    sampler.set_epoch(3)
    whole = list(sampler)
    assert len(whole) == 250 and sampler.state_dict() == {"yielded": 250}
    resumed = ShuffledSampler(500, num_replicas=2, rank=1, shuffle=True, seed=0)
    resumed.set_epoch(3)
    resumed.load_state_dict({"yielded": 100})
    assert list(resumed) == whole[100:]
    assert list(resumed) == whole  # the resume applies to one iteration only


def test_a_billion_samples_cost_no_memory():
    import tracemalloc

    tracemalloc.start()
    it = iter(ShuffledSampler(10**12, num_replicas=8, rank=3, shuffle=True, seed=0))
    first = [next(it) for _ in range(1000)]
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert len(set(first)) == 1000 and all(0 <= i < 10**12 for i in first)
    assert peak < 1_000_000, peak
