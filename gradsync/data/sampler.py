"""DistributedSampler: torch's index order exactly, and resumable in the middle of an epoch.

Each rank takes every ``num_replicas``-th index of one shared (per-epoch shuffled, padded or truncated) list,
exactly as ``torch.utils.data.distributed.DistributedSampler`` does, so switching changes nothing in results. What
torch's lacks (pytorch/pytorch #11813, #36650): ``state_dict()`` / ``load_state_dict()`` to continue an epoch after a
restart without replaying or skipping samples.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterator, Mapping, Sized
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Sampler

from gradsync.errors import ConfigError
from gradsync.validate import require_bool, require_group


def epoch_order(n: int, shuffle: bool, seed: int, epoch: int) -> list[int]:
    """The whole dataset's order for one epoch, the same on every rank: torch's ``DistributedSampler`` order
    (``randperm`` seeded with ``seed + epoch``), which :class:`gradsync.elastic.ElasticLoader` shares too.

    >>> epoch_order(4, shuffle=False, seed=0, epoch=3)
    [0, 1, 2, 3]
    """
    if not shuffle:
        return list(range(n))
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()


def require_plain_int(owner: str, name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(f"{owner}: {name} must be an int, got {type(value).__name__} {value!r}")


def replicas_and_rank(
    owner: str, num_replicas: int | None, rank: int | None, group: dist.ProcessGroup | None = None
) -> tuple[int, int]:
    """A sampler's world and rank, as torch's DistributedSampler finds them: given, else the group's (the default
    group's when ``group`` is None), else one process. ``owner`` names the sampler in the errors."""
    require_group(owner, "process_group", group)
    grouped = dist.is_available() and dist.is_initialized()
    if num_replicas is None:
        num_replicas = dist.get_world_size(group) if grouped else 1
    if rank is None:
        rank = dist.get_rank(group) if grouped else 0
    require_plain_int(owner, "num_replicas", num_replicas)
    require_plain_int(owner, "rank", rank)
    if num_replicas < 1:
        raise ConfigError(f"{owner}: num_replicas must be >= 1, got {num_replicas}")
    if not 0 <= rank < num_replicas:
        raise ConfigError(
            f"{owner}: rank {rank} is outside [0, {num_replicas - 1}] (num_replicas): give each process's rank in "
            "its group, from 0 to num_replicas - 1"
        )
    return num_replicas, rank


def checked_epoch(owner: str, epoch: object) -> int:
    """``epoch`` as an int, or a ConfigError naming ``owner``'s set_epoch: the epoch seeds the shuffle."""
    try:
        return operator.index(epoch)  # type: ignore[arg-type]
    except TypeError:
        raise ConfigError(
            f"{owner}.set_epoch: epoch must be an int (it seeds the shuffle), got {type(epoch).__name__} "
            f"{epoch!r}; pass the loop's epoch counter, e.g. set_epoch(epoch)."
        ) from None


def _check_dataset(dataset: object) -> None:
    """A dataset with a length (as torch's sampler needs); a string or a bare number is refused here, at
    construction, not at the first iteration."""
    if isinstance(dataset, (str, bytes)) or not hasattr(dataset, "__len__"):
        raise ConfigError(
            f"DistributedSampler needs a map-style dataset (one with a length), got {type(dataset).__name__} "
            f"{dataset!r:.40}; an IterableDataset must be sharded by the dataset itself."
        )


def check_state(state: object, owner: str) -> None:
    """A path or a whole checkpoint passed where the sampler's own state dict belongs is named, not indexed into."""
    if not isinstance(state, Mapping):
        raise ConfigError(
            f"{owner}.load_state_dict: expected the dict that {owner}.state_dict() returned, got "
            f"{type(state).__name__} {state!r:.60}. From a checkpoint file, pass the entry saved for it "
            "(load_state_dict(checkpoint.load(path)['loader'])) or use checkpoint.restore(checkpoint.load(path), ...)."
        )


class DistributedSampler(Sampler[int]):
    """Yield this rank's share of ``range(len(dataset))``; reshuffled each epoch by :meth:`set_epoch`.

    Example::

        sampler = DistributedSampler(dataset, shuffle=True, seed=0)
        loader = DataLoader(dataset, batch_size=32, sampler=sampler)
        for epoch in range(start_epoch, epochs):
            sampler.set_epoch(epoch)
            for step, batch in enumerate(loader):
                ...
                # save the position the training loop reached, not what DataLoader prefetched:
                state = sampler.state_dict(samples_consumed=(step + 1) * 32)

    After ``load_state_dict(state)`` the next iteration of the same epoch yields only the remaining indices;
    ``len()`` is then the number remaining. :class:`gradsync.data.DistributedLoader` does the bookkeeping for you.
    """

    def __init__(
        self,
        dataset: Sized,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        _check_dataset(dataset)
        num_replicas, rank = replicas_and_rank("DistributedSampler", num_replicas, rank)
        require_plain_int("DistributedSampler", "seed", seed)
        self.dataset = dataset
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = require_bool("DistributedSampler", "shuffle", shuffle)
        self.seed = seed
        self.drop_last = require_bool("DistributedSampler", "drop_last", drop_last)
        self.epoch = 0
        n = len(dataset)
        # torch's arithmetic: with drop_last the tail that cannot be split evenly is dropped, else indices repeat.
        if drop_last and n % num_replicas != 0:
            self.num_samples = math.ceil((n - num_replicas) / num_replicas)
        else:
            self.num_samples = math.ceil(n / num_replicas)
        self.total_size = self.num_samples * num_replicas
        self._resume_at = 0  # indices of self.epoch already handed out before a restart
        self._yielded = 0  # indices of self.epoch handed out by the current iteration

    def indices(self) -> list[int]:
        """This rank's whole list for the current epoch (what torch's sampler yields)."""
        order = epoch_order(len(self.dataset), self.shuffle, self.seed, self.epoch)
        if not self.drop_last:
            padding = self.total_size - len(order)
            if padding <= len(order):
                order += order[:padding]
            elif order:
                order += (order * math.ceil(padding / len(order)))[:padding]
        else:
            order = order[: self.total_size]
        return order[self.rank : self.total_size : self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        # Not a generator function: the position must reset when iteration starts, not at the first next().
        start, self._resume_at = self._resume_at, 0
        self._yielded = start
        return self._yield_from(self.indices()[start:])

    def _yield_from(self, remaining: list[int]) -> Iterator[int]:
        for index in remaining:
            self._yielded += 1
            yield index

    def __len__(self) -> int:
        return self.num_samples - self._resume_at

    @property
    def resume_position(self) -> int:
        """Indices of this epoch the next iteration skips (non-zero only right after a mid-epoch load)."""
        return self._resume_at

    def set_epoch(self, epoch: int) -> None:
        """Reshuffle for ``epoch`` (call before each epoch, as with torch's sampler)."""
        epoch = checked_epoch("DistributedSampler", epoch)
        if epoch != self.epoch:
            self._resume_at = 0  # a saved position belongs to the epoch it was saved in
            self._yielded = 0
        self.epoch = epoch

    def state_dict(self, samples_consumed: int | None = None) -> dict[str, Any]:
        """Where this rank is in the epoch. Pass ``samples_consumed`` (batches your loop finished × batch size)
        when iterating through a DataLoader, which prefetches ahead of your loop; otherwise the count of indices
        this sampler has yielded is used."""
        consumed = self._yielded if samples_consumed is None else samples_consumed
        if not 0 <= consumed <= self.num_samples:
            raise ConfigError(f"samples_consumed={consumed} is outside [0, {self.num_samples}] for this rank")
        return {
            "epoch": self.epoch,
            "samples_consumed": consumed,
            "seed": self.seed,
            "num_replicas": self.num_replicas,
            "rank": self.rank,
            "dataset_len": len(self.dataset),
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``: the next iteration yields the rest of that epoch."""
        check_state(state, "DistributedSampler")
        expected = {
            "dataset_len": len(self.dataset),
            "num_replicas": self.num_replicas,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
        }
        for key, mine in expected.items():
            if state.get(key) != mine:
                raise ConfigError(
                    f"DistributedSampler.load_state_dict: the state was saved with {key}={state.get(key)!r} but this "
                    f"sampler has {key}={mine!r}; the saved position would point at different samples. Build the "
                    "sampler with the same dataset, world size, seed, shuffle and drop_last as the saved run."
                )
        epoch, consumed = state.get("epoch"), state.get("samples_consumed")
        if not isinstance(epoch, int) or epoch < 0:
            raise ConfigError(f"DistributedSampler.load_state_dict: epoch must be an int >= 0, got {epoch!r}")
        if not isinstance(consumed, int) or not 0 <= consumed <= self.num_samples:
            raise ConfigError(
                f"DistributedSampler.load_state_dict: samples_consumed={consumed!r} is outside [0, "
                f"{self.num_samples}] (this rank's samples per epoch); the state is corrupt or from another run."
            )
        self.epoch = epoch
        self._resume_at = consumed
        self._yielded = self._resume_at
