"""The collective backends a job uses: gloo (CPU tensors, and the default without a GPU), and NCCL with the GPUs it
would run on (``gradsync.init()`` picks NCCL whenever CUDA is available)."""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from gradsync.doctor.job import GLOO_IFNAME_VARIABLE, Job
from gradsync.doctor.result import Result


def check_gloo() -> Result:
    """gloo is built in, and a group of one forms here (gloo picks its interface then: GLOO_SOCKET_IFNAME, else
    the host name's address)."""
    if not dist.is_available() or not dist.is_gloo_available():
        return Result("gloo", "fail", "this torch has no gloo backend", "install a torch build with distributed")
    try:
        # A backend of one on its own store: no default group is touched, and no peer is contacted.
        dist.ProcessGroupGloo(dist.HashStore(), 0, 1, datetime.timedelta(seconds=2))
    except RuntimeError as exc:
        return Result(
            "gloo",
            "fail",
            f"gloo cannot make its device: {str(exc).splitlines()[0]}",
            f"check {GLOO_IFNAME_VARIABLE} (see 'network')",
        )
    return Result("gloo", "ok", "gloo is available and a group of one forms here")


def check_gpus(job: Job) -> Result:
    """The GPUs NCCL would use, one per worker: NCCL refuses two ranks of a group on one GPU."""
    if not torch.cuda.is_available():
        if job.workers_per_node == "gpu":
            return Result("nccl/GPUs", "fail", "--nproc-per-node gpu, and no GPU is visible", "use a number, or cpu")
        return Result("nccl/GPUs", "ok", "no GPU: CPU/gloo only")
    count = torch.cuda.device_count()
    names = sorted({torch.cuda.get_device_name(i) for i in range(count)})
    seen = f"{count} GPU(s): {', '.join(names)}"
    if not dist.is_nccl_available():
        return Result(
            "nccl/GPUs",
            "fail",
            f"{seen}, and this torch has no NCCL (gradsync.init() picks NCCL with CUDA)",
            "install a CUDA build of torch, or call gradsync.init(backend='gloo')",
        )
    version = ".".join(str(p) for p in torch.cuda.nccl.version())
    if job.workers_per_node.isdigit() and int(job.workers_per_node) > count:
        return Result(
            "nccl/GPUs",
            "fail",
            f"{seen}; --nproc-per-node {job.workers_per_node} puts two workers on one GPU, which NCCL refuses",
            f"--nproc-per-node {count} (or gpu), or set CUDA_VISIBLE_DEVICES",
        )
    return Result("nccl/GPUs", "ok", f"NCCL {version}; {seen}")
