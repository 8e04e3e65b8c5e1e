"""Joining the elastic job: the first round, or admission into a running one (:func:`init`)."""

from __future__ import annotations

import contextlib
import os

from gradsync import torch_private
from gradsync.elastic.errors import JobFinished, MembershipChanged
from gradsync.elastic.keys import REJOIN_VARIABLE
from gradsync.elastic.membership import Membership
from gradsync.elastic.recovery import MAX_FUTILE
from gradsync.elastic.timeouts import Timeouts
from gradsync.errors import GradsyncError
from gradsync.log import log


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
    with job.coordinating():  # waiting to be admitted, however long, is not a stalled step
        return _join(job)


def _join(job: Membership) -> Membership:
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
    for _ in range(MAX_FUTILE):
        try:
            job.form_group(round_)
            return job
        except MembershipChanged as exc:  # a member was lost while the group formed: the next round, without it
            log.warning("gradsync elastic: %s; trying the next round", exc)
            round_ = job.next_round()
    raise GradsyncError(f"could not form a process group in {MAX_FUTILE} rounds")


def _import_before_joining() -> None:
    """torch's optimizers import torch._dynamo when the first one is built, a slow import (docs/elastic.md). A
    joiner builds its optimizer after it was admitted, between its DistributedDataParallel and the state sync, and
    every member waits at that step boundary meanwhile: pay the import before asking to join."""
    with contextlib.suppress(ImportError):
        torch_private.import_dynamo()
