"""The one way gradsync waits for something it can only ask about: with a deadline, and a pause that grows.

A store has no "tell me when" for most questions (which members registered, whether a key exists among several),
so the elastic membership, the collectives' arrival check and the launcher poll. Each wait goes through
:func:`wait_until`, so each has a deadline its caller names in its error, and none spins a core.

Example::

    if not wait_until(lambda: store.check(["ready"]), seconds=30):
        raise GradsyncError("no member wrote 'ready' within 30s: ...")
"""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(condition: Callable[[], bool], seconds: float, pause: float = 0.01, max_pause: float = 0.1) -> bool:
    """Call ``condition()`` until it is true (then True) or ``seconds`` have passed (then False, after a last call).
    Between calls sleep ``pause``, doubling up to ``max_pause``: a wait that ends at once costs one call, and one
    that lasts costs ten calls a second at most. ``condition`` may raise to end the wait with that error."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() >= deadline:
            return condition()
        time.sleep(pause)
        pause = min(pause * 2, max_pause)
    return True
