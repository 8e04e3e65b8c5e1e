"""Two-level all-reduce for hosts holding several ranks, as a communication hook: inside each host, then across.

A flat ring over N = H x L ranks, placed host by host, has every rank send 2 (N - 1) / N of each bucket to the
next; a host's link out carries its last rank's hop: 1.5 x the bucket for 2 hosts x 2 ranks, 1.875 x for 2 x 8.
Reducing inside the host first (Horovod's hierarchical all-reduce; NCCL's trees and 2-D rings do the same on GPUs)
makes each host's link carry 2 (H - 1) / H of it, 1.0 x for 2 hosts:

1. sum inside the host: local rank i will carry the host's sum of chunk i (an all-reduce over loopback: gloo's
   reduce-scatter returns no future to chain the next step on);
2. all-reduce chunk i across the hosts, between the ranks of local index i (the host's L chunks make one bucket);
3. all-gather inside the host: every rank has the whole average.

The three steps run as a pipeline over pieces of each bucket, a thread and a group a step (:mod:`.stages`): while
one piece crosses the link, the next is summed and the one before gathered, and every group sees its collectives
in the same order on every rank.

The hosts are told apart by host name and network namespace (two lab "hosts" on one machine share a name, not a
loopback), gathered once when the state is made. Where the group has one host, one rank a host, or hosts with
different numbers of ranks, the hook is a flat all-reduce and :attr:`HierarchicalState.flat_because` says why.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence

import torch
import torch.distributed as dist

from gradsync.comm.stages import StagePipeline
from gradsync.errors import ConfigError
from gradsync.reducer.grad_bucket import GradBucket
from gradsync.validate import require_group, require_int


def host_key() -> str:
    """This process's host, as the ranks that share a loopback see it: its host name and network namespace."""
    try:
        namespace = os.stat("/proc/self/ns/net").st_ino
    except OSError:  # not Linux: the host name alone
        namespace = 0
    return f"{socket.gethostname()}/{namespace}"


def hosts_of(keys: Sequence[str]) -> list[list[int]]:
    """The group ranks of each host, hosts in the order of their lowest rank (``keys[r]``: rank r's host)."""
    hosts: dict[str, list[int]] = {}
    for rank, key in enumerate(keys):
        hosts.setdefault(key, []).append(rank)
    return list(hosts.values())


class HierarchicalState:
    """The groups :func:`hierarchical_hook` reduces over, made from ``process_group`` (None: the default group).
    Every rank of the group constructs it at the same point (it gathers the hosts and makes two groups). ``host``
    names this rank's host where :func:`host_key` cannot tell (ranks of one host must pass the same string);
    ``piece_bytes``: what each step of the pipeline takes at a time (stages.py).

    Example::

        state = gradsync.comm.HierarchicalState(process_group)
        ddp.register_comm_hook(state, gradsync.comm.hierarchical_hook)
    """

    def __init__(
        self, process_group: dist.ProcessGroup | None = None, host: str | None = None, piece_bytes: int = 4 * 2**20
    ) -> None:
        require_group("HierarchicalState", "process_group", process_group)
        if host is not None and (not isinstance(host, str) or not host):
            raise ConfigError(
                f"HierarchicalState: host must name this rank's host (the same non-empty str on the ranks of one "
                f"host), or be None to find it, got {type(host).__name__} {host!r}"
            )
        self.process_group = process_group
        # 0 would cut each bucket into pieces of no bytes: the pipeline would never finish the first backward.
        self.piece_bytes = require_int("HierarchicalState", "piece_bytes (bytes per pipeline step)", piece_bytes, 1)
        self.world_size = dist.get_world_size(process_group)
        keys: list[str] = [""] * self.world_size
        dist.all_gather_object(keys, host or host_key(), group=process_group)
        self.hosts = hosts_of(keys)
        sizes = {len(h) for h in self.hosts}
        self.flat_because = (
            "one host"
            if len(self.hosts) == 1
            else "one rank a host"
            if sizes == {1}
            else f"hosts hold different numbers of ranks ({sorted(len(h) for h in self.hosts)})"
            if len(sizes) > 1
            else ""
        )
        self.local_index = 0  # this rank's place in its host: the chunk it carries across
        self.local: dist.ProcessGroup | None = None
        self.pipeline: StagePipeline | None = None
        self.across: dist.ProcessGroup | None = None
        if not self.flat_because:
            self._make_groups(dist.get_rank(process_group))

    def _make_groups(self, me: int) -> None:
        # Only each group's own members call new_group for it (use_local_synchronization): the data-parallel group
        # may be part of a larger job whose other ranks never construct this state. The host's two steps have a
        # group each: they run on threads of their own (stages.py).
        group = self.process_group or dist.group.WORLD
        assert group is not None  # the default group exists: the state gathered over it
        as_global = lambda ranks: [dist.get_global_rank(group, r) for r in ranks]  # noqa: E731
        host = next(h for h in self.hosts if me in h)
        self.local_index = host.index(me)
        made = lambda ranks: dist.new_group(as_global(ranks), use_local_synchronization=True)  # noqa: E731
        self.local, self.across = made(host), made([h[self.local_index] for h in self.hosts])
        groups = (self.local, self.across, made(host))
        self.pipeline = StagePipeline(groups, len(host), self.local_index, self.piece_bytes)

    @property
    def ranks_per_host(self) -> int:
        return len(self.hosts[0])


def hierarchical_hook(state: HierarchicalState, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average ``bucket`` over the group inside each host first, then across hosts (module docstring). Not the
    default: it saves link bytes only, at the CPU cost of the steps inside the host, so it pays where a host's link
    is the limit and its ranks have cores to spare (docs/benchmarks.md, "Hosts of several ranks", measures both).

    Example::

        state = gradsync.comm.HierarchicalState(process_group)
        ddp.register_comm_hook(state, gradsync.comm.hierarchical_hook)
        loss_fn(ddp(x), y).backward()   # averaged inside each host, then across
    """
    tensor = bucket.buffer().div_(state.world_size)
    if state.flat_because:
        work = dist.all_reduce(tensor, group=state.process_group, async_op=True)
        return work.get_future().then(lambda _: tensor)  # type: ignore[union-attr]
    assert state.pipeline is not None  # made with the groups whenever the hook is not flat
    return state.pipeline.average(tensor)
