"""Chrome-trace / Perfetto JSON: one process per rank, a compute track (forward, backward, waiting, optimizer)
and a communication track (one slice per bucket all-reduce). Opens in chrome://tracing and ui.perfetto.dev; the
raw step records ride along under ``otherData`` so ``gradsync report`` can analyse the same file."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from gradsync.errors import ConfigError
from gradsync.observe.arguments import require_per_rank
from gradsync.observe.recorder import BucketRecord, StepRecord


def _slice(name: str, start: float, end: float, pid: int, tid: int, origin: float, **args: Any) -> dict[str, Any]:
    return {
        "name": name,
        "ph": "X",
        "ts": (start - origin) * 1e6,
        "dur": max(0.0, end - start) * 1e6,
        "pid": pid,
        "tid": tid,
        "args": args,
    }


def chrome_trace(per_rank: Mapping[int, Sequence[StepRecord]]) -> dict[str, Any]:
    """Every rank's steps as a Chrome trace (a dict): a row per rank for compute and one for communication.

    Example::

        trace = chrome_trace(monitor.gather())   # on every rank (gather is a collective)
        print(len(trace["traceEvents"]), "events")
    """
    require_per_rank("chrome_trace", per_rank)
    starts = [s.forward_start for steps in per_rank.values() for s in steps if s.forward_start]
    origin = min(starts, default=0.0)
    events: list[dict[str, Any]] = []
    for rank, steps in sorted(per_rank.items()):
        events.append({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}})
        events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": "compute"}})
        events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": 1, "args": {"name": "communication"}})
        for i, s in enumerate(steps):
            phases = [
                ("forward", s.forward_start, s.forward_end),
                ("backward", s.forward_end, s.backward_end),
                ("wait for all-reduce", s.backward_end, s.comm_end),
                ("optimizer", s.optimizer_start, s.optimizer_end),
            ]
            for name, start, end in phases:
                if start and end:
                    events.append(_slice(name, start, end, rank, 0, origin, step=i))
            for b in s.buckets:
                if b.launch and b.done:
                    events.append(
                        _slice(
                            f"all-reduce bucket {b.index}",
                            b.launch,
                            b.done,
                            rank,
                            1,
                            origin,
                            step=i,
                            bytes=b.nbytes,
                            params=b.nparams,
                            ready_us=(b.ready - origin) * 1e6,
                        )
                    )
    raw = {str(r): [dataclasses.asdict(s) for s in steps] for r, steps in per_rank.items()}
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"gradsync": {"ranks": raw}}}


def write_chrome_trace(per_rank: Mapping[int, Sequence[StepRecord]], path: str | os.PathLike) -> None:
    """:func:`chrome_trace` written to ``path`` as JSON: open it in ui.perfetto.dev or ``gradsync report``.

    Example::

        write_chrome_trace(monitor.gather(), "trace.json")   # what monitor.export_chrome_trace does
    """
    trace = chrome_trace(require_per_rank("write_chrome_trace", per_rank))
    if os.path.isdir(path):
        raise ConfigError(f"write_chrome_trace: path {str(path)!r} is a directory: give a file's path, e.g. trace.json")
    try:
        with open(path, "w") as fh:
            json.dump(trace, fh)
    except OSError as exc:
        raise ConfigError(
            f"write_chrome_trace: cannot write path {str(path)!r} ({exc.strerror or exc}): give a file's path in a "
            "directory this user can write"
        ) from None


def read_steps(path: str | os.PathLike) -> dict[int, list[StepRecord]]:
    """The step records of every rank stored in a trace written by :func:`write_chrome_trace`.

    Example::

        steps = read_steps("trace.json")    # {rank: [StepRecord, ...]}, as the job recorded them
        print(median_breakdown(steps[0]))
    """
    try:
        with open(path) as fh:
            data = json.load(fh)
    except OSError as exc:
        raise ConfigError(
            f"read_steps: cannot read the trace path '{path}' ({exc.strerror or exc}): give the path of a file "
            "written by Monitor.export_chrome_trace or write_chrome_trace"
        ) from None
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"'{path}' is not JSON ({exc.msg} at line {exc.lineno}); is it a trace from Monitor?"
        ) from None
    try:
        raw = data["otherData"]["gradsync"]["ranks"]
        return {
            int(rank): [StepRecord(**{**s, "buckets": [BucketRecord(**b) for b in s["buckets"]]}) for s in steps]
            for rank, steps in raw.items()
        }
    except (KeyError, TypeError, ValueError):
        raise ConfigError(
            f"'{path}' is not a gradsync trace (no readable otherData.gradsync); write it with "
            "Monitor.export_chrome_trace"
        ) from None
