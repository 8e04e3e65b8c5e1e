"""The elastic job's two exceptions (kinds of :class:`~gradsync.errors.GradsyncError`): the group must be formed
again, or the job finished without this worker."""

from __future__ import annotations

from gradsync.errors import GradsyncError


class MembershipChanged(GradsyncError):
    """A member died, stalled or a worker asked to join: the group must be formed again (handled by elastic.run).

    Example::

        try:
            raise MembershipChanged("rank 2 stopped")   # what a step raises when a member is lost
        except gradsync.GradsyncError as error:       # elastic.run and State.guard() catch it for you
            print(error)
    """


class JobFinished(GradsyncError):
    """A worker started (or restarted) too late: the others already finished the training. ``elastic.init``
    returns no job then, and ``elastic.run`` returns None: nothing is left to do.

    Example::

        job = gradsync.elastic.init(timeout=10)
        if job.finished_without_me:   # init caught JobFinished: the others are done, nothing is left to do
            raise SystemExit(0)
    """
