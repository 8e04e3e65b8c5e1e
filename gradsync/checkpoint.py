"""Checkpoints that are never half-written, and resume that continues exactly where training stopped.

Written to a temporary file in the same directory, flushed and fsynced, then renamed over the old one: a process
killed mid-save leaves the previous checkpoint intact (nanoGPT and picotron overwrite in place). Every rank's RNG
states are saved, so dropout and shuffling continue bit for bit after a resume.
"""

from __future__ import annotations

import errno
import os
import pickle
import random
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from gradsync import dtensor_state
from gradsync.collectives.communicator import Communicator, Op
from gradsync.errors import CheckpointError, ConfigError, GradsyncError
from gradsync.validate import require_bool, require_group, require_state

# Every rank must call save: the ones that arrive wait for the others, as long as a collective may take (the process
# group's timeout: GRADSYNC_TIMEOUT under gradsync.init), before failing by name; a number here overrides it.
ARRIVAL_SECONDS: float | None = None
_RNG_KEY = "_gradsync_rng"
_KINDS_KEY = "_gradsync_kinds"


def _unwrap(obj: Any) -> Any:
    # DDP (ours or torch's) saves the wrapped model's unprefixed names, loadable without DDP.
    return obj.module if isinstance(obj, torch.nn.Module) and hasattr(obj, "module") else obj


def rng_state() -> dict[str, Any]:
    """This process's torch, CUDA, numpy and Python generator states.

    Example::

        saved = checkpoint.rng_state()
        first = torch.rand(1)
        checkpoint.set_rng_state(saved)
        assert torch.equal(torch.rand(1), first)   # the same draw again
    """
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Set this process's torch, CUDA, numpy and Python generators to ``state``, from :func:`rng_state`.

    Example::

        checkpoint.set_rng_state(checkpoint.rng_state())   # what restore() does with a checkpoint's saved states
    """
    state = require_state("checkpoint.set_rng_state", state, ("torch", "numpy", "python"))
    try:
        torch.set_rng_state(state["torch"])
        np.random.set_state(state["numpy"])
        random.setstate(state["python"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ConfigError(
            f"checkpoint.set_rng_state: the state holds something that is no generator state ({exc}); pass what "
            "checkpoint.rng_state() returned."
        ) from None


def atomic_torch_save(obj: Any, path: str | os.PathLike) -> None:
    """``torch.save`` to a temporary file beside ``path``, fsync, then rename over ``path``.

    Example::

        checkpoint.atomic_torch_save({"step": 3}, "state.pt")   # a reader sees the old state.pt or the new one, whole
    """
    try:
        _save_atomically(obj, Path(path))
    except (pickle.PicklingError, AttributeError, TypeError) as exc:  # what pickle raises for a lambda or a lock
        raise CheckpointError(
            f"cannot save {type(obj).__name__} to '{path}': torch.save cannot pickle it ({exc}); save plain values "
            f"and state_dict()s, not functions or live objects. '{path}' was left as it was."
        ) from None


def _save_atomically(obj: Any, path: Path) -> None:
    """:func:`atomic_torch_save`'s work; pickle's own errors pass through (save() names the entry at fault)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        for stale in path.parent.glob(f".{path.name}.tmp-*"):  # left by a save that was killed mid-write
            stale.unlink(missing_ok=True)
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


# What to do about the usual reasons a file cannot be created (the OS's own words say what happened).
_WRITE_HINTS = {
    errno.EACCES: "you may not create files in that directory: save elsewhere or fix its permissions",
    errno.EPERM: "you may not create files in that directory: save elsewhere or fix its permissions",
    errno.EROFS: "that file system is read-only: save to a writable one",
    errno.ENOENT: "that directory cannot hold new files (missing, or a virtual file system such as /proc)",
    errno.ENOTDIR: "a part of the path is a file, not a directory",
    errno.EISDIR: "the path is a directory: give a file name inside it",
}


def _write_failed(path: Path, exc: BaseException) -> str:
    code = getattr(exc, "errno", None)
    # torch.save reports a full disk from C++ ("unexpected pos ...", no errno): name it by checking the space left.
    free = _free_bytes(path.parent)
    if code == errno.ENOSPC or (code is None and free is not None and free < 1 << 20):
        return (
            f"no space left on the device to write '{path}' ({(free or 0) / 2**20:.1f} MiB free). The previous "
            "checkpoint, if any, is intact. Free space or save elsewhere."
        )
    if code in _WRITE_HINTS:
        return (
            f"cannot write '{path}': {os.strerror(code)} ({errno.errorcode[code]}); {_WRITE_HINTS[code]}. The "
            "previous checkpoint, if any, is intact."
        )
    return f"writing '{path}' failed ({type(exc).__name__}: {exc}). The previous checkpoint, if any, is intact."


def _free_bytes(directory: Path) -> int | None:
    try:
        return shutil.disk_usage(directory).free
    except OSError:  # the directory does not exist (or cannot be read): nothing to say about space
        return None


def save(path: str | os.PathLike, process_group: dist.ProcessGroup | None = None, **state: Any) -> None:
    """Save ``state`` atomically; call on every rank (the RNG states are gathered), rank 0 writes.

    Values with a ``state_dict()`` (models, DDP-wrapped models, optimizers, samplers, loaders) are stored as their
    state dicts; anything else (step, epoch, your extras) as it is.

    >>> checkpoint.save("ckpt.pt", model=ddp, optimizer=opt, loader=loader, step=step)  # doctest: +SKIP
    """
    require_group("checkpoint.save", "process_group", process_group)
    payload: dict[str, Any] = {}
    kinds: dict[str, str] = {}
    layouts: dict[str, list] = {}  # each model's state, as names and shapes: one replica's, on every rank
    for key, value in state.items():
        value = _unwrap(value)
        if hasattr(value, "state_dict") and callable(value.state_dict):
            payload[key], kinds[key] = value.state_dict(), "state_dict"
            if isinstance(value, torch.nn.Module):
                layouts[key] = dtensor_state.layout(payload[key])
        else:
            payload[key], kinds[key] = value, "value"
    comm = Communicator(process_group) if dist.is_initialized() else None
    if comm is not None:
        arrival = ARRIVAL_SECONDS or comm.timeout_seconds()
        comm.expect_everyone(Op.CHECKPOINT_RNG, arrival, "gradsync.checkpoint.save")
    mine = (rng_state(), layouts, dtensor_state.holds_dtensors(payload))
    gathered = comm.all_gather_object(Op.CHECKPOINT_RNG, mine) if comm is not None else [mine]
    _check_same_layout([g[1] for g in gathered])
    if any(g[2] for g in gathered):  # tensor parallelism: the file holds each DTensor whole
        payload = dtensor_state.whole(payload)
    payload[_RNG_KEY], payload[_KINDS_KEY] = [g[0] for g in gathered], kinds
    if comm is None or comm.rank == 0:
        _write(payload, Path(path), comm)
    if comm is not None:
        comm.barrier(Op.CHECKPOINT_BARRIER)  # nobody moves on (or exits) before the file is in place


def _check_same_layout(layouts: list[dict[str, list]]) -> None:
    """One file holds one replica's state: a rank whose model differs (a pipeline stage) is refused on every rank."""
    for rank, theirs in enumerate(layouts):
        differing = [key for key in set(theirs) | set(layouts[0]) if theirs.get(key) != layouts[0].get(key)]
        if differing:
            raise CheckpointError(
                f"checkpoint.save: rank {rank}'s {differing[0]}= holds a different model from rank 0's (other "
                "parameter names or shapes), and the file holds rank 0's copy only. Ranks that hold different "
                "parts of a model (pipeline stages) each save their own part: use torch.distributed.checkpoint "
                "(dcp.save(ddp.state_dict(), checkpoint_id=...)), or save each stage from its own process group."
            )


def _write(payload: dict[str, Any], path: Path, comm: Communicator | None) -> None:
    """Rank 0's write; a failure is also reported to the other ranks, which are waiting in the barrier."""
    try:
        try:
            _save_atomically(payload, path)
        except (pickle.PicklingError, TypeError, AttributeError) as exc:
            key = _unpicklable_key(payload)
            if key is None:
                raise
            raise CheckpointError(
                f"checkpoint.save: the value passed as {key}= cannot be pickled ({type(exc).__name__}: {exc}). "
                f"Save data only (tensors, numbers, strings, lists and dicts of them): leave {key} out of the "
                "checkpoint, or save what it holds instead of the object itself."
            ) from exc
    except CheckpointError as error:
        if comm is not None:
            comm.report(str(error))
        raise


def _unpicklable_key(payload: dict[str, Any]) -> str | None:
    """The first entry of ``payload`` that pickle refuses (only looked for once the whole save failed)."""
    for key, value in payload.items():
        try:
            _Probe(_Discard()).dump(value)
        except Exception:
            return key
    return None


class _Probe(pickle.Pickler):
    """Pickles everything but tensors' data, which torch.save writes itself (and which can be gigabytes)."""

    def persistent_id(self, obj: Any) -> int | None:
        return id(obj) if isinstance(obj, (torch.Tensor, torch.UntypedStorage, torch.TypedStorage)) else None


class _Discard:
    def write(self, data: bytes) -> int:
        return len(data)


def load(path: str | os.PathLike, map_location: str | torch.device | None = None) -> dict[str, Any]:
    """Read a checkpoint written by :func:`save` (onto ``map_location``, default CPU); pass it to :func:`restore`.

    Example::

        ckpt = checkpoint.load("ckpt.pt")   # on every rank; tensors onto the CPU
        extras = checkpoint.restore(ckpt, model=ddp, optimizer=opt, loader=loader)
    """
    _check_map_location(map_location)
    if not Path(path).exists():
        raise FileNotFoundError(
            f"gradsync.checkpoint.load: no checkpoint at '{path}': check the path (and that the save finished)"
        )
    if Path(path).is_dir():
        raise CheckpointError(
            f"'{path}' is a directory, not a checkpoint: give the path of the file gradsync.checkpoint.save wrote."
        )
    try:
        # weights_only=False: the payload holds numpy and Python RNG states; load only checkpoints you wrote.
        payload = torch.load(path, map_location=map_location or "cpu", weights_only=False)
    except Exception as exc:
        if _LOCATION_ERRORS.search(str(exc)):
            raise ConfigError(_bad_location(map_location, exc)) from exc
        raise CheckpointError(_unreadable(Path(path), exc)) from exc
    if not isinstance(payload, dict) or _KINDS_KEY not in payload:
        raise CheckpointError(
            f"'{path}' is a torch file but not a gradsync checkpoint (no {_KINDS_KEY} entry): write it with "
            "gradsync.checkpoint.save, or read it with torch.load."
        )
    return payload


# torch's words when the file is fine but the device it is mapped onto is not (unknown, or absent here).
_LOCATION_ERRORS = re.compile(r"restore data location|deserialize object on")


def _check_map_location(map_location: Any) -> None:
    if not isinstance(map_location, str):
        return  # a torch.device, a dict or a callable: torch.load checks those
    try:
        torch.device(map_location)
    except RuntimeError as exc:
        raise ConfigError(_bad_location(map_location, exc)) from None


def _bad_location(map_location: Any, exc: Exception) -> str:
    return (
        f"checkpoint.load: map_location={map_location!r} cannot be used ({exc}). Pass a device that exists here: "
        "'cpu', 'cuda', 'cuda:0', a torch.device, or None (CPU)."
    )


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


def _placed_for(target: Any, saved: Any) -> Any:
    """``saved`` with its whole tensors split to ``target``'s DTensor placements (tensor parallelism), if any."""
    if isinstance(target, torch.nn.Module):
        current = target.state_dict()
        return dtensor_state.module_state_for(current, saved) if dtensor_state.holds_dtensors(current) else saved
    if isinstance(target, torch.optim.Optimizer) and any(
        dtensor_state.holds_dtensors(group["params"]) for group in target.param_groups
    ):
        return dtensor_state.optimizer_state_for(target, saved)
    return saved


def _load_into(key: str, target: Any, saved: Any) -> None:
    """``target.load_state_dict`` of the state saved under ``key``; torch's refusal of a state saved by another
    model (size mismatch, missing keys) is said as the checkpoint's, naming the key."""
    try:
        _unwrap(target).load_state_dict(_placed_for(_unwrap(target), saved))
    except GradsyncError:
        raise
    except (RuntimeError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(
            f"gradsync.checkpoint.restore: '{key}' was saved from another model or configuration than the "
            f"{type(_unwrap(target)).__name__} passed as {key}= ({exc}). Restore a checkpoint saved from the same "
            "model, or build the object as it was when saved."
        ) from None


def restore(checkpoint: Mapping[str, Any], restore_rng: bool = True, **targets: Any) -> dict[str, Any]:
    """Load each saved state into the object passed under the same name; return the plain values (step, ...).

    >>> ckpt = checkpoint.load("ckpt.pt")
    >>> extras = checkpoint.restore(ckpt, model=ddp, optimizer=opt, loader=loader)
    >>> start_step = extras["step"]  # doctest: +SKIP
    """
    if not isinstance(checkpoint, Mapping):
        raise ConfigError(
            f"checkpoint.restore: expected what checkpoint.load(path) returns, got {type(checkpoint).__name__} "
            f"{checkpoint!r:.80}. Load the file first: checkpoint.restore(checkpoint.load(path), model=...)."
        )
    restore_rng = require_bool("checkpoint.restore", "restore_rng", restore_rng)
    kinds = checkpoint.get(_KINDS_KEY, {})
    for key, target in targets.items():
        if key not in checkpoint:
            raise CheckpointError(
                f"gradsync.checkpoint.restore: the checkpoint has no '{key}' (it has "
                f"{sorted(kinds) or 'nothing: it is empty'}): restore the names it was saved with "
                f"(checkpoint.save(path, {key}=...))."
            )
        _load_into(key, target, checkpoint[key])
    if restore_rng:
        rngs = checkpoint.get(_RNG_KEY)
        if not rngs:
            raise CheckpointError(
                "gradsync.checkpoint.restore: the checkpoint holds no random generator states: it was not written "
                "by gradsync.checkpoint.save. Pass restore_rng=False to restore only the states."
            )
        rank = dist.get_rank() if dist.is_initialized() else 0
        if len(rngs) == (dist.get_world_size() if dist.is_initialized() else 1):
            set_rng_state(rngs[rank])
        else:  # another world size: per-rank streams cannot carry over; keep rank 0's for determinism
            set_rng_state(rngs[0])
    return {k: v for k, v in checkpoint.items() if kinds.get(k) == "value"}
