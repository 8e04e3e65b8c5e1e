"""Elastic training state and the loop that survives a lost member: ``State`` and ``run``.

Prior art: Horovod Elastic's ``State.commit()``/``run`` and torchft's per-step quorum. The protocol:

- a step is committed at :meth:`State.step`, which replaces ``optimizer.step()``: its gradients' all-reduce has
  completed, so every member's backward took part, and each member steps its optimizer. A member lost before then
  fails the all-reduce on every survivor, so nobody steps: parameters and optimizer state stay those of the last
  committed step, with no copy kept. One lost inside the all-reduce can leave the step committed on some
  survivors only; the next round's rank 0 is a member with the most committed steps, and every member takes its
  state, so the step is then committed everywhere. The store is not touched per step: a worker waiting to join
  is admitted at a step boundary that rank 0 announces a few steps ahead (:meth:`Membership.step_boundary`);
- when a collective fails (a dead peer, or a stopped one past the process group's timeout) or the agreement finds a
  member without a heartbeat, :func:`run` forms a new round among the live workers (and any waiting to join), a
  fresh process group, rebuilds the model's reducer for it, sends rank 0's state to every member (a rejoining
  worker receives the parameters, optimizer state, data position and counters this way), and calls the training
  function again, which resumes from the committed position.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from gradsync.checkpoint import rng_state, set_rng_state
from gradsync.collectives.communicator import Communicator, Op
from gradsync.elastic.errors import JobFinished, MembershipChanged
from gradsync.elastic.loader import ElasticLoader
from gradsync.elastic.membership import Membership
from gradsync.elastic.recovery import FutileRecoveries, Phases, Recovery
from gradsync.elastic.rounds import Round
from gradsync.errors import CollectiveError, ConfigError, GradsyncError
from gradsync.log import log
from gradsync.validate import require_callable

T = TypeVar("T")


class State:
    """What must survive a membership change: the DDP model, its optimizer, the data position and your counters.

    ``State(job, model=ddp, optimizer=opt, loader=loader, epoch=0)``, with ``job`` from :func:`gradsync.elastic.init`;
    counters are attributes (``state.epoch``).

    Example::

        state = gradsync.elastic.State(job, model=ddp, optimizer=opt, loader=loader, epoch=0)
        state.begin()                   # a worker that joins receives the state here
        print(state.epoch, state.steps)  # a counter of yours, and the committed steps
        state.finish()
    """

    def __init__(
        self, job: Membership, model: Any, optimizer: torch.optim.Optimizer, loader: ElasticLoader, **counters: Any
    ) -> None:
        from gradsync.optim.overlapped import OverlappedOptimizer
        from gradsync.validate import require_ddp

        if not isinstance(job, Membership):
            raise ConfigError(
                f"elastic.State: job must be what gradsync.elastic.init() returned, got {type(job).__name__}"
            )
        require_ddp("elastic.State (model)", model)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(
                f"elastic.State: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
            )
        if not isinstance(loader, ElasticLoader):
            raise ConfigError(
                f"elastic.State: loader must be a gradsync.elastic.ElasticLoader (it resumes each epoch at the "
                f"committed position after a membership change), got {type(loader).__name__}"
            )
        if isinstance(optimizer, OverlappedOptimizer):
            raise ConfigError(
                "elastic training cannot use OverlappedOptimizer: it steps each bucket during backward, before the "
                "members can agree that the step is complete. Use a plain optimizer."
            )
        self.job, self.model, self.optimizer, self.loader = job, model, optimizer, loader
        self.counters = dict(counters)
        self.steps = 0  # committed steps
        self.recoveries: list[Recovery] = []
        self._recovery_phases: Phases | None = None  # the last recovery's, for its failure's line
        self._futile = FutileRecoveries(job.timeout)
        self._started = False  # begin() ran start() (a joiner receives the state there)
        self._sharded = hasattr(optimizer, "reshard")  # ShardedOptimizer: its state is re-partitioned

    def __getattr__(self, name: str) -> Any:
        counters = self.__dict__.get("counters", {})
        if name in counters:
            return counters[name]
        raise AttributeError(name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self.__dict__.get("counters", {}):
            self.counters[name] = value
        else:
            super().__setattr__(name, value)

    # ----------------------------------------------------------------------------------------- the step
    def step(self) -> None:
        """Commit this step: step the optimizer (the backward's all-reduce completed: every member took part) and
        consume the step's samples. Use it in place of ``optimizer.step()``."""
        self.optimizer.step()
        self.steps += 1
        self.loader.commit()
        # A worker waits to join: form the next round here, unless the epoch's last step would then leave a rank
        # without a sample; every member has the same position, so all put it off to the same boundary.
        if self.job.step_boundary(self.steps) and self.loader.can_grow_to(self.job.max_world_size()):
            raise MembershipChanged("admitting a worker that asked to join")

    def count_recovery(self, failure: BaseException) -> None:
        """Give up after more than MAX_FUTILE membership changes in a row without a committed step, over 6 heartbeat
        timeouts at least (:class:`~gradsync.elastic.recovery.FutileRecoveries`: not within a burst of faults)."""
        why = self._futile.count(self.steps, time.monotonic())
        if why is not None:
            raise GradsyncError(f"{why}: giving up") from failure

    # ----------------------------------------------------------------------- your own loop's shape
    def begin(self) -> None:
        """Before a loop of :meth:`guard` blocks: a worker admitted into a running job receives the members' state
        here (``state.epoch`` and your other counters among it), so call it before reading them. Raises
        :class:`JobFinished` on a worker the job did not need."""
        if self.job.finished_without_me:
            raise JobFinished("the job finished before this worker could join")
        if self._started:
            return
        self._started = True
        try:
            self.start()
        except RECOVERABLE as exc:
            self._recover_or_finish(exc)

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Keep your training loop's own shape instead of decorating it with :func:`run` (torchft's style: its
        ``should_commit`` and optimizer wrapper): a membership change inside the block is recovered here, the
        step in progress dropped, and ``state.loader`` resumes at the committed position.

        Example::

            state.begin()                       # a joiner receives the state (state.epoch too) here
            for epoch in range(state.epoch, epochs):
                state.loader.set_epoch(epoch)
                for x, y in state.loader:
                    with state.guard():
                        state.optimizer.zero_grad()
                        loss_fn(state.model(x), y).backward()
                        state.step()
                state.epoch = epoch + 1
            state.finish()

        The trade-off: :func:`run` calls your function again after a change, so every variable in it is rebuilt
        from ``state``; with ``guard`` your loop goes on, so keep what must survive a change in ``state``'s
        counters (the members' are rank 0's after a change, and a joiner receives them in :meth:`begin`).
        """
        self.begin()
        try:
            yield
        except RECOVERABLE as exc:
            self._recover_or_finish(exc)
        except JobFinished as done:  # the job finished while this worker was stalled in the step
            self.job.finish_without_me(done)
            raise

    def _recover_or_finish(self, failure: BaseException) -> None:
        if not _recover(self, failure):
            raise JobFinished("this worker was left out, and the others finished before it could join again")

    def finish(self) -> None:
        """The training loop ended (with :meth:`guard`): tell the job, so the store's host may close."""
        self.job.finished()

    # ------------------------------------------------------------------------------------- membership
    def start(self) -> None:
        """A worker admitted into a running job receives the members' state here (they send it in recover). A member
        lost during the model's construction collectives is recovered from here (``take_construction_failure``)."""
        failure = self.model.take_construction_failure()
        if failure is not None:
            raise failure
        if self.job.joined_late:
            self._sync()

    def recover(self, reason: BaseException) -> None:
        """Form the next round with the live workers (and any waiting to join), then carry on from there."""
        assert self.job.round is not None
        start, before = time.monotonic(), self.job.round.world_size
        clock = self._recovery_phases = Phases()
        with self.job.coordinating():
            round_ = self._form_next_round(reason, clock)
        seconds = time.monotonic() - start
        why = str(reason).splitlines()[0][:200]
        self.recoveries.append(Recovery(self.steps, why, before, round_.world_size, seconds, clock.seconds()))
        log.warning(
            "gradsync elastic: %d -> %d workers at step %d in %.2fs: %s (%s)",
            before,
            round_.world_size,
            self.steps,
            seconds,
            clock.describe(),
            why,
        )

    def _form_next_round(self, reason: BaseException, clock: Phases) -> Round:
        with clock.phase("leave"):
            self.job.leave_group(reason)  # first: the members still inside the failed collective then fail at once
        with clock.phase("round"):
            round_ = self.job.next_round(self.steps)
        with clock.phase("group"):
            self.job.form_group(round_)
        with clock.phase("rebuild"):
            # The same collectives, in the same order, as a newly started worker's constructors, then the state.
            self.model.rebuild_for_new_group()
            if self._sharded:
                self.optimizer.verify_parameters()  # type: ignore[attr-defined]
        with clock.phase("state"):
            self._sync()
        return round_

    def failed_recovery(self) -> str:
        """Where the last recovery failed, and the seconds each phase took until then: ``"in its group, after
        leave 0.01s, round 0.20s, group 1.00s"``."""
        clock = self._recovery_phases
        if clock is None or clock.failed_in is None:
            return "before it began"
        return f"in its {clock.failed_in}, after {clock.describe()}"

    def _sync(self) -> None:
        """Rank 0's state everywhere: optimizer, data position, counters, RNG (a joiner's only source)."""
        mine = {
            "optimizer": None if self._sharded else self.optimizer.state_dict(),
            "loader": self.loader.state_dict(),
            "steps": self.steps,
            "counters": self.counters,
            "rng": rng_state(),
            "replica": self.model.shared_replica(),  # a comm hook's shared state, the rebuilt buckets
        }
        state = Communicator().broadcast_object(Op.ELASTIC_STATE, mine)
        if self._sharded:
            self.optimizer.reshard()  # type: ignore[attr-defined]
        elif dist.get_rank() != 0:
            self.optimizer.load_state_dict(state["optimizer"])
        self.loader.load_state_dict(state["loader"])
        self.steps, self.counters = state["steps"], dict(state["counters"])
        self.model.load_shared_replica(state["replica"])
        set_rng_state(state["rng"])
        for p in self.model.parameters():
            p.grad = None  # the half-done step's gradients are dropped


RECOVERABLE: tuple[type[BaseException], ...] = (MembershipChanged, CollectiveError)


def run(train: Callable[..., T]) -> Callable[..., T | None]:
    """Decorate the training function ``train(state, ...)``: it runs until it returns, and is called again from
    the committed position after every membership change. It returns None, without training, on a worker the job
    did not need: one (re)started, cut off or stalled in a step, after the others finished
    (``state.job.finished_without_me``).

    Example::

        @gradsync.elastic.run
        def train(state):
            for epoch in range(state.epoch, epochs):
                state.loader.set_epoch(epoch)
                for x, y in state.loader:
                    state.optimizer.zero_grad()
                    loss_fn(state.model(x), y).backward()
                    state.step()
                state.epoch = epoch + 1

        train(gradsync.elastic.State(job, model=ddp, optimizer=opt, loader=loader, epoch=0))
    """
    # Refused when decorated: functools.wraps would take anything, and the mistake show only at the first call.
    require_callable("elastic.run", "train (the training function it decorates)", train)

    @functools.wraps(train)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> T | None:
        if state.job.finished_without_me:
            return None  # the job finished before this worker could join: nothing left to do
        failure: BaseException | None = None
        try:
            state.start()
        except RECOVERABLE as exc:
            failure = exc
        while True:
            if failure is not None and not _recover(state, failure):
                return None
            try:
                result = train(state, *args, **kwargs)
                state.job.finished()
                return result
            except RECOVERABLE as exc:
                failure = exc
            except JobFinished as done:  # the job finished while this worker was stalled in a step
                state.job.finish_without_me(done)
                return None

    return wrapper


def _recover(state: State, failure: BaseException) -> bool:
    """Form a new round; again if another member is lost during the recovery itself. False: this worker was left
    out, and the others finished before it could join again."""
    while True:
        if (finished := state.job.finished_while_stalled()) is not None:  # its store may have closed with the job
            state.job.finish_without_me(finished)
            return False
        state.count_recovery(failure)
        try:
            state.recover(failure)
            return True
        except RECOVERABLE as exc:
            where = state.failed_recovery()
            log.warning("gradsync elastic: recovery at step %d failed %s (%s); trying again", state.steps, where, exc)
            failure = exc
        except JobFinished as done:
            state.job.finish_without_me(done)
            return False
