"""torch's own DDP tests, run on the CPU with torch's DistributedDataParallel and with gradsync's, side by side.

Run from the repository root (needs ``expecttest``, which torch's test utilities import:
``.venv/bin/pip install expecttest``)::

    python -m conformance.torch_suite                      # both DDPs, all 102 tests: ~95 min on 2 cores
    python -m conformance.torch_suite --start-method fork  # the same in ~30 min (ranks forked, not spawned)
    python -m conformance.torch_suite --ddp gradsync -k unused   # rerun gradsync only, tests whose name has "unused"
    python -m conformance.torch_suite --list               # the selection
    python -m conformance.torch_suite --report-only        # the report of the results file, running nothing

Options: ``--ddp torch|gradsync|both`` (default both), ``-k SUBSTRING`` (repeatable, case-insensitive),
``--jobs N`` (tests at once, default 1), ``--timeout-per-test S`` (default 120), ``--out FILE`` (default
``conformance/results/torch_suite.json``), ``--fresh``, ``--log-dir DIR``, ``--start-method spawn|fork`` (default spawn,
as upstream: every rank re-imports torch, about 20 s a test here; fork starts the ranks from the test process,
already set up, about 8 s a test). The results file is merged with what it already holds, so a gradsync-only rerun
is still compared with torch's earlier results; ``--fresh`` starts over. It prints the counts per DDP and the
tests that pass with torch and fail with gradsync (the list to fix), with the end of each error; the JSON has
every test's status, one-line summary, error tail, log path, time and start method.

What runs. The tests are the methods of ``DistributedTest._DistTestBase`` in the installed wheel's
``torch/testing/_internal/distributed/distributed_test.py``, run the way upstream's
``test/distributed/test_distributed_spawn.py`` runs them: ``BACKEND=gloo``, ``WORLD_SIZE=2``, a ``TEMP_DIR``, and
``class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase)`` whose ``setUp`` spawns one process
per rank (:mod:`.harness`). Each test runs in its own process, in its own session, under unittest
(:mod:`.run_one`); the runner kills the whole process group at the timeout. The harness's own timeout is set 20 s
shorter, so a hang usually ends with the hung ranks' stacks in the log. Outcomes: passed, failed (with the first
failing rank's last 20 lines), skipped (with the reason: a decorator's, or the rank's, or torch's ``TEST_SKIPS``
message for a skip exit code), timeout.

Selection rule (:mod:`.selection`): a test is selected when it, or a ``self._helper`` of the class it calls
(transitively, read from the source with ``ast``), refers to ``DistributedDataParallel``. That covers every name
the brief listed (ddp, DistributedDataParallel, join, SyncBatchNorm, grad_is_view, static_graph, comm hooks,
buckets, unused parameters, no_sync, post-local SGD) plus four DDP tests with other names
(``test_get_data_parallel_params``, ``test_verify_model_across_rank_*``, ``test_different_graph_across_ranks``).
Two tests named like DDP tests construct no DDP and are not run: ``test_dump_DDP_relevant_env_vars`` (prints
torch's env vars) and ``test_SyncBatchNorm_process_group`` (``convert_sync_batchnorm`` on a torchvision model).
There is no ZeroRedundancyOptimizer test in this class. Parametrized tests run once per instantiation.

The CPU mapping (:mod:`.cpu_mapping`, installed in every process at import of :mod:`.harness`, before
distributed_test is imported, identical for both DDPs). Most DDP tests are written for one GPU per rank
(``@skip_if_lt_x_gpu(2)``, ``torch.cuda.set_device(rank)``, ``.cuda(rank)``, ``device=rank``,
``device_ids=[rank]``). So that they run here:

- ``torch.cuda.is_available / device_count / current_device / set_device / synchronize / manual_seed(_all)``
  answer as a machine with ``WORLD_SIZE`` GPUs (2, like upstream's 2-GPU CI: ``skip_if_lt_x_gpu(4)`` tests still
  skip) only when called from ``common_distributed`` or ``distributed_test``; torch's own modules and gradsync see
  the real CPU-only machine. ``common_distributed.TEST_CUDA`` is set True after the import, for ``skip_if_no_gpu``.
- a ``TorchFunctionMode`` entered around each test method in each rank maps ``device=<int|cuda>`` arguments,
  ``Tensor.to(<int|cuda>)`` (hence ``Module.to(rank)``) and ``Tensor.cuda()`` (hence ``Module.cuda()``) to the CPU.
- ``device_ids`` / ``output_device`` are dropped when the module given to DDP lives on the CPU (torch's DDP
  raises for them on CPU modules), by wrapping ``__init__`` of the DDP class in use.
- with ``GRADSYNC_TORCH_SUITE_DDP=gradsync``, ``torch.nn.parallel.DistributedDataParallel``,
  ``torch.nn.parallel.distributed.DistributedDataParallel`` and distributed_test's own ``DistributedDataParallel``
  name are gradsync's class. ``torch._dynamo`` is imported before the swap and keeps torch's class, as in a real
  program where only user code names gradsync's (it calls torch's private ``_get_active_ddp_module()`` on it).

What the mapping cannot give: CUDA streams, autocast/GradScaler on CUDA, NCCL, ``torch.device(rank)`` (an int
device needs an accelerator; a C type, not patchable), and torch's ``SyncBatchNorm`` (which refuses CPU inputs):
those tests fail or skip for both DDPs. ``test_ddp_uneven_inputs`` trains a conv net on 1000x1000 inputs: too slow
for a CPU (torch's run times out even at 600 s). Tests of torch internals, or of features gradsync
refuses by design, are listed in :mod:`.not_applicable` with a reason and left out of the regression list.
Rank processes run with ``OMP_NUM_THREADS=1`` unless it is set.
"""
