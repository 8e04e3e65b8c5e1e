"""How long a round's group may take to connect once its gate opened: a few times the slowest connect this process
measured, not the collective timeout.

The gate (:mod:`.formation`) opens once every member arrived, and a member lost before it calls the round off at
once. One lost in the milliseconds after, inside ``init_process_group``, leaves the others waiting for its address
until the group's timeout. Connecting grows with the members and the store's load (each member reads every other's
address), so no constant fits: the bound is ``MARGIN`` times the slowest connect measured here, at least
``FLOOR_S``, at most the collective timeout. It is the group's timeout while it connects, which bounds the wait for
each member's address in the store; gloo waits ``PEER_CONNECT_FACTOR`` times as long for a member that posted its
address to connect (its tcp ``Pair`` "uses a longer timeout when waiting for initial connect"), so the floor is
divided by that factor: a member lost after posting costs ``FLOOR_S x PEER_CONNECT_FACTOR``, 1 s. A process that
measured none yet starts from the slowest connect the members published (``keys.CONNECT_SLOWEST``): otherwise a
joiner would wait the whole timeout for a member lost as it joined, and hold the next round as long, as its leader
waits for every live member. One with nothing to start from (the job's first round), and one whose last connect
failed with no member seen gone or still meanwhile (a store too slow for the bound, rather than a member lost),
waits the whole collective timeout, so that a slow store costs one round, never a livelock. A connect that failed
while a member was seen gone keeps its bound, so that a second member lost in the next round costs the bound again,
not the whole timeout. docs/elastic.md ("Under chaos") measures each of these waits.
The group then takes the collective timeout for its collectives (``torch_private.set_group_timeout``); where torch
cannot set it, the connect keeps the collective timeout too.

Example::

    clock = ConnectTimeout(collective=5.0)
    clock.seconds()          # 5.0: nothing measured yet
    clock.connected(0.02)
    clock.seconds()          # 0.2: FLOOR_S, above 4 x 0.02 s
"""

from __future__ import annotations

PEER_CONNECT_FACTOR = 5  # gloo's wait for a peer's connect, in times the group's timeout (gloo/transport/tcp/pair.h)
FLOOR_S = 1.0 / PEER_CONNECT_FACTOR  # a member lost after posting costs 1 s and a round more: within the 1.5 s p99 goal
MARGIN = 4.0  # over the slowest connect measured: a store busier than then still connects


class ConnectTimeout:
    """The connect's bound for the next round's group, from the connects of this process (see the module)."""

    def __init__(self, collective: float) -> None:
        self._collective = collective
        self._slowest: float | None = None
        self._fresh = True

    def seconds(self) -> float:
        if self._slowest is None:
            return self._collective
        return min(self._collective, max(FLOOR_S, MARGIN * self._slowest))

    def fresh(self) -> bool:
        """Nothing connected or failed here yet: :meth:`start_from` applies."""
        return self._fresh

    def start_from(self, published: float) -> None:
        """The slowest connect the job's members published, for a process that measured none yet."""
        if self._fresh:
            self._slowest, self._fresh = published, False

    def connected(self, seconds: float) -> bool:
        """A connect took ``seconds``; whether it was the slowest measured (then worth publishing)."""
        slowest, self._fresh = seconds > (self._slowest or 0.0), False
        self._slowest = max(seconds, self._slowest or 0.0)
        return slowest

    def failed(self) -> None:
        """A connect failed: the next one waits the collective timeout (it may have been the store, not a member)."""
        self._slowest, self._fresh = None, False
