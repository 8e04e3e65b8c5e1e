"""docs/parallelism.md's blocks, each run as written on 4 ranks under `gradsync run` (as the page says to launch
them), with a check after each of what the page promises."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from docs_blocks import ROOT, blocks

PAGE = "docs/parallelism.md"
CHECKS = {
    "Tensor parallelism": (
        "from torch.distributed.tensor import DTensor\n"
        "assert all(isinstance(p, DTensor) and isinstance(p.grad, DTensor) for p in ddp.parameters())\n"
        "names = [n for n, _ in model.named_parameters()]\n"
        "assert [n.removeprefix('module.') for n, _ in ddp.named_parameters()] == names\n"
    ),
    "Pipeline parallelism": "assert all(p.grad is not None for p in ddp.parameters())\n",
}


@pytest.mark.long
@pytest.mark.timeout(300)
@pytest.mark.parametrize("section", list(CHECKS))
def test_the_blocks_run_as_written_on_four_ranks(section: str, tmp_path: Path) -> None:
    (block,) = blocks(PAGE, "python", section)
    script = tmp_path / "train.py"
    script.write_text(block.code + CHECKS[section] + "torch.distributed.destroy_process_group()\n")
    argv = [sys.executable, "-m", "gradsync", "run", "--standalone", "--nproc-per-node", "4", str(script)]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "LOCAL_"))}
    env.update(PYTHONPATH=str(ROOT), GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    done = subprocess.run(argv, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, f"{section}:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
