"""Every collective gradsync issues goes through the one Communicator: counted, named on failure, and under
GRADSYNC_DEBUG fingerprinted, so a joined rank's shadows and every other feature match by construction."""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist
from ddp_cases import BATCH, batch
from torch import nn
from torch.distributed.algorithms.join import Join

import gradsync
from gradsync import checkpoint
from gradsync.collectives.activity import CollectiveActivity
from gradsync.collectives.communicator import Communicator, Op
from gradsync.observe import Monitor
from gradsync.polling import wait_until
from gradsync.testing import spawn
from lab.zoo.toys import build

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


class _Work:
    """A stand-in for a NCCL work: completes (with or without an error) when the test says."""

    def __init__(self) -> None:
        self.completed, self.error = False, None

    def is_completed(self) -> bool:
        return self.completed

    def is_success(self) -> bool:
        return self.error is None

    def exception(self) -> object:
        return self.error


def test_the_nccl_watch_reports_a_failed_or_stuck_collective_once() -> None:
    from gradsync.collectives.nccl_watch import Watch

    now = [0.0]
    reports: list[tuple[str, str]] = []
    watch = Watch(timeout_seconds=100, report=lambda what, why: reports.append((what, why)), clock=lambda: now[0])
    fine, failing, stuck = _Work(), _Work(), _Work()
    for name, work in (("fine", fine), ("failing", failing), ("stuck", stuck)):
        watch.add(work, lambda name=name: name)
    watch.check()
    assert reports == [] and watch.in_flight() == 3
    fine.completed = True
    failing.completed, failing.error = True, RuntimeError("NCCL error: remote process exited")
    now[0] = 89.0  # before 0.9 of the timeout: a slow collective is not reported
    watch.check()
    assert reports == [("failing", "NCCL reported: NCCL error: remote process exited")] and watch.in_flight() == 1
    now[0] = 91.0
    watch.check()
    watch.check()  # once only
    assert len(reports) == 2 and reports[1][0] == "stuck"
    assert "still running after 91s of the process group's 100s timeout" in reports[1][1]
    stuck.completed = True
    watch.check()
    assert watch.in_flight() == 0


def _stuck_on_nccl(rank: int, world_size: int) -> str | None:
    import contextlib
    import io
    from types import SimpleNamespace

    from gradsync.collectives import Communicator, nccl_watch
    from gradsync.collectives.communicator import Op
    from gradsync.collectives.peer_errors import peer_errors

    if rank == 0:
        nccl_watch.WARN_FRACTION = 0.0  # report at once: the test cannot wait for a real timeout
        comm = Communicator(None)
        comm._on_nccl = lambda: True  # type: ignore[method-assign]  # this machine has no NCCL
        comm.timeout_seconds = lambda: 30.0  # type: ignore[method-assign]
        cuda_tensor = SimpleNamespace(is_cuda=True)
        comm._watched(_Work(), Op.BUCKET_ALLREDUCE, 3, None, cuda_tensor)  # type: ignore[arg-type]
        said = io.StringIO()
        with contextlib.redirect_stderr(said):
            assert comm._watch is not None
            comm._watch.check()
        dist.barrier()
        return said.getvalue()
    dist.barrier()
    return (peer_errors() or {}).get(0)


def test_a_stuck_nccl_collective_is_named_on_stderr_and_to_the_peers() -> None:
    said, posted = spawn(_stuck_on_nccl, timeout=60)
    assert said.startswith("gradsync: all-reduce of bucket 3 failed on rank 0: still running after")
    assert "NCCL's watchdog will end this process" in said and "GRADSYNC_DEBUG=1" in said
    assert "rank(s) [1] reported nothing" in said  # the peer that never issued it
    assert posted is not None and posted.startswith("all-reduce of bucket 3 failed on rank 0")


def test_the_communicator_marks_the_time_this_rank_spends_inside_collectives() -> None:
    """An elastic worker's heartbeat thread tells a step stalled outside every collective from one waiting inside a
    collective that has yet to fail (gradsync/collectives/activity.py): the communicator marks its waits."""
    activity = CollectiveActivity()
    comm = Communicator(activity=activity)
    future: torch.futures.Future = torch.futures.Future()
    waiting = threading.Thread(target=comm.wait, args=(future, Op.BUCKET_ALLREDUCE, 0))
    waiting.start()
    assert wait_until(lambda: activity.outside_for() is None, 5)  # inside, for as long as the wait lasts
    time.sleep(0.05)
    assert activity.outside_for() is None
    future.set_result(None)
    waiting.join(5)
    outside = activity.outside_for()
    assert outside is not None and outside < 1.0  # since the wait ended, not since it was made
