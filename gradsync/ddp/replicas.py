"""Keep replicas identical: check every rank built the same model, then copy rank 0's state to all.

Li et al. (section 3.1): DDP is only equivalent to local training if all replicas start from the same values, so
the constructor broadcasts rank 0's parameters and buffers. Before that, a model that differs between ranks (a
rank-dependent branch, a different config, a buffer of another dtype) would silently mis-pair gradients or be
unpacked into the wrong bytes; the parameter and buffer lists are compared first, and every rank fails with the
first difference named.

A DTensor (tensor parallelism) is checked and broadcast by its local shard, with its placements in the signature:
the members of a data-parallel group hold the same shard of it (torch's DDP broadcasts the same local tensors).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn

from gradsync.collectives.communicator import Communicator, Op
from gradsync.collectives.tensors import broadcast_tensors
from gradsync.errors import ModelMismatchError
from gradsync.reducer.local_params import is_dtensor, local_of

Signature = tuple[str, str, tuple[int, ...], str, str, bool]


class SharedReplica(NamedTuple):
    """What the members of a new elastic round must hold alike besides parameters and buffers, rank 0's sent to all
    (``DistributedDataParallel.shared_replica``): the comm hook's shared state (PowerSGD's generator, DiLoCo's
    anchor...: :mod:`gradsync.comm.regroup`), and the rebuilt buckets' parameter order and caps, so that the new
    round's reducer need not learn them again in an iteration of one bucket."""

    hook: dict[str, Any] | None
    layout: tuple[list[int], list[int]] | None


def model_signature(module: nn.Module, ignored: Collection[str] = ()) -> list[Signature]:
    """What every rank must agree on: each parameter's and buffer's name, shape, dtype, device type and
    requires_grad (values may differ: rank 0's are broadcast). Names on the ignore list are left out."""
    params = [
        ("parameter", n, tuple(local_of(p).shape), str(p.dtype), _placed(p), p.requires_grad)
        for n, p in module.named_parameters()
        if n not in ignored
    ]
    buffers = [
        ("buffer", n, tuple(local_of(b).shape), str(b.dtype), _placed(b), False)
        for n, b in module.named_buffers()
        if n not in ignored
    ]
    return params + buffers


def _placed(tensor: torch.Tensor) -> str:
    """The device type, and for a DTensor its placements and mesh shape (its shape in the signature is local)."""
    if not is_dtensor(tensor):
        return tensor.device.type
    mesh = tensor.device_mesh  # type: ignore[attr-defined]
    placements = ", ".join(str(p) for p in tensor.placements)  # type: ignore[attr-defined]
    return f"{tensor.device.type}, a DTensor [{placements}] over a mesh of {tuple(mesh.shape)}"


def settings_signature(settings: Mapping[str, object]) -> list[Signature]:
    """Settings that decide which collectives run (bucket caps, graph mode, GRADSYNC_DEBUG's fingerprints): a rank
    with other values would issue other collectives, which gloo answers by aborting the process."""
    return [("setting", name, (), repr(value), "", False) for name, value in sorted(settings.items())]


def verify_same_model(
    comm: Communicator, module: nn.Module, ignored: Collection[str] = (), settings: Mapping[str, object] | None = None
) -> None:
    """Raise :class:`ModelMismatchError` on every rank if any rank's parameters, buffers or collective-shaping
    ``settings`` differ, naming the first difference and the ranks involved."""
    mine = model_signature(module, ignored) + settings_signature(settings or {})
    everyone = comm.all_gather_object(Op.MODEL_CHECK, mine)
    reference = everyone[0]
    for rank, theirs in enumerate(everyone[1:], start=1):
        if theirs != reference:
            raise ModelMismatchError(_mismatch(comm.global_rank(rank), reference, theirs, everyone))


def _mismatch(rank: int, reference: Sequence[Signature], theirs: Sequence[Signature], everyone: list) -> str:
    pos = next(p for p in range(max(len(reference), len(theirs))) if _at(reference, p) != _at(theirs, p))
    a, b = _at(reference, pos), _at(theirs, pos)
    # Settings follow the model's tensors, so one rank's extra buffer meets the other's first setting: the model
    # differs there (the kind that comes first), and the setting stands for "nothing there".
    kinds = {sig[0] for sig in (a, b) if sig is not None}
    kind = next(k for k in ("parameter", "buffer", "setting") if k in kinds)
    a, b = (sig if sig is not None and sig[0] == kind else None for sig in (a, b))
    number = sum(1 for sig in reference[:pos] if sig[0] == kind)
    same = [r for r, sig in enumerate(everyone) if sig == reference]
    counts = f"{_count(reference, kind)} vs {_count(theirs, kind)} {kind}s"
    if kind == "setting":
        return (
            f"DistributedDataParallel needs the same settings on every rank, but rank {rank} has {_describe(b)} "
            f"where rank 0 has {_describe(a)} (ranks matching rank 0: {same}). Pass the same arguments and "
            "GRADSYNC_* environment variables on every rank."
        )
    return (
        f"DistributedDataParallel needs the same model on every rank, but rank {rank} differs from rank 0 at "
        f"{kind} #{number}: rank 0 has {_describe(a)}, rank {rank} has {_describe(b)} ({counts}; ranks matching "
        f"rank 0: {same}). Build the model identically on all ranks (same config, no rank-dependent layers or "
        "buffers) before wrapping it."
    )


def _at(signatures: Sequence[Signature], pos: int) -> Signature | None:
    return signatures[pos] if pos < len(signatures) else None


def _count(signatures: Sequence[Signature], kind: str) -> int:
    return sum(1 for sig in signatures if sig[0] == kind)


def _describe(sig: Signature | None) -> str:
    if sig is None:
        return "nothing there"
    kind, name, shape, dtype, device, requires_grad = sig
    if kind == "setting":
        return f"{name}={dtype}"
    grad = f" requires_grad={requires_grad}" if kind == "parameter" else ""
    return f"'{name}' shape={list(shape)} dtype={dtype} device={device}{grad}"


def broadcast_initial_state(
    comm: Communicator, module: nn.Module, include_buffers: bool, ignored: Collection[str] = ()
) -> None:
    """Copy rank 0's parameters (and buffers) to every rank; call after :func:`verify_same_model`."""
    tensors: list[torch.Tensor] = [local_of(p).detach() for n, p in module.named_parameters() if n not in ignored]
    if include_buffers:
        tensors += [local_of(b) for n, b in module.named_buffers() if n not in ignored]
    broadcast_tensors(comm, Op.INITIAL_BROADCAST, tensors)
