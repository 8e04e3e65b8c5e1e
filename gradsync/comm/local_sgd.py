"""Skipping synchronisation beyond no_sync: post-local SGD (Lin et al., ICLR 2020; torch's ``post_localSGD_hook`` +
``PeriodicModelAverager``).

For the first ``warmup_steps`` optimizer steps gradients are averaged as usual; afterwards each rank trains on its
own gradients and the *parameters* are averaged every ``period`` steps: 1/period of the communication, at the cost
of replicas drifting apart between averages.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from gradsync.collectives.communicator import Communicator, Op
from gradsync.collectives.tensors import average_tensors
from gradsync.comm.default_hooks import allreduce_hook
from gradsync.errors import ConfigError
from gradsync.reducer.grad_bucket import GradBucket
from gradsync.validate import require_ddp, require_group, require_int, require_state


class LocalPhases:
    """What the local methods share (post-local SGD, DiLoCo, Streaming DiLoCo): a warm-up of ``warmup_steps``
    synchronous steps, whose gradients the model's hook all-reduces, then local steps, whose gradients stay on
    their rank. Set ``ddp``, ``step_count`` and ``warmup_steps``, and register :meth:`_hook` on the model."""

    ddp: Any
    step_count: int
    warmup_steps: int

    @property
    def local(self) -> bool:
        """True once warm-up is over and gradients stay on their rank."""
        return self.step_count >= self.warmup_steps

    @property
    def _comm(self) -> Communicator:
        return self.ddp.communicator  # the model's current one: an elastic regroup replaces it

    def _hook(self, _state: Any, bucket: GradBucket) -> torch.futures.Future:
        return allreduce_unless_local(self.local, self.ddp.process_group, bucket)


class PostLocalSGD(LocalPhases):
    """Attach to a DDP model before the first backward; call :meth:`step` after each ``optimizer.step()``.

    Example::

        local_sgd = PostLocalSGD(ddp, period=4, warmup_steps=100)
        for x, y in loader:
            opt.zero_grad(); loss_fn(ddp(x), y).backward(); opt.step()
            local_sgd.step()   # averages the parameters every 4 steps once warm-up is over
    """

    def __init__(self, ddp: Any, period: int, warmup_steps: int = 0) -> None:
        require_ddp("PostLocalSGD", ddp)
        self.period = require_int("PostLocalSGD", "period (optimizer steps between averages)", period, 1)
        self.warmup_steps = require_int("PostLocalSGD", "warmup_steps", warmup_steps, 0)
        self.ddp = ddp
        self.step_count = 0
        ddp.register_comm_hook(None, self._hook)

    def state_dict(self) -> dict[str, Any]:
        """The step count, which every rank holds alike (for checkpoints and elastic regroups)."""
        return {"step_count": self.step_count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s step count."""
        state = require_state("PostLocalSGD.load_state_dict", state, ("step_count",))
        self.step_count = require_int("PostLocalSGD.load_state_dict", "step_count", state["step_count"], 0)

    def for_new_group(self) -> None:
        """A membership change keeps nothing per rank here (the step count arrives with :meth:`load_state_dict`)."""

    def step(self) -> bool:
        """Count an optimizer step; average the parameters if one is due. Returns True when it averaged."""
        self.step_count += 1
        due = self.step_count > self.warmup_steps and (self.step_count - self.warmup_steps) % self.period == 0
        if due:
            params = [p.detach() for p in self.ddp.module.parameters()]
            average_tensors(self.ddp.communicator, Op.PARAMETER_AVERAGE, params)
        return due


def allreduce_unless_local(
    local: bool, process_group: dist.ProcessGroup | None, bucket: GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """The comm hook of local SGD methods: average during warm-up, afterwards keep this rank's own gradients."""
    if not local:  # torch's hook, typed for torch's GradBucket: ours has its methods; None means the world group
        return allreduce_hook(process_group, bucket)  # type: ignore[arg-type]
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def average_parameters(module: torch.nn.Module, process_group: dist.ProcessGroup | None = None) -> None:
    """Replace every parameter of ``module`` by its mean over ``process_group`` (one all-reduce per dtype).

    Example::

        average_parameters(ddp.module)   # every rank now holds the mean of the replicas
    """
    if not isinstance(module, torch.nn.Module):
        raise ConfigError(f"average_parameters: module must be an nn.Module, got {type(module).__name__}")
    require_group("average_parameters", "process_group", process_group)
    average_tensors(Communicator(process_group), Op.PARAMETER_AVERAGE, [p.detach() for p in module.parameters()])
