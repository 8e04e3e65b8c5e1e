"""Every torch-private name gradsync relies on, in one place, with the torch releases it was checked against.

torch promises nothing about names that start with an underscore, so each one gradsync uses goes through an
accessor here, and :data:`PRIVATE_NAMES` records where it is used, which releases it was checked in and how.
:data:`PUBLIC_APIS` records the public APIs that set the oldest torch gradsync can run on. :func:`check` resolves
every record in the installed torch; importing this module warns once, naming the name and the installed version,
for each private name this torch lacks. An accessor whose name is gone degrades where gradsync has another way
(the fallback each record names) and otherwise fails when it is called, with the same words.

How the releases were checked: every x.0 release from 2.4.0 to 2.13.0. In 2.4.0 and 2.8.0 (scratch virtual
environments with the PyPI wheels) and 2.13.0 (the project's), :func:`check` was run and the accessors called on a
one-process gloo group (tests/test_torch_private.py); for the other releases, whose wheels were downloaded but not
installed, the Python sources and the ``torch/_C`` stubs of each wheel were read for each name, as each record's
``how`` says. Every private name resolves from 2.4.0 on; one is spelled two ways in that range (dynamo's
``optimize_ddp`` mode reader moved in 2.7) and :func:`optimize_ddp_mode` reads either.

pyproject's floor is ``torch>=2.4``, the oldest release checked, as the project promises. One behaviour differs
inside that range and gradsync covers both (the last of :data:`PUBLIC_APIS`, the one with a fallback): from 2.8.0
the autograd engine runs the post-accumulate-grad hook of a parameter reached only through an undefined gradient
(an output the loss does not use), which is how gradsync's reducer counts such a parameter unused; in 2.4.0 to
2.7.0 the hook never runs, so with ``find_unused_parameters=True`` the reducer marks the parameters still without
a gradient at the end of the backward as its hooks would have (:func:`hooks_run_for_undefined_gradients`;
tests/test_torch_parity.py's unused_output and undefined_grads cases, run in 2.4.0 and 2.13.0).
A torch newer than 2.13 is unchecked: :func:`check` (and tests/test_torch_private.py) says what it lacks.

:mod:`gradsync.ddp.compiled` stays the seam through which ``torch.compile`` splits graphs at bucket boundaries;
its names are the records whose ``seam`` is ``"compile"`` (what the split needs) or ``"compile-notice"`` (what
its warning about an unsplit graph reads), and it checks the first through :func:`missing`.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import pkgutil
import re
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gradsync.errors import GradsyncError

CHECKED_VERSIONS = ("2.4.0", "2.5.0", "2.6.0", "2.7.0", "2.8.0", "2.9.0", "2.10.0", "2.11.0", "2.12.0", "2.13.0")
FLOOR = "2.4"
_RAN = "check() and the accessor run in 2.4.0, 2.8.0 and 2.13.0"
_READ = "read in the 2.5.0-2.7.0 and 2.9.0-2.12.0 wheels"


class TorchCompatError(GradsyncError):
    """The installed torch lacks a private name gradsync needs (the message names it and the torch version)."""


@dataclass(frozen=True)
class PrivateName:
    """One torch name gradsync depends on: where, why, which torch releases it was checked in, and how."""

    name: str  # as torch spells it
    used_in: tuple[str, ...]  # gradsync's files that use it (through an accessor here, or compiled.py)
    why: str
    checked: tuple[str, ...]
    how: str
    resolve: Callable[[], object] = field(repr=False, compare=False)  # raises where the installed torch lacks it
    fallback: str = ""  # what gradsync does without it; "" where the accessor fails instead
    seam: str = ""  # "compile": what gradsync.ddp.compiled needs to split graphs; "compile-notice": to warn


def _attr(dotted: str) -> Callable[[], object]:
    """A resolver for ``module.attr.attr`` (the stdlib's ``pkgutil.resolve_name``: the longest importable module
    prefix, then attributes)."""
    return lambda: pkgutil.resolve_name(dotted)


def _source_has(dotted: str, *needles: str) -> Callable[[], object]:
    """A resolver that reads ``dotted``'s source and requires each of ``needles`` in it."""

    def resolve() -> object:
        source = inspect.getsource(_attr(dotted)())  # type: ignore[arg-type]
        absent = [n for n in needles if n not in source]
        if absent:
            raise AttributeError(f"{dotted} no longer contains {absent}")
        return True

    return resolve


def _parameter(dotted: str, parameter: str) -> Callable[[], object]:
    """A resolver for a function that takes ``parameter``."""
    return lambda: inspect.signature(_attr(dotted)()).parameters[parameter]  # type: ignore[arg-type]


def _bucket_methods_called() -> object:
    """torch's hooks run unchanged on gradsync's GradBucket: they call nothing on a bucket that it lacks."""
    hooks = "torch.distributed.algorithms.ddp_comm_hooks"
    source = "".join(inspect.getsource(_attr(f"{hooks}.{m}")()) for m in ("powerSGD_hook", "default_hooks"))  # type: ignore[arg-type]
    called = set(re.findall(r"\bbucket\.([a-z_]+)\(", source))
    unknown = called - {"buffer", "gradients", "index", "is_last", "parameters", "set_buffer"}
    if unknown:
        raise AttributeError(f"torch's hooks call GradBucket.{sorted(unknown)}, which gradsync's GradBucket lacks")
    return called


def _hooks_run_for_undefined_gradients() -> object:
    """Whether the engine runs the post-accumulate-grad hook of a parameter whose only gradient is undefined (an
    output the loss does not use, routed through a sink as gradsync's reducer routes outputs)."""

    class Sink(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, used: torch.Tensor, unused: torch.Tensor) -> Any:  # type: ignore[override]
            ctx.set_materialize_grads(False)
            return used.clone(), unused.clone()

        @staticmethod
        def backward(ctx: Any, *grads: torch.Tensor | None) -> Any:  # type: ignore[override]
            return grads

    used, unused = torch.zeros(1, requires_grad=True), torch.zeros(1, requires_grad=True)
    ran: list[torch.Tensor] = []
    unused.register_post_accumulate_grad_hook(ran.append)
    with torch.enable_grad():
        out, _ = Sink.apply(used * 1, unused * 1)
        out.sum().backward()
    if not ran:
        raise RuntimeError("the engine skips the hooks of a parameter reached only through an undefined gradient")
    return True


def _backend_options_timeout() -> object:
    # The classes only: _timeout itself is read on a live group (tests/test_torch_private.py).
    return _attr("torch.distributed.ProcessGroup._get_backend")(), _attr("torch.distributed.ProcessGroupGloo.options")()


def _optimize_ddp_mode_reader() -> Callable[[], object]:
    utils = importlib.import_module("torch._dynamo.utils")
    reader = getattr(utils, "get_optimize_ddp_mode", None)  # 2.7 and later
    if reader is None:
        reader = importlib.import_module("torch._dynamo.config")._get_optimize_ddp_mode  # 2.4 to 2.6
    if not callable(reader):
        raise AttributeError("get_optimize_ddp_mode is not callable")
    return reader  # type: ignore[no-any-return]


def _compiled_function_class() -> object:
    wrappers = importlib.import_module("torch._functorch._aot_autograd.runtime_wrappers")
    source = inspect.getsource(wrappers)
    if "class CompiledFunction(torch.autograd.Function)" not in source:
        raise AttributeError("AOTAutograd's CompiledFunction (its backward node is CompiledFunctionBackward)")
    return True


_ALL = CHECKED_VERSIONS
_COMPILED = "gradsync/ddp/compiled.py"
PRIVATE_NAMES: tuple[PrivateName, ...] = (
    PrivateName(
        "torch._foreach_copy_",
        ("gradsync/reducer/buckets.py", "gradsync/collectives/tensors.py"),
        "copies many gradients into (or out of) a bucket in one kernel launch",
        _ALL,
        f"{_RAN}; {_READ}: torch/_C/_VariableFunctions.pyi",
        _attr("torch._foreach_copy_"),
        fallback="a copy_ per tensor",
    ),
    PrivateName(
        "torch._foreach_mul_",
        ("gradsync/reducer/layout.py",),
        "scales every dense bucket by one number in one kernel launch",
        _ALL,
        f"{_RAN}; {_READ}: torch/_C/_VariableFunctions.pyi (the list, scalar overload)",
        _attr("torch._foreach_mul_"),
        fallback="a mul_ per tensor",
    ),
    PrivateName(
        "torch._C.Future",
        ("gradsync/reducer/reduction.py",),
        "the class of every future a hook may return: torch.futures.Future and what .then() returns",
        _ALL,
        f"{_RAN}; {_READ}: torch/_C/__init__.pyi, torch/futures/__init__.py (Future subclasses it)",
        _attr("torch._C.Future"),
        fallback="torch.futures.Future",
    ),
    PrivateName(
        "torch._C._current_graph_task_id",
        ("gradsync/reducer/ready.py",),
        "tells one backward from the next (a nested backward shares no id with the outer one)",
        _ALL,
        f"{_RAN}; {_READ}: torch/_C/__init__.pyi",
        _attr("torch._C._current_graph_task_id"),
        fallback="-1, as outside a backward",
    ),
    PrivateName(
        "torch.autograd.graph._engine_run_backward",
        ("gradsync/reducer/ready.py",),
        "the frame that backward() and autograd.grad() run the engine in, counted to notice a nested backward",
        _ALL,
        f"{_RAN}; {_READ}: torch/autograd/graph.py defines it, torch/autograd/__init__.py calls it twice",
        lambda: (
            _source_has("torch.autograd.backward", "_engine_run_backward(")(),
            _source_has("torch.autograd.grad", "_engine_run_backward(")(),
        ),
    ),
    PrivateName(
        "torch.autograd.Variable._execution_engine.queue_callback",
        ("gradsync/reducer/reducer.py",),
        "runs the finalizer when the outermost backward ends, as torch's DDP does",
        _ALL,
        f"{_RAN}; {_READ}: torch/autograd/variable.py, torch/_C/__init__.pyi (_ImperativeEngine)",
        _attr("torch.autograd.Variable._execution_engine.queue_callback"),
    ),
    PrivateName(
        "torch._C._get_privateuse1_backend_name",
        ("gradsync/launch/run.py",),
        "the name a custom accelerator registered, accepted by --nproc-per-node",
        _ALL,
        f"{_RAN}; {_READ}: torch/_C/__init__.pyi",
        _attr("torch._C._get_privateuse1_backend_name"),
        fallback='"privateuseone"',
    ),
    PrivateName(
        "torch.distributed.distributed_c10d._get_default_store",
        (
            "gradsync/collectives/communicator.py",
            "gradsync/collectives/peer_errors.py",
            "gradsync/elastic/membership.py",
        ),
        "the default group's key-value store: arrival checks and the peers' error reports live there",
        _ALL,
        f"{_RAN}; {_READ}: torch/distributed/distributed_c10d.py",
        _attr("torch.distributed.distributed_c10d._get_default_store"),
    ),
    PrivateName(
        "torch.distributed.distributed_c10d._world.group_count",
        ("gradsync/elastic/membership.py",),
        "reset after a failed init_process_group, as destroy_process_group resets it, so store keys match again",
        _ALL,
        f"{_RAN}; {_READ}: torch/distributed/distributed_c10d.py (_World.group_count has a setter)",
        _attr("torch.distributed.distributed_c10d._world.group_count"),
    ),
    PrivateName(
        "ProcessGroup._get_backend(device).options._timeout",
        ("gradsync/collectives/communicator.py",),
        "the collective timeout the backend enforces, which bounds gradsync's own waits on hook futures",
        _ALL,
        f"{_RAN}; {_READ}: torch/_C/_distributed_c10d.pyi (2.4.0's stub omits Backend.options; it ran there)",
        _backend_options_timeout,
        fallback="GRADSYNC_TIMEOUT or 600 s",
    ),
    PrivateName(
        "torch.nn.modules.batchnorm._BatchNorm",
        ("gradsync/nn/sync_batchnorm.py",),
        "the base of torch's batch norms: SyncBatchNorm derives from it and convert_sync_batchnorm finds them by it",
        _ALL,
        f"{_RAN}; {_READ}: torch/nn/modules/batchnorm.py",
        _attr("torch.nn.modules.batchnorm._BatchNorm"),
    ),
    PrivateName(
        "torch.Tensor._version",
        ("gradsync/optim/overlapped.py",),
        "a tensor's in-place write counter: tells a .grad edited after its bucket was stepped",
        _ALL,
        f"{_RAN}; {_READ}: torch/_C/__init__.pyi (TensorBase._version)",
        lambda: torch.zeros(1)._version,
    ),
    PrivateName(
        "_ddp_params_and_buffers_to_ignore",
        ("gradsync/ddp/arguments.py", "gradsync/ddp/module.py"),
        "the module attribute torch's DDP reads for the parameters to leave alone; gradsync reads and sets it too",
        _ALL,
        f"{_RAN}; {_READ}: torch/nn/parallel/distributed.py",
        _source_has(
            "torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model",
            "_ddp_params_and_buffers_to_ignore",
        ),
    ),
    PrivateName(
        "torch._dynamo",
        ("gradsync/elastic/__init__.py", _COMPILED),
        "imported ahead (about 2 s) so a joiner does not pay it inside its first step",
        _ALL,
        f"{_RAN}; {_READ}: torch/_dynamo/__init__.py",
        lambda: importlib.util.find_spec("torch._dynamo"),
    ),
    PrivateName(
        "torch.distributed._DEFAULT_FIRST_BUCKET_BYTES",
        ("gradsync/reducer/buckets.py",),
        "torch's first-bucket size, which gradsync's DEFAULT_FIRST_BUCKET_BYTES mirrors (tested equal)",
        _ALL,
        f"{_RAN} (1 MiB in both); {_READ}: torch/_C/_distributed_c10d.pyi",
        _attr("torch.distributed._DEFAULT_FIRST_BUCKET_BYTES"),
        fallback="gradsync's own 1 MiB",
    ),
    PrivateName(
        "torch.nn.parallel.DistributedDataParallel._active_ddp_module / _get_active_ddp_module",
        (_COMPILED,),
        "where dynamo looks for the DDP whose frames it splits at bucket boundaries",
        _ALL,
        f"{_RAN}; {_READ}: torch/nn/parallel/distributed.py",
        lambda: (
            _attr("torch.nn.parallel.DistributedDataParallel._active_ddp_module")(),
            _attr("torch.nn.parallel.DistributedDataParallel._get_active_ddp_module")(),
        ),
        fallback="compiled models train without overlap (a warning says so)",
        seam="compile",
    ),
    PrivateName(
        "torch._dynamo.utils.get_optimize_ddp_mode (2.7+) / torch._dynamo.config._get_optimize_ddp_mode (2.4-2.6)",
        (_COMPILED,),
        "dynamo's optimize_ddp mode: only 'ddp_optimizer' splits graphs",
        _ALL,
        f"{_RAN} (the config spelling in 2.4.0); {_READ}: torch/_dynamo/utils.py from 2.7.0, "
        "torch/_dynamo/config.py in 2.5.0 and 2.6.0",
        _optimize_ddp_mode_reader,
        fallback="compiled models train without overlap (a warning says so)",
        seam="compile",
    ),
    PrivateName(
        "torch._dynamo.backends.distributed.DDPOptimizer",
        (_COMPILED,),
        "the dynamo backend that splits a compiled graph at bucket boundaries",
        _ALL,
        f"{_RAN}; {_READ}: torch/_dynamo/backends/distributed.py",
        _attr("torch._dynamo.backends.distributed.DDPOptimizer"),
        fallback="compiled models train without overlap (a warning says so)",
        seam="compile",
    ),
    PrivateName(
        "torch._dynamo.convert_frame: DDPOptimizer(bucket_bytes_cap=<active module>.bucket_bytes_cap, ...)",
        (_COMPILED,),
        "how dynamo engages DDPOptimizer: it reads nothing of the active module but bucket_bytes_cap",
        _ALL,
        f"{_RAN}; {_READ}: torch/_dynamo/convert_frame.py",
        _source_has("torch._dynamo.convert_frame", "_get_active_ddp_module()", ".bucket_bytes_cap"),
        fallback="compiled models train without overlap (a warning says so)",
        seam="compile",
    ),
    PrivateName(
        "CompiledFunctionBackward",
        (_COMPILED,),
        "the name of AOTAutograd's backward node, to notice a compiled graph that reached gradsync unsplit",
        _ALL,
        f"{_RAN}; {_READ}: torch/_functorch/_aot_autograd/runtime_wrappers.py (class CompiledFunction)",
        _compiled_function_class,
        fallback="no warning about an unsplit graph",
        seam="compile-notice",
    ),
)


@dataclass(frozen=True)
class PublicApi:
    """A public torch API gradsync needs that older releases lack: these set the floor with the private names."""

    name: str
    since: str  # the release that introduced it, where that is below the floor it is only a lower bound
    how: str
    resolve: Callable[[], object] = field(repr=False, compare=False)
    fallback: str = ""  # what gradsync does on a release without it; empty: the API sets the floor


_PUBLIC_HOW = f"resolved in 2.4.0, 2.8.0 and 2.13.0; {_READ}"
PUBLIC_APIS: tuple[PublicApi, ...] = (
    PublicApi(
        "torch.Tensor.register_post_accumulate_grad_hook",
        "2.1",
        _PUBLIC_HOW + ": torch/_tensor.py",
        _attr("torch.Tensor.register_post_accumulate_grad_hook"),
    ),
    PublicApi(
        "torch.compiler.disable(fn, recursive=False)",
        "2.1",
        _PUBLIC_HOW + ": torch/compiler/__init__.py",
        _parameter("torch.compiler.disable", "recursive"),
    ),
    PublicApi(
        "torch.compiler.is_compiling",
        "2.3",
        _PUBLIC_HOW + ": torch/compiler/__init__.py",
        _attr("torch.compiler.is_compiling"),
    ),
    PublicApi(
        "torch.distributed.device_mesh.DeviceMesh",
        "2.2",
        _PUBLIC_HOW + ": torch/distributed/device_mesh.py",
        _attr("torch.distributed.device_mesh.DeviceMesh"),
    ),
    PublicApi(
        "torch.distributed.elastic.multiprocessing.DefaultLogsSpecs, start_processes(logs_specs=)",
        "2.2",
        _PUBLIC_HOW + ": torch/distributed/elastic/multiprocessing/__init__.py",
        lambda: (
            _parameter("torch.distributed.elastic.multiprocessing.start_processes", "logs_specs")(),
            _attr("torch.distributed.elastic.multiprocessing.DefaultLogsSpecs")(),
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
        lambda: (_attr("torch.distributed.run.config_from_args")(), _attr("torch.distributed.run.get_args_parser")()),
    ),
    PublicApi(
        "torch.distributed.algorithms.join.Join, Joinable, JoinHook",
        "1.10",
        _PUBLIC_HOW + ": torch/distributed/algorithms/join.py",
        _attr("torch.distributed.algorithms.join.JoinHook"),
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
        _attr("torch.distributed.Work.get_future"),
    ),
    PublicApi(
        "the autograd engine runs post-accumulate-grad hooks for a parameter reached only through an undefined "
        "gradient (find_unused_parameters with an output the loss does not use)",
        "2.8",
        "run in 2.4.0 and 2.7.0 (the hook never runs) and in 2.8.0, 2.10.0 and 2.13.0 (it runs, with .grad None)",
        _hooks_run_for_undefined_gradients,
        fallback="find_unused_parameters: the parameters still without a gradient at the end of the backward are "
        "marked as their hooks would have been (gradsync/reducer/reducer.py, _end_of_backward)",
    ),
)


def _records(seam: str) -> list[PrivateName | PublicApi]:
    if seam == "*":
        return [*PRIVATE_NAMES, *PUBLIC_APIS]
    return [r for r in PRIVATE_NAMES if r.seam == seam]


def _gaps(seam: str) -> list[tuple[str, Exception]]:
    out = []
    for record in _records(seam):
        try:
            record.resolve()
        except Exception as exc:  # an absent module, attribute or signature: torch changed it
            out.append((record.name, exc))
    return out


def missing(seam: str = "") -> list[str]:
    """The names of ``seam``'s records that the installed torch lacks: ``""`` for the private names outside the
    compile seam, ``"compile"`` for :mod:`gradsync.ddp.compiled`'s (resolving them imports ``torch._dynamo``),
    ``"*"`` for every record, public APIs included."""
    return [name for name, _ in _gaps(seam)]


def check() -> list[str]:
    """A sentence for each record, private or public, that the installed torch lacks, naming the name and the
    installed version (and what gradsync does instead, where it has a fallback); empty when everything resolves."""
    fallbacks = {api.name: api.fallback for api in PUBLIC_APIS if api.fallback}
    return [
        f"this torch ({torch.__version__}) lacks {name} ({type(exc).__name__}: {exc})"
        + (f"; gradsync falls back: {fallbacks[name]}" if name in fallbacks else "")
        for name, exc in _gaps("*")
    ]


def _warn_missing() -> None:
    checked = f"torch {CHECKED_VERSIONS[0]} to {CHECKED_VERSIONS[-1]}"
    for name, exc in _gaps(""):
        warnings.warn(
            f"gradsync: this torch ({torch.__version__}) lacks {name} ({exc}); gradsync was checked against "
            f"{checked}, and what uses this name may fail or fall back.",
            RuntimeWarning,
            stacklevel=3,
        )


def _needed(name: str) -> TorchCompatError:
    return TorchCompatError(
        f"this torch ({torch.__version__}) lacks {name}, which gradsync needs here; gradsync was checked against "
        f"torch {CHECKED_VERSIONS[0]} to {CHECKED_VERSIONS[-1]}."
    )


# ---------------------------------------------------------------------------------------------- the accessors
def _copy_each(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
    for dst, src in zip(dsts, srcs):
        dst.copy_(src)


def _mul_each(tensors: Sequence[torch.Tensor], scalar: float) -> None:
    for tensor in tensors:
        tensor.mul_(scalar)


_FOREACH_COPY: Callable[..., None] = getattr(torch, "_foreach_copy_", _copy_each)
_FOREACH_MUL: Callable[..., None] = getattr(torch, "_foreach_mul_", _mul_each)
_FUTURE: type = getattr(torch._C, "Future", torch.futures.Future)
_GRAPH_TASK_ID: Callable[[], int] | None = getattr(torch._C, "_current_graph_task_id", None)

ENGINE_RUN_BACKWARD_FRAME = "_engine_run_backward"  # torch.autograd.graph's; checked 2.4.0-2.13.0
PARAMS_AND_BUFFERS_TO_IGNORE = "_ddp_params_and_buffers_to_ignore"  # torch DDP's module attribute; 2.4.0-2.13.0
BatchNormBase = nn.modules.batchnorm._BatchNorm  # torch's batch norms' base class; checked 2.4.0-2.13.0


def foreach_copy_(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
    """``dst.copy_(src)`` for each pair (lists or tuples) in one kernel launch (``torch._foreach_copy_``; checked
    2.4.0-2.13.0)."""
    _FOREACH_COPY(dsts, srcs)


def foreach_mul_(tensors: Sequence[torch.Tensor], scalar: float) -> None:
    """``t.mul_(scalar)`` for each tensor (a list or tuple) in one kernel launch (``torch._foreach_mul_``; checked
    2.4.0-2.13.0)."""
    _FOREACH_MUL(tensors, scalar)


def is_torch_future(obj: object) -> bool:
    """Whether ``obj`` is a torch future, ``.then()``'s result included (``torch._C.Future``; 2.4.0-2.13.0)."""
    return isinstance(obj, _FUTURE)


def current_graph_task_id() -> int:
    """The autograd engine's id for the backward now running, -1 outside one
    (``torch._C._current_graph_task_id``; checked 2.4.0-2.13.0)."""
    return _GRAPH_TASK_ID() if _GRAPH_TASK_ID is not None else -1


def queue_backward_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the current backward ends, on the engine's thread
    (``Variable._execution_engine.queue_callback``; checked 2.4.0-2.13.0)."""
    engine = getattr(torch.autograd.Variable, "_execution_engine", None)
    if engine is None:
        raise _needed("torch.autograd.Variable._execution_engine.queue_callback")
    engine.queue_callback(callback)


@functools.cache
def hooks_run_for_undefined_gradients() -> bool:
    """Whether this torch runs a parameter's post-accumulate-grad hook when its only gradient is undefined (an
    output the loss does not use): 2.8.0 and later do, 2.4.0 to 2.7.0 do not (one tiny backward, once)."""
    try:
        _hooks_run_for_undefined_gradients()
    except RuntimeError:
        return False
    return True


def privateuse1_backend_name() -> str:
    """The name a custom accelerator registered for the privateuse1 device
    (``torch._C._get_privateuse1_backend_name``; checked 2.4.0-2.13.0)."""
    read = getattr(torch._C, "_get_privateuse1_backend_name", None)
    return str(read()) if read is not None else "privateuseone"


def default_store() -> dist.Store:
    """The default process group's store; raises when there is none
    (``distributed_c10d._get_default_store``; checked 2.4.0-2.13.0)."""
    read = getattr(dist.distributed_c10d, "_get_default_store", None)
    if read is None:
        raise _needed("torch.distributed.distributed_c10d._get_default_store")
    return read()


def reset_group_count() -> None:
    """Reset torch's count of groups made, as ``destroy_process_group`` does, after an init that failed
    (``distributed_c10d._world.group_count``; checked 2.4.0-2.13.0)."""
    world = getattr(dist.distributed_c10d, "_world", None)
    if world is None or not hasattr(world, "group_count"):
        raise _needed("torch.distributed.distributed_c10d._world.group_count")
    world.group_count = 0


def backend_timeout_seconds(group: dist.ProcessGroup, device: torch.device) -> float | None:
    """The collective timeout of ``group``'s backend for ``device``, or None where there is no such backend or it
    does not say (``ProcessGroup._get_backend(device).options._timeout``; checked 2.4.0-2.13.0)."""
    try:
        return float(group._get_backend(device).options._timeout.total_seconds())
    except Exception:  # no backend for this device, or one without options
        return None


def grad_version(tensor: torch.Tensor) -> int:
    """``tensor``'s in-place write counter (``Tensor._version``; checked 2.4.0-2.13.0)."""
    return int(tensor._version)


def first_bucket_bytes() -> int | None:
    """torch DDP's first-bucket size, or None where torch no longer says
    (``dist._DEFAULT_FIRST_BUCKET_BYTES``; checked 2.4.0-2.13.0)."""
    value = getattr(dist, "_DEFAULT_FIRST_BUCKET_BYTES", None)
    return int(value) if value is not None else None


def import_dynamo() -> None:
    """Import ``torch._dynamo`` now (about 2 s on CPU), as torch's optimizers do at their first construction."""
    importlib.import_module("torch._dynamo")


def optimize_ddp_mode() -> str:
    """dynamo's ``optimize_ddp`` mode ("ddp_optimizer" is the default and the only one that splits graphs), read
    where each release keeps it: ``torch._dynamo.utils.get_optimize_ddp_mode`` from 2.7.0 (checked to 2.13.0),
    ``torch._dynamo.config._get_optimize_ddp_mode`` in 2.4.0-2.6.0."""
    return str(_optimize_ddp_mode_reader()())


_warn_missing()
