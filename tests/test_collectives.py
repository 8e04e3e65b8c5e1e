"""Every collective gradsync issues goes through the one Communicator: counted, named on failure, and under
GRADSYNC_DEBUG fingerprinted, so a joined rank's shadows and every other feature match by construction."""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.distributed as dist
from ddp_cases import BATCH, batch
from models import build
from torch import nn
from torch.distributed.algorithms.join import Join

import gradsync
from gradsync.observe import Monitor
from gradsync.runtime import checkpoint
from gradsync.testing import spawn

COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_object", "barrier", "all_to_all", "reduce")
ALLOWED = ("gradsync/collectives/communicator.py", "torch/distributed/algorithms/join.py")


def _watch_collectives(outside: list[str]) -> None:
    """Wrap torch.distributed's collectives: record any call with no allowed file on the Python stack."""
    for name in COLLECTIVES:
        original = getattr(dist, name)

        def watched(*args, _original=original, _name=name, **kwargs):
            frame = sys._getframe(1)
            while frame is not None and not frame.f_code.co_filename.endswith(ALLOWED):
                frame = frame.f_back
            if frame is None:
                outside.append(f"{_name} from {sys._getframe(1).f_code.co_filename}:{sys._getframe(1).f_lineno}")
            return _original(*args, **kwargs)

        setattr(dist, name, watched)


def _everything(rank: int, world_size: int, path: str) -> dict:
    os.environ["GRADSYNC_DEBUG"] = "1"
    outside: list[str] = []
    _watch_collectives(outside)
    from gradsync.reducer import autotune

    autotune.MIN_GAIN, autotune.CANDIDATE_CAPS_MB = -1e9, (0.0002,)  # always propose, so the trial runs too
    module = build("bn")
    ddp = gradsync.DistributedDataParallel(module, bucket_cap_mb="auto")
    opt = gradsync.ShardedOptimizer(module.parameters(), optimizer_class=torch.optim.SGD, lr=0.1)
    monitor = Monitor(ddp, opt)
    steps = 16 if rank == 0 else 12  # uneven: rank 1 joins early and shadows the rest
    sl = slice(rank * BATCH, (rank + 1) * BATCH)
    with Join([ddp, opt]):  # the sharded optimizer is Joinable too, as torch's ZeroRedundancyOptimizer
        for step in range(steps):
            x, y = batch(step, 0, world_size)
            opt.zero_grad()
            nn.functional.mse_loss(ddp(x[sl]), y[sl]).backward()
            opt.step()
    monitor.gather()
    gradsync.comm.average_parameters(module)
    checkpoint.save(path, model=ddp)
    seen = list(outside)
    dist.barrier()  # the watcher's self-check: a raw collective from here is reported
    assert len(outside) == len(seen) + 1 and "test_collectives.py" in outside[-1], outside
    return {"outside": seen, "sequence": ddp.communicator.sequence, "tuning": ddp.reducer.tuning.describe()}


@pytest.mark.timeout(120)
def test_every_collective_goes_through_the_communicator(tmp_path) -> None:
    results = spawn(_everything, args=(str(tmp_path / "ckpt.pt"),), timeout=100, pg_timeout=20)
    for r in results:
        assert r["outside"] == [], r["outside"]
        assert "paired steps" in r["tuning"]  # the trial ran, on the joined rank too
    assert results[0]["sequence"] == results[1]["sequence"]  # the joined rank issued exactly as many


def _object_collectives_device(rank: int, world_size: int) -> list[str]:
    """NCCL stages object collectives on torch.cuda.current_device(): gradsync enters its owner's device first.
    Recorded with a fake torch.cuda.device (this machine has no GPU; gloo carries the bytes)."""
    import contextlib as _contextlib

    from gradsync.collectives import Communicator, Op

    entered: list[str] = []

    @_contextlib.contextmanager
    def recording_device(device: torch.device):
        entered.append(str(device))
        yield

    torch.cuda.device = recording_device  # this rank's process only
    comm = Communicator(None, device=torch.device("cuda", rank))
    comm.all_gather_object(Op.HOOK_CHECK, rank)
    comm.broadcast_object(Op.PLAN_BROADCAST, rank)
    Communicator(None, device=torch.device("cpu")).all_gather_object(Op.HOOK_CHECK, rank)
    return entered


def test_object_collectives_run_on_the_owners_cuda_device() -> None:
    results = spawn(_object_collectives_device, timeout=60)
    assert results == [["cuda:0", "cuda:0"], ["cuda:1", "cuda:1"]]


def test_the_timeout_is_read_from_the_backend_of_the_owners_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CUDA model's collectives run on NCCL: its timeout bounds them, not the CPU side's (or gradsync's 600 s).
    A stand-in group answers per device, since this machine has no NCCL."""
    import datetime
    from types import SimpleNamespace

    from gradsync.collectives import Communicator

    seconds = {"cuda": 42.0, "cpu": 7.0}

    class Group:
        def _get_backend(self, device: torch.device) -> SimpleNamespace:
            timeout = datetime.timedelta(seconds=seconds[device.type])
            return SimpleNamespace(options=SimpleNamespace(_timeout=timeout))

    monkeypatch.setattr(Communicator, "group", property(lambda self: Group()))
    assert Communicator(None, device=torch.device("cuda", 0)).timeout_seconds() == 42.0
    assert Communicator(None, device=torch.device("cpu")).timeout_seconds() == 7.0
    assert Communicator(None).timeout_seconds() == 7.0
