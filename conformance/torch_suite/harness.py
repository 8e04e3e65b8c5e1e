"""torch's spawn harness for ``DistributedTest._DistTestBase``, with the CPU mapping and the chosen DDP class.

Imported by the per-test process and, through the pickled test class (spawn start method), by every rank process:
the patches below therefore run in all of them, before distributed_test is imported, controlled by the environment
the runner sets (``BACKEND``, ``WORLD_SIZE``, ``GRADSYNC_TORCH_SUITE_DDP``).

Mirrors upstream's ``test/distributed/test_distributed_spawn.py`` (not shipped in the wheel).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

os.environ.setdefault("BACKEND", "gloo")
os.environ.setdefault("WORLD_SIZE", "2")

import torch  # noqa: E402

from conformance.torch_suite import cpu_mapping  # noqa: E402

DDP_CLASS = cpu_mapping.install()

from torch.testing._internal import common_distributed  # noqa: E402
from torch.testing._internal.distributed import distributed_test  # noqa: E402

cpu_mapping.patch_test_constants()
distributed_test.DistributedDataParallel = DDP_CLASS  # the module's own `from torch.nn.parallel import ...`
torch.backends.cuda.matmul.allow_tf32 = False  # as upstream's spawn runner

SKIP_REASON_MARK = "skipping test"
START_METHOD_ENV = "GRADSYNC_TORCH_SUITE_START"  # spawn (upstream's) or fork (no re-import: about twice as fast)


def _log_skip_reasons() -> None:
    """Rank processes log why they skip (``Process R skipping test T for following reason: ...``) at INFO level."""
    logger = logging.getLogger(common_distributed.__name__)
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(lambda record: SKIP_REASON_MARK in record.getMessage())
    logger.addHandler(handler)


def _bound_harness_timeout() -> None:
    """The harness's own per-test timeouts (300-500 s) give way to the runner's, read from the environment."""
    common_distributed.TIMEOUT_OVERRIDE.clear()


_log_skip_reasons()
_bound_harness_timeout()


class TestDistBackendWithSpawn(distributed_test.TestDistBackend, distributed_test.DistributedTest._DistTestBase):
    """upstream: ``class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase)``."""

    def setUp(self) -> None:
        super().setUp()
        if os.environ.get(START_METHOD_ENV, "spawn") == "fork":
            self._start_processes(torch.multiprocessing.get_context("fork").Process)
        else:
            self._spawn_processes()

    def run_test(self, test_name: str, parent_pipe: Any) -> None:
        """In a rank process: the test method runs with GPU devices mapped to the CPU."""
        with cpu_mapping.CpuDeviceMode():
            super().run_test(test_name, parent_pipe)
