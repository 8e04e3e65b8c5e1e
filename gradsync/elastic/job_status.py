"""The job as a whole, as its launchers and workers read it in the store: whether a round was formed, whether the
members finished, and a worker's exit reported by its launcher; and the two variables through which
``gradsync run --elastic`` tells each worker where the store is and which worker it is."""

from __future__ import annotations

import json

import torch.distributed as dist

from gradsync.elastic import keys
from gradsync.elastic.liveness import mark_exited

STORE_VARIABLE = "GRADSYNC_ELASTIC_STORE"  # the job's store (host:port, or etcd://...), set by `gradsync run --elastic`
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


def everyone_finished(store: dist.Store) -> bool:
    """Whether every member of the latest round reported its training finished (the store's host may close)."""
    if not store.check([keys.CURRENT_ROUND]):
        return False
    members = json.loads(store.get(keys.members(int(store.get(keys.CURRENT_ROUND)))))
    return int(store.add(keys.FINISHED, 0)) >= len(members)
