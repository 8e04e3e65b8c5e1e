"""A loader for elastic training: every sample of an epoch is used exactly once, whatever the membership does.

One shuffled order per epoch is shared by all ranks. A step takes the next ``world_size x batch_size`` samples of
it, rank r the r-th ``batch_size`` of those; the position advances only when the step is committed
(:meth:`gradsync.elastic.State.step`). After a failure the uncommitted step's samples are handed out again, split
among the new members, so none is lost or used twice.

Every rank's batch holds one sample at least (an empty batch has no loss to average: ``mean()`` of nothing is NaN,
and the all-reduce would spread it). A step that would leave the epoch fewer samples than ranks takes them too (its
batches are one sample larger), and the members admit a joiner only at a boundary where what is left of the epoch is
nothing or a sample for each rank of the largest world the job may reach (:meth:`ElasticLoader.can_grow_to`). Only a
round formed after a failure at the epoch's last step, with joiners in it, can still find fewer samples than ranks:
a rank left without one repeats one of the step's samples (torch's DistributedSampler pads the same way) and
consumes nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sized
from typing import Any

import torch.distributed as dist
from torch.utils.data import default_collate

from gradsync.data.sampler import epoch_order, require_plain_int
from gradsync.errors import ConfigError
from gradsync.validate import require_bool, require_callable, require_state


class ElasticLoader:
    """Batches of ``dataset`` for this rank, from the epoch's committed position on.

    Example::

        loader = ElasticLoader(dataset, batch_size=32, seed=0)
        state = gradsync.elastic.State(job, model=ddp, optimizer=opt, loader=loader)
        state.begin()
        for x, y in loader:            # after a membership change, iteration resumes where the group was
            with state.guard():
                opt.zero_grad()
                loss_fn(ddp(x), y).backward()
                state.step()           # commits this step's samples
        state.finish()
    """

    def __init__(
        self,
        dataset: Sized,
        batch_size: int,
        seed: int = 0,
        shuffle: bool = True,
        collate_fn: Callable[[list[Any]], Any] = default_collate,
    ) -> None:
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ConfigError(f"ElasticLoader: batch_size must be an int >= 1, got {batch_size!r}")
        if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
            raise ConfigError(
                f"ElasticLoader: dataset must have a length and be indexable (a map-style dataset: a list, a "
                f"TensorDataset, a torch Dataset with __len__), got {type(dataset).__name__}: the loader splits each "
                "epoch by sample index, so that a membership change resumes exactly where the group was"
            )
        self.dataset = dataset
        self.batch_size = batch_size
        # The sampler's rules (gradsync/data/sampler.py): a seed is an int (torch.Generator.manual_seed's), shuffle a
        # bool (the string "false" is true), collate_fn is called with each batch's samples.
        require_plain_int("ElasticLoader", "seed", seed)
        self.seed = seed
        self.shuffle = require_bool("ElasticLoader", "shuffle", shuffle)
        require_callable("ElasticLoader", "collate_fn", collate_fn)
        self.collate_fn = collate_fn
        self.epoch = 0
        self.position = 0  # samples of this epoch consumed by committed steps (all ranks together)
        self.last_indices: list[int] = []  # what this rank's last batch held
        self._step_size = 0  # samples the step in progress takes (all ranks), committed by commit()
        self._generation = 0  # bumped by load_state_dict (a membership change): iterations resume from position

    def order(self) -> list[int]:
        """This epoch's order of the whole dataset, shared by all ranks (the sampler's, :func:`epoch_order`)."""
        return epoch_order(len(self.dataset), self.shuffle, self.seed, self.epoch)

    def share(self, position: int, world_size: int, rank: int) -> tuple[list[int], int]:
        """This rank's indices for the step starting at ``position``, and how many samples the step takes."""
        order = self.order()
        remaining = len(order) - position
        step = min(world_size * self.batch_size, remaining)
        if remaining - step < world_size:  # too few left for a step of their own: this step takes them too
            step = remaining
        base, extra = divmod(step, world_size)  # the last step of an epoch: as even as possible
        start = position + rank * base + min(rank, extra)
        size = base + (1 if rank < extra else 0)
        return order[start : start + size], step

    def __iter__(self) -> Iterator[Any]:
        generation = -1
        cursor = world = rank = 0
        while True:
            if generation != self._generation:  # a membership change: resume at the committed position
                generation, cursor = self._generation, self.position
                world, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
            if cursor >= len(self.dataset):
                return
            indices, step = self.share(cursor, world, rank)
            self.last_indices, self._step_size = indices, step
            batch = indices or self._padding(cursor, rank)
            yield self.collate_fn([self.dataset[i] for i in batch])  # type: ignore[index]
            cursor += step

    def _padding(self, position: int, rank: int) -> list[int]:
        """A batch for a rank whose share is empty: fewer samples are left than ranks, as when a failure's round
        took in joiners at the epoch's last step. It repeats one of the step's samples, as torch's
        DistributedSampler pads (``drop_last=False``); ``last_indices`` stays empty, for it consumed nothing."""
        left = self.order()[position:]
        return [left[rank % len(left)]]

    def remaining(self) -> int:
        """Samples of this epoch not yet in a committed step."""
        return len(self.dataset) - self.position

    def can_grow_to(self, world_size: int | None) -> bool:
        """Whether a world of up to ``world_size`` ranks (None: not known) can start at this boundary with a
        sample for every rank's next batch: nothing is left of the epoch, or a sample for each rank at least.

        >>> loader = ElasticLoader(range(10), batch_size=2)
        >>> loader.position = 7
        >>> loader.can_grow_to(3), loader.can_grow_to(4), loader.can_grow_to(None)
        (True, False, True)
        """
        left = self.remaining()
        return world_size is None or left == 0 or left >= world_size

    def commit(self) -> None:
        """The step in progress is done everywhere: its samples are consumed."""
        self.position += self._step_size
        self._step_size = 0

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch, self.position = epoch, 0

    def __len__(self) -> int:
        world = dist.get_world_size() if dist.is_initialized() else 1
        full, tail = divmod(self.remaining(), world * self.batch_size)
        return full + (1 if tail >= world or (tail and not full) else 0)  # a tail of fewer: in the last full step

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "dataset_len": len(self.dataset)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state = require_state("ElasticLoader.load_state_dict", state, ("epoch", "position", "seed", "dataset_len"))
        if state.get("dataset_len") != len(self.dataset) or state.get("seed") != self.seed:
            raise ConfigError("ElasticLoader.load_state_dict: the state is for another dataset or seed")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._step_size = 0
        self._generation += 1
