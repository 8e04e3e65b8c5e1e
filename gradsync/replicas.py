"""Keep replicas identical: check every rank built the same model, then copy rank 0's state to all.

Li et al. (section 3.1): DDP is only equivalent to local training if all replicas start from the same values, so
the constructor broadcasts rank 0's parameters and buffers. Before that, a model that differs between ranks (a
rank-dependent branch, a different config) would silently mis-pair gradients; we compare the parameter lists first
and fail on every rank with the first difference named.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from gradsync.groups import rank0_global


def _signature(named_params: Sequence[tuple[str, torch.Tensor]]) -> list[tuple[str, tuple[int, ...], str, bool]]:
    return [(name, tuple(p.shape), str(p.dtype), p.requires_grad) for name, p in named_params]


def verify_same_parameters(
    named_params: Sequence[tuple[str, torch.Tensor]], process_group: dist.ProcessGroup | None
) -> None:
    """Raise ``ValueError`` on every rank if any rank's parameters differ in count, name, shape, dtype or
    requires_grad, naming the first differing parameter and the ranks involved."""
    mine = _signature(named_params)
    everyone: list = [None] * dist.get_world_size(process_group)
    dist.all_gather_object(everyone, mine, group=process_group)
    reference = everyone[0]
    for rank, theirs in enumerate(everyone[1:], start=1):
        if theirs == reference:
            continue
        for pos in range(max(len(reference), len(theirs))):
            a = reference[pos] if pos < len(reference) else None
            b = theirs[pos] if pos < len(theirs) else None
            if a != b:
                break
        same = [r for r, sig in enumerate(everyone) if sig == reference]
        raise ValueError(
            "gradsync: DistributedDataParallel needs the same model on every rank, but rank "
            f"{rank} differs from rank 0 at parameter #{pos}: rank 0 has {_describe(a)}, rank {rank} has "
            f"{_describe(b)} ({len(reference)} vs {len(theirs)} parameters; ranks matching rank 0: {same}). "
            "Build the model identically on all ranks (same config, no rank-dependent layers) before wrapping it."
        )


def _describe(sig: tuple | None) -> str:
    if sig is None:
        return "no parameter there"
    name, shape, dtype, requires_grad = sig
    return f"'{name}' shape={list(shape)} dtype={dtype} requires_grad={requires_grad}"


def _flat_groups(tensors: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    groups: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    return list(groups.values())


def average_tensors(tensors: Sequence[torch.Tensor], process_group: dist.ProcessGroup | None) -> None:
    """Replace ``tensors`` in place by their mean over the group, one flat all-reduce per dtype and device."""
    world = dist.get_world_size(process_group)
    with torch.no_grad():
        for members in _flat_groups(tensors):
            flat = torch.cat([t.reshape(-1) for t in members]).div_(world)
            dist.all_reduce(flat, group=process_group)
            _copy_back(members, flat)


def _copy_back(members: list[torch.Tensor], flat: torch.Tensor) -> None:
    pieces = flat.split([t.numel() for t in members])
    torch._foreach_copy_(members, [piece.view_as(t) for piece, t in zip(pieces, members)])


def broadcast_tensors(
    tensors: Sequence[torch.Tensor], process_group: dist.ProcessGroup | None, src: int | None = None
) -> None:
    """Overwrite ``tensors`` in place with the values of global rank ``src`` (default: the group's rank 0).

    One broadcast per device whatever the dtypes: every tensor's bytes are packed into one ``uint8`` buffer. The
    buffers broadcast before each forward mix float statistics and int64 counters, and on a slow link each extra
    collective is a round trip.
    """
    if not tensors:
        return
    src = rank0_global(process_group) if src is None else src
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        by_device.setdefault(t.device, []).append(t)
    with torch.no_grad():
        for members in by_device.values():
            members = _widest_first(members)
            flat = _pack(members)
            dist.broadcast(flat, src=src, group=process_group)
            _unpack(members, flat)


def all_gather_shards(shards: Sequence[Sequence[torch.Tensor]], process_group: dist.ProcessGroup | None) -> None:
    """Rank r of the group holds the up-to-date values of ``shards[r]``; afterwards every rank holds all of them.

    One all-gather of the byte-packed shards (padded to the largest) rather than one broadcast per owner in turn:
    every rank sends its shard while it receives the others, so on a full-duplex link it takes about half the
    time with 2 ranks. All tensors must be on one device.
    """
    me = dist.get_rank(process_group)
    shards = [_widest_first(list(shard)) for shard in shards]
    sizes = [sum(t.numel() * t.element_size() for t in shard) for shard in shards]
    width = max(sizes, default=0)
    if width == 0:
        return
    device = next(t.device for shard in shards for t in shard)
    with torch.no_grad():
        mine = torch.zeros(width, dtype=torch.uint8, device=device)
        if shards[me]:
            mine[: sizes[me]] = _pack(shards[me])
        gathered = [torch.empty_like(mine) for _ in shards]
        dist.all_gather(gathered, mine, group=process_group)
        for r, shard in enumerate(shards):
            if r != me and shard:
                _unpack(shard, gathered[r][: sizes[r]])


def _widest_first(members: list[torch.Tensor]) -> list[torch.Tensor]:
    # Every offset is then a multiple of the next element size, so each piece can be viewed back in place.
    return sorted(members, key=lambda t: -t.element_size())


def _pack(members: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).view(torch.uint8) for t in members])


def _unpack(members: Sequence[torch.Tensor], flat: torch.Tensor) -> None:
    pieces = flat.split([t.numel() * t.element_size() for t in members])
    torch._foreach_copy_(list(members), [piece.view(t.dtype).view_as(t) for piece, t in zip(pieces, members)])
