"""The job as a whole, as its launchers and workers read it in the store: whether a round was formed, whether the
members finished, and a worker's exit reported by its launcher; and the two variables through which
``gradsync run --elastic`` tells each worker where the store is and which worker it is."""

from __future__ import annotations

import json

import torch.distributed as dist

from gradsync.elastic import keys
from gradsync.elastic.verdicts import mark_exited

MAX_WORLD_VARIABLE = "GRADSYNC_MAX_WORLD_SIZE"  # --nnodes' maximum x --nproc-per-node, set by `gradsync run --elastic`
WORKER_VARIABLE = "GRADSYNC_ELASTIC_WORKER"  # this process's id, so that its launcher can report its exit


def report_exit(store: dist.Store, worker: str) -> None:
    """Called by a launcher when its worker ``worker`` (its WORKER_VARIABLE) exited: the members stop waiting for it."""
    key = keys.worker(worker)
    if store.check([key]):
        mark_exited(store, int(store.get(key)))


def job_running(store: dist.Store) -> bool:
    """Whether a round was formed: a worker arriving now joins a running job."""
    return store.check([keys.CURRENT_ROUND])


def job_done(store: dist.Store) -> bool:
    """Whether the members finished training (a launcher then restarts no worker)."""
    return store.check([keys.DONE])


def state_lost(store: dist.Store) -> str | None:
    """Why no worker holds the job's state any more (written by :func:`find_state_lost`), or None."""
    return store.get(keys.STATE_LOST).decode() if store.check([keys.STATE_LOST]) else None


def find_state_lost(store: dist.Store) -> str | None:
    """Whether every member of the latest round exited (their launchers saw it: an exit is final, where a member
    declared lost may come back): then the job's state went with them, and this says why, once, for the job's
    every worker and launcher to stop on (:func:`state_lost`). None while one of them may still hold it."""
    latest = _latest_round(store)
    if latest is None:
        return None
    number, members = latest
    if not isinstance(members, list) or not members or not store.check([keys.exited(m) for m in members]):
        return None
    why = (
        f"every member of round {number} (workers {', '.join(map(str, members))}) exited, and the job's training "
        "state went with them: no worker holds it, so none can be admitted and none can go on without reusing "
        "samples. Restart the job from its last checkpoint"
    )
    return store.compare_set(keys.STATE_LOST, "", why).decode()


def state_holders(store: dist.Store) -> tuple[int, list[int]] | None:
    """The latest round formed and its members, who hold the job's state; None before the first."""
    latest = _latest_round(store)
    if latest is None or not isinstance(latest[1], list) or not latest[1]:
        return None
    return latest[0], latest[1]


def everyone_finished(store: dist.Store) -> bool:
    """Whether every member of the latest round reported its training finished (the store's host may close)."""
    latest = _latest_round(store)
    return latest is not None and int(store.add(keys.FINISHED, 0)) >= len(latest[1])


def _latest_round(store: dist.Store) -> tuple[int, list[int] | dict] | None:
    """The latest round formed (``current_round``) and its member list, or None before the first."""
    if not store.check([keys.CURRENT_ROUND]):
        return None
    number = int(store.get(keys.CURRENT_ROUND))
    return number, json.loads(store.get(keys.members(number)))
