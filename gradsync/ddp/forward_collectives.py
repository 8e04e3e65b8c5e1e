"""A forward's collectives, in the order every rank issues them: the one sequence a training rank's forward and a
joined rank's shadow of it both run, so the two cannot drift apart (ARCHITECTURE.md, invariant 1)."""

from __future__ import annotations

from gradsync.collectives.communicator import Communicator
from gradsync.ddp.buffers import BufferSync
from gradsync.reducer.reducer import Reducer


class ForwardCollectives:
    """The collectives before a forward's call of the module: the step's start, the buffers' broadcast, and what the
    reducer issues before a synced forward (the rebuild, the tuner's trial)."""

    def __init__(self, comm: Communicator, buffer_sync: BufferSync, reducer: Reducer) -> None:
        self._comm = comm
        self._buffer_sync = buffer_sync
        self._reducer = reducer

    def broadcast_due(self, enabled: bool, previous_forward_synced: bool) -> bool:
        """Whether this forward broadcasts the buffers (torch's rule: :meth:`BufferSync.due`)."""
        return self._buffer_sync.due(enabled, previous_forward_synced)

    def issue(self, synced: bool, broadcast: bool) -> None:
        """A forward's collectives, in order; a joined rank's shadow runs this same method."""
        if synced:
            self._comm.begin_step()
        # Buffers first: a rank that runs an extra no_sync forward (data-dependent accumulation) broadcasts at that
        # forward instead, and its sequence stays the same as the others' (broadcast, then the rebuild's
        # collectives) instead of pairing a broadcast with a rebuild collective, which makes gloo abort.
        if broadcast:
            self._buffer_sync.broadcast()
        if synced:
            # Before the forward, when memory is lowest and all ranks are at the same point (torch does the same).
            self._reducer.before_synced_forward()
