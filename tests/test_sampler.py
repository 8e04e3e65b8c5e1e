"""DistributedSampler: index for index what torch's gives, and a resume that neither replays nor skips."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler as TorchSampler

from gradsync.data import DistributedLoader, DistributedSampler


class Sized:
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n


GRID = list(itertools.product([0, 1, 3, 7, 10, 33], [1, 2, 3, 4], [True, False], [True, False], [0, 5]))


@pytest.mark.parametrize("n,world,shuffle,drop_last,seed", GRID)
def test_identical_to_torch(n: int, world: int, shuffle: bool, drop_last: bool, seed: int) -> None:
    data = Sized(n)
    for rank in range(world):
        ours = DistributedSampler(data, world, rank, shuffle=shuffle, seed=seed, drop_last=drop_last)
        theirs = TorchSampler(data, world, rank, shuffle=shuffle, seed=seed, drop_last=drop_last)
        for epoch in (0, 1, 4):
            ours.set_epoch(epoch)
            theirs.set_epoch(epoch)
            assert list(ours) == list(theirs)
            assert len(ours) == len(theirs)


@pytest.mark.parametrize("cut", [0, 1, 6, 13])  # start, middle, end of a 13-sample share
def test_resume_yields_exactly_the_rest_then_whole_epochs(cut: int) -> None:
    data = Sized(50)
    first = DistributedSampler(data, 4, 1, seed=3)
    first.set_epoch(2)
    full = list(first)
    it = iter(first)
    taken = [next(it) for _ in range(cut)]
    state = first.state_dict()
    assert state["samples_consumed"] == cut

    resumed = DistributedSampler(data, 4, 1, seed=3)
    resumed.load_state_dict(state)
    resumed.set_epoch(2)  # the usual loop calls set_epoch again for the epoch it resumes
    assert len(resumed) == 13 - cut
    assert taken + list(resumed) == full
    resumed.set_epoch(3)
    first.set_epoch(3)
    assert list(resumed) == list(first) and len(resumed) == 13


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_through_a_dataloader(num_workers: int) -> None:
    data = TensorDataset(torch.arange(37))
    seen_uninterrupted = []
    loader = DistributedLoader(data, batch_size=4, num_replicas=2, rank=0, seed=1, num_workers=num_workers)
    for epoch in range(2):
        loader.set_epoch(epoch)
        seen_uninterrupted += [b[0].tolist() for b in loader]

    seen, state = [], None
    loader = DistributedLoader(data, batch_size=4, num_replicas=2, rank=0, seed=1, num_workers=num_workers)
    loader.set_epoch(0)
    for i, b in enumerate(loader):
        seen.append(b[0].tolist())
        if i == 2:  # "crash" after 3 batches; the workers have prefetched more than that
            state = loader.state_dict()
            break
    assert state["samples_consumed"] == 12

    loader = DistributedLoader(data, batch_size=4, num_replicas=2, rank=0, seed=1, num_workers=num_workers)
    loader.load_state_dict(state)
    for epoch in range(state["epoch"], 2):
        loader.set_epoch(epoch)
        seen += [b[0].tolist() for b in loader]
    assert seen == seen_uninterrupted


def test_sampler_in_a_plain_dataloader_with_explicit_count() -> None:
    data = TensorDataset(torch.arange(20))
    sampler = DistributedSampler(data, 2, 0, seed=0)
    loader = DataLoader(data, batch_size=3, sampler=sampler, num_workers=2)
    batches = []
    for step, b in enumerate(loader):
        batches.append(b[0].tolist())
        if step == 1:
            state = sampler.state_dict(samples_consumed=(step + 1) * 3)
            break
    again = DistributedSampler(data, 2, 0, seed=0)
    again.load_state_dict(state)
    rest = [b[0].tolist() for b in DataLoader(data, batch_size=3, sampler=again)]
    assert sum(batches, []) + sum(rest, []) == list(DistributedSampler(data, 2, 0, seed=0))


def test_bad_input_is_named() -> None:
    with pytest.raises(ValueError, match=r"rank 2 is outside \[0, 1\]"):
        DistributedSampler(Sized(4), 2, 2)
    with pytest.raises(ValueError, match="num_replicas must be >= 1"):
        DistributedSampler(Sized(4), 0, 0)
    state = DistributedSampler(Sized(10), 2, 0).state_dict()
    for other in (
        DistributedSampler(Sized(11), 2, 0),
        DistributedSampler(Sized(10), 3, 0),
        DistributedSampler(Sized(10), 2, 0, seed=9),
    ):
        with pytest.raises(ValueError, match="was saved with"):
            other.load_state_dict(state)
