"""The bucket of a sparse gradient: no flat buffer and no slots, beside the dense
:class:`gradsync.reducer.buckets.Bucket` (whose assignment rule gives every sparse parameter a bucket of its own)."""

from __future__ import annotations

from collections.abc import Sequence

import torch


class SparseBucket:
    """A bucket of one parameter whose gradient is sparse (a sparse ``nn.Embedding``): the gradient itself, divided
    on its way in, is what is all-reduced (gloo sums sparse tensors; torch's DDP does the same), and the result
    becomes ``.grad``. It has the dense :class:`Bucket`'s interface, so the step handles both alike."""

    def __init__(self, index: int, param_index: int, params: Sequence[torch.Tensor]) -> None:
        self.index = index
        self.assigned = self.param_indices = [param_index]
        param = params[param_index]
        self.params = [param]
        self.n_large = 1  # its gradient is taken as soon as it is ready
        self.nbytes = param.numel() * param.element_size()  # its dense size, for messages
        self.buffer = _empty_sparse(param)
        self.views = [self.buffer]

    def take(self, _slot: int, divisor: int | None) -> None:
        grad = self.params[0].grad
        if grad is None:
            self.buffer = _empty_sparse(self.params[0])
        else:
            grad = grad.coalesce()
            self.buffer = grad / divisor if divisor else grad.clone()
        self.views = [self.buffer]

    def gather(self, divisor: int | None, large_slots: Sequence[int] = ()) -> None:
        pass  # taken when ready

    def receive(self, result: torch.Tensor) -> None:
        self.buffer = result
        self.views = [result]

    def write_back(self, scale: float) -> None:
        self.params[0].grad = self.buffer * scale if scale != 1.0 else self.buffer


def _empty_sparse(param: torch.Tensor) -> torch.Tensor:
    indices = torch.zeros(1, 0, dtype=torch.int64, device=param.device)
    values = torch.zeros(0, *param.shape[1:], dtype=param.dtype, device=param.device)
    return torch.sparse_coo_tensor(indices, values, param.shape)
