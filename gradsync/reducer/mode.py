"""Which parameters take part in a backward: decided once, at construction, from torch's two flags."""

from __future__ import annotations

import enum


class GraphMode(enum.Enum):
    """How the reducer learns which parameters get a gradient (torch's ``find_unused_parameters`` and
    ``static_graph``, which torch's Reducer tests in many places; here they are one value).

    >>> GraphMode.from_flags(find_unused_parameters=True, static_graph=False)
    <GraphMode.FIND_UNUSED: 'find_unused_parameters=True'>
    """

    ALL_USED = "every parameter gets a gradient in every synced backward"
    FIND_UNUSED = "find_unused_parameters=True"  # walk the graph at each forward; all-reduce a usage map each step
    STATIC = "static_graph=True"  # the first iteration's graph and usage stand for every later one

    @classmethod
    def from_flags(cls, find_unused_parameters: bool, static_graph: bool) -> GraphMode:
        if static_graph:  # torch: static_graph takes precedence (it handles unused parameters itself)
            return cls.STATIC
        return cls.FIND_UNUSED if find_unused_parameters else cls.ALL_USED

    @property
    def tracks_usage(self) -> bool:
        """Whether a parameter no rank used keeps its ``.grad`` untouched (torch does so in these two modes)."""
        return self is not GraphMode.ALL_USED

    @property
    def rebuilds(self) -> bool:
        """Whether buckets are rebuilt in the observed ready order: never with a dynamic graph, as in torch, since
        the order then changes from one iteration to the next."""
        return self is not GraphMode.FIND_UNUSED
