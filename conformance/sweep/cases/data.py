"""DistributedSampler and DistributedLoader: wrong types, out-of-range numbers, corrupt or foreign resume states,
and edge sizes that must give exactly torch's indices."""

from __future__ import annotations

import torch
from torch.utils.data import IterableDataset, TensorDataset
from torch.utils.data.distributed import DistributedSampler as TorchSampler

from conformance.sweep.core import case

CAT = "sampler/loader"


class Sized:
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


class Stream(IterableDataset):
    def __iter__(self):
        return iter(range(10))


def _sampler(*args, **kwargs):
    from gradsync import DistributedSampler

    return DistributedSampler(*args, **kwargs)


def _loader(*args, **kwargs):
    from gradsync import DistributedLoader

    return DistributedLoader(*args, **kwargs)


def _indices(sampler) -> list[int]:
    return list(sampler)


@case("sampler_string_dataset", CAT, "DistributedSampler('train.csv', 2, 0)", ["dataset"])
def _():
    return _indices(_sampler("train.csv", 2, 0))


@case("sampler_int_dataset", CAT, "DistributedSampler(100, 2, 0): a length, not a dataset", ["dataset"])
def _():
    return _indices(_sampler(100, 2, 0))


@case("sampler_none_dataset", CAT, "DistributedSampler(None, 2, 0)", ["dataset"])
def _():
    return _indices(_sampler(None, 2, 0))


@case("sampler_iterable_dataset", CAT, "DistributedSampler of an IterableDataset", ["IterableDataset"])
def _():
    return _indices(_sampler(Stream(), 2, 0))


@case("sampler_rank_out_of_range", CAT, "rank=2 with num_replicas=2", ["rank 2", "num_replicas"])
def _():
    return _indices(_sampler(Sized(10), 2, 2))


@case("sampler_rank_negative", CAT, "rank=-1", ["rank -1"])
def _():
    return _indices(_sampler(Sized(10), 2, -1))


@case("sampler_num_replicas_zero", CAT, "num_replicas=0", ["num_replicas"])
def _():
    return _indices(_sampler(Sized(10), 0, 0))


@case("sampler_num_replicas_string", CAT, "num_replicas='2'", ["num_replicas"])
def _():
    return _indices(_sampler(Sized(10), "2", 0))


@case("sampler_seed_string", CAT, "seed='42'", ["seed"])
def _():
    return _indices(_sampler(Sized(10), 2, 0, seed="42"))


@case("sampler_seed_float", CAT, "seed=1.5", ["seed"])
def _():
    return _indices(_sampler(Sized(10), 2, 0, seed=1.5))


def _like_torch(n: int, world: int, drop_last: bool, epoch: int = 0):
    def run():
        ours = []
        theirs = []
        for rank in range(world):
            a = _sampler(Sized(n), world, rank, drop_last=drop_last)
            b = TorchSampler(Sized(n), world, rank, drop_last=drop_last)
            a.set_epoch(epoch)
            b.set_epoch(epoch)
            ours.append((list(a), len(a)))
            theirs.append((list(b), len(b)))
        return ours, theirs

    return run


def _same_as_torch(value) -> str | None:
    ours, theirs = value
    return None if ours == theirs else f"indices differ from torch's: ours {ours}, torch {theirs}"


case("sampler_empty_dataset", CAT, "a dataset of length 0: no indices, as torch", check=_same_as_torch)(
    _like_torch(0, 2, False)
)
case("sampler_more_replicas_than_samples", CAT, "3 samples on 4 replicas (padding)", check=_same_as_torch)(
    _like_torch(3, 4, False)
)
case("sampler_more_replicas_drop_last", CAT, "3 samples on 4 replicas, drop_last=True", check=_same_as_torch)(
    _like_torch(3, 4, True)
)
case("sampler_negative_epoch", CAT, "set_epoch(-1): torch's indices for seed + epoch", check=_same_as_torch)(
    _like_torch(10, 2, False, epoch=-1)
)


@case("sampler_set_epoch_string", CAT, "set_epoch('1') then iterate", ["epoch"])
def _():
    s = _sampler(Sized(10), 2, 0)
    s.set_epoch("1")
    return _indices(s)


def _state(**changes):
    s = _sampler(Sized(10), 2, 0, seed=3)
    state = s.state_dict()
    state.update(changes)
    return state


def _load(state):
    s = _sampler(Sized(10), 2, 0, seed=3)
    s.load_state_dict(state)
    return _indices(s)


@case("sampler_load_consumed_minus2", CAT, "load_state_dict with samples_consumed=-2", ["samples_consumed", "-2"])
def _():
    return _load(_state(samples_consumed=-2))


@case(
    "sampler_load_consumed_99",
    CAT,
    "load_state_dict with samples_consumed=99 (5 per epoch)",
    ["samples_consumed", "99"],
)
def _():
    return _load(_state(samples_consumed=99))


@case("sampler_load_consumed_float", CAT, "load_state_dict with samples_consumed=2.5", ["samples_consumed"])
def _():
    return _load(_state(samples_consumed=2.5))


@case("sampler_load_consumed_string", CAT, "load_state_dict with samples_consumed='3'", ["samples_consumed"])
def _():
    return _load(_state(samples_consumed="3"))


@case("sampler_load_epoch_negative", CAT, "load_state_dict with epoch=-1", ["epoch"])
def _():
    return _load(_state(epoch=-1))


@case("sampler_load_other_world_size", CAT, "a state saved with num_replicas=3", ["num_replicas"])
def _():
    return _load(_state(num_replicas=3))


@case("sampler_load_other_seed", CAT, "a state saved with seed=4", ["seed"])
def _():
    return _load(_state(seed=4))


@case("sampler_load_empty_dict", CAT, "load_state_dict({})", ["load_state_dict", ("missing", "dataset_len")])
def _():
    return _load({})


@case("sampler_load_string", CAT, "load_state_dict('ckpt.pt') (a path, not a state)", ["load_state_dict"])
def _():
    return _load("ckpt.pt")


@case("sampler_state_dict_consumed_negative", CAT, "state_dict(samples_consumed=-1)", ["samples_consumed"])
def _():
    return _sampler(Sized(10), 2, 0).state_dict(samples_consumed=-1)


def _resume_then_other_epoch():
    s = _sampler(Sized(20), 2, 0, seed=1)
    s.set_epoch(2)
    it = iter(s)
    for _ in range(3):
        next(it)
    resumed = _sampler(Sized(20), 2, 0, seed=1)
    resumed.load_state_dict(s.state_dict())
    resumed.set_epoch(3)  # a different epoch than the saved one: the saved position no longer applies
    fresh = _sampler(Sized(20), 2, 0, seed=1)
    fresh.set_epoch(3)
    return list(resumed), list(fresh)


@case(
    "sampler_resume_other_epoch",
    CAT,
    "load a mid-epoch-2 state, then set_epoch(3): epoch 3 whole",
    check=lambda v: None if v[0] == v[1] else f"epoch 3 after the resume is {v[0]}, expected {v[1]}",
)
def _():
    return _resume_then_other_epoch()


def _data(n: int = 20) -> TensorDataset:
    return TensorDataset(torch.arange(n))


@case("loader_batch_size_string", CAT, "DistributedLoader(batch_size='8')", ["batch_size"])
def _():
    return len(_loader(_data(), batch_size="8", num_replicas=2, rank=0))


@case("loader_batch_size_zero", CAT, "DistributedLoader(batch_size=0)", ["batch_size"])
def _():
    return len(_loader(_data(), batch_size=0, num_replicas=2, rank=0))


@case("loader_batch_size_float", CAT, "DistributedLoader(batch_size=8.0)", ["batch_size"])
def _():
    return len(_loader(_data(), batch_size=8.0, num_replicas=2, rank=0))


@case("loader_string_dataset", CAT, "DistributedLoader('data/', batch_size=8)", ["dataset"])
def _():
    return len(_loader("data/", batch_size=8, num_replicas=2, rank=0))


@case("loader_sampler_kwarg", CAT, "DistributedLoader(..., sampler=...)", ["sampler"])
def _():
    return len(_loader(_data(), batch_size=4, num_replicas=2, rank=0, sampler=[0, 1]))


@case("loader_shuffle_and_batch_sampler", CAT, "DistributedLoader(..., batch_sampler=...)", ["batch_sampler"])
def _():
    return len(_loader(_data(), batch_size=4, num_replicas=2, rank=0, batch_sampler=[[0, 1]]))


@case("loader_num_workers_negative", CAT, "DistributedLoader(num_workers=-1)", ["num_workers"])
def _():
    return [b[0].tolist() for b in _loader(_data(), batch_size=4, num_replicas=2, rank=0, num_workers=-1)]


@case("loader_load_other_dataset", CAT, "a loader state from a 20-sample dataset into a 30-sample one", ["dataset_len"])
def _():
    a = _loader(_data(20), batch_size=4, num_replicas=2, rank=0)
    b = _loader(_data(30), batch_size=4, num_replicas=2, rank=0)
    b.load_state_dict(a.state_dict())
    return [x[0].tolist() for x in b]


def _loader_resume():
    full = _loader(_data(37), batch_size=4, num_replicas=2, rank=1, seed=5)
    full.set_epoch(1)
    expected = [b[0].tolist() for b in full]
    first = _loader(_data(37), batch_size=4, num_replicas=2, rank=1, seed=5)
    first.set_epoch(1)
    seen = []
    for i, b in enumerate(first):
        seen.append(b[0].tolist())
        if i == 1:
            break
    state = first.state_dict()
    again = _loader(_data(37), batch_size=4, num_replicas=2, rank=1, seed=5)
    again.load_state_dict(state)
    again.set_epoch(1)
    seen += [b[0].tolist() for b in again]
    return seen, expected


@case(
    "loader_resume_mid_epoch",
    CAT,
    "stop after 2 of 5 batches (37 samples, odd share), resume: the rest, no replay",
    check=lambda v: None if v[0] == v[1] else f"resumed batches {v[0]}, expected {v[1]}",
)
def _():
    return _loader_resume()
