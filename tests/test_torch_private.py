"""Every torch-private name gradsync uses resolves in the installed torch, goes through gradsync.torch_private, and
its accessor does what the call sites relied on the name for."""

from __future__ import annotations

import ast
import datetime
import re
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from gradsync import torch_private
from gradsync.ddp import compiled
from gradsync.reducer.buckets import DEFAULT_FIRST_BUCKET_BYTES
from gradsync.testing import spawn

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "gradsync"

# Files that may spell torch-private names themselves, and why.
ALLOWED = {
    **{
        path.relative_to(ROOT).as_posix(): "the package of accessors and the table"
        for path in sorted((PACKAGE / "torch_private").glob("*.py"))
    },
    "gradsync/ddp/compiled.py": "the compile seam: imports torch._dynamo, sets DDP._active_ddp_module; its names are "
    "the table's compile records",
}
# Files that still spell the names themselves until switched to the accessors: none now (the reducer and the DDP
# module were switched last, after their refactor).
NOT_YET_SWITCHED: tuple[str, ...] = ()
# Attributes that are torch's private ones on whatever object they are read from (a group, a tensor, an engine).
PRIVATE_ATTRIBUTES = {"_get_backend", "_timeout", "_version", "_execution_engine", "_world", "_get_default_store"}
# Bare names that code could pass to getattr/setattr or compare with a frame's name.
PRIVATE_STRINGS = {
    torch_private.PARAMS_AND_BUFFERS_TO_IGNORE,
    torch_private.ENGINE_RUN_BACKWARD_FRAME,
    "_current_graph_task_id",
    "_get_privateuse1_backend_name",
    "_get_default_store",
    "_active_ddp_module",
}
TORCH_ROOTS = {"torch", "dist", "nn", "_TorchDDP"}  # how gradsync's modules name torch and its packages


def _root(node: ast.expr) -> str:
    while isinstance(node, (ast.Attribute, ast.Call, ast.Subscript)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else ""


def private_uses(source: str) -> list[tuple[int, str]]:
    """(line, what) for each torch-private name ``source`` spells."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            if _root(node.value) in TORCH_ROOTS or node.attr in PRIVATE_ATTRIBUTES:
                found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if re.match(r"torch(\.\w+)*\._", a.name)]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            names = [node.module or "", *(a.name for a in node.names)]
            if any(part.startswith("_") for name in names for part in name.split(".")):
                found.append((node.lineno, f"from {node.module} import ..."))
        elif isinstance(node, ast.Constant) and node.value in PRIVATE_STRINGS:
            found.append((node.lineno, repr(node.value)))
    return found


def test_every_record_resolves_in_the_installed_torch() -> None:
    # Before 2.8 one engine behaviour is missing, and gradsync falls back (torch_private's docstring); nothing else.
    assert all("gradsync falls back" in gap for gap in torch_private.check()), torch_private.check()
    if _release() >= (2, 8):
        assert torch_private.check() == [] and torch_private.hooks_run_for_undefined_gradients()


def test_the_scan_finds_what_it_should() -> None:
    source = (
        "import torch\nimport torch._dynamo\nfrom torch._C import Future\nimport sys\n"
        "torch._foreach_copy_(a, b)\nself.group._get_backend(d).options._timeout\np.grad._version\n"
        "getattr(m, '_ddp_params_and_buffers_to_ignore', ())\ndist.distributed_c10d._world.group_count = 0\n"
        "sys._getframe()\nself._mine\n"
    )
    lines = sorted({line for line, _ in private_uses(source)})
    assert lines == [2, 3, 5, 6, 7, 8, 9]


def test_no_module_outside_torch_private_spells_a_private_name() -> None:
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel in ALLOWED or rel in NOT_YET_SWITCHED:
            continue
        uses = private_uses(path.read_text())
        if uses:
            offenders[rel] = uses
    assert not offenders, f"use gradsync.torch_private's accessors (or add a record there): {offenders}"


def test_the_table_names_files_that_exist_and_every_checked_release() -> None:
    CHECKED = torch_private.CHECKED_VERSIONS  # noqa: N806
    for record in torch_private.PRIVATE_NAMES:
        # A fast path with a fallback (seam "speed") may be checked in fewer releases: without it, torch's cost.
        partial = record.seam == "speed" and record.fallback and set(record.checked) <= set(CHECKED)
        assert record.checked == CHECKED or partial, record.name
        for rel in record.used_in:
            assert (ROOT / rel).exists(), f"{record.name}: {rel} moved; update gradsync/torch_private/registry.py"


def test_pyproject_floor_is_what_the_check_supports() -> None:
    pyproject = (ROOT / "pyproject.toml").read_text()
    floor = re.search(r'"torch>=([0-9.]+)"', pyproject)
    assert floor is not None
    assert floor.group(1) == torch_private.FLOOR
    release = lambda v: tuple(int(n) for n in v.split("."))  # noqa: E731
    # The oldest release checked, and no API without a fallback newer than it (the project promises torch >= 2.4).
    assert f"{torch_private.FLOOR}.0" == torch_private.CHECKED_VERSIONS[0] == "2.4.0"
    needed = [api.since for api in torch_private.PUBLIC_APIS if not api.fallback]
    assert release(torch_private.FLOOR) >= max(map(release, needed))
    assert all(release(api.since) <= release(torch_private.CHECKED_VERSIONS[-1]) for api in torch_private.PUBLIC_APIS)
    installed = ".".join(torch.__version__.split("+")[0].split(".")[:2]) + ".0"
    assert installed in torch_private.CHECKED_VERSIONS, f"torch {torch.__version__} is outside the checked range"


def test_compiled_names_are_the_tables_and_all_there() -> None:
    compile_records = [r.name for r in torch_private.PRIVATE_NAMES if r.seam.startswith("compile")]
    assert compiled.PRIVATE_NAMES == tuple(compile_records) and len(compile_records) == 5
    assert compiled.missing_seam() is None
    assert torch_private.optimize_ddp_mode() == compiled.split_mode() == "ddp_optimizer"


def test_foreach_accessors_and_their_fallbacks() -> None:
    for copy in (torch_private.foreach_copy_, torch_private._copy_each):
        dsts, srcs = [torch.zeros(3), torch.zeros(2, 2)], [torch.arange(3.0), torch.ones(2, 2)]
        copy(dsts, srcs)
        assert all(torch.equal(d, s) for d, s in zip(dsts, srcs))
    for mul in (torch_private.foreach_mul_, torch_private._mul_each):
        tensors = [torch.ones(3), torch.full((2,), 2.0)]
        mul(tensors, 0.5)
        assert torch.equal(tensors[0], torch.full((3,), 0.5)) and torch.equal(tensors[1], torch.ones(2))


def test_futures_graph_task_and_backward_callback() -> None:
    future: torch.futures.Future[int] = torch.futures.Future()
    assert torch_private.is_torch_future(future) and torch_private.is_torch_future(future.then(lambda f: 1))
    assert not torch_private.is_torch_future(object())
    assert torch_private.current_graph_task_id() == -1
    seen: list[object] = []
    x = torch.ones(2, requires_grad=True)

    def hook(grad: torch.Tensor) -> None:
        seen.append(torch_private.current_graph_task_id())
        torch_private.queue_backward_callback(lambda: seen.append("ended"))

    x.register_hook(hook)
    (x * 2).sum().backward()
    assert isinstance(seen[0], int) and seen[0] >= 0 and seen[1:] == ["ended"]


def _release() -> tuple[int, ...]:
    return tuple(int(n) for n in torch.__version__.split("+")[0].split(".")[:2])


def test_the_engine_runs_hooks_for_undefined_gradients_from_2_8() -> None:
    # Measured, not assumed: 2.4.0 and 2.7.0 skip the hook, 2.8.0 and later run it (the reducer falls back before).
    assert torch_private.hooks_run_for_undefined_gradients() is (_release() >= (2, 8))


def test_grad_version_counts_in_place_writes() -> None:
    t = torch.zeros(2)
    before = torch_private.grad_version(t)
    t.add_(1)
    assert torch_private.grad_version(t) == before + 1


def test_first_bucket_bytes_matches_gradsyncs() -> None:
    assert torch_private.first_bucket_bytes() == DEFAULT_FIRST_BUCKET_BYTES


def test_privateuse1_backend_name() -> None:
    assert torch_private.privateuse1_backend_name() == "privateuseone"  # no custom accelerator registered


def test_store_timeout_and_group_count_on_a_live_group() -> None:
    if dist.is_initialized():
        pytest.skip("a default group already exists in this process")
    dist.init_process_group(
        "gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=datetime.timedelta(seconds=77)
    )
    try:
        assert torch_private.backend_timeout_seconds(dist.group.WORLD, torch.device("cpu")) == 77.0
        assert torch_private.backend_timeout_seconds(dist.group.WORLD, torch.device("meta")) is None
        store = torch_private.default_store()
        store.set("k", "v")
        assert store.get("k") == b"v"
        dist.distributed_c10d._world.group_count = 5
        torch_private.reset_group_count()
        assert dist.distributed_c10d._world.group_count == 0
    finally:
        dist.destroy_process_group()


def _outlive_the_formed_timeout(rank: int, world_size: int) -> float:
    torch_private.set_group_timeout(4.0)  # the group formed with 1 s (spawn's pg_timeout)
    t = torch.ones(4)
    dist.all_reduce(t)
    if rank == 1:
        time.sleep(2.5)  # past the 1 s the group formed with
    began = time.monotonic()
    dist.all_reduce(t)
    return time.monotonic() - began


@pytest.mark.timeout(60)
def test_a_timeout_set_after_forming_is_the_one_gloo_collectives_keep() -> None:
    """gradsync/elastic/round_group.py forms a round's group with a short timeout, then sets the collective one:
    a collective that outlives the first must still complete (torch 2.9 to 2.12's gloo kept the first:
    pytorch/pytorch#167052). Without the set, rank 0's second all-reduce fails after 1 s."""
    if not torch_private.group_timeout_settable():
        pytest.skip(f"torch {torch.__version__}: rounds connect with the collective timeout (no set)")
    waited = spawn(_outlive_the_formed_timeout, world_size=2, pg_timeout=1.0, timeout=50)
    assert waited[0] > 2.0, waited
