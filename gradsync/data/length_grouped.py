"""LengthGroupedSampler: batches of samples of similar length (bucketing), the same number on every rank.

The seeds' third way of partitioning data (after random and sequential): Hugging Face's ``group_by_length``
(transformers' ``LengthGroupedSampler``) and torchdata's bucket batching. Padded to its longest sample, a batch of
similar lengths wastes little; ``python -m bench.padding`` measures how little on real text.

It is a *batch* sampler (``DataLoader(dataset, batch_sampler=sampler)``): what it decides is which samples share a
batch, which a per-index sampler cannot say (transformers' distributed one hands out indices and leaves the batch
cut to the DataLoader, so its batches straddle its length groups). Deciding batches here also lets every rank's
k-th batch hold the same number of samples, so every rank runs the same number of steps and no all-reduce waits
for a rank that ran out.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterator, Mapping, Sequence, Sized
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Sampler

from gradsync.data.sampler import check_state, checked_epoch, replicas_and_rank, require_plain_int
from gradsync.errors import ConfigError
from gradsync.validate import require_bool, require_int

_OWNER = "LengthGroupedSampler"
DEFAULT_INPUT_NAME = "input_ids"  # transformers' LengthGroupedSampler's model_input_name


def _item_length(dataset: Any, index: int, field: str | None) -> int:
    """A sample's length when no ``lengths`` are given: ``len`` of the item, of its first field for a tuple (what a
    ``TensorDataset`` yields: the input first), or of the sequence a dict holds (a Hugging Face datasets row)."""
    item = dataset[index]
    if isinstance(item, Mapping):
        item = _field_of(item, index, field)
    elif field is not None:
        raise ConfigError(
            f"{_OWNER}: model_input_name={field!r} names a field of dict samples, but dataset[{index}] is a "
            f"{type(item).__name__}; drop model_input_name, or pass lengths=[...]."
        )
    if isinstance(item, tuple) and item:
        item = item[0]
    try:
        return len(item)
    except TypeError:
        raise ConfigError(
            f"{_OWNER}: dataset[{index}] ({type(item).__name__}) has no length to group by; pass "
            "lengths=[...] (one token count per sample, e.g. [len(ids) for ids in tokenized])."
        ) from None


def _field_of(row: Mapping[str, Any], index: int, field: str | None) -> Any:
    """The sequence of a dict sample whose length is the sample's: ``field`` (transformers' ``model_input_name``),
    else ``input_ids`` (its default), else the one length every sequence of the row shares. ``len(row)`` would be
    the number of fields, the same for every sample."""
    if field is not None or DEFAULT_INPUT_NAME in row:
        name = DEFAULT_INPUT_NAME if field is None else field
        if name not in row:
            raise ConfigError(
                f"{_OWNER}: model_input_name={name!r}, but dataset[{index}] has no such field (it has "
                f"{sorted(map(str, row))}); name the field holding the tokens, or pass lengths=[...]."
            )
        return row[name]
    sequences = {k: len(v) for k, v in row.items() if hasattr(v, "__len__") and not isinstance(v, (str, bytes))}
    if len(set(sequences.values())) == 1:
        return next(v for k, v in row.items() if k in sequences)
    raise ConfigError(
        f"{_OWNER}: dataset[{index}] is a dict without 'input_ids', whose sequences do not say the sample's length "
        f"(lengths {sequences or 'none'}); pass model_input_name='FIELD' (the field holding the tokens), or "
        "lengths=[...] (one token count per sample)."
    )


def read_lengths(
    dataset: Sized, lengths: Sequence[int] | torch.Tensor | None, field: str | None = None
) -> torch.Tensor:
    """One length per sample as an int64 tensor, checked: as many as the dataset has samples, whole, >= 0.
    ``field``: for dict samples, the one holding the tokens (transformers' ``model_input_name``)."""
    if field is not None and not (isinstance(field, str) and field):
        raise ConfigError(f"{_OWNER}: model_input_name must be a field's name (a str), got {field!r}")
    if lengths is None:  # reads every item once, at construction: pass lengths for a dataset that loads lazily
        lengths = [_item_length(dataset, i, field) for i in range(len(dataset))]
    try:
        # An empty list would become a float tensor: no samples have int64 lengths.
        found = torch.as_tensor(lengths) if len(lengths) else torch.zeros(0, dtype=torch.int64)
    except (TypeError, ValueError, RuntimeError) as error:
        raise ConfigError(f"{_OWNER}: lengths must be a sequence of ints, one per sample ({error})") from None
    if found.dim() != 1 or found.dtype.is_floating_point or found.dtype.is_complex or found.dtype == torch.bool:
        raise ConfigError(
            f"{_OWNER}: lengths must be a flat sequence of ints (one token count per sample), got a "
            f"{found.dtype} tensor of shape {tuple(found.shape)}"
        )
    if len(found) != len(dataset):
        raise ConfigError(
            f"{_OWNER}: {len(found)} lengths for a dataset of {len(dataset)} samples; pass exactly one length per "
            "sample, in the dataset's index order."
        )
    if len(found) and int(found.min()) < 0:
        at = int(found.argmin())
        raise ConfigError(f"{_OWNER}: lengths[{at}] is {int(found[at])}; a length is a count of tokens, >= 0")
    return found.to(device="cpu", dtype=torch.int64)


def epoch_slots(order: torch.Tensor, num_replicas: int, batch_size: int, drop_last: bool) -> torch.Tensor:
    """The epoch's order cut or padded to the samples the epoch hands out. Without ``drop_last``: padded to a
    multiple of ``num_replicas`` by repeating the order from its start, as torch's DistributedSampler pads (the
    same samples repeat). With it: cut to a multiple of ``num_replicas * batch_size``, so every batch is full."""
    n = len(order)
    if drop_last:
        return order[: n // (num_replicas * batch_size) * num_replicas * batch_size]
    total = math.ceil(n / num_replicas) * num_replicas
    return order.repeat(math.ceil(total / n))[:total] if n else order


def group_by_length(slots: torch.Tensor, lengths: torch.Tensor, megabatch: int) -> torch.Tensor:
    """``slots`` cut into consecutive runs of ``megabatch``, each sorted longest first (ties keep their order).

    Two stable sorts give the lexicographic order (run, then length descending, then position) in C; the plain
    Python rule is :func:`group_by_length_reference`."""
    by_length = torch.sort(lengths[slots], descending=True, stable=True).indices
    run = torch.div(by_length, megabatch, rounding_mode="floor")
    return slots[by_length[torch.sort(run, stable=True).indices]]


def group_by_length_reference(slots: Sequence[int], lengths: Sequence[int], megabatch: int) -> list[int]:
    """The rule of :func:`group_by_length`, one run at a time in plain Python: the reference its test compares with."""
    grouped: list[int] = []
    for start in range(0, len(slots), megabatch):
        grouped += sorted(slots[start : start + megabatch], key=lambda i: -lengths[i])  # sorted() is stable
    return grouped


def arrange(
    batches: list[torch.Tensor], lengths: torch.Tensor, generator: torch.Generator | None
) -> list[torch.Tensor]:
    """The global batches in a shuffled order (none without a generator), then the one holding the epoch's longest
    sample moved first: a batch too large for memory fails at the first step, not hours in."""
    if generator is not None:
        batches = [batches[i] for i in torch.randperm(len(batches), generator=generator).tolist()]
    if batches:
        longest = max(range(len(batches)), key=lambda k: int(lengths[batches[k]].max()))  # the first on a tie
        batches.insert(0, batches.pop(longest))
    return batches


class LengthGroupedSampler(Sampler[list[int]]):
    """Yield this rank's batches of indices, samples of similar length together; pass it as ``batch_sampler=``.

    A batch sampler, not a sampler of indices, because what it decides is which samples share a batch, and because
    deciding the batches here gives every rank as many batches of the same sizes, so no all-reduce waits for a rank
    that ran out. ``state_dict()`` / ``load_state_dict()`` continue an epoch after a restart, as
    :class:`DistributedSampler`'s do, and :mod:`gradsync.checkpoint` saves and restores it.

    Example::

        lengths = torch.randint(1, 64, (len(dataset),)).tolist()   # each sample's token count
        sampler = LengthGroupedSampler(dataset, batch_size=8, lengths=lengths, seed=0)
        loader = DataLoader(dataset, batch_sampler=sampler)
        for epoch in range(start_epoch, epochs):
            sampler.set_epoch(epoch)
            for step, (x, y) in enumerate(loader):
                ...
                # the batches the loop finished, not what DataLoader prefetched:
                state = sampler.state_dict(batches_consumed=step + 1)

    The rule, each epoch, the same on every rank without communication:

    1. The epoch's order: ``randperm(len(dataset))`` seeded with ``seed + epoch`` (torch's DistributedSampler
       order), or ``0, 1, ...`` without ``shuffle``.
    2. Without ``drop_last``, padded to a multiple of ``num_replicas`` by repeating the order from its start (the
       same samples torch's DistributedSampler repeats, at most ``num_replicas - 1`` of them); with ``drop_last``,
       cut to a multiple of ``num_replicas * batch_size`` (at most that many minus one dropped, the order's tail).
    3. Cut into megabatches of ``megabatch_mult * num_replicas * batch_size`` samples, each sorted longest first.
    4. Cut into global batches of ``num_replicas * batch_size``; rank ``r``'s batch is the samples ``r``,
       ``r + num_replicas``, ``r + 2 * num_replicas``, ... of one, so the ranks' batches of a step span the same
       lengths and none waits long for another.
    5. The global batches shuffled by the same generator (kept in order without ``shuffle``), then the one holding
       the longest sample moved first.

    So each epoch, across all ranks, every sample is in exactly one batch, except the repeats of step 2 (in two;
    more only with fewer samples than ranks) and the tail that ``drop_last`` cuts (in none; with fewer than
    ``num_replicas * batch_size`` samples, no batch at all). Every rank has ``len(sampler)`` batches, and every
    batch holds ``batch_size`` samples except, without ``drop_last``, one smaller batch, the same size on every
    rank. A larger ``megabatch_mult`` sorts across more samples: less padding, batches less random.

    ``lengths`` defaults to ``len(dataset[i])`` (of its first field for a tuple), read once here. For dict samples
    (Hugging Face datasets rows) it is the length of their ``model_input_name`` field, ``"input_ids"`` by default
    as in transformers' sampler, or of their sequences where they all have one length; other dicts are refused.
    ``num_replicas`` and ``rank`` default to ``process_group``'s (default: the world group), as DistributedSampler's do.
    """

    def __init__(
        self,
        dataset: Sized,
        batch_size: int,
        lengths: Sequence[int] | torch.Tensor | None = None,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        megabatch_mult: int = 50,
        process_group: dist.ProcessGroup | None = None,
        model_input_name: str | None = None,
    ) -> None:
        if isinstance(dataset, (str, bytes)) or not hasattr(dataset, "__len__"):
            raise ConfigError(
                f"{_OWNER} needs a map-style dataset (one with a length), got {type(dataset).__name__}; an "
                "IterableDataset must be bucketed by the dataset itself."
            )
        self.batch_size = require_int(_OWNER, "batch_size", batch_size, 1)
        self.megabatch_mult = require_int(_OWNER, "megabatch_mult", megabatch_mult, 1)
        require_plain_int(_OWNER, "seed", seed)
        self.seed = seed
        self.num_replicas, self.rank = replicas_and_rank(_OWNER, num_replicas, rank, process_group)
        self.dataset = dataset
        self.shuffle = require_bool(_OWNER, "shuffle", shuffle)
        self.drop_last = require_bool(_OWNER, "drop_last", drop_last)
        self.lengths = read_lengths(dataset, lengths, model_input_name)
        self.epoch = 0
        self._plan: tuple[int, list[list[int]]] | None = None  # (epoch, this rank's batches), made once per epoch
        self._resume_at = 0  # batches of self.epoch already handed out before a restart
        self._yielded = 0  # batches of self.epoch handed out by the current iteration

    @property
    def num_batches(self) -> int:
        """Batches per rank in a whole epoch (``len()`` is the number left after a mid-epoch load)."""
        n, world = len(self.lengths), self.num_replicas
        if self.drop_last:
            return n // (world * self.batch_size)
        return math.ceil(math.ceil(n / world) / self.batch_size)

    def batches(self) -> list[list[int]]:
        """This rank's whole list of batches for the current epoch."""
        if self._plan is None or self._plan[0] != self.epoch:
            self._plan = (self.epoch, self._make_batches())
        return self._plan[1]

    def _make_batches(self) -> list[list[int]]:
        world, width = self.num_replicas, self.num_replicas * self.batch_size
        generator = torch.Generator().manual_seed(self.seed + self.epoch) if self.shuffle else None
        n = len(self.lengths)
        order = torch.randperm(n, generator=generator) if generator is not None else torch.arange(n)
        slots = epoch_slots(order, world, self.batch_size, self.drop_last)
        grouped = group_by_length(slots, self.lengths, self.megabatch_mult * width)
        global_batches = list(torch.split(grouped, width)) if len(grouped) else []  # split() gives one empty
        arranged = arrange(global_batches, self.lengths, generator)
        return [global_batch[self.rank :: world].tolist() for global_batch in arranged]

    def __iter__(self) -> Iterator[list[int]]:
        self._yielded = self._resume_at  # a fresh iteration has handed out nothing yet
        return self._from_resume_position()

    def _from_resume_position(self) -> Iterator[list[int]]:
        # A generator, so the saved position is used up at the first next(), not at iter(): DataLoader's worker
        # iterator calls iter() on its batch sampler twice before it draws a batch.
        start, self._resume_at = self._resume_at, 0
        self._yielded = start
        for batch in self.batches()[start:]:
            self._yielded += 1
            yield batch

    def __len__(self) -> int:
        return self.num_batches - self._resume_at

    @property
    def resume_position(self) -> int:
        """Batches of this epoch the next iteration skips (non-zero only right after a mid-epoch load)."""
        return self._resume_at

    def set_epoch(self, epoch: int) -> None:
        """Regroup and reshuffle for ``epoch`` (call before each epoch, as with torch's sampler)."""
        epoch = checked_epoch(_OWNER, epoch)
        if epoch != self.epoch:
            self._resume_at = self._yielded = 0  # a saved position belongs to the epoch it was saved in
        self.epoch = epoch

    def _identity(self) -> dict[str, Any]:
        """What a saved position depends on: the same values, or the position names other samples."""
        return {
            "dataset_len": len(self.lengths),
            "lengths_crc32": zlib.crc32(self.lengths.numpy().tobytes()),
            "num_replicas": self.num_replicas,
            "batch_size": self.batch_size,
            "megabatch_mult": self.megabatch_mult,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
        }

    def state_dict(self, batches_consumed: int | None = None) -> dict[str, Any]:
        """Where this rank is in the epoch: the same on every rank (they step together), so rank 0's saved state
        resumes them all. Pass ``batches_consumed`` (the batches your loop finished) when iterating through a
        DataLoader, which draws batches ahead of your loop; otherwise the batches this sampler yielded are counted."""
        if batches_consumed is None:
            batches_consumed = self._yielded
        consumed = require_int(f"{_OWNER}.state_dict", "batches_consumed", batches_consumed, 0)
        if consumed > self.num_batches:
            raise ConfigError(
                f"{_OWNER}.state_dict: batches_consumed={consumed} is outside [0, {self.num_batches}] (this rank's "
                "batches per epoch); pass the batches the loop finished in this epoch, e.g. step + 1."
            )
        return {"epoch": self.epoch, "batches_consumed": consumed, "rank": self.rank, **self._identity()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state``: the next iteration yields the rest of that epoch's batches."""
        check_state(state, _OWNER)
        for key, mine in self._identity().items():
            if state.get(key) != mine:
                raise ConfigError(
                    f"{_OWNER}.load_state_dict: the state was saved with {key}={state.get(key)!r} but this sampler "
                    f"has {key}={mine!r}; the saved position would point at other batches. Build the sampler with "
                    "the same lengths, world size, batch_size, megabatch_mult, seed, shuffle and drop_last."
                )
        epoch, consumed = state.get("epoch"), state.get("batches_consumed")
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ConfigError(f"{_OWNER}.load_state_dict: epoch must be an int >= 0, got {epoch!r}")
        if isinstance(consumed, bool) or not isinstance(consumed, int) or not 0 <= consumed <= self.num_batches:
            raise ConfigError(
                f"{_OWNER}.load_state_dict: batches_consumed={consumed!r} is outside [0, {self.num_batches}]; "
                "the state is corrupt or from another run."
            )
        self.epoch = epoch
        self._resume_at = self._yielded = consumed
