"""Configuration that differs between ranks (2 gloo ranks): a flag, a bucket size, a hook or an environment
variable set on one rank only. Either every rank fails naming the setting, or training stays right."""

from __future__ import annotations

import torch

import gradsync
from conformance.sweep.core import case, ranks
from conformance.sweep.util import same_and_right, seeded, setenv, train_compare
from lab.zoo.toys import Big, Shallow, ShallowBN

CAT = "rank-dependent config"


def _config_on_rank0(rank: int, world: int, setting: str, model: str) -> dict:
    kwargs: dict = {}
    if rank == 0:
        if setting == "GRADSYNC_DEBUG":
            setenv(GRADSYNC_DEBUG="1")
        elif setting == "GRADSYNC_BUCKET_TUNING":
            setenv(GRADSYNC_BUCKET_TUNING="0")
        elif setting == "bucket_cap_mb":
            kwargs["bucket_cap_mb"] = 0.0001  # 100 bytes: one bucket per parameter on rank 0, one in all on rank 1
        elif setting == "comm_hook":
            pass
        else:
            kwargs[setting] = {"forward_sync_buffers": False}.get(setting, True)
    make = {"mlp": Shallow, "bn": ShallowBN, "big": lambda: Big()}[model]
    net, ref = seeded(make)
    ddp = gradsync.DistributedDataParallel(net, **kwargs)
    if setting == "comm_hook" and rank == 0:
        from gradsync.comm import bf16_compress_hook

        ddp.register_comm_hook(None, bf16_compress_hook)
    make_batch = None
    if model == "big":
        make_batch = lambda step, r: torch.randn(8, 256, generator=torch.Generator().manual_seed(step * 7 + r))  # noqa: E731
    if make_batch is None:
        return train_compare(ddp, ref, rank, world, steps=4)
    return train_compare(ddp, ref, rank, world, steps=4, make=make_batch, lr=0.01)


def _rank_case(setting: str, model: str, keywords, how: str, name: str | None = None) -> None:
    @case(name or f"rank0_only_{setting}", CAT, how, keywords, check=same_and_right)
    def _():
        return ranks(_config_on_rank0, setting, model)


_rank_case(
    "bucket_cap_mb",
    "mlp",
    ["bucket_cap_mb"],
    "bucket_cap_mb=0.0001 on rank 0, default on rank 1: different bucket layouts",
)
_rank_case(
    "find_unused_parameters",
    "mlp",
    ["find_unused_parameters"],
    "find_unused_parameters=True on rank 0 only (an extra usage all-reduce there)",
)
_rank_case("static_graph", "mlp", ["static_graph"], "static_graph=True on rank 0 only")
_rank_case(
    "gradient_as_bucket_view",
    "mlp",
    ["gradient_as_bucket_view"],
    "gradient_as_bucket_view=True on rank 0 only (a local memory choice: may be accepted)",
)
_rank_case(
    "forward_sync_buffers",
    "bn",
    ["forward_sync_buffers"],
    "forward_sync_buffers=False on rank 0 only, BatchNorm model (buffer broadcasts on one rank)",
)
_rank_case("comm_hook", "mlp", [("hook", "bf16")], "bf16_compress_hook registered on rank 0 only")
_rank_case("GRADSYNC_DEBUG", "mlp", ["GRADSYNC_DEBUG"], "GRADSYNC_DEBUG=1 on rank 0 only")
_rank_case(
    "GRADSYNC_BUCKET_TUNING",
    "big",
    ["GRADSYNC_BUCKET_TUNING"],
    "GRADSYNC_BUCKET_TUNING=0 on rank 0 only, a model the tuner probes (0.5 MiB of gradients)",
)
