"""Checkpoints that are never half-written, and resume that continues exactly where training stopped.

Written to a temporary file in the same directory, flushed and fsynced, then renamed over the old one: a process
killed mid-save leaves the previous checkpoint intact (nanoGPT and picotron overwrite in place). Every rank's RNG
states are saved, so dropout and shuffling continue bit for bit after a resume.
"""

from __future__ import annotations

import errno
import os
import random
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from gradsync.collectives.communicator import Communicator, Op
from gradsync.errors import CheckpointError

# Every rank must call save: the ones that arrive wait this long for the others before failing by name.
ARRIVAL_SECONDS = 60.0
_RNG_KEY = "_gradsync_rng"
_KINDS_KEY = "_gradsync_kinds"


def _unwrap(obj: Any) -> Any:
    # DDP (ours or torch's) saves the wrapped model's unprefixed names, loadable without DDP.
    return obj.module if isinstance(obj, torch.nn.Module) and hasattr(obj, "module") else obj


def rng_state() -> dict[str, Any]:
    """This process's torch, CUDA, numpy and Python generator states."""
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def atomic_torch_save(obj: Any, path: str | os.PathLike) -> None:
    """``torch.save`` to a temporary file beside ``path``, fsync, then rename over ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in path.parent.glob(f".{path.name}.tmp-*"):  # left by a save that was killed mid-write
        stale.unlink(missing_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as fh:
            torch.save(obj, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except (OSError, RuntimeError) as exc:
        raise CheckpointError(_write_failed(path, exc)) from exc
    finally:
        if tmp.exists():
            tmp.unlink()
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # the rename itself survives a power cut
    finally:
        os.close(dir_fd)


def _write_failed(path: Path, exc: BaseException) -> str:
    # torch.save reports a full disk from C++ ("unexpected pos ..."): name it by checking the space left.
    free = shutil.disk_usage(path.parent).free
    if getattr(exc, "errno", None) == errno.ENOSPC or free < 1 << 20:
        return (
            f"no space left on the device to write '{path}' ({free / 2**20:.1f} MiB free). The previous "
            "checkpoint, if any, is intact. Free space or save elsewhere."
        )
    return f"writing '{path}' failed ({type(exc).__name__}: {exc}). The previous checkpoint, if any, is intact."


def save(path: str | os.PathLike, process_group: dist.ProcessGroup | None = None, **state: Any) -> None:
    """Save ``state`` atomically; call on every rank (the RNG states are gathered), rank 0 writes.

    Values with a ``state_dict()`` (models, DDP-wrapped models, optimizers, samplers, loaders) are stored as their
    state dicts; anything else (step, epoch, your extras) as it is.

    >>> checkpoint.save("ckpt.pt", model=ddp, optimizer=opt, loader=loader, step=step)  # doctest: +SKIP
    """
    payload: dict[str, Any] = {}
    kinds: dict[str, str] = {}
    for key, value in state.items():
        value = _unwrap(value)
        if hasattr(value, "state_dict") and callable(value.state_dict):
            payload[key], kinds[key] = value.state_dict(), "state_dict"
        else:
            payload[key], kinds[key] = value, "value"
    comm = Communicator(process_group) if dist.is_initialized() else None
    if comm is not None:
        comm.expect_everyone(Op.CHECKPOINT_RNG, ARRIVAL_SECONDS, "gradsync.checkpoint.save")
    rngs = comm.all_gather_object(Op.CHECKPOINT_RNG, rng_state()) if comm is not None else [rng_state()]
    payload[_RNG_KEY], payload[_KINDS_KEY] = rngs, kinds
    if comm is None or comm.rank == 0:
        atomic_torch_save(payload, path)
    if comm is not None:
        comm.barrier(Op.CHECKPOINT_BARRIER)  # nobody moves on (or exits) before the file is in place


def load(path: str | os.PathLike, map_location: str | torch.device | None = None) -> dict[str, Any]:
    """Read a checkpoint written by :func:`save` (onto ``map_location``, default CPU); pass it to :func:`restore`."""
    if not Path(path).exists():
        raise FileNotFoundError(f"gradsync.checkpoint.load: no checkpoint at '{path}'")
    try:
        # weights_only=False: the payload holds numpy and Python RNG states; load only checkpoints you wrote.
        payload = torch.load(path, map_location=map_location or "cpu", weights_only=False)
    except Exception as exc:
        raise CheckpointError(_unreadable(Path(path), exc)) from exc
    if not isinstance(payload, dict) or _KINDS_KEY not in payload:
        raise CheckpointError(
            f"'{path}' is a torch file but not a gradsync checkpoint (no {_KINDS_KEY} entry): write it with "
            "gradsync.checkpoint.save, or read it with torch.load."
        )
    return payload


def _unreadable(path: Path, exc: Exception) -> str:
    size = path.stat().st_size
    with open(path, "rb") as fh:
        head = fh.read(4)
    if head != b"PK\x03\x04":  # torch.save writes a zip archive
        return f"'{path}' ({size} bytes) is not a checkpoint: it is not a torch.save archive ({exc})."
    return (
        f"'{path}' ({size} bytes) looks truncated or damaged: torch cannot read it ({type(exc).__name__}: {exc}). "
        "gradsync writes checkpoints atomically, so a file cut short was copied or written by something else; "
        "use an earlier checkpoint."
    )


def restore(checkpoint: Mapping[str, Any], restore_rng: bool = True, **targets: Any) -> dict[str, Any]:
    """Load each saved state into the object passed under the same name; return the plain values (step, ...).

    >>> ckpt = checkpoint.load("ckpt.pt")
    >>> extras = checkpoint.restore(ckpt, model=ddp, optimizer=opt, loader=loader)
    >>> start_step = extras["step"]  # doctest: +SKIP
    """
    kinds = checkpoint.get(_KINDS_KEY, {})
    for key, target in targets.items():
        if key not in checkpoint:
            raise CheckpointError(
                f"gradsync.checkpoint.restore: the checkpoint has no '{key}' (it has {sorted(kinds)})"
            )
        _unwrap(target).load_state_dict(checkpoint[key])
    if restore_rng:
        rngs = checkpoint[_RNG_KEY]
        rank = dist.get_rank() if dist.is_initialized() else 0
        if len(rngs) == (dist.get_world_size() if dist.is_initialized() else 1):
            set_rng_state(rngs[rank])
        else:  # another world size: per-rank streams cannot carry over; keep rank 0's for determinism
            set_rng_state(rngs[0])
    return {k: v for k, v in checkpoint.items() if kinds.get(k) == "value"}
