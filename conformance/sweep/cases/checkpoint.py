"""gradsync.checkpoint: missing, empty, truncated and foreign files; a full disk; saves killed mid-write; save called
on one rank only; restore misuse."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

import gradsync
from conformance.sweep.core import ROOT, Skip, case, clean_env, group1, ranks
from conformance.sweep.util import batch, loss_of, seeded
from lab.zoo.toys import Shallow

CAT = "checkpoint"


def _tmp() -> Path:
    return Path(tempfile.mkdtemp(prefix="sweep-ckpt-"))


def _good(path: Path) -> Path:
    from gradsync import checkpoint

    torch.manual_seed(0)
    checkpoint.save(path, model=Shallow(), step=3)
    return path


def _load(path: Path):
    from gradsync import checkpoint

    return sorted(checkpoint.load(path))


@case("ckpt_load_missing", CAT, "checkpoint.load of a path that does not exist", ["nothere.pt"])
def _():
    return _load(_tmp() / "nothere.pt")


@case("ckpt_load_empty", CAT, "checkpoint.load of a 0-byte file", ["empty.pt", ("empty", "0 bytes")])
def _():
    path = _tmp() / "empty.pt"
    path.write_bytes(b"")
    return _load(path)


@case("ckpt_load_truncated", CAT, "checkpoint.load of a checkpoint cut to half its size", ["cut.pt", "truncated"])
def _():
    path = _good(_tmp() / "cut.pt")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return _load(path)


@case("ckpt_load_random_bytes", CAT, "checkpoint.load of a file of random bytes", ["noise.pt", "not a checkpoint"])
def _():
    path = _tmp() / "noise.pt"
    path.write_bytes(os.urandom(4096))
    return _load(path)


@case("ckpt_load_text_file", CAT, "checkpoint.load of a YAML config by mistake", ["config.yaml", "not a checkpoint"])
def _():
    path = _tmp() / "config.yaml"
    path.write_text("lr: 0.1\nepochs: 3\n")
    return _load(path)


@case(
    "ckpt_load_plain_torch_file",
    CAT,
    "checkpoint.load of a torch.save'd state dict",
    ["weights.pt", "gradsync.checkpoint.save"],
)
def _():
    path = _tmp() / "weights.pt"
    torch.save(Shallow().state_dict(), path)
    return _load(path)


@case("ckpt_load_directory", CAT, "checkpoint.load of a directory", ["ckpts", "directory"])
def _():
    path = _tmp() / "ckpts"
    path.mkdir()
    return _load(path)


@case(
    "ckpt_load_map_location_garbage",
    CAT,
    "checkpoint.load(path, map_location='gpu0') of a good checkpoint",
    ["map_location"],
    forbid=["truncated", "damaged"],
)
def _():
    from gradsync import checkpoint

    path = _good(_tmp() / "ok.pt")
    return sorted(checkpoint.load(path, map_location="gpu0"))


def _mount_tiny(dir_: Path, options: str = "size=64k") -> None:
    if os.geteuid() != 0:
        raise Skip(f"needs root to mount a tmpfs ({options})")
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(dir_)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise Skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")


def _disk_full():
    from gradsync import checkpoint

    dir_ = _tmp() / "tiny"
    dir_.mkdir()
    _mount_tiny(dir_)
    try:
        path = dir_ / "ckpt.pt"
        checkpoint.save(path, step=1)  # a small checkpoint that fits
        error = None
        try:
            checkpoint.save(path, model=nn.Linear(256, 256), step=2)  # 257 KiB: does not fit
        except Exception as exc:
            error = exc
        left = sorted(p.name for p in dir_.iterdir())
        previous = checkpoint.load(path).get("step")
        return error, left, previous
    finally:
        subprocess.run(["umount", str(dir_)], capture_output=True)


@case("ckpt_save_disk_full", CAT, "checkpoint.save onto a full disk (64 KiB tmpfs)", ["ckpt.pt", "no space"])
def _():
    error, _left, _previous = _disk_full()
    if error is not None:
        raise error
    return "saved on a full disk?"


@case(
    "ckpt_disk_full_leaves_previous",
    CAT,
    "after a save failed for lack of space: the previous checkpoint loads, no temporary file is left",
    check=lambda v: None if v == (["ckpt.pt"], 1) else f"directory holds {v[0]}, previous step reads {v[1]}",
)
def _():
    _error, left, previous = _disk_full()
    return left, previous


SAVE_FOREVER = """
import sys, torch
from gradsync.checkpoint import atomic_torch_save
i = 0
while True:
    atomic_torch_save({"i": i, "w": torch.full((5_000_000,), float(i))}, sys.argv[1])
    print(f"saved {i}", flush=True)
    i += 1
"""


def _killed_save(dir_: Path, path: Path) -> list[str]:
    """Start a process saving 20 MB checkpoints in a loop; SIGKILL it mid-write; return what it left."""
    proc = subprocess.Popen(
        [sys.executable, "-c", SAVE_FOREVER, str(path)], stdout=subprocess.PIPE, text=True, env=clean_env(), cwd=ROOT
    )
    assert proc.stdout is not None
    proc.stdout.readline()  # one complete save
    time.sleep(0.15)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    return sorted(p.name for p in dir_.iterdir())


@case(
    "ckpt_killed_save_tmp_cleaned",
    CAT,
    "SIGKILL a process mid-save (leaves .ckpt.pt.tmp-PID), then checkpoint.save again: no .tmp- file left",
    check=lambda v: None if v[1] == ["ckpt.pt"] else f"after the next save the directory holds {v[1]} (was {v[0]})",
    timeout=60,
)
def _():
    from gradsync import checkpoint

    dir_ = _tmp()
    path = dir_ / "ckpt.pt"
    for _ in range(5):
        left = _killed_save(dir_, path)
        if any(".tmp-" in name for name in left):
            break
    else:
        raise Skip(f"could not kill a save mid-write in 5 tries (left {left})")
    checkpoint.save(path, step=7)
    return left, sorted(p.name for p in dir_.iterdir())


@case(
    "ckpt_killed_save_previous_intact",
    CAT,
    "SIGKILL a process mid-save: the previous checkpoint still loads",
    check=lambda v: None if v == "loads" else v,
    timeout=60,
)
def _():
    dir_ = _tmp()
    path = dir_ / "ckpt.pt"
    _killed_save(dir_, path)
    try:
        torch.load(path, weights_only=False)
    except Exception as exc:
        return f"the previous checkpoint no longer loads: {exc}"
    return "loads"


@case("ckpt_save_unpicklable", CAT, "checkpoint.save(path, my_callback=lambda: 0)", ["my_callback"])
def _():
    from gradsync import checkpoint

    checkpoint.save(_tmp() / "ckpt.pt", my_callback=lambda: 0)
    return "saved a lambda"


@case("ckpt_save_path_is_directory", CAT, "checkpoint.save to a path that is a directory", ["ckpts", "directory"])
def _():
    from gradsync import checkpoint

    path = _tmp() / "ckpts"
    path.mkdir()
    checkpoint.save(path, step=1)
    return "saved over a directory"


@case(
    "ckpt_save_unwritable",
    CAT,
    "checkpoint.save('/proc/ckpt.pt') (a directory nobody can create files in)",
    ["/proc/ckpt.pt"],
    forbid=["no space"],
)
def _():
    from gradsync import checkpoint

    checkpoint.save("/proc/ckpt.pt", step=1)
    return "saved into /proc"


@case(
    "ckpt_save_read_only_fs",
    CAT,
    "checkpoint.save onto a read-only file system (16 MiB tmpfs mounted ro)",
    ["ckpt.pt", "read-only"],
    forbid=["no space"],
)
def _():
    from gradsync import checkpoint

    dir_ = _tmp() / "ro"
    dir_.mkdir()
    _mount_tiny(dir_, "ro,size=16m")
    try:
        checkpoint.save(dir_ / "ckpt.pt", step=1)
    finally:
        subprocess.run(["umount", str(dir_)], capture_output=True)
    return "saved on a read-only file system"


@case(
    "ckpt_save_new_directory",
    CAT,
    "checkpoint.save into a directory that does not exist yet: created",
    check=lambda v: None if v == 5 else f"read back {v!r}",
)
def _():
    from gradsync import checkpoint

    path = _tmp() / "a" / "b" / "ckpt.pt"
    checkpoint.save(path, step=5)
    return checkpoint.restore(checkpoint.load(path))["step"]


@case("ckpt_restore_missing_key", CAT, "restore(ckpt, optimizer=opt) from a checkpoint without one", ["optimizer"])
def _():
    from gradsync import checkpoint

    path = _good(_tmp() / "ok.pt")
    model = Shallow()
    return checkpoint.restore(checkpoint.load(path), model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1))


@case(
    "ckpt_restore_path_not_loaded",
    CAT,
    "restore('ckpt.pt', model=m): the path instead of checkpoint.load's result",
    ["checkpoint.load"],
)
def _():
    from gradsync import checkpoint

    path = _good(_tmp() / "ok.pt")
    return checkpoint.restore(str(path), model=Shallow())


@case(
    "ckpt_restore_wrong_model",
    CAT,
    "restore into a model of another shape",
    ["fc1.weight", "size mismatch"],
)
def _():
    from gradsync import checkpoint

    path = _good(_tmp() / "ok.pt")
    return checkpoint.restore(checkpoint.load(path), model=Shallow(hidden=16))


def _save_on_rank0_only(rank: int, world: int, path: str) -> str:
    from gradsync import checkpoint as ckpt

    ckpt.ARRIVAL_SECONDS = 3.0  # the real wait is 60 s
    ddp = gradsync.DistributedDataParallel(seeded(Shallow)[0])
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(3):
        opt.zero_grad()
        loss_of(ddp(batch(step, rank))).backward()
        opt.step()
        if rank == 0 and step == 0:
            ckpt.save(path, model=ddp, optimizer=opt, step=step)
    return "trained on"


@case(
    "ckpt_save_on_rank0_only",
    CAT,
    "`if rank == 0: checkpoint.save(...)` inside the training loop (ARRIVAL_SECONDS patched to 3)",
    ["checkpoint.save", "every rank"],
    timeout=40,
)
def _():
    return ranks(_save_on_rank0_only, str(_tmp() / "ckpt.pt"), must_fail=(0, 1))


def _sharded_unconsolidated(rank: int, world: int, path: str) -> str:
    from gradsync import checkpoint

    ddp = gradsync.DistributedDataParallel(seeded(Shallow)[0])
    opt = gradsync.ShardedOptimizer(ddp.parameters(), torch.optim.Adam, lr=0.01)
    loss_of(ddp(batch(0, rank))).backward()
    opt.step()
    checkpoint.save(path, model=ddp, optimizer=opt)
    return "saved"


@case(
    "ckpt_save_sharded_unconsolidated",
    CAT,
    "checkpoint.save(optimizer=ShardedOptimizer) without consolidate_state_dict first",
    ["consolidate_state_dict"],
)
def _():
    return ranks(_sharded_unconsolidated, str(_tmp() / "ckpt.pt"), must_fail=(0, 1))


def _save_load_world1():
    from gradsync import checkpoint

    group1()
    ddp = gradsync.DistributedDataParallel(seeded(Shallow)[0])
    path = _tmp() / "ckpt.pt"
    checkpoint.save(path, model=ddp, step=1)
    other = gradsync.DistributedDataParallel(Shallow())
    checkpoint.restore(checkpoint.load(path), model=other)
    return max((a - b).abs().max().item() for a, b in zip(ddp.parameters(), other.parameters()))


@case(
    "ckpt_roundtrip_group_of_one",
    CAT,
    "save and restore a DDP model in a group of one (control)",
    check=lambda v: None if v == 0 else f"restored weights differ by {v}",
)
def _():
    return _save_load_world1()
