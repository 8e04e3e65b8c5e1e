"""DistributedLoader: a DataLoader wired to a DistributedSampler, that knows how far your loop really got.

A DataLoader with workers prefetches batches, so the sampler's own count runs ahead of training; the position to
save is the batches the loop received × the batch size. This wrapper counts exactly that.
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any, cast

import torch
from torch.utils.data import DataLoader, Dataset

from gradsync.data.sampler import DistributedSampler, check_state
from gradsync.errors import ConfigError


class DistributedLoader:
    """Iterate this rank's batches; ``state_dict()`` is the position reached by the training loop.

    Example::

        loader = DistributedLoader(dataset, batch_size=32, shuffle=True, num_workers=2)
        if resuming:
            loader.load_state_dict(checkpoint["loader"])
        for epoch in range(start_epoch, epochs):
            loader.set_epoch(epoch)
            for batch in loader:
                ...
                checkpoint["loader"] = loader.state_dict()
    """

    def __init__(
        self,
        dataset: Sized,
        batch_size: int,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        num_replicas: int | None = None,
        rank: int | None = None,
        **dataloader_kwargs: Any,
    ) -> None:
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise ConfigError(f"DistributedLoader: batch_size must be an int >= 1, got {batch_size!r}")
        for reserved in ("sampler", "batch_sampler", "shuffle"):
            if reserved in dataloader_kwargs:
                raise ConfigError(f"DistributedLoader chooses '{reserved}' itself; do not pass it")
        self.batch_size = batch_size
        self.sampler = DistributedSampler(dataset, num_replicas, rank, shuffle=shuffle, seed=seed, drop_last=drop_last)
        # A DataLoader draws its workers' base seed from the *global* torch RNG whenever iteration starts, so a run
        # resumed mid-epoch would see every later dropout mask shifted. Its own generator, seeded per epoch and
        # rank, keeps the global stream untouched and worker seeds reproducible.
        self._own_generator = "generator" not in dataloader_kwargs
        dataloader_kwargs.setdefault("generator", torch.Generator())
        # A map-style dataset is any Sized object with __getitem__; torch's stubs ask for a Dataset subclass.
        data = cast(Dataset, dataset)
        self.loader: DataLoader = DataLoader(data, batch_size=batch_size, sampler=self.sampler, **dataloader_kwargs)
        self._start = 0
        self._batches = 0

    def set_epoch(self, epoch: int) -> None:
        previous = self.sampler.epoch
        self.sampler.set_epoch(epoch)  # first: it refuses an epoch that is not an int
        if self.sampler.epoch != previous:
            self._start = self._batches = 0

    def __iter__(self) -> Iterator[Any]:
        self._start, self._batches = self.sampler.resume_position, 0  # now, not at the first next()
        if self._own_generator:
            s = self.sampler
            self.loader.generator.manual_seed((s.seed * 1_000_003 + s.epoch) * 4099 + s.rank)
        return self._count(iter(self.loader))

    def _count(self, batches: Iterator[Any]) -> Iterator[Any]:
        for batch in batches:
            self._batches += 1
            yield batch

    def __len__(self) -> int:
        return len(self.loader)

    def state_dict(self) -> dict[str, Any]:
        consumed = min(self._start + self._batches * self.batch_size, self.sampler.num_samples)
        return self.sampler.state_dict(samples_consumed=consumed)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_state(state, "DistributedLoader")
        self.sampler.load_state_dict(state)
        self._start, self._batches = self.sampler.resume_position, 0
