"""A communication hook carried across a membership change (``gradsync.elastic`` forms a new group each round).

torch's DDP never changes its group, so its hooks' states assume one world for life. gradsync keeps the hook and its
state object through a regroup and splits what the state holds in two:

- **this rank's memory of the old group** (error-feedback residuals, PowerSGD's error and P/Q matrices, a bucket's
  exchange still in flight): dropped. It was sized for the old buckets and world size, and a worker that joins
  has none, so keeping it on the survivors would make the members differ. Dropping a residual forgets one step's
  compression error, once; PowerSGD rebuilds its P/Q from its generator, as at its start.
- **what every member must share** (PowerSGD's iteration and random generator, from which every rank draws the same
  Q; DiLoCo's anchor, outer optimizer and step count; PostLocalSGD's step count): rank 0's, sent with the rest of
  the elastic state (:meth:`gradsync.elastic.State`), so survivors and the worker that joins agree.

A process group held by a state is replaced by ``None``: the new default group.

Example::

    state = for_new_group(state, hook)               # on a survivor, when its reducer is rebuilt
    shared = shared_state(state, hook)               # rank 0's, broadcast to every member
    load_shared_state(state, hook, shared)           # on every member
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

from gradsync.comm.quantized import QuantizedState


def for_new_group(state: Any, hook: Any) -> Any:
    """``state`` ready for the new group: its process group the new default one, its per-rank memory dropped."""
    if isinstance(state, dist.ProcessGroup):
        return None
    if isinstance(state, PowerSGDState):
        state.process_group = None  # torch's hooks read None as the default group
        state.error_dict.clear()
        state.p_memory_dict.clear()
        state.q_memory_dict.clear()
    elif isinstance(state, QuantizedState):
        state.for_new_group()
    owner = _owner(hook)
    if owner is not None:
        owner.for_new_group()
    return state


def shared_state(state: Any, hook: Any) -> dict[str, Any] | None:
    """What every member must hold alike (rank 0's is sent to all); None when the hook keeps nothing of the kind."""
    if isinstance(state, PowerSGDState):
        return {"iter": state.iter, "rng": state.rng.get_state()}
    owner = _owner(hook)
    return owner.state_dict() if owner is not None else None


def load_shared_state(state: Any, hook: Any, shared: dict[str, Any] | None) -> None:
    """Take rank 0's shared state (from :func:`shared_state`)."""
    if shared is None:
        return
    if isinstance(state, PowerSGDState):
        state.iter = shared["iter"]
        state.rng.set_state(shared["rng"])
        return
    owner = _owner(hook)
    if owner is not None:
        owner.load_state_dict(shared)


def _owner(hook: Any) -> Any:
    """gradsync's local-SGD methods register a bound method of theirs as the hook; they carry their own state."""
    owner = getattr(hook, "__self__", None)
    wanted = ("for_new_group", "state_dict", "load_state_dict")
    return owner if owner is not None and all(hasattr(owner, name) for name in wanted) else None
