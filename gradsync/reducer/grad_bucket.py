"""GradBucket: what a communication hook sees of one bucket, with torch's method names.

torch's hooks (``torch.distributed.algorithms.ddp_comm_hooks``) call ``buffer()``, ``index()``, ``is_last()``,
``gradients()``, ``parameters()`` and ``set_buffer()``; giving them the same object lets them run unchanged.
"""

from __future__ import annotations

import torch


class GradBucket:
    """A bucket of flattened gradients handed to a communication hook.

    Example (a hook that sums instead of averaging)::

        def sum_hook(state, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
            work = dist.all_reduce(bucket.buffer(), group=state, async_op=True)
            return work.get_future().then(lambda fut: fut.value()[0])
    """

    def __init__(
        self,
        index: int,
        buffer: torch.Tensor,
        gradients: list[torch.Tensor],
        parameters: list[torch.Tensor],
        is_last: bool,
    ) -> None:
        self._index = index
        self._buffer = buffer
        self._gradients = gradients
        self._parameters = parameters
        self._is_last = is_last

    def index(self) -> int:
        """Position of this bucket in launch order (0 is reduced first)."""
        return self._index

    def buffer(self) -> torch.Tensor:
        """The flat 1-D tensor holding every gradient of this bucket."""
        return self._buffer

    def gradients(self) -> list[torch.Tensor]:
        """One view of ``buffer()`` per parameter, shaped like the parameter."""
        return self._gradients

    def parameters(self) -> list[torch.Tensor]:
        """The parameters whose gradients this bucket holds, in buffer order."""
        return self._parameters

    def is_last(self) -> bool:
        """True for the last bucket of the iteration (hooks use it to count iterations)."""
        return self._is_last

    def set_buffer(self, buffer: torch.Tensor) -> None:
        """Make ``buffer`` (e.g. a compressed copy) what later hooks see as ``buffer()``; as in torch, the reducer
        still takes the averaged result from the hook's future."""
        self._buffer = buffer


def result_future(device: torch.device) -> torch.futures.Future:
    """The future a hook returns for a bucket on ``device`` when it completes it later itself (the quantized
    hook's, in its all-gather's callback; a bucket's future while it waits for the bucket before it).

    torch's hook contract: a plain ``Future()`` records no CUDA event, so the reducer's wait, and its copy into
    ``.grad``, would not wait for the averaging kernels queued on the callback's stream, and ``.grad`` could get
    un-averaged values. A future with ``devices`` records an event on the stream current when ``set_result`` runs
    (the callback's, after those kernels) and makes every waiter's stream wait for it.
    """
    if device.type == "cpu":
        return torch.futures.Future()
    return torch.futures.Future(devices=[device])
