"""Elastic training: survive a lost worker or host without restarting the job (``gradsync run --elastic``).

Survivors detect the failure (a failed collective, or a member whose heartbeat stopped), agree on the new members
through the job's store, form a new process group in-process, drop the half-done step, re-split the epoch's remaining
samples, and carry on. A restarted worker rejoins at a step boundary and receives the state from a survivor.

Example::

    job = gradsync.elastic.init(timeout=10)               # joins the job; the default process group is formed
    ddp = gradsync.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    loader = gradsync.elastic.ElasticLoader(dataset, batch_size=32)

    @gradsync.elastic.run
    def train(state):
        for epoch in range(state.epoch, 10):
            state.loader.set_epoch(epoch)
            for x, y in state.loader:
                state.optimizer.zero_grad()
                loss_fn(state.model(x), y).backward()
                state.step()                                 # in place of optimizer.step()
            state.epoch = epoch + 1

    train(gradsync.elastic.State(job, model=ddp, optimizer=opt, loader=loader, epoch=0))

The store lives in the launcher of the node serving the rendezvous; if that node is lost, the job cannot coordinate
and ends (restart it from a checkpoint, e.g. ``gradsync run --max-restarts``). See docs/elastic.md.

The folder: ``state.py`` (``State``, ``run``: commit, recover), ``loader.py`` (every sample once), ``membership.py``
(a worker's view of the job), ``rounds.py`` (a round's members agreed through the store), ``round_group.py`` (the
round's process group), ``liveness.py`` (heartbeats, launcher exit reports), ``admission.py`` (a joiner admitted at
an announced step), ``timeouts.py``, ``errors.py``, ``job_status.py`` (the job as its launchers read it),
``keys.py`` (the store's keys), ``job_store.py`` and ``etcd_store.py`` (which store, and etcd's).
"""

from __future__ import annotations

import contextlib
import os

from gradsync import torch_private
from gradsync.elastic.errors import JobFinished, JobStateLost, MembershipChanged
from gradsync.elastic.loader import ElasticLoader
from gradsync.elastic.membership import Membership
from gradsync.elastic.state import MAX_FUTILE_RECOVERIES, REJOIN_VARIABLE, Recovery, State, run
from gradsync.elastic.timeouts import Timeouts
from gradsync.errors import GradsyncError
from gradsync.log import log

__all__ = [
    "ElasticLoader",
    "JobFinished",
    "JobStateLost",
    "Membership",
    "MembershipChanged",
    "Recovery",
    "State",
    "Timeouts",
    "init",
    "run",
]


def init(
    timeout: float = 10.0, collective_timeout: float | None = None, admission_timeout: float = 600.0
) -> Membership:
    """Join the elastic job started by ``gradsync run --elastic``: form the first round with the other workers, or,
    for a worker (re)started into a running job, wait to be admitted at the next step boundary. Afterwards the
    default process group is this round's.

    Three timeouts, in seconds, each with its own meaning (and a ``GRADSYNC_ELASTIC_*_TIMEOUT`` override):
    ``timeout``, a member whose heartbeat has not moved for this long counts as lost (HEARTBEAT); the round's
    process group's timeout, after which a collective with a stopped member fails (COLLECTIVE; default:
    ``timeout``); how long a worker asking to join waits to be admitted (ADMISSION).

    If the job finished before this worker could join (a worker restarted, or a host's launcher started again,
    as the others finished), it logs so and exits the process with status 0: nothing is left to do, and the lines
    after ``init`` (a DistributedDataParallel, which needs the group this worker never got) must not run.

    Example::

        job = gradsync.elastic.init(timeout=10)   # on every worker that `gradsync run --elastic` started
        print(f"rank {dist.get_rank()} of {dist.get_world_size()}")   # the round's process group is the default one
        job.finished()                            # done (elastic.run and State.finish() call it for you)
    """
    job = Membership.connect(Timeouts.read(timeout, collective_timeout, admission_timeout))
    if os.environ.get(REJOIN_VARIABLE) == "1" or job.job_running():
        _import_before_joining()
        job.request_to_join()
        try:
            round_ = job.next_round()
        except JobFinished as done:
            job.finish_without_me(done)
            raise SystemExit(0) from None
    else:
        round_ = job.first_round(int(os.environ.get("WORLD_SIZE", "1")))
    for _ in range(MAX_FUTILE_RECOVERIES):
        try:
            job.form_group(round_)
            return job
        except MembershipChanged as exc:  # a member was lost while the group formed: the next round, without it
            log.warning("gradsync elastic: %s; trying the next round", exc)
            round_ = job.next_round()
    raise GradsyncError(f"could not form a process group in {MAX_FUTILE_RECOVERIES} rounds")


def _import_before_joining() -> None:
    """torch's optimizers import torch._dynamo when the first one is built, a slow import (docs/elastic.md). A
    joiner builds its optimizer after it was admitted, between its DistributedDataParallel and the state sync, and
    every member waits at that step boundary meanwhile: pay the import before asking to join."""
    with contextlib.suppress(ImportError):
        torch_private.import_dynamo()
