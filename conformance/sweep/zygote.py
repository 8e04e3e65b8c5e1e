"""A process that has imported torch, gradsync and every case once, and forks a fresh child per case.

A fresh interpreter per case costs seconds (importing torch, then spawn's forkserver importing it again) times
two hundred cases. The zygote pays that once: it imports everything, starts the forkserver that
:func:`gradsync.testing.spawn` uses, and for each case forks a child that runs it with its own environment,
globals and process group, its output in a log file. Rank processes come from the shared forkserver.

Protocol (lines on stdin / stdout): the parent writes ``NAME<TAB>RESULT.json<TAB>LOG``; the zygote answers
``started CHILD_PID HELPER_PIDS...`` (the forkserver and resource tracker, which a hang must not kill) and, when
the child has ended, ``exit CHILD_PID WAIT_STATUS``.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
import traceback
from multiprocessing import forkserver, resource_tracker

# What gradsync.testing.spawn preloads, plus torch._dynamo (any optimizer step imports it: 2 s per rank) and the
# cases (their rank functions). All single-threaded imports, so forking after them is safe.
PRELOAD = ["torch", "torch.distributed", "gradsync", "torch._dynamo", "conformance.sweep.cases"]


def _helpers() -> list[int]:
    forkserver.ensure_running()  # (re)starts the forkserver if a case killed it
    pids = [forkserver._forkserver._forkserver_pid, resource_tracker._resource_tracker._pid]
    return [p for p in pids if p]


def _reuse_forkserver() -> None:
    """In a case child: the forkserver belongs to the zygote (os.waitpid on it would fail here); it is alive,
    since the zygote checked just before forking, so only the resource tracker needs its usual check."""
    resource_tracker.ensure_running()


def use_scratch(folder: str) -> None:
    """Temporary files of this case (and of what it starts) go under ``folder``, which the parent deletes."""
    work = os.path.join(folder, "work")
    os.makedirs(work, exist_ok=True)
    tempfile.tempdir = work
    os.environ["TMPDIR"] = work


def _run_child(name: str, out: str, log: str) -> None:
    code = 70
    try:
        os.setsid()
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        forkserver._forkserver.ensure_running = _reuse_forkserver  # type: ignore[method-assign]
        use_scratch(os.path.dirname(out))
        from conformance.sweep.cases import by_name
        from conformance.sweep.core import classify

        c = by_name()[name]
        start = time.monotonic()
        result = classify(c, c.run)
        result["seconds"] = round(time.monotonic() - start, 2)
        with open(out, "w") as fh:
            json.dump(result, fh)
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # no interpreter teardown: the result is written; leftovers are not this case's subject


def main() -> None:
    import torch  # noqa: F401
    import torch._dynamo  # noqa: F401
    import torch.distributed  # noqa: F401

    import gradsync  # noqa: F401
    from conformance.sweep.cases import by_name

    by_name()
    mp.get_context("forkserver").set_forkserver_preload(PRELOAD)
    print("ready", *_helpers(), flush=True)
    for line in sys.stdin:
        name, out, log = line.rstrip("\n").split("\t")
        helpers = _helpers()
        pid = os.fork()
        if pid == 0:
            _run_child(name, out, log)
        print("started", pid, *helpers, flush=True)
        _, status = os.waitpid(pid, 0)
        print("exit", pid, status, flush=True)


if __name__ == "__main__":
    main()
