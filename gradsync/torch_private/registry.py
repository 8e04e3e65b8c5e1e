"""The registry: every torch-private name gradsync relies on (:data:`PRIVATE_NAMES`), where it is used, the torch
releases it was checked in and how, and :func:`check`, which resolves every record, private names and the public
APIs that set the floor (:data:`~gradsync.torch_private.public_apis.PUBLIC_APIS`), in the installed torch."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import warnings

import torch

from gradsync.torch_private.dynamo import optimize_ddp_mode_reader
from gradsync.torch_private.public_apis import PUBLIC_APIS
from gradsync.torch_private.records import (
    CHECKED_VERSIONS,
    RAN,
    READ,
    PrivateName,
    PublicApi,
    attribute,
    source_has,
)


def _backend_options_timeout() -> object:
    # The classes only: _timeout itself is read on a live group (tests/test_torch_private.py).
    backend = attribute("torch.distributed.ProcessGroup._get_backend")
    return backend(), attribute("torch.distributed.ProcessGroupGloo.options")()


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
        f"{RAN}; {READ}: torch/_C/_VariableFunctions.pyi",
        attribute("torch._foreach_copy_"),
        fallback="a copy_ per tensor",
    ),
    PrivateName(
        "torch._C._storage_Use_Count",
        ("gradsync/torch_private/storage.py",),
        "tells whether a bucket's storage, or a fresh gradient's, is held by anything else (lending a slot to .grad)",
        ("2.13.0",),
        "run in 2.13.0 (tests/test_lending.py); before 2.5 CPU builds may lack it (pytorch/pytorch#131881: it was "
        "registered with the CUDA module)",
        attribute("torch._C._storage_Use_Count"),
        fallback="nothing is lent: averages are copied back into .grad, as torch's reducer does",
        seam="speed",
    ),
    PrivateName(
        "torch.Tensor._use_count",
        ("gradsync/torch_private/storage.py",),
        "tells whether a fresh gradient's own TensorImpl has an owner besides its parameter (a DLPack export holds "
        "it, not its storage) before a slot is lent to it",
        ("2.13.0",),
        "run in 2.13.0 (tests/test_lending.py); torch/utils/__init__.py's swap_tensors reads it too",
        attribute("torch.Tensor._use_count"),
        fallback="nothing is lent: averages are copied back into .grad, as torch's reducer does",
        seam="speed",
    ),
    PrivateName(
        "torch._foreach_mul_",
        ("gradsync/reducer/buckets.py",),
        "scales every dense bucket by one number in one kernel launch",
        _ALL,
        f"{RAN}; {READ}: torch/_C/_VariableFunctions.pyi (the list, scalar overload)",
        attribute("torch._foreach_mul_"),
        fallback="a mul_ per tensor",
    ),
    PrivateName(
        "torch._C.Future",
        ("gradsync/reducer/backward.py",),
        "the class of every future a hook may return: torch.futures.Future and what .then() returns",
        _ALL,
        f"{RAN}; {READ}: torch/_C/__init__.pyi, torch/futures/__init__.py (Future subclasses it)",
        attribute("torch._C.Future"),
        fallback="torch.futures.Future",
    ),
    PrivateName(
        "torch._C._current_graph_task_id",
        ("gradsync/reducer/backward.py",),
        "tells one backward from the next (a nested backward shares no id with the outer one)",
        _ALL,
        f"{RAN}; {READ}: torch/_C/__init__.pyi",
        attribute("torch._C._current_graph_task_id"),
        fallback="-1, as outside a backward",
    ),
    PrivateName(
        "torch.autograd.graph._engine_run_backward",
        ("gradsync/reducer/backward.py",),
        "the frame that backward() and autograd.grad() run the engine in, counted to notice a nested backward",
        _ALL,
        f"{RAN}; {READ}: torch/autograd/graph.py defines it, torch/autograd/__init__.py calls it twice",
        lambda: (
            source_has("torch.autograd.backward", "_engine_run_backward(")(),
            source_has("torch.autograd.grad", "_engine_run_backward(")(),
        ),
    ),
    PrivateName(
        "torch.autograd.Variable._execution_engine.queue_callback",
        ("gradsync/reducer/reducer.py",),
        "runs the finalizer when the outermost backward ends, as torch's DDP does",
        _ALL,
        f"{RAN}; {READ}: torch/autograd/variable.py, torch/_C/__init__.pyi (_ImperativeEngine)",
        attribute("torch.autograd.Variable._execution_engine.queue_callback"),
    ),
    PrivateName(
        "torch._C._get_privateuse1_backend_name",
        ("gradsync/launch/run.py",),
        "the name a custom accelerator registered, accepted by --nproc-per-node",
        _ALL,
        f"{RAN}; {READ}: torch/_C/__init__.pyi",
        attribute("torch._C._get_privateuse1_backend_name"),
        fallback='"privateuseone"',
    ),
    PrivateName(
        "torch.distributed.distributed_c10d._get_default_store",
        (
            "gradsync/collectives/communicator.py",
            "gradsync/collectives/peer_errors.py",
            "gradsync/elastic/round_group.py",
        ),
        "the default group's key-value store: arrival checks and the peers' error reports live there",
        _ALL,
        f"{RAN}; {READ}: torch/distributed/distributed_c10d.py",
        attribute("torch.distributed.distributed_c10d._get_default_store"),
    ),
    PrivateName(
        "torch.distributed.distributed_c10d._world.group_count",
        ("gradsync/elastic/round_group.py",),
        "reset after a failed init_process_group, as destroy_process_group resets it, so store keys match again",
        _ALL,
        f"{RAN}; {READ}: torch/distributed/distributed_c10d.py (_World.group_count has a setter)",
        attribute("torch.distributed.distributed_c10d._world.group_count"),
    ),
    PrivateName(
        "torch.distributed.distributed_c10d._set_pg_timeout",
        ("gradsync/elastic/round_group.py",),
        "a round's group connects with a timeout of its own, the connects measured, then takes the collective one",
        ("2.13.0",),
        "run in 2.13.0 (tests/test_torch_private.py: a gloo collective outlives the timeout its group formed with); "
        "used from 2.13 only: gloo's operations ignored it from 2.9 (pytorch/pytorch#158128) until #167052",
        attribute("torch.distributed.distributed_c10d._set_pg_timeout"),
        fallback="the round's group connects with the collective timeout",
        seam="speed",
    ),
    PrivateName(
        "ProcessGroup._get_backend(device).options._timeout",
        ("gradsync/collectives/communicator.py",),
        "the collective timeout the backend enforces, which bounds gradsync's own waits on hook futures",
        _ALL,
        f"{RAN}; {READ}: torch/_C/_distributed_c10d.pyi (2.4.0's stub omits Backend.options; it ran there)",
        _backend_options_timeout,
        fallback="GRADSYNC_TIMEOUT or 600 s",
    ),
    PrivateName(
        "torch.nn.modules.batchnorm._BatchNorm",
        ("gradsync/nn/sync_batchnorm.py",),
        "the base of torch's batch norms: SyncBatchNorm derives from it and convert_sync_batchnorm finds them by it",
        _ALL,
        f"{RAN}; {READ}: torch/nn/modules/batchnorm.py",
        attribute("torch.nn.modules.batchnorm._BatchNorm"),
    ),
    PrivateName(
        "torch.Tensor._version",
        ("gradsync/optim/overlapped.py",),
        "a tensor's in-place write counter: tells a .grad edited after its bucket was stepped",
        _ALL,
        f"{RAN}; {READ}: torch/_C/__init__.pyi (TensorBase._version)",
        lambda: torch.zeros(1)._version,
    ),
    PrivateName(
        "_ddp_params_and_buffers_to_ignore",
        ("gradsync/ddp/arguments.py", "gradsync/ddp/module.py"),
        "the module attribute torch's DDP reads for the parameters to leave alone; gradsync reads and sets it too",
        _ALL,
        f"{RAN}; {READ}: torch/nn/parallel/distributed.py",
        source_has(
            "torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model",
            "_ddp_params_and_buffers_to_ignore",
        ),
    ),
    PrivateName(
        "torch._dynamo",
        ("gradsync/elastic/join.py", _COMPILED),
        "imported ahead (a slow import) so a joiner does not pay it inside its first step",
        _ALL,
        f"{RAN}; {READ}: torch/_dynamo/__init__.py",
        lambda: importlib.util.find_spec("torch._dynamo"),
    ),
    PrivateName(
        "torch.distributed._DEFAULT_FIRST_BUCKET_BYTES",
        ("gradsync/reducer/buckets.py",),
        "torch's first-bucket size, which gradsync's DEFAULT_FIRST_BUCKET_BYTES mirrors (tested equal)",
        _ALL,
        f"{RAN} (1 MiB in both); {READ}: torch/_C/_distributed_c10d.pyi",
        attribute("torch.distributed._DEFAULT_FIRST_BUCKET_BYTES"),
        fallback="gradsync's own 1 MiB",
    ),
    PrivateName(
        "torch.nn.parallel.DistributedDataParallel._active_ddp_module / _get_active_ddp_module",
        (_COMPILED,),
        "where dynamo looks for the DDP whose frames it splits at bucket boundaries",
        _ALL,
        f"{RAN}; {READ}: torch/nn/parallel/distributed.py",
        lambda: (
            attribute("torch.nn.parallel.DistributedDataParallel._active_ddp_module")(),
            attribute("torch.nn.parallel.DistributedDataParallel._get_active_ddp_module")(),
        ),
        fallback="compiled models train without overlap (a warning says so)",
        seam="compile",
    ),
    PrivateName(
        "torch._dynamo.utils.get_optimize_ddp_mode (2.7+) / torch._dynamo.config._get_optimize_ddp_mode (2.4-2.6)",
        (_COMPILED,),
        "dynamo's optimize_ddp mode: only 'ddp_optimizer' splits graphs",
        _ALL,
        f"{RAN} (the config spelling in 2.4.0); {READ}: torch/_dynamo/utils.py from 2.7.0, "
        "torch/_dynamo/config.py in 2.5.0 and 2.6.0",
        optimize_ddp_mode_reader,
        fallback="compiled models train without overlap (a warning says so)",
        seam="compile",
    ),
    PrivateName(
        "torch._dynamo.backends.distributed.DDPOptimizer",
        (_COMPILED,),
        "the dynamo backend that splits a compiled graph at bucket boundaries",
        _ALL,
        f"{RAN}; {READ}: torch/_dynamo/backends/distributed.py",
        attribute("torch._dynamo.backends.distributed.DDPOptimizer"),
        fallback="compiled models train without overlap (a warning says so)",
        seam="compile",
    ),
    PrivateName(
        "torch._dynamo.convert_frame: DDPOptimizer(bucket_bytes_cap=<active module>.bucket_bytes_cap, ...)",
        (_COMPILED,),
        "how dynamo engages DDPOptimizer: it reads nothing of the active module but bucket_bytes_cap",
        _ALL,
        f"{RAN}; {READ}: torch/_dynamo/convert_frame.py",
        source_has("torch._dynamo.convert_frame", "_get_active_ddp_module()", ".bucket_bytes_cap"),
        fallback="compiled models train without overlap (a warning says so)",
        seam="compile",
    ),
    PrivateName(
        "CompiledFunctionBackward",
        (_COMPILED,),
        "the name of AOTAutograd's backward node, to notice a compiled graph that reached gradsync unsplit",
        _ALL,
        f"{RAN}; {READ}: torch/_functorch/_aot_autograd/runtime_wrappers.py (class CompiledFunction)",
        _compiled_function_class,
        fallback="no warning about an unsplit graph",
        seam="compile-notice",
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


def warn_missing() -> None:
    """Warn once for each private name outside the compile seam that the installed torch lacks (at import)."""
    checked = f"torch {CHECKED_VERSIONS[0]} to {CHECKED_VERSIONS[-1]}"
    for name, exc in _gaps(""):
        warnings.warn(
            f"gradsync: this torch ({torch.__version__}) lacks {name} ({exc}); gradsync was checked against "
            f"{checked}, and what uses this name may fail or fall back.",
            RuntimeWarning,
            stacklevel=3,
        )
