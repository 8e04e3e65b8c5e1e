"""What real scripts hit, run the same way with torch's DDP and gradsync's in the same processes: the results must
be the same (gradients None where torch leaves them None, buffers broadcast when torch broadcasts them)."""

from __future__ import annotations

import copy
import io
import os
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

import gradsync
from gradsync.testing import spawn

WRAPPERS = {"torch": torch.nn.parallel.DistributedDataParallel, "gradsync": gradsync.DistributedDataParallel}


def _data(step: int, rank: int, n: int = 4, dim: int = 8) -> torch.Tensor:
    return torch.randn(n, dim, generator=torch.Generator().manual_seed(1000 * step + rank))


def _params_and_grads(module: nn.Module) -> dict:
    out = {}
    for name, p in module.named_parameters():
        out[name] = p.detach().clone()
        out[f"{name}.grad"] = None if p.grad is None else p.grad.detach().clone().to_dense()
    return out


# ----------------------------------------------------------------------------------------------- recipes
class Branches(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.extra = nn.Linear(8, 8)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor, use_extra: bool = True) -> torch.Tensor:
        h = torch.tanh(self.body(x))
        return self.head(torch.tanh(self.extra(h)) if use_extra else h)


def no_sync_find_unused(rank: int, wrap: Callable) -> dict:
    # `extra` is used only in the no_sync micro-batch: its accumulated gradient must still be averaged.
    torch.manual_seed(0)
    model = Branches()
    ddp = wrap(model, find_unused_parameters=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        opt.zero_grad()
        with ddp.no_sync():
            ddp(_data(step, rank), use_extra=True).sum().backward()
        ddp(_data(step + 10, rank), use_extra=False).sum().backward()
        opt.step()
    return _params_and_grads(model)


def second_wrapper(rank: int, wrap: Callable) -> dict:
    # Re-wrapping a module: the first wrapper's hooks must stay quiet while the second one trains.
    torch.manual_seed(0)
    model = Branches()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step, find_unused in enumerate([True, False, False]):
        ddp = wrap(model, find_unused_parameters=find_unused)
        opt.zero_grad()
        ddp(_data(step, rank)).sum().backward()
        opt.step()
    return _params_and_grads(model)


class TwoOutputs(nn.Module):
    def __init__(self, as_dict: bool) -> None:
        super().__init__()
        self.a = nn.Linear(8, 4)
        self.b = nn.Linear(8, 4)
        self.as_dict = as_dict

    def forward(self, x: torch.Tensor):
        a, b = self.a(x), self.b(x)
        return {"a": a, "b": b} if self.as_dict else (a, b)


def unused_output(rank: int, wrap: Callable, as_dict: bool, view: bool) -> dict:
    # The loss uses one output only: the other branch's grads stay None, as in torch.
    torch.manual_seed(0)
    model = TwoOutputs(as_dict)
    ddp = wrap(model, find_unused_parameters=True, gradient_as_bucket_view=view)
    for step in range(2):
        out = ddp(_data(step, rank))
        (out["a"] if as_dict else out[0]).sum().backward()
    return _params_and_grads(model)


def undefined_grads(rank: int, wrap: Callable) -> dict:
    torch.manual_seed(0)
    model = Branches()
    ddp = wrap(model, find_unused_parameters=True)
    out = ddp(_data(0, rank)).sum()
    torch._C._functions.UndefinedGrad()(out).backward()
    return _params_and_grads(model)


class WithBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 1)
        self.register_buffer("buf", torch.zeros(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) + self.buf.sum()


def buffer_reassigned(rank: int, wrap: Callable) -> dict:
    torch.manual_seed(0)
    ddp = wrap(WithBuffer())
    seen = []
    for step in range(3):
        if rank == 0:
            ddp.module.buf = ddp.module.buf + 1  # a new tensor: the buffer list cached at wrapping is stale
        ddp(_data(step, rank)).sum().backward()
        seen.append(ddp.module.buf.clone())
    return {"seen": torch.stack(seen)}


def copies(rank: int, wrap: Callable) -> dict:
    # torch.save(ddp_model) and copy.deepcopy (EMA code): the copy trains with a reducer of its own.
    torch.manual_seed(0)
    ddp = wrap(Branches())
    ddp(_data(0, rank)).sum().backward()
    buffer = io.BytesIO()
    torch.save(ddp, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    twin = copy.deepcopy(ddp)
    out = {}
    for name, model in (("loaded", loaded), ("twin", twin)):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(2):
            opt.zero_grad()
            model(_data(step + 1, rank)).sum().backward()
            opt.step()
        out.update({f"{name}.{k}": v for k, v in _params_and_grads(model.module).items()})
    return out


class Square(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.tensor(1.0))

    def forward(self) -> torch.Tensor:
        return self.p.pow(2)


def create_graph(rank: int, wrap: Callable) -> dict:
    # torch's test_ddp_create_graph: backward(create_graph=True) works, and the gradients keep requiring grad.
    ddp = wrap(Square())
    for _ in range(6):
        ddp().backward(create_graph=True)
    result = _params_and_grads(ddp.module)
    result["requires_grad"] = torch.tensor([p.grad.requires_grad for p in ddp.module.parameters()])
    return result


class Checkpointed(nn.Module):
    def __init__(self, where: str) -> None:
        super().__init__()
        self.stem = nn.Linear(8, 8)
        self.mid = nn.Linear(8, 8)
        self.head = nn.Linear(8, 2)
        self.where = where

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.where == "stem":
            h = checkpoint(lambda t: torch.tanh(self.stem(t)), x, use_reentrant=True)
            return self.head(torch.tanh(self.mid(h)))
        h = torch.tanh(self.stem(x))
        return checkpoint(lambda t: self.head(torch.tanh(self.mid(t))), h, use_reentrant=True)


def reentrant_checkpoint(rank: int, wrap: Callable, where: str, static: bool) -> dict:
    torch.manual_seed(0)
    model = Checkpointed(where)
    ddp = wrap(model, static_graph=static)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(4):
        opt.zero_grad()
        ddp(_data(step, rank).requires_grad_(True)).sum().backward()
        opt.step()
    return _params_and_grads(model)


class SparseNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(50, 8, sparse=True)
        self.head = nn.Linear(8, 1)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.embedding(idx))


def sparse_embedding(rank: int, wrap: Callable) -> dict:
    torch.manual_seed(0)
    model = SparseNet()
    ddp = wrap(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        opt.zero_grad()
        idx = torch.randint(0, 50, (6,), generator=torch.Generator().manual_seed(step * 10 + rank))
        ddp(idx).sum().backward()
        assert model.embedding.weight.grad.is_sparse
        opt.step()
    return _params_and_grads(model)


class BNNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.bn(self.fc(x)))


def buffer_timing(rank: int, wrap: Callable, scenario: str) -> dict:
    # torch broadcasts buffers at a forward when the previous forward was a synced one, whatever the grad mode.
    torch.manual_seed(0)
    model = BNNet()
    ddp = wrap(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = {}
    for step in range(3):
        opt.zero_grad()
        if scenario == "no_sync":
            with ddp.no_sync():
                ddp(_data(step, rank)).sum().backward()
        ddp(_data(step + 10, rank)).sum().backward()
        opt.step()
        if scenario == "eval":
            model.eval()
            with torch.no_grad():
                out[f"eval{step}"] = ddp(_data(step + 20, rank))
            model.train()
        elif scenario == "no_grad":
            with torch.no_grad():
                out[f"val{step}"] = ddp(_data(step + 20, rank))  # train mode: BatchNorm updates its statistics
    out.update({k: v.clone() for k, v in model.state_dict().items()})
    return out


def ignore_list(rank: int, wrap: Callable) -> dict:
    torch.manual_seed(rank)  # different weights per rank: only the ignored one may stay different
    model = Branches()
    torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ["extra.weight"])
    ddp = wrap(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        opt.zero_grad()
        ddp(_data(step, rank)).sum().backward()
        opt.step()
    return _params_and_grads(model)


def skip_unused(rank: int, wrap: Callable) -> dict:
    torch.manual_seed(0)
    model = Branches()
    ddp = wrap(model, find_unused_parameters=True, skip_all_reduce_unused_params=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        opt.zero_grad()
        ddp(_data(step, rank), use_extra=False).sum().backward()  # `extra` unused on every rank, every step
        opt.step()
    return _params_and_grads(model)


def backward_twice(rank: int, wrap: Callable) -> dict:
    # A second backward of the same forward (retain_graph): torch's hooks do nothing after the reduction, so its
    # gradients accumulate locally, unaveraged. gradsync matches that (GRADSYNC_DEBUG is the way to catch it).
    torch.manual_seed(0)
    model = Branches()
    ddp = wrap(model)
    loss = ddp(_data(0, rank)).sum()
    loss.backward(retain_graph=True)
    loss.backward()
    return _params_and_grads(model)


def mesh(rank: int, wrap: Callable) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    model = Branches()
    ddp = wrap(model, device_mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    ddp(_data(0, rank)).sum().backward()
    return _params_and_grads(model)


class Mock(nn.Module):
    """torch's test_stateless_api_with_ddp's module, one layer deeper."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(8, 8)
        self.l2 = nn.Linear(8, 1)
        self.register_buffer("buffer", torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.tanh(self.l1(x))) + self.buffer


def functional_call(rank: int, wrap: Callable, swapped: str, find_unused: bool) -> dict:
    # torch.func.functional_call(ddp, tensors, x): the tensors stand in for the module's for one call and get their
    # gradients locally, unaveraged; the module's own are untouched; the next ordinary step averages as always.
    # "own": the module's own parameters passed (averaged); "some" (find_unused only): the rest are averaged.
    torch.manual_seed(0)
    model = Mock()
    ddp = wrap(model, find_unused_parameters=find_unused)
    names = {"all": ["l1.weight", "l1.bias", "l2.weight", "l2.bias"], "some": ["l1.weight"], "own": []}[swapped]
    tensors = {f"module.{n}": (p.detach() * (rank + 2)).requires_grad_() for n, p in model.named_parameters()}
    passed = {n: t for n, t in tensors.items() if n[len("module.") :] in names}
    if swapped == "own":
        passed = {f"module.{n}": p for n, p in model.named_parameters()}
    passed["module.buffer"] = torch.zeros(1)
    out = {"output": torch.func.functional_call(ddp, passed, _data(0, rank)).detach()}
    torch.func.functional_call(ddp, passed, _data(1, rank)).sum().backward()
    out.update({f"passed.{n}.grad": t.grad for n, t in passed.items() if n != "module.buffer" and swapped != "own"})
    out.update({f"during.{k}": v for k, v in _params_and_grads(model).items()})
    out["buffer"] = model.buffer.clone()
    model.zero_grad()
    ddp(_data(2, rank)).sum().backward()
    out.update({f"after.{k}": v for k, v in _params_and_grads(model).items()})
    return out


class NestedOutputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.lin = nn.Linear(8, 1, bias=False)

    def forward(self, x: torch.Tensor, kind: str):
        h = self.lin(torch.tanh(self.body(x)))
        return {"a": h, "b": {"c": 2 * h}} if kind == "dict" else (h, [3 * h, h])


def _total(output) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output.sum()
    return sum(_total(v) for v in (output.values() if isinstance(output, dict) else output))


def nested_ddp(rank: int, wrap: Callable, outer: dict) -> dict:
    # torch's test_ddp_static_graph_nested_types: a DDP wrapping a DDP, each trained in turn (the outer's
    # parameters are the inner's); both average the same parameters, .grad holds the average.
    torch.manual_seed(0)
    model = NestedOutputs()
    inner = wrap(model)
    both = wrap(inner, **outer)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = {}
    for step in range(6):
        for name, ddp in (("inner", inner), ("outer", both)):
            kind = "dict" if step % 2 else "tuple"
            opt.zero_grad()
            output = ddp(_data(step, rank), kind)
            assert isinstance(output, dict if step % 2 else tuple)
            _total(output).backward()
            out.update({f"{step}.{name}.{k}": v for k, v in _params_and_grads(model).items()})
            opt.step()
    return out


RECIPES: dict[str, Callable] = {
    f.__name__: f
    for f in (
        no_sync_find_unused,
        second_wrapper,
        unused_output,
        undefined_grads,
        buffer_reassigned,
        copies,
        create_graph,
        reentrant_checkpoint,
        sparse_embedding,
        buffer_timing,
        ignore_list,
        skip_unused,
        backward_twice,
        mesh,
        functional_call,
        nested_ddp,
    )
}


def _both(rank: int, world_size: int, recipe: str, args: tuple) -> dict:
    os.environ["GRADSYNC_BUCKET_TUNING"] = "0"  # the same buckets as torch
    return {kind: RECIPES[recipe](rank, wrap, *args) for kind, wrap in WRAPPERS.items()}


def _assert_same(results: list[dict], atol: float = 1e-6) -> None:
    for rank, both in enumerate(results):
        theirs, ours = both["torch"], both["gradsync"]
        assert theirs.keys() == ours.keys()
        for key, value in theirs.items():
            if value is None or ours[key] is None:
                assert value is None and ours[key] is None, f"rank {rank} {key}: torch {value}, gradsync {ours[key]}"
                continue
            torch.testing.assert_close(ours[key], value, rtol=0, atol=atol, msg=f"rank {rank} {key}")


CASES = [
    ("no_sync_find_unused", ()),
    ("second_wrapper", ()),
    ("unused_output", (False, False)),
    ("unused_output", (True, True)),
    ("undefined_grads", ()),
    ("buffer_reassigned", ()),
    ("copies", ()),
    ("create_graph", ()),
    ("reentrant_checkpoint", ("head", False)),
    ("reentrant_checkpoint", ("stem", False)),
    ("reentrant_checkpoint", ("head", True)),
    ("reentrant_checkpoint", ("stem", True)),
    ("sparse_embedding", ()),
    ("buffer_timing", ("eval",)),
    ("buffer_timing", ("no_grad",)),
    ("buffer_timing", ("no_sync",)),
    ("ignore_list", ()),
    ("skip_unused", ()),
    ("backward_twice", ()),
    ("mesh", ()),
    ("functional_call", ("all", False)),
    ("functional_call", ("all", True)),
    ("functional_call", ("some", True)),
    ("functional_call", ("own", False)),
    ("nested_ddp", ({},)),
    ("nested_ddp", ({"static_graph": True},)),
    ("nested_ddp", ({"find_unused_parameters": True},)),
]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("recipe,args", CASES, ids=[f"{r}{'-' + '-'.join(map(str, a)) if a else ''}" for r, a in CASES])
def test_same_as_torch(recipe: str, args: tuple) -> None:
    _assert_same(spawn(_both, args=(recipe, args), timeout=80, pg_timeout=20))


def _profiled(rank: int, world_size: int) -> dict:
    counts = {}
    for kind, wrap in WRAPPERS.items():
        torch.manual_seed(0)
        ddp = wrap(nn.Linear(10, 10, bias=False))  # gradsync's default: bucket tuning on
        x = torch.rand(3, 10)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(6):
                ddp(x).sum().backward()
        counts[kind] = sum(e.count for e in prof.key_averages() if e.key == "gloo:all_reduce")
    return counts


@pytest.mark.timeout(60)
def test_a_profiler_sees_the_same_all_reduces_as_with_torch() -> None:
    for counts in spawn(_profiled, timeout=50):
        assert counts["gradsync"] == counts["torch"] == 6, counts


def _contract(rank: int, world_size: int) -> dict:
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ddp = gradsync.DistributedDataParallel(nn.Linear(2, 2), broadcast_buffers=False, bucket_cap_mb_list=[1, 2])
    theirs = torch.nn.parallel.DistributedDataParallel(nn.Linear(2, 2), bucket_cap_mb_list=[1, 2])
    return {
        "warned": [str(w.message) for w in caught if issubclass(w.category, FutureWarning)],
        "caps": (ddp.bucket_bytes_cap, ddp.bucket_bytes_cap_list),
        "torch's caps": (theirs.bucket_bytes_cap, theirs.bucket_bytes_cap_list),
    }


@pytest.mark.timeout(60)
def test_deprecation_warnings_and_bucket_cap_attributes_as_in_torch() -> None:
    got = spawn(_contract, timeout=50)[0]
    assert any("`broadcast_buffers` is deprecated" in w for w in got["warned"]), got
    # torch: the list's largest cap is bucket_bytes_cap (gradsync said 25 MiB before)
    assert got["caps"] == got["torch's caps"] == (2 * 2**20, [2**20, 2 * 2**20])


def _static_graph_changes(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    ddp = gradsync.DistributedDataParallel(Branches(), static_graph=True)
    for step in range(3):
        ddp(_data(step, rank), use_extra=step > 0).sum().backward()  # `extra` joins the graph after step 1


@pytest.mark.timeout(60)
def test_a_changed_static_graph_says_so_in_torchs_words() -> None:
    from gradsync.testing import spawn_failures

    failures = spawn_failures(_static_graph_changes, timeout=50, pg_timeout=10)
    assert any("Your training graph has changed" in f.message and "extra." in f.message for f in failures.values())


def _missing_gradient(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    ddp = gradsync.DistributedDataParallel(Branches())
    ddp(_data(0, rank), use_extra=False).sum().backward()


@pytest.mark.timeout(60)
def test_missing_gradients_quote_torchs_phrase() -> None:
    from gradsync.testing import spawn_failures

    failures = spawn_failures(_missing_gradient, timeout=50, pg_timeout=10)
    for f in failures.values():
        assert "Expected to have finished reduction in the prior iteration" in f.message
        assert "extra.weight, extra.bias" in f.message and "find_unused_parameters=True" in f.message


def _gradient_penalty(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    ddp = gradsync.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        opt.zero_grad(set_to_none=True)
        x = _data(step, rank).requires_grad_(True)
        out = ddp(x).sum()
        (gx,) = torch.autograd.grad(out, x, create_graph=True)
        (out + gx.pow(2).sum()).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.timeout(60)
def test_gradient_penalty_training_matches_one_process() -> None:
    # torch's DDP fails on this recipe ("a leaf Variable that requires grad is being used in an in-place
    # operation"); gradsync averages the penalised gradients like one process with both ranks' batches.
    ranks = spawn(_gradient_penalty, timeout=50)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        opt.zero_grad()
        total = 0
        for rank in range(2):
            x = _data(step, rank).requires_grad_(True)
            out = model(x).sum()
            (gx,) = torch.autograd.grad(out, x, create_graph=True)
            total = total + (out + gx.pow(2).sum()) / 2
        total.backward()
        opt.step()
    for got in ranks:
        for name, value in model.state_dict().items():
            torch.testing.assert_close(got[name], value, rtol=0, atol=1e-5, msg=name)


class Mixed(nn.Module):
    """Layers of different sizes, and a sparse embedding, so several bucket caps give several layouts."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.EmbeddingBag(16, 8, sparse=True)
        self.layers = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.layers(self.embed(ids))


def _buckets_seen(rank: int, world_size: int, kwargs: dict) -> dict:
    """Per wrapper and iteration, the buckets its comm hook is handed: index and parameter names, in order."""
    os.environ["GRADSYNC_BUCKET_TUNING"] = "0"
    seen: dict = {}
    for kind, wrap in WRAPPERS.items():
        torch.manual_seed(0)
        model = Mixed()
        names = {id(p): n for n, p in model.named_parameters()}
        ddp = wrap(model, **kwargs)
        calls: list = []

        def recording(state, bucket, calls=calls, names=names):
            calls.append((bucket.index(), sorted(names[id(p)] for p in bucket.parameters())))
            return gradsync.comm.allreduce_hook(state, bucket)

        ddp.register_comm_hook(None, recording)
        for step in range(3):
            ids = torch.randint(0, 16, (4, 3), generator=torch.Generator().manual_seed(step * 10 + rank))
            ddp(ids).sum().backward()
            seen[(kind, step)] = sorted(calls)
            calls.clear()
    return seen


BUCKET_CASES = [
    {},
    {"bucket_cap_mb": 0.004},
    {"bucket_cap_mb": 0.004, "find_unused_parameters": True},
    {"bucket_cap_mb": 0.004, "static_graph": True},
    {"find_unused_parameters": True},
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kwargs", BUCKET_CASES, ids=[",".join(f"{k}={v}" for k, v in c.items()) for c in BUCKET_CASES])
def test_every_iteration_buckets_the_parameters_as_torch_does(kwargs: dict) -> None:
    # Iteration 1 is one bucket unless the graph is dynamic; with find_unused_parameters the buckets are torch's
    # registration-order ones, reversed, for ever. A hook sees bucket membership (PowerSGD seeds per bucket).
    # static_graph's iteration 1 all-reduces every bucket after backward, and torch's hook is then handed index 0
    # for each of them: there only the membership is compared.
    for seen in spawn(_buckets_seen, args=(kwargs,), timeout=50, pg_timeout=20):
        for step in range(3):
            ours, theirs = seen[("gradsync", step)], seen[("torch", step)]
            if step == 0 and kwargs.get("static_graph"):
                ours, theirs = sorted(names for _, names in ours), sorted(names for _, names in theirs)
            assert ours == theirs, f"iteration {step + 1}"
        if "find_unused_parameters" not in kwargs and "bucket_cap_mb" in kwargs:
            rebuilt = 2 if kwargs.get("static_graph") else 1  # the iteration from which the buckets are rebuilt
            assert len(seen[("torch", 0)]) == 2 and len(seen[("torch", rebuilt)]) > 2  # one dense bucket, then more
