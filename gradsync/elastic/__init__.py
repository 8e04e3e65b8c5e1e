"""Elastic training: survive a lost worker or host without restarting the job (``gradsync run --elastic``).

Survivors detect the failure (a failed collective, or a member whose heartbeat stopped), agree on the new members
through the job's store, form a new process group in-process, drop the half-done step, re-split the epoch's remaining
samples, and carry on. A restarted worker rejoins at a step boundary and receives the state from a survivor.

Example::

    job = gradsync.elastic.init(timeout=10)               # joins the job; the default process group is formed
    ddp = gradsync.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    loader = gradsync.elastic.ElasticLoader(dataset, batch_size=32)

    @gradsync.elastic.run
    def train(state):
        for epoch in range(state.epoch, 10):
            state.loader.set_epoch(epoch)
            for x, y in state.loader:
                state.optimizer.zero_grad()
                loss_fn(state.model(x), y).backward()
                state.step()                                 # in place of optimizer.step()
            state.epoch = epoch + 1

    train(gradsync.elastic.State(job, model=ddp, optimizer=opt, loader=loader, epoch=0))

The store lives in the launcher of the node serving the rendezvous; if that node is lost, the job cannot coordinate
and ends (restart it from a checkpoint, e.g. ``gradsync run --max-restarts``). See docs/elastic.md.

Each file of this folder is listed, with what it holds, in ARCHITECTURE.md's module table; the job's store (which
one, and etcd's) is ``gradsync.store``'s.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gradsync.exports import lazy

# Imported at first use (gradsync.exports says why): the launcher imports this package's store and keys, not the
# training side.
__getattr__, __dir__ = lazy(
    __name__,
    {
        "ElasticLoader": "gradsync.elastic.loader",
        "JobFinished": "gradsync.elastic.errors",
        "JobStateLost": "gradsync.elastic.errors",
        "Membership": "gradsync.elastic.membership",
        "MembershipChanged": "gradsync.elastic.errors",
        "Recovery": "gradsync.elastic.recovery",
        "State": "gradsync.elastic.state",
        "Timeouts": "gradsync.elastic.timeouts",
        "init": "gradsync.elastic.join",
        "run": "gradsync.elastic.state",
    },
)

if TYPE_CHECKING:
    from gradsync.elastic.errors import JobFinished, JobStateLost, MembershipChanged
    from gradsync.elastic.join import init
    from gradsync.elastic.loader import ElasticLoader
    from gradsync.elastic.membership import Membership
    from gradsync.elastic.recovery import Recovery
    from gradsync.elastic.state import State, run
    from gradsync.elastic.timeouts import Timeouts

__all__ = [
    "ElasticLoader",
    "JobFinished",
    "JobStateLost",
    "Membership",
    "MembershipChanged",
    "Recovery",
    "State",
    "Timeouts",
    "init",
    "run",
]
