"""DiLoCo (Douillard et al., 2023): local SGD with an outer optimizer on the averaged pseudo-gradient.

Every rank trains on its own gradients for ``period`` (H) inner steps; then the ranks average the *pseudo-gradient*,
the parameters before those H steps minus the parameters after them, and an outer optimizer (Nesterov momentum by
default) moves the shared parameters along it. One collective per H steps instead of one per step: with H = 64,
1/64 of the communication. The average can travel in bf16, int8 or int4 (:mod:`.outer_exchange`).

The inner optimizer's state (AdamW's moments) stays on its rank by design, as in the paper: only parameters are
averaged. A synchronous warm-up (``warmup_steps``: plain data-parallel steps, gradients all-reduced) starts the
outer loop from a shared, already-trained point, as the paper's runs start from a pretrained model.
:class:`~gradsync.comm.streaming_diloco.StreamingDiLoCo` exchanges fragments on a staggered schedule instead, and
overlaps each exchange with the inner steps that follow.

With ``period=1``, outer SGD, ``outer_lr=1`` and no momentum, this is parameter averaging after every step.
"""

from __future__ import annotations

from typing import Any

import torch

from gradsync.comm.local_sgd import LocalPhases
from gradsync.comm.outer_exchange import apply_outer_step, check_wire, pseudo_gradient, reset_anchors, start_average
from gradsync.optim.saved_state import check_saved_state, prober
from gradsync.validate import (
    require_bool,
    require_ddp,
    require_int,
    require_number,
    require_state,
    require_tensors_like,
)


class DiLoCo(LocalPhases):
    """Attach to a DDP model before the first backward; call :meth:`step` after each inner ``optimizer.step()``.

    Example::

        diloco = DiLoCo(ddp, period=16, outer_lr=0.7, momentum=0.9)   # Nesterov outer optimizer
        inner = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
        for x, y in loader:
            inner.zero_grad(); loss_fn(ddp(x), y).backward(); inner.step()
            diloco.step()   # every 16 steps: average the pseudo-gradient, take an outer step
    """

    def __init__(
        self,
        ddp: Any,
        period: int,
        outer_lr: float = 0.7,
        momentum: float = 0.9,
        nesterov: bool = True,
        warmup_steps: int = 0,
        compression: str | None = None,
    ) -> None:
        require_ddp("DiLoCo", ddp)
        period = require_int("DiLoCo", "period (inner steps between outer steps)", period, 1)
        warmup_steps = require_int("DiLoCo", "warmup_steps", warmup_steps, 0)
        outer_lr = require_number("DiLoCo", "outer_lr", outer_lr, 0.0)
        momentum = require_number("DiLoCo", "momentum", momentum, 0.0)
        check_wire("DiLoCo", compression)
        self.ddp = ddp
        self.period = period
        self.warmup_steps = warmup_steps
        self.compression = compression
        self.step_count = 0
        self.bytes_sent = 0
        self._params = [p for p in ddp.module.parameters() if p.requires_grad]
        self._anchor = [torch.nn.Parameter(p.detach().clone()) for p in self._params]
        nesterov = require_bool("DiLoCo", "nesterov", nesterov)
        kind = dict(momentum=momentum, nesterov=nesterov and momentum > 0)
        self.outer = torch.optim.SGD(self._anchor, lr=outer_lr, **kind)  # type: ignore[arg-type]
        ddp.register_comm_hook(None, self._hook)

    def state_dict(self) -> dict[str, Any]:
        """What every rank holds alike: the step count, the anchor (the parameters of the last outer step) and the
        outer optimizer's state. For checkpoints, and sent from rank 0 to every member after an elastic regroup."""
        return {
            "step_count": self.step_count,
            "anchor": [a.detach().clone() for a in self._anchor],
            "outer": self.outer.state_dict(),
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s state, checked first (one saved over another model is refused, and nothing
        is changed)."""
        where = "DiLoCo.load_state_dict"
        state = require_state(where, state, ("step_count", "anchor", "outer"))
        step_count = require_int(where, "step_count", state["step_count"], 0)
        anchor = require_tensors_like(where, "anchor", state["anchor"], self._anchor)
        probe = prober(type(self.outer), self.outer.defaults)
        outer = check_saved_state(where, state["outer"], [self._anchor], probe, self.outer.param_groups)
        self.step_count = step_count
        for mine, saved in zip(self._anchor, anchor):
            mine.copy_(saved)
        self.outer.load_state_dict(outer)

    def for_new_group(self) -> None:
        """A membership change keeps nothing per rank here: the anchor and the outer state are shared (rank 0's
        arrive with :meth:`load_state_dict`), and each member trains on from rank 0's parameters."""

    def step(self) -> bool:
        """Count an inner step; every ``period`` steps after warm-up, take an outer step. True when it did."""
        self.step_count += 1
        if self.step_count <= self.warmup_steps:
            reset_anchors(self._anchor, self._params)
            return False
        if (self.step_count - self.warmup_steps) % self.period:
            return False
        self._outer_step()
        return True

    def _outer_step(self) -> None:
        average = self._average(pseudo_gradient(self._anchor, self._params))
        apply_outer_step(self.outer, self._anchor, self._params, average)

    def _average(self, flat: torch.Tensor) -> torch.Tensor:
        exchange = start_average(self._comm, flat, self.compression)
        self.bytes_sent += exchange.bytes_sent
        return exchange.result()
