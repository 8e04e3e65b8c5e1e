"""SyncBatchNorm: batch normalisation over the whole global batch, on CPU/gloo as on GPU/NCCL.

torch's ``nn.SyncBatchNorm`` runs only on CUDA (its statistics kernels have no CPU version), so on gloo there is
nothing. This one is plain tensor arithmetic, so it runs wherever the process group does. In training, each rank
computes its batch's count, mean and sum of squared deviations; one all-gather gives every rank everyone's, and
they are combined exactly (Chan et al.'s parallel variance), so uneven batch sizes are weighted correctly. Backward
needs the global sums of ``dy`` and ``dy * x_hat``: one all-reduce. Evaluation uses the running statistics and
communicates nothing.

The result equals ``BatchNorm`` over all ranks' batches concatenated in one process (tests/test_sync_batchnorm.py).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gradsync.collectives.communicator import Communicator, Op
from gradsync.errors import ConfigError
from gradsync.torch_private import BatchNormBase
from gradsync.validate import require_bool, require_group, require_int, require_number


def _check_arguments(
    num_features: object, eps: object, momentum: object, switches: tuple[object, object], group: object
) -> None:
    """torch's BatchNorm takes these unchecked and fails at the first forward (a zero-size buffer, eps <= 0) or
    never (a NaN momentum poisons the running statistics): refused here, by name."""
    where = "SyncBatchNorm"
    require_int(where, "num_features (the channels, C of an (N, C, ...) input)", num_features, 1)
    if require_number(where, "eps", eps, 0.0) == 0:
        raise ConfigError(f"{where}: eps must be > 0 (it keeps the division by the deviation finite), got {eps!r}")
    if momentum is not None and require_number(where, "momentum", momentum, 0.0) > 1:
        raise ConfigError(f"{where}: momentum must be in [0, 1], or None for a cumulative average, got {momentum!r}")
    require_bool(where, "affine", switches[0])
    require_bool(where, "track_running_stats", switches[1])
    require_group(where, "process_group", group)


class SyncBatchNorm(BatchNormBase):
    """``torch.nn.SyncBatchNorm``'s arguments and behaviour, on any device and backend.

    Example::

        model = gradsync.SyncBatchNorm.convert_sync_batchnorm(model)   # every BatchNorm*d becomes one of these
        ddp = gradsync.DistributedDataParallel(model)
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group: dist.ProcessGroup | None = None,
        device: Any = None,
        dtype: Any = None,
    ) -> None:
        _check_arguments(num_features, eps, momentum, (affine, track_running_stats), process_group)
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype)
        self.process_group = process_group

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ConfigError(f"SyncBatchNorm expects an input of at least 2 dimensions (N, C, ...), got {input.dim()}")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        use_batch_stats = self.training or not self.track_running_stats
        if not use_batch_stats or not dist.is_initialized() or dist.get_world_size(self.process_group) == 1:
            return super().forward(input)  # torch's BatchNorm: nothing to synchronise
        comm = Communicator(self.process_group)
        output, mean, var, count = _SyncBatchNormFunction.apply(input, self.weight, self.bias, self.eps, comm)
        if self.training and self.track_running_stats:
            self._update_running_stats(mean, var, count)
        return output

    @torch.no_grad()
    def _update_running_stats(self, mean: torch.Tensor, var: torch.Tensor, count: torch.Tensor) -> None:
        assert self.running_mean is not None and self.running_var is not None
        assert self.num_batches_tracked is not None
        self.num_batches_tracked.add_(1)
        momentum = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        unbiased = var * (count / (count - 1).clamp(min=1))  # torch keeps the unbiased variance
        self.running_mean.mul_(1 - momentum).add_(mean, alpha=momentum)
        self.running_var.mul_(1 - momentum).add_(unbiased, alpha=momentum)

    @classmethod
    def convert_sync_batchnorm(cls, module: nn.Module, process_group: dist.ProcessGroup | None = None) -> nn.Module:
        """``module`` with every ``BatchNorm1d/2d/3d`` replaced by a SyncBatchNorm holding the same parameters,
        statistics and mode (torch's ``convert_sync_batchnorm``)."""
        if not isinstance(module, nn.Module):
            raise ConfigError(
                f"SyncBatchNorm.convert_sync_batchnorm expects a torch.nn.Module (the model to convert), got "
                f"{type(module).__name__} {module!r:.40}; pass the model object itself."
            )
        if isinstance(module, BatchNormBase) and not isinstance(module, cls):
            return _converted(cls, module, process_group)
        for name, child in list(module.named_children()):
            module.add_module(name, cls.convert_sync_batchnorm(child, process_group))
        return module


def _converted(cls: type[SyncBatchNorm], bn: BatchNormBase, group: Any) -> SyncBatchNorm:
    sync = cls(bn.num_features, bn.eps, bn.momentum, bn.affine, bn.track_running_stats, group)
    if bn.affine:
        with torch.no_grad():
            sync.weight = bn.weight
            sync.bias = bn.bias
    sync.running_mean = bn.running_mean
    sync.running_var = bn.running_var
    sync.num_batches_tracked = bn.num_batches_tracked
    sync.train(bn.training)
    if hasattr(bn, "qconfig"):
        sync.qconfig = bn.qconfig
    return sync


class _SyncBatchNormFunction(torch.autograd.Function):
    """Normalise with the global batch's statistics; backward with the global sums it needs."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: Any, bias: Any, eps: float, comm: Communicator) -> Any:  # type: ignore[override]
        dims = [d for d in range(x.dim()) if d != 1]
        mean, var, count = _global_stats(x, dims, comm)  # float32 for a half-precision x, as torch keeps them
        shape = [1, -1] + [1] * (x.dim() - 2)
        invstd = torch.rsqrt(var + eps)
        x_hat = (x.to(mean.dtype) - mean.view(shape)) * invstd.view(shape)
        out = x_hat * weight.view(shape) + bias.view(shape) if weight is not None else x_hat
        ctx.save_for_backward(x_hat.to(x.dtype), invstd, weight, count)
        ctx.comm, ctx.dims, ctx.shape = comm, dims, shape
        ctx.mark_non_differentiable(mean, var, count)
        return out.to(x.dtype), mean, var, count  # the input's dtype, as torch's (autocast's fp16 stays fp16)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor, *_unused: Any) -> Any:  # type: ignore[override]
        x_hat, invstd, weight, count = ctx.saved_tensors
        dims, shape = ctx.dims, ctx.shape
        # Sums in float32 for half-precision gradients: a channel's sum over a large batch overflows float16.
        dy_acc, x_hat = dy.to(invstd.dtype), x_hat.to(invstd.dtype)
        local_dy = dy_acc.sum(dims)
        local_dy_xhat = (dy_acc * x_hat).sum(dims)
        sums = torch.cat([local_dy, local_dy_xhat])
        ctx.comm.all_reduce(Op.SYNC_BATCHNORM, sums)  # the global sums, over every rank's batch
        sum_dy, sum_dy_xhat = sums.chunk(2)
        scale = invstd if weight is None else invstd * weight
        dx = (dy_acc - (sum_dy / count).view(shape) - x_hat * (sum_dy_xhat / count).view(shape)) * scale.view(shape)
        dweight = local_dy_xhat.to(weight.dtype) if weight is not None and ctx.needs_input_grad[1] else None
        dbias = local_dy.to(weight.dtype) if weight is not None and ctx.needs_input_grad[2] else None
        return dx.to(dy.dtype), dweight, dbias, None, None


def _global_stats(x: torch.Tensor, dims: list[int], comm: Communicator) -> tuple[torch.Tensor, ...]:
    """Mean and (biased) variance per channel over every rank's batch, and the total count, from one all-gather of
    each rank's count, mean and sum of squared deviations (exact for uneven batch sizes). In float32 for a
    half-precision ``x`` (torch's statistics are float32 too): a float16 count is ``inf`` past 65,504 values per
    channel, and the variance would then be NaN."""
    n = x.numel() // x.shape[1]
    acc = x.detach().to(torch.float64) if x.dtype in (torch.float16, torch.bfloat16) else x.detach()
    mean = acc.mean(dims) if n else torch.zeros(x.shape[1], dtype=acc.dtype, device=x.device)
    m2 = ((acc - mean.view([1, -1] + [1] * (x.dim() - 2))) ** 2).sum(dims)
    mine = torch.cat([mean, m2, torch.tensor([float(n)], dtype=acc.dtype, device=x.device)])
    everyone = torch.stack(comm.all_gather(Op.SYNC_BATCHNORM, mine))
    means, m2s, counts = everyone[:, : x.shape[1]], everyone[:, x.shape[1] : -1], everyone[:, -1:]
    total = counts.sum()
    if total == 0:
        raise ConfigError("SyncBatchNorm: every rank's batch is empty, so there are no statistics to compute.")
    global_mean = (means * counts).sum(0) / total
    global_m2 = (m2s + counts * (means - global_mean) ** 2).sum(0)
    stat = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
    return global_mean.to(stat), (global_m2 / total).to(stat), total.to(stat)
