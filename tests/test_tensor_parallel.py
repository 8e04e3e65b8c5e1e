"""Data parallelism over tensor-parallel DTensor parameters (issue 39, part 1): a 2 x 2 mesh ("dp", "tp") on 4 gloo
ranks, the model given torch's own tensor-parallel plans, then wrapped with device_mesh=mesh["dp"]. The parameters
after several steps must equal torch's DDP's on the same mesh, and, unlike torch's, the wrapped model keeps its
DTensor parameters, state_dict and DTensor gradients of the parameters' placements."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gradsync
from gradsync.testing import spawn

pytest.importorskip("torch.distributed.tensor.parallel")


class Block(nn.Module):
    """A norm (sequence parallel in one plan), an up and a down projection, and a head no plan shards."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.down(torch.relu(self.up(self.norm(x)))))


def _plan(name: str) -> dict:
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    if name == "mlp":
        return {"up": ColwiseParallel(), "down": RowwiseParallel()}
    return {  # sequence parallel: the norm's weights are replicated and their gradients come back partial
        "norm": SequenceParallel(),
        "up": ColwiseParallel(input_layouts=Shard(1)),
        "down": RowwiseParallel(output_layouts=Shard(1)),
    }


def _train(wrapper, mesh, plan: str, as_view: bool, explicit_group: bool, steps: int = 4):
    from torch.distributed.tensor.parallel import parallelize_module

    torch.manual_seed(0)
    model = parallelize_module(Block(), mesh["tp"], _plan(plan))
    where = {"process_group": mesh["dp"].get_group()} if explicit_group else {"device_mesh": mesh["dp"]}
    ddp = wrapper(model, gradient_as_bucket_view=as_view, **where)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    dp = mesh["dp"].get_local_rank()
    for step in range(steps):
        x = torch.randn(2, 6, 8, generator=torch.Generator().manual_seed(100 * step + dp))
        optimizer.zero_grad()
        ddp(x).pow(2).mean().backward()
        optimizer.step()
    return model, ddp


def _local_values(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every weight's local values, read from the modules (torch's DDP leaves them as plain attributes after a
    forward, not parameters: torch issue 152712)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for prefix, module in model.named_modules():
        for name in ("weight", "bias"):
            t = module._parameters.get(name) if name in module._parameters else module.__dict__.get(name)
            if t is not None:
                out[f"{prefix}.{name}"] = (t.to_local() if isinstance(t, DTensor) else t).detach().clone()
    return out


def _compare(rank: int, world: int, plan: str, as_view: bool, explicit_group: bool) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    theirs, _ = _train(torch.nn.parallel.DistributedDataParallel, mesh, plan, False, False)
    ours, ddp = _train(gradsync.DistributedDataParallel, mesh, plan, as_view, explicit_group)
    expected, got = _local_values(theirs), _local_values(ours)
    names = [n for n, _ in ddp.named_parameters()]
    grads = {
        n: (str(p.grad.placements) == str(p.placements)) if isinstance(p, DTensor) else not isinstance(p.grad, DTensor)
        for n, p in ours.named_parameters()
    }
    # Over the DTensor parameters: torch's foreach norm refuses plain tensors mixed in, with or without DDP.
    sharded = [p for p in ours.parameters() if isinstance(p, DTensor)]
    norm = torch.nn.utils.clip_grad_norm_(sharded, max_norm=1e9)
    return {
        "max_diff": max((expected[n] - got[n]).abs().max().item() for n in expected),
        "same_names": sorted(expected) == sorted(got),
        "parameters": names,
        "state_dict": sorted(ddp.state_dict()),
        "dtensors": sorted(n for n, p in ours.named_parameters() if isinstance(p, DTensor)),
        "grads_placed": grads,
        "norm": float(norm.full_tensor() if isinstance(norm, DTensor) else norm),
    }


@pytest.mark.parametrize(
    "plan, as_view, explicit_group",
    [("mlp", False, False), ("mlp", True, False), ("sequence", False, False), ("sequence", False, True)],
)
def test_tensor_parallel_training_equals_torchs_ddp_and_keeps_dtensors(
    plan: str, as_view: bool, explicit_group: bool
) -> None:
    results = spawn(_compare, world_size=4, args=(plan, as_view, explicit_group), timeout=180, pg_timeout=60)
    names = ["module.norm.weight", "module.norm.bias", "module.up.weight", "module.up.bias"]
    names += ["module.down.weight", "module.down.bias", "module.head.weight", "module.head.bias"]
    sharded = ["down.bias", "down.weight", "up.bias", "up.weight"]
    if plan == "sequence":
        sharded = sorted(sharded + ["norm.bias", "norm.weight"])
    for rank, r in enumerate(results):
        assert r["same_names"], rank
        assert r["max_diff"] <= 1e-6, (rank, r["max_diff"])
        assert r["parameters"] == names, rank  # after forward too: torch's come back empty
        assert r["state_dict"] == sorted(names), rank
        assert r["dtensors"] == sharded, rank
        assert all(r["grads_placed"].values()), (rank, r["grads_placed"])
    # The norm over the tensor-parallel model is the same number on every rank (DTensor gradients reduce over tp).
    assert len({round(r["norm"], 6) for r in results}) == 1, [r["norm"] for r in results]


def _refusals(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    said = {}

    def refused(name: str, build) -> None:
        try:
            build()
            said[name] = "accepted"
        except gradsync.GradsyncError as error:
            said[name] = str(error)

    model = parallelize_module(Block(), mesh["tp"], _plan("mlp"))
    refused("no group", lambda: gradsync.DistributedDataParallel(model))
    refused("tp as dp", lambda: gradsync.DistributedDataParallel(model, device_mesh=mesh["tp"]))
    refused("2-D mesh", lambda: gradsync.DistributedDataParallel(model, device_mesh=mesh))
    plain = torch.nn.parallel.DistributedDataParallel(Block())
    refused("torch's DDP", lambda: gradsync.DistributedDataParallel(plain))
    late = gradsync.DistributedDataParallel(Block(), device_mesh=mesh["dp"])
    parallelize_module(late.module, mesh["tp"], _plan("mlp"))  # the plan after wrapping: new Parameter objects
    refused("plan after wrapping", lambda: late(torch.randn(2, 8)))
    return said


def test_what_does_not_compose_is_refused_naming_the_parameter_and_the_fix() -> None:
    said = spawn(_refusals, world_size=4, timeout=120, pg_timeout=60)[0]
    assert "'up.weight' is a DTensor" in said["no group"] and "device_mesh=mesh['dp']" in said["no group"]
    assert "'up.weight' is a DTensor over ranks [0, 1]" in said["tp as dp"], said["tp as dp"]
    assert "mesh['dp']" in said["2-D mesh"], said["2-D mesh"]
    assert "already wrapped in torch's DistributedDataParallel" in said["torch's DDP"], said["torch's DDP"]
    late = said["plan after wrapping"]
    assert "parameter 'up.weight' (and 3 more) was replaced" in late and "parallelize_module" in late, late


def _save_and_load(rank: int, world: int, path: str) -> float:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model, ddp = _train(gradsync.DistributedDataParallel, mesh, "mlp", False, False, steps=2)
    dcp.save(ddp.state_dict(), checkpoint_id=path)
    saved = {n: t.full_tensor() if hasattr(t, "full_tensor") else t.clone() for n, t in ddp.state_dict().items()}
    fresh, again = _train(gradsync.DistributedDataParallel, mesh, "mlp", False, False, steps=0)
    state = again.state_dict()
    before = max(
        (saved[n] - (t.full_tensor() if hasattr(t, "full_tensor") else t)).abs().max().item() for n, t in state.items()
    )
    assert before > 0, "the fresh model already held the trained values: the load would prove nothing"
    dcp.load(state, checkpoint_id=path)
    again.load_state_dict(state)
    loaded = {n: t.full_tensor() if hasattr(t, "full_tensor") else t for n, t in again.state_dict().items()}
    return max((saved[n] - loaded[n]).abs().max().item() for n in saved)


def test_distributed_checkpoint_saves_and_loads_the_wrapped_models_dtensors(tmp_path) -> None:
    diffs = spawn(_save_and_load, world_size=4, args=(str(tmp_path / "ckpt"),), timeout=180, pg_timeout=60)
    assert diffs == [0.0] * 4, diffs


def _steps(ddp, optimizer, dp: int, first: int, count: int) -> None:
    for step in range(first, first + count):
        x = torch.randn(2, 6, 8, generator=torch.Generator().manual_seed(100 * step + dp))
        optimizer.zero_grad()
        ddp(x).pow(2).mean().backward()
        optimizer.step()


def _whole(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        n: (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone() for n, t in model.state_dict().items()
    }


def _resume_with_gradsync_checkpoint(rank: int, world: int, path: str) -> dict:
    """Train 2 steps, save with gradsync.checkpoint, train 2 more; a fresh model and optimizer restored from the
    file and trained the same 2 steps must end where the uninterrupted run did."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from gradsync import checkpoint

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp = mesh["dp"].get_local_rank()

    def fresh():
        torch.manual_seed(rank)  # different on every rank: only the restore can make them agree
        ddp = gradsync.DistributedDataParallel(
            parallelize_module(Block(), mesh["tp"], _plan("mlp")), device_mesh=mesh["dp"]
        )
        return ddp, torch.optim.Adam(ddp.parameters(), lr=0.01, foreach=False)

    torch.manual_seed(0)
    ddp = gradsync.DistributedDataParallel(
        parallelize_module(Block(), mesh["tp"], _plan("mlp")), device_mesh=mesh["dp"]
    )
    optimizer = torch.optim.Adam(ddp.parameters(), lr=0.01, foreach=False)
    _steps(ddp, optimizer, dp, 0, 2)
    checkpoint.save(path, model=ddp, optimizer=optimizer, step=2)
    _steps(ddp, optimizer, dp, 2, 2)
    uninterrupted = _whole(ddp.module)

    again, again_optimizer = fresh()
    extras = checkpoint.restore(checkpoint.load(path), model=again, optimizer=again_optimizer)
    _steps(again, again_optimizer, dp, extras["step"], 2)
    resumed = _whole(again.module)
    file = torch.load(path, weights_only=False)["model"]
    return {
        "diff": max((uninterrupted[n] - resumed[n]).abs().max().item() for n in uninterrupted),
        "whole_in_file": {n: tuple(t.shape) for n, t in file.items()}
        == {n: tuple(Block().state_dict()[n].shape) for n in file},
        "plain_in_file": not any(type(t) is not torch.Tensor for t in file.values()),
    }


def test_gradsync_checkpoint_saves_dtensors_whole_and_restores_them_to_their_placements(tmp_path) -> None:
    """The file holds one replica's state, each DTensor whole (rank 0's shards alone would lose the others'), and
    loads into a plain model too; restored, training continues exactly as if never stopped."""
    results = spawn(_resume_with_gradsync_checkpoint, world_size=4, args=(str(tmp_path / "ckpt.pt"),), timeout=180)
    for rank, r in enumerate(results):
        assert r["diff"] == 0.0, (rank, r)
        assert r["whole_in_file"] and r["plain_in_file"], (rank, r)
    Block().load_state_dict(torch.load(tmp_path / "ckpt.pt", weights_only=False)["model"])  # a plain model loads it


def _compiled_against_eager(rank: int, world: int) -> dict:
    import warnings

    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    eager, _ = _train(gradsync.DistributedDataParallel, mesh, "mlp", False, False, steps=3)
    compiled_wrapper = lambda model, **kw: torch.compile(gradsync.DistributedDataParallel(model, **kw))  # noqa: E731
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled, ddp = _train(compiled_wrapper, mesh, "mlp", False, False, steps=3)
    expected, got = _local_values(eager), _local_values(compiled)
    return {
        "diff": max((expected[n] - got[n]).abs().max().item() for n in expected),
        "gradsync_warnings": [str(w.message) for w in caught if "gradsync" in str(w.message)],
    }


@pytest.mark.long
@pytest.mark.timeout(300)
def test_compiled_tensor_parallel_model_trains_as_the_eager_one() -> None:
    """torch.compile(ddp) over the DTensor model: the same parameters as eager (torch 2.13's own DDP fails to
    compile this model: "BackendCompilerFailed ... unhashable type: non-nested SymInt")."""
    for rank, r in enumerate(spawn(_compiled_against_eager, world_size=4, timeout=280, pg_timeout=120)):
        assert r["diff"] <= 1e-6 and not r["gradsync_warnings"], (rank, r)
