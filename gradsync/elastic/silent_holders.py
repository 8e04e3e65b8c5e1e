"""A joiner's word on a job whose every state holder went silent: no heartbeat, and no exit reported.

An exit its launcher reported is final, and stops the job at once (:func:`~.job_status.find_state_lost`). A host
lost whole leaves no launcher to report it: its workers only stop beating, as a host cut off does, which may come
back with the state (a round of one member, cut off, trains on alone and admits the joiners once its link is back).
So silence alone stops nothing. But a joiner waiting on holders that will not come back (a round of 1 whose host
was lost) would wait out its whole admission timeout in silence, the operator seeing nothing until then. So a
joiner says, once the latest round's members have all been silent past the heartbeat timeout and every
``SAY_EVERY_S`` after, who it waits for, for how long, until when, and what to do if none can come back; and its
admission error says it too.

Example::

    silent = SilentHolders(store, liveness, me=5)
    silent.look()            # from the joiner's wait, now and then: logs when every holder is silent
    silent.why()             # "" while one beats; else the holders and their silence, for an error
"""

from __future__ import annotations

import time

import torch.distributed as dist

from gradsync.elastic.job_status import state_holders
from gradsync.elastic.liveness import Liveness
from gradsync.log import log

SAY_EVERY_S = 60.0  # a joiner says it again this often while the holders stay silent


class SilentHolders:
    """What joiner ``me`` knows of the job's state holders, from its own heartbeat thread's reads (``liveness``)."""

    def __init__(self, store: dist.Store, liveness: Liveness, me: int) -> None:
        self._store = store
        self._liveness = liveness
        self._me = me
        self._said_at: float | None = None

    def why(self) -> str:
        """ "" while a member of the latest round beats (or none formed yet); else who is silent, and for how long."""
        holders = state_holders(self._store)
        if holders is None:
            return ""
        number, members = holders
        # Every member asked, not the first alive only: one watched from now counts alive for a timeout.
        if any([self._liveness.alive(m) for m in members]):
            return ""
        silent_s = min(self._liveness.still_for(m) for m in members)
        return (
            f"every member of round {number} (workers {', '.join(map(str, members))}), which hold the job's training "
            f"state, has been silent for {silent_s:.0f}s at least (no heartbeat; not every one's exit was reported): "
            "their hosts may be lost, or cut off"
        )

    def look(self, admission_s: float) -> None:
        """Log :meth:`why`, if any, unless said within ``SAY_EVERY_S``; ``admission_s``: this joiner's timeout."""
        why = self.why()
        now = time.monotonic()
        if not why or (self._said_at is not None and now - self._said_at < SAY_EVERY_S):
            return
        self._said_at = now
        log.warning(
            "gradsync elastic: worker %d waits to join, but %s. It waits for one to come back until its admission "
            "timeout (%.0fs, GRADSYNC_ELASTIC_ADMISSION_TIMEOUT); if none can, restart the job from its last "
            "checkpoint",
            self._me,
            why,
            admission_s,
        )
