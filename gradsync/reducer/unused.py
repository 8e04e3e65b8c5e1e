"""Which parameters will get no gradient in this backward: a walk of the autograd graph from the outputs.

torch's DDP does the same walk in C++ (``Reducer::prepare_for_backward``) when ``find_unused_parameters=True``:
a parameter whose ``AccumulateGrad`` node is not reachable from any output tensor will never fire its hook, so the
reducer must count it ready itself or its bucket would never be launched.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from gradsync.collectives.communicator import Communicator, Op
from gradsync.reducer.mode import GraphMode


def reachable_parameter_ids(outputs: Iterable[torch.Tensor]) -> set[int]:
    """``id()`` of every leaf tensor whose gradient the outputs' graph would accumulate."""
    reached: set[int] = set()
    seen: set = set()
    stack = []
    for t in outputs:
        if t.grad_fn is not None:
            stack.append(t.grad_fn)
        elif t.requires_grad:  # a parameter returned as-is
            reached.add(id(t))
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # AccumulateGrad nodes hold their leaf
        if variable is not None:
            reached.add(id(variable))
        for child, _ in node.next_functions:
            if child is not None and child not in seen:
                stack.append(child)
    return reached


def unused_parameter_indices(outputs: Iterable[torch.Tensor], params: Sequence[torch.Tensor]) -> list[int]:
    """Indices into ``params`` of the parameters the outputs do not depend on."""
    reached = reachable_parameter_ids(outputs)
    return [i for i, p in enumerate(params) if id(p) not in reached]


class GlobalUsage:
    """Which parameters got a gradient on at least one rank since the last synced step (torch's "globally used" map).

    With ``find_unused_parameters`` (a dynamic graph) each rank's map is all-reduced in every synced backward; with
    ``static_graph`` only in the first, whose answer stands for every later step, as torch's Reducer does
    (``static_graph_first_iteration``), so a static graph pays no per-step collective for it. A parameter counts
    as used on a rank if its gradient was defined in this synced backward or in a ``no_sync`` one before it (torch's
    ``local_used_map``): gradients accumulated under no_sync must be averaged too.
    """

    def __init__(self, n: int, mode: GraphMode, comm: Communicator, assume_same_everywhere: bool = False) -> None:
        self.n = n
        self.mode = mode
        self._comm = comm
        # skip_all_reduce_unused_params: the user guarantees every rank leaves the same parameters unused, so this
        # rank's map is everyone's and no all-reduce is needed.
        self._local_is_global = assume_same_everywhere
        self._local = bytearray(n)
        self._known: list[int] | None = None  # static_graph: the first step's answer (None: all used)
        self._have_known = False
        self._map: torch.Tensor | None = None
        self._future: torch.futures.Future | None = None
        self._used_everywhere_here = False  # this rank used every parameter: the reduced map cannot say otherwise

    def reduced_this_step(self) -> bool:
        """Whether this step's backward all-reduces a usage map (a joined rank then shadows it with zeros)."""
        return self.mode is GraphMode.FIND_UNUSED or (self.mode is GraphMode.STATIC and not self._have_known)

    def all_used_known(self) -> bool:
        """Whether every parameter already counts as used this step (no map to wait for, none known unused)."""
        return not self.reduced_this_step() and self._known is None

    def local_map(self) -> bytearray | None:
        """This rank's map since the last synced step, for hooks to mark; None when this step needs none."""
        return self._local if self.reduced_this_step() else None

    def start(self, used: bytearray, device: torch.device) -> None:
        """Launch the all-reduce of this rank's map (after the last bucket, so it never delays one); the next
        synced step starts from an empty map."""
        self._used_everywhere_here = used.count(0) == 0
        self._map = _on_device(torch.frombuffer(bytearray(used), dtype=torch.uint8).to(torch.int32), device)
        if self._local_is_global:
            self._future = torch.futures.Future()
            self._future.set_result([self._map])
        else:
            self._future = self._comm.all_reduce_async(Op.USAGE_ALLREDUCE, self._map)
        self._local = bytearray(self.n)

    @property
    def known(self) -> bool:
        """static_graph: whether the first step's answer is in (then no more maps are reduced)."""
        return self._have_known

    def result(self) -> list[int] | None:
        """Per parameter, 0 if no rank used it; None if every parameter counts as used (the write-back's fast path).

        The reduced map is read on the host only if this rank left a parameter unused, as torch's reducer reads it
        lazily (``finalize_bucket_dense``): a parameter used here is used globally, so a rank that used them all
        knows the answer, and on a GPU it does not wait for the device. The wait itself only orders the streams
        there (and surfaces a failed all-reduce on gloo)."""
        if self._future is None or self._map is None:
            return self._known
        self._comm.wait(self._future, Op.USAGE_ALLREDUCE)
        self._future = None
        flags = None if self._used_everywhere_here else self._map.tolist()
        result = None if flags is None or all(flags) else flags
        if self.mode is GraphMode.STATIC:
            self._known, self._have_known = result, True
        return result


def _on_device(flags: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``flags`` (on the CPU) on ``device``. To a GPU from pinned memory without blocking, as torch's reducer copies
    its local_used_map: a pageable copy would make the host wait for the GPU, inside backward. The copy is queued
    on the current stream before the all-reduce that reads it, and the pinned source stays alive until it ran
    (the caching host allocator keeps a pinned block until the work that used it is done)."""
    if device.type == "cpu":
        return flags
    return flags.pin_memory().to(device, non_blocking=True)
