"""Streaming DiLoCo: its fragments cover every parameter exactly once per period; with one fragment and no delay it
is DiLoCo; with fragments and no delay it is blocking DiLoCo applied fragment by fragment (a naive reference
here); with a delay, the update applied is the one computed when the fragment's exchange began. And the
convergence lab evaluates a synchronised model for a local method, never one rank's own replica."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import gradsync
from gradsync.comm import DiLoCo, StreamingDiLoCo
from gradsync.comm.local_sgd import allreduce_unless_local
from gradsync.errors import ConfigError
from gradsync.testing import spawn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DIM = 6


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, 1))


def _inner_step(ddp: nn.Module, opt: torch.optim.Optimizer, rank: int, step: int) -> None:
    opt.zero_grad()
    x = torch.randn(8, DIM, generator=torch.Generator().manual_seed(100 * step + rank))
    ddp(x).pow(2).mean().backward()
    opt.step()


def test_fragments_cover_every_parameter_exactly_once_per_period(group_of_one: None) -> None:
    ddp = gradsync.DistributedDataParallel(_model())
    streaming = StreamingDiLoCo(ddp, period=8, fragments=3)
    params = list(ddp.module.parameters())
    # Disjoint, in order, together every parameter.
    assert [p for group in streaming.fragments for p in group] == params
    assert all(streaming.fragments)
    starts = {step: streaming.due(step) for step in range(1, 8 * 5 + 1)}
    for window in range(8, 8 * 5 + 1):  # every run of `period` consecutive steps, once each fragment has begun
        seen = [f for step in range(window - 7, window + 1) for f in starts[step]]
        assert sorted(seen) == [0, 1, 2], (window, seen)
    assert [s for s, due in starts.items() if due][:3] == [2, 5, 8]  # staggered: offsets (p + 1) * 8 // 3


def test_bad_settings_are_refused_by_name(group_of_one: None) -> None:
    ddp = gradsync.DistributedDataParallel(_model())
    with pytest.raises(ConfigError, match="delay=4 must be below period=4"):
        StreamingDiLoCo(ddp, period=4, fragments=2, delay=4)
    with pytest.raises(ConfigError, match="fragments=5 must be at most .* the period \\(4\\)"):
        StreamingDiLoCo(ddp, period=4, fragments=5)
    with pytest.raises(ConfigError, match="mixing=1.0 must be below 1"):
        StreamingDiLoCo(ddp, period=4, fragments=2, delay=1, mixing=1.0)
    with pytest.raises(ConfigError, match="compression must be one of"):
        StreamingDiLoCo(ddp, period=4, compression="fp8")


def _one_fragment_vs_diloco(rank: int, world_size: int, wire: str | None) -> dict:
    out = {}
    for kind in ("diloco", "streaming"):
        model = _model()
        ddp = gradsync.DistributedDataParallel(model)
        opt = torch.optim.AdamW(model.parameters(), lr=0.02)
        settings = dict(outer_lr=0.7, momentum=0.9, warmup_steps=2, compression=wire)
        if kind == "diloco":
            outer = DiLoCo(ddp, period=3, **settings)
        else:
            outer = StreamingDiLoCo(ddp, period=3, fragments=1, delay=0, **settings)
        for step in range(11):
            _inner_step(ddp, opt, rank, step)
            outer.step()
        out[kind] = [p.detach().clone() for p in model.parameters()]
        out[f"{kind}_bytes"] = outer.bytes_sent
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("wire", [None, "int4"])
def test_one_fragment_without_delay_is_diloco(wire: str | None) -> None:
    for r in spawn(_one_fragment_vs_diloco, args=(wire,), timeout=50):
        for a, b in zip(r["diloco"], r["streaming"]):
            assert torch.equal(a, b)
        assert r["diloco_bytes"] == r["streaming_bytes"] > 0


def _blocking_reference(rank: int, world_size: int, split: list[int], period: int) -> list[torch.Tensor]:
    """Naive: local AdamW steps; after each, every fragment due (offset (p + 1) * period // fragments) takes a
    blocking DiLoCo outer step of its own: its pseudo-gradient averaged with one all-reduce per tensor, Nesterov SGD
    on its anchor, the anchor copied into the parameters. ``split``: how many parameters each fragment holds."""
    model = _model()
    ddp = gradsync.DistributedDataParallel(model)
    ddp.register_comm_hook(None, _local_only)
    opt = torch.optim.AdamW(model.parameters(), lr=0.02)
    params, fragments = list(model.parameters()), len(split)
    by_hand = [params[sum(split[:f]) : sum(split[: f + 1])] for f in range(fragments)]
    anchors = [[p.detach().clone().requires_grad_() for p in group] for group in by_hand]
    outers = [torch.optim.SGD(a, lr=0.7, momentum=0.9, nesterov=True) for a in anchors]
    for step in range(1, 14):
        _inner_step(ddp, opt, rank, step)
        for f in range(fragments):
            first = (f + 1) * period // fragments
            if step >= first and (step - first) % period == 0:
                with torch.no_grad():
                    for anchor, p in zip(anchors[f], by_hand[f]):
                        pseudo = anchor - p
                        dist.all_reduce(pseudo)
                        anchor.grad = pseudo / world_size
                    outers[f].step()
                    for anchor, p in zip(anchors[f], by_hand[f]):
                        p.copy_(anchor)
    return [p.detach().clone() for p in params]


def _local_only(_state, bucket):
    return allreduce_unless_local(True, None, bucket)  # every gradient stays on its rank


def _streaming_without_delay(rank: int, world_size: int, fragments: int, period: int) -> dict:
    model = _model()
    ddp = gradsync.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.02)
    streaming = StreamingDiLoCo(ddp, period=period, fragments=fragments, delay=0)
    split = [len(group) for group in streaming.fragments]
    reference = _blocking_reference(rank, world_size, split, period)
    for step in range(1, 14):
        _inner_step(ddp, opt, rank, step)
        streaming.step()
    return {"reference": reference, "streaming": [p.detach().clone() for p in model.parameters()], "split": split}


@pytest.mark.timeout(60)
def test_fragments_without_delay_are_blocking_diloco_fragment_by_fragment() -> None:
    # 6 parameters of 36, 6, 36, 6, 6 and 1 values in 3 fragments of about 30 values: 36 | 6 + 36 | 6 + 6 + 1.
    for r in spawn(_streaming_without_delay, args=(3, 4), timeout=50):
        assert r["split"] == [1, 2, 3]
        for a, b in zip(r["reference"], r["streaming"]):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def _delayed(rank: int, world_size: int) -> dict:
    model = _model()
    ddp = gradsync.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.02)
    # Outer SGD with lr 1 and no momentum: the new anchor is the average of the parameters the pseudo-gradient
    # was taken from (anchor - mean(anchor - theta) = mean(theta)), which makes the bookkeeping visible.
    streaming = StreamingDiLoCo(ddp, period=4, fragments=2, delay=2, mixing=0.25, outer_lr=1.0, momentum=0.0)
    history, checks = {}, []
    for step in range(1, 12):
        _inner_step(ddp, opt, rank, step)
        history[step] = [p.detach().clone() for p in model.parameters()]  # after the inner step, before any merge
        landed = streaming.step()
        for f in landed:
            began = step - 2
            indices = [i for i, p in enumerate(model.parameters()) if any(p is q for q in streaming.fragments[f])]
            for i, anchor in zip(indices, streaming._anchors[f]):
                then = history[began][i].clone()
                dist.all_reduce(then)
                now = history[step][i].clone()
                dist.all_reduce(now)
                merged = 0.25 * history[step][i] + 0.75 * anchor.detach()
                checks.append(
                    {
                        "fragment": f,
                        "anchor_is_mean_then": torch.allclose(anchor, then / world_size, rtol=0, atol=1e-6),
                        "anchor_is_mean_now": torch.allclose(anchor, now / world_size, rtol=0, atol=1e-6),
                        "merged": torch.allclose(list(model.parameters())[i], merged, rtol=0, atol=1e-6),
                    }
                )
    return {"checks": checks, "outer_steps": streaming.outer_steps, "in_flight": len(streaming._in_flight)}


@pytest.mark.timeout(60)
def test_a_delayed_exchange_applies_the_update_computed_when_it_began() -> None:
    for r in spawn(_delayed, timeout=50):
        # Fragment 0 began at steps 2, 6, 10 and fragment 1 at 4, 8; each landed 2 steps later, but the last.
        assert r["outer_steps"] == [2, 2] and r["in_flight"] == 1
        assert r["checks"] and all(c["anchor_is_mean_then"] and c["merged"] for c in r["checks"]), r["checks"]
        assert not any(c["anchor_is_mean_now"] for c in r["checks"])  # not the parameters at landing


def _evaluated(rank: int, world_size: int) -> dict:
    from bench.converge.worker import evaluate_synchronised

    model = _model()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(float(rank + 1))  # the replicas differ, as a local method's do between exchanges
    own = [p.detach().clone() for p in model.parameters()]

    def evaluate() -> float:  # what the evaluation reads: every rank's parameters, gathered
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        gathered = [torch.empty_like(flat) for _ in range(world_size)]
        dist.all_gather(gathered, flat)
        seen.append(gathered)
        return float(flat.sum())

    seen: list[list[torch.Tensor]] = []
    evaluate_synchronised(model, evaluate, average=True)
    restored = all(torch.equal(p, q) for p, q in zip(model.parameters(), own))
    mean_of_own = torch.cat([p.reshape(-1) for p in own])
    dist.all_reduce(mean_of_own)
    return {"seen": seen[0], "restored": restored, "mean": mean_of_own / world_size}


@pytest.mark.timeout(60)
def test_evaluating_a_local_method_reads_a_synchronised_model() -> None:
    """bench.converge's evaluation of DiLoCo-like replicas: every rank evaluates the same parameters, their
    average, and training goes on from each rank's own replica afterwards."""
    for r in spawn(_evaluated, timeout=50):
        first, second = r["seen"]
        assert torch.equal(first, second)
        torch.testing.assert_close(first, r["mean"], rtol=0, atol=1e-6)
        assert r["restored"]


def test_the_docs_local_method_lines_run_as_written(group_of_one: None) -> None:
    """docs/hooks.md's second block: each line is one alternative, run as written on a fresh model, then a few
    steps."""
    from docs_blocks import block as page_block

    block = page_block("docs/hooks.md", "python", "Communication hooks", 1, count=2)
    lines = [line for line in block.splitlines() if line.strip()]
    assert len(lines) == 3 and "StreamingDiLoCo" in lines[2]
    for line in lines:
        model = _model()
        names: dict = {"ddp": gradsync.DistributedDataParallel(model), "comm": gradsync.comm}
        exec(line, names)
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        method = names.get("diloco") or names.get("streaming")
        for step in range(60):
            _inner_step(names["ddp"], opt, 0, step)
            if method is not None:
                method.step()
        if method is not None:
            assert method.step_count == 60
