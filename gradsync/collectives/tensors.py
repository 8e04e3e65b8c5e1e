"""Collectives over lists of tensors, packed into one flat buffer per device: fewer collectives, fewer round trips.

A flat buffer's layout is only meaningful if every rank packs the same tensors (names, shapes, dtypes) in the same
order; :mod:`gradsync.ddp.replicas` checks that for a model before anything is packed.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gradsync import torch_private
from gradsync.collectives.communicator import Communicator, Op


def broadcast_tensors(comm: Communicator, op: Op, tensors: Sequence[torch.Tensor], src: int = 0) -> None:
    """Overwrite ``tensors`` in place with group rank ``src``'s values.

    One broadcast per device whatever the dtypes: every tensor's bytes are packed into one ``uint8`` buffer. The
    buffers broadcast before each forward mix float statistics and int64 counters, and on a slow link each extra
    collective is a round trip.

    >>> broadcast_tensors(comm, Op.BUFFER_BROADCAST, list(model.buffers()))  # doctest: +SKIP
    """
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        by_device.setdefault(t.device, []).append(t)
    with torch.no_grad():
        for members in by_device.values():
            for chunk in chunks(widest_first(members), BROADCAST_CHUNK_BYTES):
                flat = pack(chunk)
                what = f"{op.value} ({len(chunk)} tensors, {flat.numel() / 2**20:.2f} MiB)"
                comm.broadcast(op, flat, src=src, what=what)
                unpack(chunk, flat)


# torch's _sync_module_states broadcasts in 250 MiB buckets: a packed copy of a whole large model would double its
# memory at construction, for no fewer round trips that matter at that size.
BROADCAST_CHUNK_BYTES = 250 * 2**20


def chunks(members: list[torch.Tensor], limit: int) -> list[list[torch.Tensor]]:
    """``members`` in order, cut into runs of at most ``limit`` bytes (a larger tensor is a run of its own).

    >>> [len(c) for c in chunks([torch.zeros(4), torch.zeros(4), torch.zeros(4)], limit=32)]
    [2, 1]
    """
    runs: list[list[torch.Tensor]] = []
    size = limit
    for t in members:
        nbytes = t.numel() * t.element_size()
        if size + nbytes > limit:
            runs.append([])
            size = 0
        runs[-1].append(t)
        size += nbytes
    return runs


def all_gather_shards(comm: Communicator, op: Op, shards: Sequence[Sequence[torch.Tensor]]) -> None:
    """Group rank r holds the up-to-date values of ``shards[r]``; afterwards every rank holds all of them.

    One all-gather of the byte-packed shards (padded to the largest) rather than one broadcast per owner in turn:
    every rank sends its shard while it receives the others, so on a full-duplex link it takes about half the
    time with 2 ranks. All tensors must be on one device.
    """
    me = comm.rank
    ordered = [widest_first(list(shard)) for shard in shards]
    sizes = [sum(t.numel() * t.element_size() for t in shard) for shard in ordered]
    width = max(sizes, default=0)
    if width == 0:
        return
    device = next(t.device for shard in ordered for t in shard)
    with torch.no_grad():
        mine = torch.zeros(width, dtype=torch.uint8, device=device)
        if ordered[me]:
            mine[: sizes[me]] = pack(ordered[me])
        gathered = comm.all_gather(op, mine)
        for r, shard in enumerate(ordered):
            if r != me and shard:
                unpack(shard, gathered[r][: sizes[r]])


def average_tensors(comm: Communicator, op: Op, tensors: Sequence[torch.Tensor]) -> None:
    """Replace ``tensors`` in place by their mean over the group, one flat all-reduce per dtype and device."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    with torch.no_grad():
        for members in groups.values():
            flat = torch.cat([t.reshape(-1) for t in members]).div_(comm.size)
            comm.all_reduce(op, flat)
            pieces = flat.split([t.numel() for t in members])
            torch_private.foreach_copy_(members, [piece.view_as(t) for piece, t in zip(pieces, members)])


def widest_first(members: list[torch.Tensor]) -> list[torch.Tensor]:
    """Largest element size first: every offset is then a multiple of the next element size, so each piece of a
    packed buffer can be viewed back in place."""
    return sorted(members, key=lambda t: -t.element_size())


def pack(members: Sequence[torch.Tensor]) -> torch.Tensor:
    """The bytes of ``members``, one after another, as one ``uint8`` tensor."""
    return torch.cat([t.detach().reshape(-1).view(torch.uint8) for t in members])


def unpack(members: Sequence[torch.Tensor], flat: torch.Tensor) -> None:
    """Copy the bytes of ``flat`` (from :func:`pack` of tensors shaped like ``members``) back into ``members``."""
    pieces = flat.split([t.numel() * t.element_size() for t in members])
    torch_private.foreach_copy_(members, [piece.view(t.dtype).view_as(t) for piece, t in zip(pieces, members)])
