"""``static_graph=True``: what the first backward learns, and what it allows from then on (torch's contract: the
same parameters are used, in the same order, in every iteration).

The first synced backward launches nothing: it notes which parameters' hooks fire, in order, and reduces every
bucket at its end (torch's delayed all-reduce). The parameters that did not fire are unused from then on, without
a graph walk per forward. After the rebuild, the hooks of parameters that always fire just before another of
their bucket are quieted, the last one standing for them (:class:`gradsync.reducer.backward.GradientHooks`).
"""

from __future__ import annotations

from collections.abc import Sequence

from gradsync.errors import GradientError
from gradsync.reducer import messages


class StaticGraph:
    """The state ``static_graph=True`` keeps across iterations."""

    def __init__(self, n_params: int) -> None:
        self.n_params = n_params
        self.unused: list[int] | None = None  # learned in the first backward; None until then
        self._fired: list[int] = []

    @property
    def learning(self) -> bool:
        """Whether the first backward is still to be learned from (its outputs then pass through the sink)."""
        return self.unused is None

    def start_learning(self) -> None:
        """The first backward starts: nothing has fired yet."""
        self._fired = []

    def fired(self, index: int) -> None:
        """Parameter ``index``'s hook fired in the first backward."""
        self._fired.append(index)

    def learned(self) -> list[int]:
        """The first backward ended: what fired is used, the rest unused from now on. Returns every parameter, the
        fired ones first in their order, for the step to mark ready."""
        fired, seen = self._fired, set(self._fired)
        self.unused = [i for i in range(self.n_params) if i not in seen]
        self._fired = []
        return fired + self.unused

    def may_silence_hooks(self, local_order: Sequence[int], check_desync: bool) -> bool:
        """Only a static graph runs the same hooks in the same order every time, and only this rank's own observed
        order says which is last. With every parameter used; the desync check keeps every hook, so a rank whose
        graph changed is still caught."""
        return bool(local_order) and not self.unused and not check_desync

    def ready_twice(self, index: int, names: Sequence[str]) -> GradientError:
        """A gradient arrived twice in one backward: with an unused parameter firing, the graph changed."""
        if self.unused and index in self.unused:
            return GradientError(messages.graph_changed(names[index]))
        return GradientError(messages.ready_twice(names[index]))
