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
    """A worker came too late: the others already finished the training. ``elastic.init`` exits a worker
    (re)started then with status 0; a member cut off mid-job that asks to join again gets None from ``elastic.run``
    (``State.begin()`` and ``guard()`` raise this). Nothing is left to do either way.

    Example::

        try:
            state.begin()                       # a worker cut off and back after the others finished
        except gradsync.elastic.JobFinished:
            raise SystemExit(0)
    """


class JobStateLost(GradsyncError):
    """Every member of the job's latest round exited, and the training state went with them: no worker can be
    admitted (there is nothing to receive) and none can go on without going back to an older state, which would
    use samples twice. Every worker and launcher of the job stops with this message; restart the job from its
    last checkpoint.

    Example::

        try:
            raise JobStateLost("every member of round 157 (workers 145, 147) exited")
        except gradsync.GradsyncError as error:     # not recoverable: elastic.run lets it through
            print(error)
    """
