"""The public torch APIs gradsync needs that older releases lack: with the private names, they set the oldest torch
gradsync runs on (pyproject's floor). One of them, a behaviour of the autograd engine, has a fallback."""

from __future__ import annotations

import inspect
import re

import torch.distributed as dist

from gradsync.torch_private.autograd import probe_hooks_for_undefined_gradients
from gradsync.torch_private.records import READ, PublicApi, attribute, takes_parameter


def _bucket_methods_called() -> object:
    """torch's hooks run unchanged on gradsync's GradBucket: they call nothing on a bucket that it lacks."""
    hooks = "torch.distributed.algorithms.ddp_comm_hooks"
    source = "".join(inspect.getsource(attribute(f"{hooks}.{m}")()) for m in ("powerSGD_hook", "default_hooks"))  # type: ignore[arg-type]
    called = set(re.findall(r"\bbucket\.([a-z_]+)\(", source))
    unknown = called - {"buffer", "gradients", "index", "is_last", "parameters", "set_buffer"}
    if unknown:
        raise AttributeError(f"torch's hooks call GradBucket.{sorted(unknown)}, which gradsync's GradBucket lacks")
    return called


_PUBLIC_HOW = f"resolved in 2.4.0, 2.8.0 and 2.13.0; {READ}"
PUBLIC_APIS: tuple[PublicApi, ...] = (
    PublicApi(
        "torch.Tensor.register_post_accumulate_grad_hook",
        "2.1",
        _PUBLIC_HOW + ": torch/_tensor.py",
        attribute("torch.Tensor.register_post_accumulate_grad_hook"),
    ),
    PublicApi(
        "torch.autograd.graph.get_gradient_edge",
        "2.2",
        f"resolved in 2.13.0; {READ}: torch/autograd/graph.py (the reducer hooks the node it returns, a parameter's "
        "AccumulateGrad, as torch's reducer does)",
        attribute("torch.autograd.graph.get_gradient_edge"),
    ),
    PublicApi(
        "torch.compiler.disable(fn, recursive=False)",
        "2.1",
        _PUBLIC_HOW + ": torch/compiler/__init__.py",
        takes_parameter("torch.compiler.disable", "recursive"),
    ),
    PublicApi(
        "torch.compiler.is_compiling",
        "2.3",
        _PUBLIC_HOW + ": torch/compiler/__init__.py",
        attribute("torch.compiler.is_compiling"),
    ),
    PublicApi(
        "torch.distributed.device_mesh.DeviceMesh",
        "2.2",
        _PUBLIC_HOW + ": torch/distributed/device_mesh.py",
        attribute("torch.distributed.device_mesh.DeviceMesh"),
    ),
    PublicApi(
        "torch.distributed.elastic.multiprocessing.DefaultLogsSpecs, start_processes(logs_specs=)",
        "2.2",
        _PUBLIC_HOW + ": torch/distributed/elastic/multiprocessing/__init__.py",
        lambda: (
            takes_parameter("torch.distributed.elastic.multiprocessing.start_processes", "logs_specs")(),
            attribute("torch.distributed.elastic.multiprocessing.DefaultLogsSpecs")(),
        ),
    ),
    PublicApi(
        "torch.distributed.DistError, DistStoreError, DistNetworkError",
        "2.2",
        _PUBLIC_HOW + ": torch/distributed/__init__.py",
        lambda: (dist.DistError, dist.DistStoreError, dist.DistNetworkError),
    ),
    PublicApi(
        "torch.distributed.run.config_from_args, get_args_parser",
        "1.9",
        _PUBLIC_HOW + ": torch/distributed/run.py",
        lambda: (
            attribute("torch.distributed.run.config_from_args")(),
            attribute("torch.distributed.run.get_args_parser")(),
        ),
    ),
    PublicApi(
        "torch.distributed.algorithms.join.Join, Joinable, JoinHook",
        "1.10",
        _PUBLIC_HOW + ": torch/distributed/algorithms/join.py",
        attribute("torch.distributed.algorithms.join.JoinHook"),
    ),
    PublicApi(
        "powerSGD_hook and default_hooks call only buffer/gradients/index/is_last/set_buffer on a bucket",
        "1.8",
        _PUBLIC_HOW + ": torch/distributed/algorithms/ddp_comm_hooks/{powerSGD_hook,default_hooks}.py",
        _bucket_methods_called,
    ),
    PublicApi(
        "torch.distributed.Work.get_future",
        "1.8",
        _PUBLIC_HOW + ": torch/_C/_distributed_c10d.pyi",
        attribute("torch.distributed.Work.get_future"),
    ),
    PublicApi(
        "the autograd engine runs post-accumulate-grad hooks for a parameter reached only through an undefined "
        "gradient (find_unused_parameters with an output the loss does not use)",
        "2.8",
        "run in 2.4.0 and 2.7.0 (the hook never runs) and in 2.8.0, 2.10.0 and 2.13.0 (it runs, with .grad None)",
        probe_hooks_for_undefined_gradients,
        fallback="find_unused_parameters: the parameters still without a gradient at the end of the backward are "
        "marked as their hooks would have been (gradsync/reducer/reducer.py, _end_of_backward)",
    ),
)
