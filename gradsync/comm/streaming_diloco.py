"""Streaming DiLoCo (Douillard et al., 2025, "Streaming DiLoCo with overlapping communication"): DiLoCo whose outer
exchange is split into fragments of the parameters on a staggered schedule, each overlapped with the inner steps
that follow it, and sent in low precision.

- **Fragments**: the parameters, in module order, in ``fragments`` contiguous groups of about equal size (the paper
  groups transformer layers the same way). Fragment p is exchanged every ``period`` inner steps, at offset
  ``(p + 1) * period // fragments``: every parameter once per period, and the link carries 1/fragments of the model
  at a time instead of all of it at once.
- **Overlap**: fragment p's pseudo-gradient (its anchor minus its parameters) is taken at the step its exchange
  starts, and its average is applied ``delay`` inner steps later, the exchange travelling meanwhile. The outer
  optimizer then moves the fragment's anchor, and the local parameters, which trained on for ``delay`` steps, are
  merged with it: ``mixing * local + (1 - mixing) * anchor`` (the paper's alpha; 0.5 by default with a delay, 0 —
  take the anchor, as DiLoCo does — without).
- **Low precision**: ``compression`` bf16, int8 or int4 (:mod:`.outer_exchange`).

With ``fragments=1`` and ``delay=0`` this is :class:`~gradsync.comm.diloco.DiLoCo`, step for step (a test checks
it); with more fragments and no delay, blocking DiLoCo applied to one fragment at a time on the same schedule.
The inner optimizer's state stays on its rank, as in DiLoCo.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from gradsync.comm.local_sgd import LocalPhases
from gradsync.comm.outer_exchange import (
    Exchange,
    apply_outer_step,
    check_wire,
    pseudo_gradient,
    reset_anchors,
    start_average,
)
from gradsync.errors import ConfigError
from gradsync.optim.saved_state import check_saved_state, prober
from gradsync.validate import (
    require_bool,
    require_ddp,
    require_int,
    require_number,
    require_state,
    require_tensors_like,
)


@dataclass
class _InFlight:
    fragment: int
    started: int  # the inner step (counted after warm-up) whose parameters gave its pseudo-gradient
    exchange: Exchange


class StreamingDiLoCo(LocalPhases):
    """Attach to a DDP model before the first backward; call :meth:`step` after each inner ``optimizer.step()``,
    and :meth:`finish` once training ends (it applies the exchanges still in flight).

    Example::

        streaming = StreamingDiLoCo(ddp, period=32, fragments=4, delay=2, compression="int4")
        inner = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
        for x, y in loader:
            inner.zero_grad(); loss_fn(ddp(x), y).backward(); inner.step()
            streaming.step()   # every 8 steps one fragment's exchange starts; each lands 2 steps later
        streaming.finish()
    """

    def __init__(
        self,
        ddp: Any,
        period: int,
        fragments: int = 4,
        delay: int = 0,
        mixing: float | None = None,
        outer_lr: float = 0.7,
        momentum: float = 0.9,
        nesterov: bool = True,
        warmup_steps: int = 0,
        compression: str | None = None,
    ) -> None:
        require_ddp("StreamingDiLoCo", ddp)
        self.period = require_int("StreamingDiLoCo", "period (inner steps between a fragment's exchanges)", period, 1)
        params = [p for p in ddp.module.parameters() if p.requires_grad]
        self.fragments = _split(params, require_int("StreamingDiLoCo", "fragments", fragments, 1), self.period)
        self.delay = require_int("StreamingDiLoCo", "delay (inner steps an exchange travels)", delay, 0)
        if self.delay >= self.period:
            raise ConfigError(
                f"StreamingDiLoCo: delay={delay} must be below period={period}: a fragment's exchange must land "
                "before the same fragment's next one starts."
            )
        default_mixing = 0.5 if self.delay else 0.0
        self.mixing = require_number("StreamingDiLoCo", "mixing", default_mixing if mixing is None else mixing, 0.0)
        if self.mixing >= 1.0:
            raise ConfigError(f"StreamingDiLoCo: mixing={mixing} must be below 1 (1 would ignore every exchange).")
        self.warmup_steps = require_int("StreamingDiLoCo", "warmup_steps", warmup_steps, 0)
        self.compression = check_wire("StreamingDiLoCo", compression)
        outer_lr = require_number("StreamingDiLoCo", "outer_lr", outer_lr, 0.0)
        momentum = require_number("StreamingDiLoCo", "momentum", momentum, 0.0)
        self.ddp = ddp
        self.step_count = 0
        self.bytes_sent = 0
        self.outer_steps = [0] * len(self.fragments)  # per fragment: how many exchanges landed
        self._anchors = [[torch.nn.Parameter(p.detach().clone()) for p in group] for group in self.fragments]
        nesterov = require_bool("StreamingDiLoCo", "nesterov", nesterov)
        kind = dict(lr=outer_lr, momentum=momentum, nesterov=nesterov and momentum > 0)
        self._outer = [torch.optim.SGD(anchors, **kind) for anchors in self._anchors]  # type: ignore[arg-type]
        self._in_flight: list[_InFlight] = []
        ddp.register_comm_hook(None, self._hook)

    def offset(self, fragment: int) -> int:
        """The inner step (after warm-up, from 1) of ``fragment``'s first exchange; the next ones follow every
        ``period`` steps."""
        return (fragment + 1) * self.period // len(self.fragments)

    def due(self, step: int) -> list[int]:
        """The fragments whose exchange starts after inner step ``step`` (counted after warm-up, from 1)."""
        offsets = [self.offset(f) for f in range(len(self.fragments))]
        return [f for f, first in enumerate(offsets) if step >= first and (step - first) % self.period == 0]

    def step(self) -> list[int]:
        """Count an inner step: start the exchanges due now, apply those that have travelled ``delay`` steps.
        Returns the fragments applied."""
        self.step_count += 1
        if self.step_count <= self.warmup_steps:
            for anchors, params in zip(self._anchors, self.fragments):
                reset_anchors(anchors, params)
            return []
        step = self.step_count - self.warmup_steps
        for fragment in self.due(step):
            self._start(fragment, step)
        landed = [f for f in self._in_flight if step - f.started >= self.delay]
        for flight in landed:
            self._land(flight)
        return [f.fragment for f in landed]

    def finish(self) -> list[int]:
        """Apply every exchange still in flight (at the end of training, or before a checkpoint)."""
        landed = list(self._in_flight)
        for flight in landed:
            self._land(flight)
        return [f.fragment for f in landed]

    def _start(self, fragment: int, step: int) -> None:
        pseudo = pseudo_gradient(self._anchors[fragment], self.fragments[fragment])
        exchange = start_average(self._comm, pseudo, self.compression, index=fragment)
        self.bytes_sent += exchange.bytes_sent
        self._in_flight.append(_InFlight(fragment, step, exchange))

    def _land(self, flight: _InFlight) -> None:
        self._in_flight.remove(flight)
        f = flight.fragment
        apply_outer_step(self._outer[f], self._anchors[f], self.fragments[f], flight.exchange.result(), self.mixing)
        self.outer_steps[f] += 1

    # ------------------------------------------------------------------------------- checkpoints and regroups
    def state_dict(self) -> dict[str, Any]:
        """What every rank holds alike: the step count, the anchors and the outer optimizers' state (the
        exchanges in flight are this rank's, and are not kept)."""
        return {
            "step_count": self.step_count,
            "anchors": [[a.detach().clone() for a in anchors] for anchors in self._anchors],
            "outer": [outer.state_dict() for outer in self._outer],
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s state, checked first (one saved over another model, or with other
        fragments, is refused, and nothing is changed)."""
        where = "StreamingDiLoCo.load_state_dict"
        state = require_state(where, state, ("step_count", "anchors", "outer"))
        step_count = require_int(where, "step_count", state["step_count"], 0)
        anchors = require_tensors_like(where, "anchors", [a for f in state["anchors"] for a in f], _flat(self._anchors))
        if [len(f) for f in state["anchors"]] != [len(f) for f in self._anchors] or len(state["outer"]) != len(
            self._outer
        ):
            raise ConfigError(
                f"{where}: the state holds {len(state['anchors'])} fragments of {[len(f) for f in state['anchors']]} "
                f"tensors, this one {[len(f) for f in self._anchors]}: build it with the fragments it was saved with."
            )
        outer = [
            check_saved_state(
                where,
                saved,
                [g["params"] for g in mine.param_groups],
                prober(type(mine), mine.defaults),
                mine.param_groups,
            )
            for mine, saved in zip(self._outer, state["outer"])
        ]
        self.step_count = step_count
        for anchor, value in zip(_flat(self._anchors), anchors):
            anchor.copy_(value)
        for mine, saved in zip(self._outer, outer):
            mine.load_state_dict(saved)

    def for_new_group(self) -> None:
        """A membership change drops the exchanges in flight: they belong to the old group."""
        self._in_flight.clear()


def _flat(groups: list[list[torch.nn.Parameter]]) -> list[torch.nn.Parameter]:
    return [t for group in groups for t in group]


def _split(params: list[torch.nn.Parameter], fragments: int, period: int) -> list[list[torch.nn.Parameter]]:
    """``params`` in order, in ``fragments`` contiguous groups of about equal numbers of values."""
    if fragments > len(params) or fragments > period:
        raise ConfigError(
            f"StreamingDiLoCo: fragments={fragments} must be at most the number of parameters ({len(params)}) and "
            f"the period ({period}): each fragment is exchanged at a step of its own."
        )
    before = [0]  # before[i]: the values in params[:i]
    for p in params:
        before.append(before[-1] + p.numel())
    cuts = [0]
    for k in range(1, fragments):
        cut = cuts[-1] + 1  # at least one parameter a group, and enough left for the groups after it
        while cut < len(params) - (fragments - k) and before[cut] < k * before[-1] / fragments:
            cut += 1
        cuts.append(cut)
    cuts.append(len(params))
    return [params[a:b] for a, b in zip(cuts, cuts[1:])]
