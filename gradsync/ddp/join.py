"""torch's ``Join``, with a failure of the joined rank's loop named instead of raised raw.

A rank out of data waits in torch's ``Join.__exit__``, answering the others' collectives through each Joinable's
shadow. When the ranks still training issue a collective no Joinable shadows (a ``ShardedOptimizer`` left out of
``ddp.join()``, a collective of the user's own), the joined rank's next collective meets the wrong one and torch
raises a bare backend error there; this says what happened and what to pass.
"""

from __future__ import annotations

from types import TracebackType
from typing import Any

import torch.distributed as dist
from torch.distributed.algorithms.join import Join

from gradsync.collectives.communicator import Communicator
from gradsync.errors import CollectiveError, GradsyncError


class NamedJoin(Join):
    """``Join`` whose joined-rank failures name the cause, reported to the peers through ``comm`` (torch's arguments
    and behaviour otherwise)."""

    def __init__(self, joinables: list, *args: Any, comm: Communicator, **kwargs: Any) -> None:
        super().__init__(joinables, *args, **kwargs)
        self._comm = comm

    def __exit__(
        self,
        type: type[BaseException] | None,  # noqa: A002 (torch's parameter names)
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        try:
            super().__exit__(type, value, traceback)
        except GradsyncError:
            raise
        except RuntimeError as exc:
            message = (
                f"ddp.join(): rank {dist.get_rank()} ran out of data and, while it shadowed the ranks still training, "
                f"a collective failed ({exc}). Those ranks issued a collective that no joined object shadows: pass "
                "every object that issues collectives in the loop to torch's Join, e.g. Join([ddp, optimizer]) for "
                "a ShardedOptimizer, and keep collectives of your own out of the loop (or make them Joinable)."
            )
            self._comm.report(message)
            raise CollectiveError(message + self._comm.reports.describe(grace=2.0)) from exc
