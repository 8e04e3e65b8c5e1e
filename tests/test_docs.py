"""The documentation: the site builds without a warning, every public name is documented with an example, every
docstring example runs as written, and every ```python and ```bash block of README.md and docs/ is run by a test.

The docstring examples use names they do not define (``model``, ``ddp``, ``loader``, ...), as torch's do; each runs
as written in a prepared namespace (``PREAMBLE``, ``IN_PROCESS``, ``IN_GROUP``) in a process group of one, or, where
one CPU process cannot show it (an elastic job, two ranks, a script whose function the ranks import), under the
launcher ``LAUNCHED`` names for it. None is skipped; the one skip here is the two-host launching test's, where
network namespaces cannot be made, and it says why.
"""

from __future__ import annotations

import doctest
import inspect
import pkgutil
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from docs_blocks import PUBLIC, ROOT, blocks, pages

_DIRECTIVE = re.compile(r"^\.\. (auto\w+|py:\w+):: ([\w.]+)")
_EXAMPLE = re.compile(r"^\s*Examples?( \(.*\))?::$")  # "Example::", "Example (a hook that sums)::"


@dataclass(frozen=True)
class Documented:
    """One directive of an API page: ``autoclass``, ``autofunction``, ..., or a hand-written ``py:`` one."""

    page: str
    directive: str
    name: str
    members: bool


@dataclass(frozen=True)
class Example:
    """One example of a docstring: an ``Example::`` block (``code``) or its ``>>>`` lines (``doctest``)."""

    id: str
    kind: str
    code: str


def documented() -> list[Documented]:
    """Every directive in docs/api/*.md, in page order."""
    found = []
    for page in pages():
        if not page.startswith("docs/api/"):
            continue
        for b in blocks(page, "{eval-rst}"):
            lines = b.code.splitlines()
            for i, line in enumerate(lines):
                match = _DIRECTIVE.match(line)
                if match:
                    options = [o.strip() for o in lines[i + 1 : i + 4] if o.startswith("   :")]
                    module = [o.split()[1] for o in options if o.startswith(":module:")]
                    name = f"{module[0]}.{match.group(2)}" if module else match.group(2)
                    found.append(Documented(page, match.group(1), name, ":members:" in options))
    return found


def resolve(name: str) -> Any:
    """The object a public dotted name means, imported as a user would (``gradsync.checkpoint.save``)."""
    return pkgutil.resolve_name(name)


def public_names(module: ModuleType) -> list[str]:
    """``__all__``, or, for a module without one, the classes and functions it defines without a leading ``_``."""
    if hasattr(module, "__all__"):
        return list(module.__all__)
    return [
        n
        for n, v in vars(module).items()
        if not n.startswith("_") and (inspect.isclass(v) or inspect.isfunction(v)) and v.__module__ == module.__name__
    ]


def _own_doc(obj: Any) -> str:
    doc = obj.__doc__ if isinstance(obj.__doc__, str) else ""
    return inspect.cleandoc(doc) if doc else ""


def _member_docs(cls: type) -> Iterator[tuple[str, str]]:
    """The public methods and properties a class defines itself (what ``:members:`` shows), with docstrings."""
    for name, value in vars(cls).items():
        if name.startswith("_"):
            continue
        if isinstance(value, (classmethod, staticmethod)):
            value = value.__func__
        elif isinstance(value, property):
            value = value.fget
        if inspect.isfunction(value) and _own_doc(value):
            yield name, _own_doc(value)


def _examples_in(doc: str, id: str) -> list[Example]:
    found = []
    lines = doc.splitlines()
    for i, line in enumerate(lines):
        if _EXAMPLE.match(line):
            indent = len(line) - len(line.lstrip())
            body = []
            for following in lines[i + 1 :]:
                if following.strip() and len(following) - len(following.lstrip()) <= indent:
                    break
                body.append(following)
            code = textwrap.dedent("\n".join(body)).strip() + "\n"
            if not code.startswith(">>>"):  # torch's style, ``Example::`` then ``>>>`` lines: a doctest, below
                found.append(Example(id, "code", code))
    if doctest.DocTestParser().get_examples(doc):
        found.append(Example(id, "doctest", doc))
    return [Example(f"{e.id}[{k}]" if k else e.id, e.kind, e.code) for k, e in enumerate(found)]


def examples() -> list[Example]:
    """Every example of every docstring the API pages show: modules, classes, their members, functions."""
    found = []
    for d in documented():
        if not d.directive.startswith("auto"):
            continue
        obj = resolve(d.name)
        found += _examples_in(_own_doc(obj), d.name)
        if d.members and inspect.isclass(obj):
            for member, doc in _member_docs(obj):
                found += _examples_in(doc, f"{d.name}.{member}")
    return found


def _package(name: str) -> str:
    """The public package or module a documented name belongs to: the longest of ``PUBLIC`` it starts with."""
    return max((p for p in PUBLIC if name == p or name.startswith(p + ".")), key=len)


# ------------------------------------------------------------------------------------------------ what examples assume
# The names the examples use without defining them, as the scripts the examples run in define them.
PREAMBLE = """\
import torch, gradsync
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class MyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, x):
        return self.net(x)


torch.manual_seed(0)
model = MyModel()
dataset = TensorDataset(torch.randn(256, 8), torch.randn(256, 1))
loss_fn = nn.functional.mse_loss
epochs = 2
"""
# In this process: a batch and counters, and, in a process group of one, a model wrapped in DDP, its optimizer,
# a loader and a loss.
IN_PROCESS = """\
x, y = next(iter(DataLoader(dataset, batch_size=32)))
x1 = x2 = x
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
process_group, rank, step, epoch, start_epoch = None, 0, 0, 0, 0
"""
IN_GROUP = """\
ddp = ddp_model = gradsync.DistributedDataParallel(MyModel())
opt = optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
loader = my_uneven_shard = gradsync.DistributedLoader(dataset, batch_size=32)
loss = loss_fn(ddp(x), y)
"""
_JOB = """\
job = gradsync.elastic.init(timeout=10)
ddp = gradsync.DistributedDataParallel(model)
opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
"""
_LIGHTNING_MODEL = """\
import lightning as L


class Regressor(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = MyModel()

    def training_step(self, batch, _index):
        x, y = batch
        return loss_fn(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


model, loader = Regressor(), DataLoader(dataset, batch_size=32)
"""
_ACCELERATE = """\
import os

os.environ["ACCELERATE_USE_CPU"] = "1"  # what `accelerate launch --cpu` sets: on CPU, Accelerate wraps only then
from accelerate import Accelerator

optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
loader = DataLoader(dataset, batch_size=32)
"""

_PIPELINE_STAGE = """\
from torch.distributed.device_mesh import init_device_mesh

dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "pp"))
stage_index, device = mesh["pp"].get_local_rank(), torch.device("cpu")
stage_module = nn.Linear(8, 8)
"""
_PIPELINE_STEP = """\
optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
x, y = torch.randn(8, 8), torch.randn(8, 8)
schedule.step(x) if stage.is_first else schedule.step(target=y)
optimizer.step()
assert all(p.grad is not None for p in ddp.parameters())
"""

# Examples one CPU process cannot show, each run under the launcher it needs (after the preamble and what it
# assumes): "elastic" is `gradsync run --elastic` with 2 workers, "run" `gradsync run` with 2, "python" a script.
LAUNCHED = {
    "gradsync.elastic": ("elastic", ""),
    "gradsync.elastic.run": ("elastic", _JOB + "loader = gradsync.elastic.ElasticLoader(dataset, batch_size=32)\n"),
    "gradsync.elastic.State.guard": (
        "elastic",
        _JOB + "loader = gradsync.elastic.ElasticLoader(dataset, batch_size=32)\n"
        "state = gradsync.elastic.State(job, model=ddp, optimizer=opt, loader=loader, epoch=0)\n",
    ),
    "gradsync.elastic.ElasticLoader": ("elastic", _JOB + "from gradsync.elastic import ElasticLoader\n"),
    "gradsync.elastic.Membership": ("elastic", ""),
    "gradsync.elastic.init": ("elastic", ""),
    "gradsync.elastic.JobFinished": (
        "elastic",
        _JOB + "loader = gradsync.elastic.ElasticLoader(dataset, batch_size=32)\n"
        "state = gradsync.elastic.State(job, model=ddp, optimizer=opt, loader=loader)\n",
    ),
    "gradsync.elastic.State": ("elastic", _JOB + "loader = gradsync.elastic.ElasticLoader(dataset, batch_size=32)\n"),
    "gradsync.elastic.Recovery": (
        "elastic",
        _JOB + "loader = gradsync.elastic.ElasticLoader(dataset, batch_size=32)\n"
        "state = gradsync.elastic.State(job, model=ddp, optimizer=opt, loader=loader)\n",
    ),
    "gradsync.integrations.lightning": ("run", _LIGHTNING_MODEL),
    "gradsync.integrations.lightning.GradsyncStrategy": ("run", _LIGHTNING_MODEL),
    "gradsync.integrations.lightning.GradsyncFabricStrategy": ("run", ""),
    "gradsync.integrations.accelerate": ("run", _ACCELERATE),
    "gradsync.integrations.accelerate.gradsync_ddp": ("run", _ACCELERATE),
    "gradsync.pipelining.PipelineStage": ("run", _PIPELINE_STAGE),
    "gradsync.testing.spawn": ("python", ""),
    "gradsync.testing.spawn_failures": ("python", ""),
    "gradsync.testing.SpawnError": ("python", ""),
    "gradsync.testing.RankFailure": ("python", ""),
}
# In this process, but before the process group exists: the example forms it.
NO_GROUP = {"gradsync.DistributedDataParallel", "gradsync.init", "gradsync.DistInfo", "gradsync.shutdown"}
_TRAINED_WITH_A_MONITOR = """\
monitor = gradsync.observe.Monitor(ddp, opt)
for x, y in loader:
    opt.zero_grad()
    loss_fn(ddp(x), y).backward()
    opt.step()
"""
# Run before an example, in its namespace: what it reads that the common names do not give.
SETUP = {
    **{
        f"gradsync.observe.{name}": _TRAINED_WITH_A_MONITOR
        for name in ("StepBreakdown", "median_breakdown", "arrivals", "slowest_rank", "chrome_trace")
    },
    "gradsync.observe.write_chrome_trace": _TRAINED_WITH_A_MONITOR,
    "gradsync.observe.read_steps": _TRAINED_WITH_A_MONITOR + 'monitor.export_chrome_trace("trace.json")\n',
    "gradsync.checkpoint.restore": 'checkpoint.save("ckpt.pt", model=ddp, optimizer=opt, loader=loader, step=3)\n',
    "gradsync.checkpoint.load": 'checkpoint.save("ckpt.pt", model=ddp, optimizer=opt, loader=loader, step=3)\n',
    "gradsync.data.DistributedLoader": (
        'checkpoint = {"loader": gradsync.DistributedLoader(dataset, batch_size=32).state_dict()}\nresuming = True\n'
    ),
    "gradsync.comm.issues_from_callbacks": (
        "def my_two_stage_hook(state, bucket):\n"
        "    summed = dist.all_reduce(bucket.buffer(), async_op=True).get_future()\n"
        "    world = torch.ones(1)\n"
        "    counted = summed.then(lambda _: dist.all_reduce(world, async_op=True).get_future().wait())\n"
        "    return counted.then(lambda _: bucket.buffer().div_(world))\n"
    ),
    "gradsync.DistributedDataParallel.set_params_and_buffers_to_ignore": (
        "model = nn.ModuleDict({'embedding': nn.Embedding(10, 4), 'head': nn.Linear(4, 1)})\n"
    ),
}
# Run after an example: what it promises, checked.
CHECK = {
    # an elastic worker tells the job it is done (elastic.run and State.finish() do), or the others wait for it
    "gradsync.elastic.Recovery": "state.finish()\n",
    "gradsync.elastic.JobFinished": "state.finish()\n",
    "gradsync.comm.GradBucket": "ddp.register_comm_hook(None, sum_hook)\nloss_fn(ddp(x), y).backward()\n",
    "gradsync.comm.issues_from_callbacks": "loss_fn(ddp(x), y).backward()\n",
    "gradsync.observe.write_chrome_trace": 'assert read_steps("trace.json")[0]\n',
    "gradsync.pipelining.PipelineStage": _PIPELINE_STEP,
    "gradsync.checkpoint.atomic_torch_save": 'assert torch.load("state.pt") == {"step": 3}\n',
    "gradsync.checkpoint.restore": "assert start_step == 3\n",
    "gradsync.observe.Monitor": 'import os\nassert os.path.getsize("trace.json") > 0\n',
    "gradsync.optim.ShardedOptimizer": 'assert "state" in torch.load("optim.pt")\n',
    "gradsync.integrations.accelerate": "assert isinstance(model, gradsync.DistributedDataParallel), type(model)\n",
    "gradsync.integrations.accelerate.gradsync_ddp": (
        "assert isinstance(model, gradsync.DistributedDataParallel), type(model)\n"
    ),
}


def _names(package: str, group: bool) -> dict[str, Any]:
    """The namespace an in-process example runs in: the preamble, the public names of its package unqualified
    (as its page shows them), ``checkpoint`` and ``comm``, and with a group the model, optimizer and loader."""
    import gradsync

    names: dict[str, Any] = {"__name__": "__example__"}
    exec(PREAMBLE, names)
    module = resolve(package)
    names.update({n: getattr(module, n) for n in public_names(module)})
    names.update(checkpoint=gradsync.checkpoint, comm=gradsync.comm)
    exec(IN_PROCESS, names)
    if group:
        exec(IN_GROUP, names)
    return names


class _Checker(doctest.OutputChecker):
    """Lines marked ``+SKIP`` run here too (the namespace gives what they assume); their output is not compared
    where they show none."""

    def check_output(self, want: str, got: str, optionflags: int) -> bool:
        return want == _UNCOMPARED or super().check_output(want, got, optionflags)


_UNCOMPARED = "<not compared>\n"


def _run_doctest(example: Example, names: dict[str, Any]) -> None:
    test = doctest.DocTestParser().get_doctest(example.code, names, example.id, None, 0)
    for line in test.examples:
        if line.options.pop(doctest.SKIP, False) and not line.want:
            line.want = _UNCOMPARED
    report: list[str] = []
    runner = doctest.DocTestRunner(checker=_Checker(), optionflags=doctest.ELLIPSIS)
    runner.run(test, out=report.append, clear_globs=False)
    assert runner.failures == 0, "".join(report)
    names.update(test.globs)  # what the lines defined, for the check after them


def _run_launched(code: str, mode: str, cwd: Path) -> subprocess.CompletedProcess:
    import os

    from gradsync.testing import free_port

    script = cwd / "example.py"
    script.write_text(code)
    if mode == "python":
        argv = [sys.executable, str(script)]
    elif mode == "run":
        argv = [sys.executable, "-m", "gradsync", "run", "--nproc-per-node", "2", "--standalone", str(script)]
    else:
        argv = [sys.executable, "-m", "gradsync", "run", "--elastic", "--nnodes", "1", "--nproc-per-node", "2"]
        argv += ["--rdzv-endpoint", f"127.0.0.1:{free_port()}", str(script)]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "LOCAL_"))}
    env.update(PYTHONPATH=str(ROOT), GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    done = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, f"{' '.join(argv[1:])}:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    return done


def _run(
    code: str,
    kind: str,
    id: str,
    package: str,
    launched: tuple[str, str] | None,
    setup: str,
    check: str,
    group: bool,
    cwd: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Run ``code`` (a block, or ``>>>`` lines) as written: under its launcher after the preamble, or in this
    process in the namespace of its package, with ``setup`` before and ``check`` after."""
    import torch.distributed as dist

    monkeypatch.chdir(cwd)
    if launched is not None:
        mode, assumed = launched
        assert kind == "code", f"{id}: a launched example is a block of code, not >>> lines"
        _run_launched(PREAMBLE + assumed + setup + code + check, mode, cwd)
        return
    if group:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    else:
        from gradsync.testing import free_port

        for key, value in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1").items():
            monkeypatch.setenv(key, value)
    try:
        names = _names(package, group)
        exec(setup, names)
        if kind == "doctest":
            _run_doctest(Example(id, kind, code), names)
        else:
            exec(compile(code, id, "exec"), names)
        exec(check, names)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _run_example(example: Example, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    base = example.id.split("[")[0]
    _run(
        example.code,
        example.kind,
        example.id,
        _package(base),
        LAUNCHED.get(base),
        SETUP.get(base, ""),
        CHECK.get(base, ""),
        base not in NO_GROUP,
        tmp_path,
        monkeypatch,
    )


def _launched_script(example: Example) -> tuple[str, str]:
    """(the script a launched example runs as, its launcher mode): the preamble, what it assumes, its setup, the
    example as written, and its check."""
    base = example.id.split("[")[0]
    mode, assumed = LAUNCHED[base]
    assert example.kind == "code", f"{example.id}: a launched example is a block of code, not >>> lines"
    return PREAMBLE + assumed + SETUP.get(base, "") + example.code + CHECK.get(base, ""), mode


@pytest.fixture(scope="module")
def launched_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, BaseException | None]:
    """Every launched example's outcome (None: it passed), run two at a time: each is mostly a launcher and its
    workers starting Python and torch, so two share the machine's 2 cores well and the suite stays within its time."""
    from concurrent.futures import ThreadPoolExecutor

    chosen = [e for e in examples() if e.id.split("[")[0] in LAUNCHED]

    def outcome(example: Example) -> BaseException | None:
        cwd = tmp_path_factory.mktemp(re.sub(r"\W+", "_", example.id))
        try:
            _run_launched(*_launched_script(example), cwd)
        except BaseException as exc:  # reported by the example's own test
            return exc
        return None

    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip((e.id for e in chosen), pool.map(outcome, chosen)))


def _long_if(launched: bool, value: object) -> object:
    """A launched block or example (``gradsync run`` and its workers starting Python and torch, seconds each) runs in
    the long tier (``pytest -m long``, which CI runs); the rest in the default one."""
    return pytest.param(value, marks=pytest.mark.long) if launched else value


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "example", [_long_if(e.id.split("[")[0] in LAUNCHED, e) for e in examples()], ids=lambda e: e.id
)
def test_every_docstring_example_runs_as_written(
    example: Example, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    if example.id.split("[")[0] in LAUNCHED:  # the launched ones, all run at the first (the long tier's)
        failure = request.getfixturevalue("launched_runs")[example.id]
        if failure is not None:
            raise failure
        return
    _run_example(example, tmp_path, monkeypatch)


# ------------------------------------------------------------------------------------------------ the API pages
def test_every_public_name_is_in_the_api_pages() -> None:
    """Each name of each public package is documented under that path, or is the very object documented under
    another public path (``gradsync.ShardedOptimizer`` is ``gradsync.optim.ShardedOptimizer``); and the pages name
    nothing through an internal module (``gradsync.reducer...``)."""
    pages_ = documented()
    names = {d.name for d in pages_}
    objects = {id(resolve(d.name)) for d in pages_}
    missing = []
    for package in PUBLIC:
        module = resolve(package)
        for name in public_names(module):
            if f"{package}.{name}" not in names and id(getattr(module, name)) not in objects:
                missing.append(f"{package}.{name}")
    assert not missing, f"public names the API pages (docs/api/*.md) do not document: {missing}"
    internal = [d.name for d in pages_ if _package(d.name) != d.name and d.name.rsplit(".", 1)[0] not in PUBLIC]
    assert not internal, f"documented through a path that is not public: {internal}"
    assert {p for p in PUBLIC} <= {d.name for d in pages_ if d.directive == "automodule"}


def test_every_documented_class_and_function_has_an_example() -> None:
    """A class or function on an API page carries an example in its own docstring (``Example::`` or ``>>>``); one
    written on the page itself (torch's re-exported PowerSGD) has a ```python block on that page."""
    lacking = []
    for d in documented():
        if d.directive == "automodule" or d.directive == "py:data":
            continue
        if d.directive.startswith("auto"):
            if not _examples_in(_own_doc(resolve(d.name)), d.name):
                lacking.append(d.name)
        elif not any(d.name.rsplit(".", 1)[1] in b.code for b in blocks(d.page, "python")):
            lacking.append(d.name)
    assert not lacking, f"no example: {lacking}"


# ------------------------------------------------------------------------------------------------ the site
@pytest.mark.long
@pytest.mark.timeout(600)
def test_the_site_builds_without_a_warning() -> None:
    """docs/index.md's command, as written: ``-W`` makes every warning an error and ``-E`` reads every page and
    docstring anew (an incremental build would not repeat the warnings of pages it did not reread)."""
    command = blocks("docs/index.md", "bash", "Building this site")[0].code.strip()
    assert command.startswith(".venv/bin/sphinx-build ") and " -W " in command and " -E " in command, command
    done = subprocess.run(command, shell=True, cwd=ROOT, capture_output=True, text=True, timeout=540)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    assert "WARNING" not in done.stderr and "build succeeded" in done.stdout, done.stderr[-6000:]
    html = ROOT / "docs" / "_build" / "html"
    for d in documented():  # autodoc rendered each name where its page says, under its public path
        page = (html / d.page.removeprefix("docs/")).with_suffix(".html").read_text()
        target = f"module-{d.name}" if d.directive == "automodule" else d.name
        assert f'id="{target}"' in page, f"{d.page}: {d.name} is not on the built page"


def test_ci_runs_the_readmes_commands() -> None:
    """CI (.ci/run) installs exactly the extras README's test command installs, the docs' included, and runs its
    pytest; the first command's training run is tests/test_main_job.py's."""
    setup = blocks("README.md", "bash", "Set up")
    assert len(setup) == 2, "README's Set up holds the training command and the test command"
    readme = re.search(r"-e '\.\[([\w,]+)\]' torch==2\.13\.0 && \.venv/bin/python -m pytest$", setup[1].code.strip())
    assert readme, setup[1].code
    ci = (ROOT / ".ci" / "run").read_text()
    ci_extras = {e for group in re.findall(r"-e '\.\[([\w,]+)\]'", ci) for e in group.split(",")}
    assert set(readme.group(1).split(",")) == ci_extras and "docs" in ci_extras, (readme.group(1), ci_extras)
    assert re.search(r"^\.venv/bin/python -m pytest -q$", ci, re.M)  # the default tier, as README's command
    assert re.search(r"^\.venv/bin/python -m pytest -q -m long$", ci, re.M)  # and the long tier
    assert setup[0].code.strip().endswith(".venv/bin/gradsync run --nproc-per-node 2 examples/train_digits.py")
    # tests/test_main_job.py runs that script the same way (gradsync run, 2 processes) and checks that it learns
    assert '"examples" / "train_digits.py"' in (ROOT / "tests" / "test_main_job.py").read_text()


# ------------------------------------------------------------------------------------------------ the pages' blocks
_LIGHTNING_BUILT = """\
from gradsync.integrations.lightning import GradsyncFabricStrategy
assert isinstance(trainer.strategy, GradsyncStrategy), type(trainer.strategy)
assert isinstance(fabric.strategy, GradsyncFabricStrategy), type(fabric.strategy)
"""
_IS_GRADSYNC_DDP = "assert isinstance(model, gradsync.DistributedDataParallel), type(model)\n"
_NET_WITH_HEAD = """\
class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.head = torch.nn.Embedding(10, 4), torch.nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.embed(x))

net = Net()
"""
_HEAD_IN_ITS_BUFFER = """\
model(torch.tensor([1, 2, 3])).sum().backward()
assert net.head.weight.grad.data_ptr() == model._delayed.buffer.data_ptr()
"""
# The ```python blocks of the pages that this module runs as written: "page:language:index" (the index-th block of
# that language on the page) -> (launcher or None for this process, setup, check). The others are run by the tests
# RUN_ELSEWHERE names.
PAGE_BLOCKS = {
    "docs/migrating.md:python:0": (("run", ""), "", ""),
    "docs/migrating.md:python:1": (None, _NET_WITH_HEAD, _HEAD_IN_ITS_BUFFER),
    "docs/migrating.md:python:2": (
        None,
        "",
        "assert {(p.dtype, p.grad.dtype) for p in model.parameters()} == {(torch.float32, torch.float32)}\n",
    ),
    "docs/checkpoints.md:python:0": (
        None,
        "epoch, step = 1, 10\n",
        'assert (extras["epoch"], extras["step"]) == (1, 10)\n',
    ),
    "docs/checkpoints.md:python:1": (
        None,
        "",
        'assert extras["epoch"] == 1 and list(resumed) == sampler.batches()[10:]\n',
    ),
    "docs/observe.md:python:0": (None, "", 'import os\nassert os.path.getsize("trace.json") > 0\n'),
    "docs/integrations.md:python:0": (("run", ""), "", _LIGHTNING_BUILT),
    "docs/integrations.md:python:1": (("run", _ACCELERATE), "", _IS_GRADSYNC_DDP),
    "docs/api/comm.md:python:0": (None, "", "loss_fn(ddp(x), y).backward()\n"),
    "docs/api/optim.md:python:0": (None, "", "assert isinstance(opt, gradsync.optim.ShardedOptimizer)\n"),
}
RUN_ELSEWHERE: dict[str, str | tuple[str, ...]] = {
    "README.md:bash:0": "tests/test_docs.py::test_ci_runs_the_readmes_commands",  # and test_main_job's run of it
    "README.md:bash:1": "tests/test_docs.py::test_ci_runs_the_readmes_commands",  # CI runs the steps: .ci/run
    "docs/index.md:bash:0": "tests/test_docs.py::test_the_site_builds_without_a_warning",
    "docs/compiled.md:python:0": "tests/test_compile.py::test_the_docs_example_runs_as_written",
    "docs/elastic.md:python:0": "tests/test_elastic.py::test_the_docs_elastic_examples_run_as_written",
    "docs/elastic.md:python:1": "tests/test_elastic.py::test_the_docs_elastic_examples_run_as_written",
    "docs/elastic.md:bash:0": "tests/test_elastic.py::test_the_docs_elastic_command_runs_on_three_hosts",
    "docs/elastic.md:bash:1": "tests/test_elastic.py::test_the_docs_etcd_block_runs_as_written",
    "docs/elastic.md:bash:2": "tests/test_elastic.py::test_the_docs_secured_etcd_blocks_run_as_written",
    "docs/elastic.md:bash:3": "tests/test_elastic.py::test_the_docs_secured_etcd_blocks_run_as_written",
    "docs/elastic.md:bash:4": "tests/test_elastic.py::test_the_docs_secured_etcd_blocks_run_as_written",
    "docs/hooks.md:python:0": "tests/test_docs.py::test_the_hooks_pages_alternatives_run_as_written",
    "docs/hooks.md:python:1": "tests/test_streaming_diloco.py::test_the_docs_local_method_lines_run_as_written",
    "docs/parallelism.md:python:0": "tests/test_parallelism_docs.py::test_the_blocks_run_as_written_on_four_ranks",
    "docs/parallelism.md:python:1": "tests/test_parallelism_docs.py::test_the_blocks_run_as_written_on_four_ranks",
    "docs/integrations.md:python:2": "tests/test_integrations.py::test_ray_runs_the_docs_block_and_matches_rays_ddp",
    "docs/doctor.md:bash:0": (
        "tests/test_doctor.py::test_the_docs_commands_run_as_written",
        "tests/test_doctor.py::test_the_docs_commands_for_two_hosts_run_as_written",
    ),
    "docs/doctor.md:bash:1": "tests/test_doctor.py::test_the_docs_json_block_runs_as_written",
    "docs/launching.md:bash:0": (
        "tests/test_docs.py::test_the_launching_commands_run_as_written",
        "tests/test_docs.py::test_the_launching_commands_for_two_hosts_run_as_written",
    ),
}


def _page_blocks() -> dict[str, str]:
    """Every ```python and ```bash block of README.md and docs/, by "page:language:index"."""
    found = {}
    for page in pages():
        for language in ("python", "bash"):
            for k, b in enumerate(blocks(page, language)):
                found[f"{page}:{language}:{k}"] = b.code
    return found


def test_every_code_block_of_readme_and_docs_is_run_by_a_test() -> None:
    """Each ```python and ```bash block is run here (PAGE_BLOCKS) or by the test RUN_ELSEWHERE names, which exists
    and reads that page; a block without a language is refused (a diagram is ```text)."""
    found = _page_blocks()
    unrun = sorted(set(found) - set(PAGE_BLOCKS) - set(RUN_ELSEWHERE))
    assert not unrun, f"blocks no test runs (run them, and list them in PAGE_BLOCKS or RUN_ELSEWHERE): {unrun}"
    stale = sorted((set(PAGE_BLOCKS) | set(RUN_ELSEWHERE)) - set(found))
    assert not stale, f"listed blocks that are not on their page any more: {stale}"
    for key, tests in RUN_ELSEWHERE.items():
        for test in (tests,) if isinstance(tests, str) else tests:
            path, name = test.split("::")
            source = (ROOT / path).read_text()
            assert f"def {name}(" in source, f"{key}: {test} does not exist"
            assert key.split(":")[0] in source, f"{key}: {path} never names the page {key.split(':')[0]}"
    bare = [f"{p}:{b.line}" for p in pages() for b in blocks(p) if not b.language]
    assert not bare, f"fenced blocks without a language (```text for a diagram): {bare}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("key", [_long_if(PAGE_BLOCKS[k][0] is not None, k) for k in sorted(PAGE_BLOCKS)])
def test_the_pages_blocks_run_as_written(key: str, tmp_path: Path, monkeypatch) -> None:
    launched, setup, check = PAGE_BLOCKS[key]
    code = _page_blocks()[key]
    _run(code, "code", key, "gradsync", launched, setup, check, True, tmp_path, monkeypatch)


def test_the_hooks_pages_alternatives_run_as_written(tmp_path: Path, monkeypatch) -> None:
    """docs/hooks.md's first block: its import, then each "one of these" line on a fresh model, then its join loop
    over uneven data, then a backward through the registered hook."""
    code = blocks("docs/hooks.md", "python", "Communication hooks")[0].code
    head, rest = code.split("# one of these, before the first backward:\n")
    alternatives, join = rest.split("with ddp.join():")
    lines = [line for line in alternatives.splitlines() if line.strip()]
    assert len(lines) == 3 and "PostLocalSGD" in lines[2], lines
    for line in lines:
        then = "loss_fn(ddp(x), y).backward()\n" + ("local.step()\n" if "local" in line else "")
        _run(
            head + line + "\nwith ddp.join():" + join,
            "code",
            line,
            "gradsync",
            None,
            "",
            then,
            True,
            tmp_path,
            monkeypatch,
        )


_TRAIN = '''\
"""train.py for docs/launching.md's commands: a few synchronised steps; with --resume, rank 1 crashes once."""
import os
import sys

import torch

import gradsync

info = gradsync.init()
attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
model = gradsync.DistributedDataParallel(torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
if "--resume" in sys.argv and info.rank == 1 and attempt == "0":
    os._exit(7)  # a crashed worker: the launcher restarts the job
for _ in range(3):
    opt.zero_grad()
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
print(f"rank {info.rank} of {info.world_size} done in attempt {attempt}", flush=True)
gradsync.shutdown()
'''


def _launching_lines() -> list[str]:
    code = blocks("docs/launching.md", "bash", "Launching")[0].code
    lines = [line for line in code.splitlines() if line.strip()]
    assert len(lines) == 4, lines
    return lines


def _launch_env(**extra: str) -> dict[str, str]:
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "LOCAL_"))}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PATH=f"{Path(sys.executable).parent}:{env['PATH']}")
    env.update(extra)
    return env


@pytest.mark.long
@pytest.mark.timeout(300)
def test_the_launching_commands_run_as_written(tmp_path: Path) -> None:
    """docs/launching.md's first two commands, as written, on this machine: both ranks train; the second's train.py
    loses rank 1 in its first attempt, and --max-restarts brings the job back."""
    (tmp_path / "train.py").write_text(_TRAIN)
    for line, attempt in zip(_launching_lines()[:2], ("0", "1")):
        done = subprocess.run(
            ["bash", "-c", line],
            cwd=tmp_path,
            env=_launch_env(GLOO_SOCKET_IFNAME="lo"),
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert done.returncode == 0, f"{line}\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
        for rank in (0, 1):
            assert f"rank {rank} of 2 done in attempt {attempt}" in done.stdout, done.stdout[-2000:]


@pytest.mark.long
@pytest.mark.netlab()
@pytest.mark.timeout(300)
def test_the_launching_commands_for_two_hosts_run_as_written(tmp_path: Path) -> None:
    """docs/launching.md's host A and host B commands, as written, on two namespace hosts at their addresses
    (10.0.0.1 and .2, inside the namespaces only): the host whose --local-addr is the endpoint serves it."""
    from lab import netlab

    (tmp_path / "train.py").write_text(_TRAIN)
    with netlab.lab(hosts=2, rate="1gbit", prefix="gsdocs", subnet="10.0.0") as hosts:
        procs = []
        for host, line in zip(hosts, _launching_lines()[2:]):
            assert f"--local-addr {host.address} " in line, (host.address, line)
            env = _launch_env(GLOO_SOCKET_IFNAME=host.interface)
            command = host.command(["env", *[f"{k}={v}" for k, v in env.items()], "bash", "-c", line])
            pipe = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}
            procs.append(subprocess.Popen(command, cwd=tmp_path, **pipe))
        logs = []
        for p in procs:
            try:
                logs.append(p.communicate(timeout=200)[0])
            except subprocess.TimeoutExpired:
                p.kill()
                logs.append(p.communicate()[0])
    assert all(p.returncode == 0 for p in procs), "\n----\n".join(log[-3000:] for log in logs)
    assert "rank 0 of 2 done" in logs[0] and "rank 1 of 2 done" in logs[1], logs
