"""Every torch-private name gradsync relies on, in one package, with the torch releases it was checked against.

torch promises nothing about names that start with an underscore, so each one gradsync uses goes through an
accessor here, and :data:`PRIVATE_NAMES` records where it is used, which releases it was checked in and how.
:data:`PUBLIC_APIS` records the public APIs that set the oldest torch gradsync can run on. :func:`check` resolves
every record in the installed torch; importing this package warns once, naming the name and the installed version,
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

The files, each name importable from this package as before:

``records.py``      what a record is (``PrivateName``, ``PublicApi``), the releases checked, the resolvers
``registry.py``     the table of private names (``PRIVATE_NAMES``); ``check()``, ``missing()``, the import warning
``public_apis.py``  the public APIs that set the floor (``PUBLIC_APIS``)
``autograd.py``     the engine: the running backward's id, a callback at its end, its frame, ``Tensor._version``
``distributed.py``  c10d: the default store, the group counter, a backend's timeout, futures, the first bucket
``dynamo.py``       importing dynamo ahead, its ``optimize_ddp`` mode
``foreach.py``      the foreach copy and multiply kernels, with a per-tensor fallback
``storage.py``      a storage's use count (lending a bucket slot to ``.grad``), with no lending as the fallback
``modules.py``      torch.nn's: the batch norms' base class, DDP's ignore-list attribute
``tensor_parallel.py``  DTensor's and FSDP's classes, imported from there (the composition checks)
``pipelining.py``   torch's PipelineStage, checked for the methods gradsync's stage overrides, imported from there
"""

from gradsync.torch_private.autograd import (
    ENGINE_RUN_BACKWARD_FRAME,
    current_graph_task_id,
    grad_version,
    hooks_run_for_undefined_gradients,
    queue_backward_callback,
)
from gradsync.torch_private.distributed import (
    backend_timeout_seconds,
    default_store,
    first_bucket_bytes,
    group_timeout_settable,
    is_torch_future,
    privateuse1_backend_name,
    reset_group_count,
    set_group_timeout,
)
from gradsync.torch_private.dynamo import import_dynamo, optimize_ddp_mode
from gradsync.torch_private.foreach import _copy_each, _mul_each, foreach_copy_, foreach_mul_
from gradsync.torch_private.modules import PARAMS_AND_BUFFERS_TO_IGNORE, BatchNormBase
from gradsync.torch_private.public_apis import PUBLIC_APIS
from gradsync.torch_private.records import CHECKED_VERSIONS, FLOOR, PrivateName, PublicApi, TorchCompatError
from gradsync.torch_private.registry import PRIVATE_NAMES, check, missing, warn_missing

__all__ = [
    "CHECKED_VERSIONS",
    "ENGINE_RUN_BACKWARD_FRAME",
    "FLOOR",
    "PARAMS_AND_BUFFERS_TO_IGNORE",
    "PRIVATE_NAMES",
    "PUBLIC_APIS",
    "BatchNormBase",
    "PrivateName",
    "PublicApi",
    "TorchCompatError",
    "_copy_each",  # the fallbacks, tested against the kernels (tests/test_torch_private.py)
    "_mul_each",
    "backend_timeout_seconds",
    "check",
    "current_graph_task_id",
    "default_store",
    "first_bucket_bytes",
    "foreach_copy_",
    "foreach_mul_",
    "grad_version",
    "group_timeout_settable",
    "hooks_run_for_undefined_gradients",
    "import_dynamo",
    "is_torch_future",
    "missing",
    "optimize_ddp_mode",
    "privateuse1_backend_name",
    "queue_backward_callback",
    "reset_group_count",
    "set_group_timeout",
]

warn_missing()  # here, so that the warning names the module that imported gradsync.torch_private
