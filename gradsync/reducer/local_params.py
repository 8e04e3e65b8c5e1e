"""Tensor parallelism's DTensor parameters as the reducer sees them: each one's local shard.

With tensor parallelism (``parallelize_module`` on a 2-D mesh of data × tensor ranks) some parameters are DTensors:
each rank holds a shard (``Shard(d)``) or a replica (``Replicate()``) of a logical tensor, over the mesh's
tensor-parallel ranks. Data parallelism averages each rank's local values over its data-parallel group, whose members
all hold the same shard. torch's DDP gets there by swapping every DTensor parameter in the model for a plain
Parameter over its local shard and rebuilding the DTensors before each forward
(``torch/distributed/tensor/parallel/ddp.py``); the model's ``parameters()`` and ``state_dict()`` then come back
empty after a forward (torch issue 152712, and the TODO in ``DistributedDataParallel.__init__``).

gradsync leaves the model's DTensor parameters where they are and gives the reducer, for each of them, a plain
tensor over the same local storage (``local``). Autograd still accumulates into the DTensor's ``.grad``; each time
the parameter's hook fires, the local tensor's ``.grad`` becomes the local shard of that gradient (:meth:`bring_in`),
after moving a partial gradient (``Partial()``: a sequence-parallel norm's weight) to the parameter's own placements
over the tensor-parallel ranks, as torch's ``DTensor.from_local`` does in backward. The buckets read and write that
local ``.grad`` in place; where the reducer gave the local tensor a ``.grad`` of its own (gradient_as_bucket_view's
slot, a parameter that had none), :meth:`publish` makes the DTensor's ``.grad`` that tensor, with the parameter's
mesh and placements. So after backward each DTensor parameter's ``.grad`` is a DTensor of its own placements holding
the average over the data-parallel ranks: ``clip_grad_norm_`` and the optimizer see what they see without DDP.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gradsync.torch_private.tensor_parallel import dtensor_type


def is_dtensor(tensor: object) -> bool:
    dtensor = dtensor_type()  # None until torch.distributed.tensor is imported: then no tensor is a DTensor
    return dtensor is not None and isinstance(tensor, dtensor)


def local_of(tensor: torch.Tensor) -> torch.Tensor:
    """A plain tensor over ``tensor``'s local values (``tensor`` itself unless it is a DTensor). Writing into it
    writes into the DTensor's shard: the initial broadcast and buffer broadcasts use it."""
    if not is_dtensor(tensor):
        return tensor
    with torch.no_grad():  # to_local() outside grad mode is the local tensor itself, not a differentiable view
        return tensor.to_local().detach()  # type: ignore[attr-defined]


class LocalParams:
    """``params`` (the tensors autograd accumulates into, DTensors or plain) and ``locals`` (what the reducer
    buckets: the same tensor for a plain parameter, its local shard for a DTensor).

    >>> local = LocalParams([torch.nn.Parameter(torch.zeros(2))])
    >>> local.locals[0] is local.params[0], local.sharded
    (True, [])
    """

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        self.params = list(params)
        self.locals = [local_of(p) for p in self.params]
        self.sharded = [i for i, p in enumerate(self.params) if is_dtensor(p)]

    def is_sharded(self, index: int) -> bool:
        return self.locals[index] is not self.params[index]

    def bring_in(self, index: int) -> None:
        """The parameter's hook fired: its local tensor's ``.grad`` becomes the local shard of its gradient, in the
        parameter's placements (a partial gradient is summed over the tensor-parallel ranks first)."""
        param, local = self.params[index], self.locals[index]
        grad = param.grad
        if grad is None:
            local.grad = None
            return
        with torch.no_grad():
            if grad.placements != param.placements:  # type: ignore[attr-defined]
                grad = grad.redistribute(param.device_mesh, param.placements)  # type: ignore[attr-defined]
                param.grad = grad
            local.grad = grad.to_local()  # type: ignore[attr-defined,union-attr]

    def bring_in_all(self) -> None:
        """Before a synced backward: every DTensor's current gradient (None, or what no_sync accumulated), for the
        parameters the reducer marks ready without their hook (unused ones)."""
        for i in self.sharded:
            self.bring_in(i)

    def publish(self) -> None:
        """After the averages are written: a DTensor parameter whose local ``.grad`` is a tensor of the reducer's
        gets a DTensor ``.grad`` over it, with the parameter's mesh and placements."""
        with torch.no_grad():
            for i in self.sharded:
                self._publish(i)

    def _publish(self, i: int) -> None:
        param, local = self.params[i], self.locals[i]
        if local.grad is None:
            return
        current = param.grad
        if current is not None and current.to_local() is local.grad:  # type: ignore[attr-defined]
            return
        param.grad = dtensor_type().from_local(  # type: ignore[union-attr]
            local.grad,
            param.device_mesh,  # type: ignore[attr-defined]
            param.placements,  # type: ignore[attr-defined]
            run_check=False,
            shape=param.shape,
            stride=param.stride(),
        )
