"""Run a function on N local gloo ranks, for tests and benchmarks: free port, bounded time, errors brought home.

Every rank is a fresh process (forked from a forkserver that has already imported torch, so starting costs tens of
milliseconds, not seconds). The rendezvous store lives in the calling process on a port the OS picks, so there is
no fixed port and no race for one. A hang is a failure: past ``timeout`` every rank is killed and
:class:`SpawnError` says which ranks had not finished.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class RankFailure:
    """How one rank ended badly: the exception's type name and message, or how the process died.

    Example::

        from gradsync.testing import SpawnError, spawn

        def work(rank, world_size):
            if rank == 1:
                raise ValueError("bad shard")

        if __name__ == "__main__":
            try:
                spawn(work, world_size=2)
            except SpawnError as error:
                failure = error.failures[1]   # a RankFailure
                assert failure.kind == "ValueError" and "bad shard" in failure.message
    """

    rank: int
    kind: str
    message: str
    traceback: str = ""


class SpawnError(RuntimeError):
    """One or more ranks failed or timed out; ``failures`` maps rank → :class:`RankFailure`.

    Example::

        from gradsync.testing import SpawnError, spawn

        def hang(rank, world_size):
            if rank == 0:
                import time
                time.sleep(60)

        if __name__ == "__main__":
            try:
                spawn(hang, world_size=2, timeout=5)
            except SpawnError as error:   # every rank was killed; error.failures says which had not finished
                assert 0 in error.failures and 1 not in error.failures
    """

    def __init__(self, failures: dict[int, RankFailure], results: dict[int, Any]) -> None:
        self.failures = failures
        self.results = results
        lines = [f"rank {f.rank}: {f.kind}: {f.message}\n{f.traceback}" for f in failures.values()]
        super().__init__(f"{len(failures)} rank(s) failed:\n" + "\n".join(lines))


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now, for a launcher, a store or a server a test starts (the OS picks it).

    >>> port = free_port()
    """
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


# What ranks use, imported once by the forkserver rather than by every rank: gradsync's packages (``import gradsync``
# alone imports none of them) and torch._dynamo, which a torch optimizer imports at its first step.
_PRELOADED = [
    "torch",
    "torch.distributed",
    "torch._dynamo",
    "gradsync.checkpoint",
    "gradsync.data",
    "gradsync.ddp",
    "gradsync.elastic.state",
    "gradsync.nn",
    "gradsync.optim",
]


def _context() -> mp.context.ForkServerContext:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOADED)
    return ctx


def _rank_main(
    fn: Callable, rank: int, world_size: int, port: int, pg_timeout: float, args: tuple, results: Any, backend: str
) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    try:
        store = dist.TCPStore(
            "127.0.0.1", port, world_size + 1, is_master=False, timeout=datetime.timedelta(seconds=pg_timeout)
        )
        if backend == "nccl":  # one GPU per rank, as NCCL requires
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=pg_timeout)
        )
        out = fn(rank, world_size, *args)
        # Plain pickle: torch's queue reducer would share tensor memory that dies with this process.
        results.put(("ok", rank, pickle.dumps(out)))
    except BaseException as exc:  # report everything, KeyboardInterrupt included
        results.put(("error", rank, RankFailure(rank, type(exc).__name__, str(exc), traceback.format_exc())))
    finally:
        # The queue writes from a thread of its own: flush it before the group's teardown, which can abort a rank
        # ("terminate called ... Resource deadlock avoided") halfway through writing its result, and the parent would
        # then block reading the rest of the message past every timeout.
        results.close()
        results.join_thread()
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def spawn(
    fn: Callable[..., Any],
    world_size: int = 2,
    args: tuple = (),
    timeout: float = 120.0,
    pg_timeout: float = 30.0,
    backend: str = "gloo",
) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` in ``world_size`` processes joined in a process group (gloo, or
    ``backend="nccl"`` with one GPU per rank).

    Returns each rank's return value (they must pickle), in rank order. Raises :class:`SpawnError` if any rank
    raised, died, or was still running after ``timeout`` seconds. ``fn`` must be importable (module level).

    Example::

        import torch
        import torch.distributed as dist
        from gradsync.testing import spawn

        def work(rank, world_size):  # at module level: every rank imports it
            t = torch.ones(1) * rank
            dist.all_reduce(t)
            return t.item()

        if __name__ == "__main__":
            assert spawn(work, world_size=2) == [1.0, 1.0]
    """
    ctx = _context()
    store = dist.TCPStore(
        "127.0.0.1",
        0,
        world_size + 1,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=pg_timeout),
    )
    results = ctx.Queue()
    procs = [
        ctx.Process(
            target=_rank_main, args=(fn, r, world_size, store.port, pg_timeout, args, results, backend), daemon=True
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    try:
        outputs, failures = _collect(procs, results, timeout)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
        del store
    if failures:
        raise SpawnError(dict(sorted(failures.items())), outputs)
    return [outputs[r] for r in range(len(procs))]


def _collect(procs: list, results: Any, timeout: float) -> tuple[dict[int, Any], dict[int, RankFailure]]:
    """Each rank's result or failure; a rank still running after ``timeout`` seconds is a hang."""
    outputs: dict[int, Any] = {}
    failures: dict[int, RankFailure] = {}
    deadline = time.monotonic() + timeout
    while len(outputs) + len(failures) < len(procs) and time.monotonic() < deadline:
        try:
            status, rank, payload = results.get(timeout=0.05)
        except queue.Empty:
            for r, p in enumerate(procs):  # a rank that died without a word (os._exit, a signal)
                if p.exitcode not in (None, 0) and r not in outputs and r not in failures:
                    time.sleep(0.2)  # its message may still be in the pipe
                    if results.empty():
                        failures[r] = RankFailure(r, "ProcessDied", f"exit code {p.exitcode}")
            continue
        if status == "ok":
            outputs[rank] = pickle.loads(payload)
        else:
            failures[rank] = payload
    for r in range(len(procs)):
        if r not in outputs and r not in failures:
            failures[r] = RankFailure(r, "Timeout", f"still running after {timeout:.0f}s (a hang)")
    return outputs, failures


def spawn_failures(fn: Callable[..., Any], **kwargs: Any) -> dict[int, RankFailure]:
    """Run :func:`spawn` where at least one rank is expected to fail; return the failures by rank.

    Example::

        from gradsync.testing import spawn_failures

        def work_that_raises(rank, world_size):
            if rank == 0:
                raise RuntimeError("rank 0 gives up")

        if __name__ == "__main__":
            failures = spawn_failures(work_that_raises, timeout=50, pg_timeout=10)
            assert failures[0].kind == "RuntimeError" and 1 not in failures
    """
    try:
        outputs = spawn(fn, **kwargs)
    except SpawnError as exc:
        return exc.failures
    raise AssertionError(f"expected a rank of {getattr(fn, '__name__', fn)} to fail; all returned: {outputs}")
