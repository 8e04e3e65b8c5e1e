"""ShardedOptimizer: ZeRO stage 1 (Rajbhandari et al., SC 2020), the optimizer state split across ranks.

Each rank owns a balanced share of the parameters and keeps optimizer state (Adam's two moments, momentum) only
for those: about 1/world of the memory. After the gradients are averaged (by DDP), each rank steps its own share
and all-gathers the updated shards, so every replica stays identical and training is unchanged.
Named like torch's ``ZeroRedundancyOptimizer`` (an alias is exported), whose constructor arguments it follows.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, Joinable, JoinHook
from torch.optim import Optimizer

from gradsync import settings
from gradsync.collectives.communicator import Communicator, Op
from gradsync.collectives.tensors import all_gather_shards
from gradsync.errors import CollectiveError, ConfigError
from gradsync.optim.saved_state import check_saved_state, prober
from gradsync.reducer.local_params import is_dtensor
from gradsync.validate import require_group, require_int

# The usual reason a rank never reaches the all-gather: uneven inputs under a Join that does not include us.
_JOIN_HINT = (
    "\n  If the ranks have different numbers of batches under ddp.join(): ddp.join() does not cover this "
    "optimizer, so the ranks that ran out skip its all-gather. Use Join([ddp, optimizer]) "
    "(torch.distributed.algorithms.join.Join) instead."
)


def state_bytes(states: Iterable[dict[str, Any]]) -> int:
    """Bytes of the tensors in optimizer per-parameter states (``optimizer.state.values()``)."""
    return sum(v.numel() * v.element_size() for s in states for v in s.values() if isinstance(v, torch.Tensor))


def partition(sizes: list[int], world_size: int) -> list[int]:
    """Owner rank of each tensor: largest first, each to the rank holding the fewest elements so far (torch's rule).

    >>> partition([10, 1, 1, 8], 2)
    [0, 1, 1, 1]
    """
    require_int("partition", "world_size", world_size, 1)
    if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Sequence):
        raise ConfigError(f"partition: sizes must be a list of element counts (ints >= 0), got {type(sizes).__name__}")
    for k, size in enumerate(sizes):
        require_int("partition", f"sizes[{k}]", size, 0)
    loads = [0] * world_size
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        owner[i] = rank
        loads[rank] += sizes[i]
    return owner


def require_optimizer_class(where: str, optimizer_class: object) -> None:
    """The class is called once per shard (or parameter): an instance or a name fails there, far from the cause."""
    if isinstance(optimizer_class, Optimizer):
        raise ConfigError(
            f"{where}: optimizer_class must be an optimizer class, got an instance of "
            f"{type(optimizer_class).__name__}. Pass the class itself and its arguments as keywords: "
            f"optimizer_class={type(optimizer_class).__name__}, lr=..."
        )
    if not callable(optimizer_class):
        raise ConfigError(
            f"{where}: optimizer_class must be an optimizer class such as torch.optim.AdamW, got "
            f"{type(optimizer_class).__name__} {optimizer_class!r:.40}."
        )


class ShardedOptimizer(Optimizer, Joinable):
    """An optimizer whose state lives on one rank per parameter. Use it exactly like ``optimizer_class``.

    Example::

        ddp = gradsync.DistributedDataParallel(model)
        opt = gradsync.ShardedOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3)
        ...
        opt.consolidate_state_dict(to=0)          # on every rank, before saving
        if rank == 0:
            torch.save(opt.state_dict(), "optim.pt")  # a plain AdamW state dict, loadable at any world size
    """

    def __init__(
        self,
        params: Iterable[Any],
        optimizer_class: type[Optimizer] = torch.optim.Adam,
        process_group: dist.ProcessGroup | None = None,
        **defaults: Any,
    ) -> None:
        require_optimizer_class("ShardedOptimizer", optimizer_class)
        require_group("ShardedOptimizer", "process_group", process_group)
        params = _plain_parameters(params)
        super().__init__(params, defaults)
        Joinable.__init__(self)
        self.optimizer_class = optimizer_class
        self._all = [p for g in self.param_groups for p in g["params"]]
        devices = {p.device for p in self._all}
        if len(devices) > 1:
            raise ConfigError(
                f"ShardedOptimizer: all parameters must be on one device, found {sorted(map(str, devices))}"
            )
        self._device = self._all[0].device if self._all else None
        self._comm = self._communicator(process_group)
        self._defaults = defaults
        _verify_same_parameters(self._comm, self._all)
        self._shard()
        self._consolidated: dict[int, Any] | None = None
        self._class_hyperparameters: dict[str, Any] | None = None

    def _shard(self) -> None:
        """Partition the parameters over the group and build this rank's optimizer for its share."""
        self.world_size = self._comm.size
        self.rank = self._comm.rank
        self.owner = partition([p.numel() for p in self._all], self.world_size)
        index = {id(p): i for i, p in enumerate(self._all)}
        self._local_to_global = [
            index[id(p)] for g in self.param_groups for p in g["params"] if self.owner[index[id(p)]] == self.rank
        ]
        local_groups = [
            {**_hyper(g), "params": [p for p in g["params"] if self.owner[index[id(p)]] == self.rank]}
            for g in self.param_groups
        ]
        # A rank can own nothing (more ranks than parameters): it then only receives the others' shards.
        self.local = self.optimizer_class(local_groups, **self._defaults) if self._local_to_global else None

    def verify_parameters(self, process_group: dist.ProcessGroup | None = None) -> None:
        """After the group changed: check the new members list the same parameters (as the constructor does)."""
        self._comm = self._communicator(process_group)
        _verify_same_parameters(self._comm, self._all)

    def _communicator(self, process_group: dist.ProcessGroup | None) -> Communicator:
        return Communicator(process_group, check_desync=settings.debug(), device=self._device)

    def reshard(self, process_group: dist.ProcessGroup | None = None) -> list[int]:
        """After the group changed (gradsync.elastic): gather the members' shards of the state, partition again for
        the new group, and keep this rank's new share. Returns the indices of parameters whose state no member
        held (their owner left): their optimizer state starts afresh, as at the first step."""
        local = self.local.state_dict()["state"] if self.local is not None else {}
        mine = {self._local_to_global[i]: s for i, s in local.items()}
        self._comm = self._communicator(process_group)
        everyone = self._comm.all_gather_object(Op.STATE_GATHER, mine)
        full = {k: v for shard in everyone for k, v in shard.items()}
        self._shard()
        if self.local is not None:
            state = {i: full[g] for i, g in enumerate(self._local_to_global) if g in full}
            groups = [{**_hyper(g), "params": list(range(len(g["params"])))} for g in self.local.param_groups]
            self.local.load_state_dict({"state": state, "param_groups": _renumber(groups)})
        return [i for i in range(len(self._all)) if i not in full]

    def gather_shards(self) -> None:
        """Every rank sends its updated shard and receives the others' (a joined rank sends its unchanged one)."""
        shards = [[p for p, o in zip(self._all, self.owner) if o == r] for r in range(self.world_size)]
        all_gather_shards(self._comm, Op.SHARD_ALLGATHER, shards)

    # Joinable (torch's ZeroRedundancyOptimizer is one too): with uneven inputs, ``Join([ddp, optimizer])``.
    def join_hook(self, **kwargs: Any) -> JoinHook:
        return _ShardJoinHook(self)

    @property
    def join_device(self) -> torch.device:
        return self._all[0].device

    @property
    def join_process_group(self) -> dist.ProcessGroup:
        return self._comm.group

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        Join.notify_join_context(self)  # inside Join([...]): the joined ranks still gather with this one
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.local is not None:
            for mine, full in zip(self.local.param_groups, self.param_groups):
                mine.update(_hyper(full))  # learning-rate schedulers edit self.param_groups
            self.local.step()
        try:
            self.gather_shards()
        except CollectiveError as error:
            if self._join_config.enable:
                raise
            raise CollectiveError(error.message + _JOIN_HINT) from error
        return loss

    def local_state_bytes(self) -> int:
        """Bytes of optimizer state held on this rank."""
        return state_bytes(self.local.state.values()) if self.local is not None else 0

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Collect every rank's shard of the state on rank ``to`` (a collective: call it on every rank)."""
        local = self.local.state_dict()["state"] if self.local is not None else {}
        mine = {self._local_to_global[i]: s for i, s in local.items()}
        shards = self._comm.all_gather_object(Op.STATE_GATHER, mine)
        self._consolidated = {k: v for shard in shards for k, v in shard.items()} if self.rank == to else None

    def state_dict(self) -> dict[str, Any]:
        """The full state, as ``optimizer_class`` over all parameters would give it (after consolidation here)."""
        if self._consolidated is None:
            raise ConfigError(
                f"ShardedOptimizer.state_dict() on rank {self.rank}: the state is sharded. Call "
                "consolidate_state_dict(to=R) on every rank first, then state_dict() on rank R."
            )
        groups, start = [], 0
        for g in self.param_groups:
            groups.append({**self._hyperparameters(g), "params": list(range(start, start + len(g["params"])))})
            start += len(g["params"])
        return {"state": dict(sorted(self._consolidated.items())), "param_groups": groups}

    def _hyperparameters(self, group: dict[str, Any]) -> dict[str, Any]:
        """``group``'s hyperparameters with every one the class keeps (Adam's betas...), as a plain
        ``optimizer_class`` over all parameters has them: its state dict loads into either."""
        if self._class_hyperparameters is None:
            self._class_hyperparameters = _hyper(prober(self.optimizer_class, self._defaults)().param_groups[0])
        return {**self._class_hyperparameters, **_hyper(group)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a full state dict (from :meth:`state_dict`, or from the unsharded optimizer) and keep this rank's
        share. The world size may differ from the one it was saved with."""
        groups = [g["params"] for g in self.param_groups]
        probe = prober(self.optimizer_class, self._defaults)
        current = [self._hyperparameters(g) for g in self.param_groups]
        state_dict = check_saved_state("ShardedOptimizer.load_state_dict", state_dict, groups, probe, current)
        for full, g in zip(self.param_groups, state_dict["param_groups"]):
            full.update(_hyper(g))
        if self.local is None:
            return
        state = {i: state_dict["state"][gi] for i, gi in enumerate(self._local_to_global) if gi in state_dict["state"]}
        groups, local_i = [], 0
        for mine_g, g in zip(self.local.param_groups, state_dict["param_groups"]):
            groups.append({**_hyper(g), "params": list(range(local_i, local_i + len(mine_g["params"])))})
            local_i += len(mine_g["params"])
        self.local.load_state_dict({"state": state, "param_groups": groups})


def _plain_parameters(params: Iterable[Any]) -> list[Any]:
    """``params`` as a list, refused by name where ShardedOptimizer cannot shard it: nothing, or a DTensor (its
    shards are plain tensors gathered into flat buffers, which a DTensor cannot join)."""
    if params is None or isinstance(params, torch.Tensor):
        raise ConfigError(
            "ShardedOptimizer: params must be an iterable of parameters (model.parameters()) or of parameter "
            f"groups, got {type(params).__name__}"
        )
    listed = [_listed_group(item) if isinstance(item, dict) else item for item in params]
    if not listed:
        raise ConfigError("ShardedOptimizer: params is empty; pass the model's parameters (model.parameters()).")
    tensors = [p for item in listed for p in (item["params"] if isinstance(item, dict) else [item])]
    dtensors = [i for i, p in enumerate(tensors) if is_dtensor(p)]
    if dtensors:
        raise ConfigError(
            f"ShardedOptimizer: params holds {len(dtensors)} DTensor parameter(s) (the first at position "
            f"{dtensors[0]}): it shards plain tensors only. Over tensor-parallel or FSDP (fully_shard) parameters, "
            "use a plain torch optimizer: their state is already sharded the way the parameters are."
        )
    return listed


def _listed_group(group: dict[str, Any]) -> dict[str, Any]:
    """A parameter group with its ``params`` made a list (torch accepts a tensor or any iterable there)."""
    ps = group.get("params", [])
    return {**group, "params": [ps] if isinstance(ps, torch.Tensor) else list(ps)}


def _verify_same_parameters(comm: Communicator, params: list[torch.Tensor]) -> None:
    """Every rank must list the same parameters in the same order, or each would own different shards and the
    all-gather would overwrite parameters with others' values: check shapes and dtypes once, at construction."""
    mine = [(tuple(p.shape), str(p.dtype)) for p in params]
    everyone = comm.all_gather_object(Op.SHARD_CHECK, mine)
    for rank, theirs in enumerate(everyone):
        if theirs != everyone[0]:
            pos = next((i for i, (a, b) in enumerate(zip(theirs, everyone[0])) if a != b), min(len(theirs), len(mine)))
            raise ConfigError(
                f"ShardedOptimizer: rank {comm.global_rank(rank)} lists its parameters differently from rank 0 "
                f"(at position {pos}: {theirs[pos] if pos < len(theirs) else 'none'} vs "
                f"{everyone[0][pos] if pos < len(everyone[0]) else 'none'}; {len(theirs)} vs {len(everyone[0])} "
                "parameters). Pass the parameters in the same order on every rank (e.g. model.parameters())."
            )


class _ShardJoinHook(JoinHook):
    """A joined rank still takes part in each step's all-gather of the shards (torch's ZeroRedundancyOptimizer too)."""

    def __init__(self, optimizer: ShardedOptimizer) -> None:
        self.optimizer = optimizer

    def main_hook(self) -> None:
        self.optimizer.gather_shards()


def _renumber(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    start = 0
    for g in groups:
        g["params"] = list(range(start, start + len(g["params"])))
        start += len(g["params"])
    return groups


def _hyper(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}


ZeroRedundancyOptimizer = ShardedOptimizer
