"""The scaling lab and the planner: the planner's costs match hand-computed ones, the synthetic models average
exactly at N = 4, and the lab's namespaces come and go cleanly."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import gradsync
from gradsync import planner
from gradsync.reducer import autotune, buckets, caps
from gradsync.testing import spawn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.scale.probe import fit_ring  # noqa: E402
from bench.scale.table import efficiency_ratio  # noqa: E402
from bench.scale.worker import scale_tuner_bytes  # noqa: E402
from lab import netlab  # noqa: E402
from lab.zoo.synthetic import SyntheticModel, bert_shapes, gpt2_shapes, resnet50_shapes  # noqa: E402


def test_ring_cost_by_hand() -> None:
    # 2 hosts x 1 rank, 125 MB/s per hop, 0.1 ms per hop: 2 (N-1) (S / (N B) + a) = 2 (1/2 * 8 MB / 125 MB/s + 1e-4)
    assert planner.Topology(2, 1, 125e6, 1e-4).allreduce_seconds(8e6) == pytest.approx(0.0642)
    # 4 hosts x 2 ranks, flat ring over 8 ranks: 14 steps of S/8 over the slowest (inter-host) hop.
    assert planner.Topology(4, 2, 125e6, 1e-4).allreduce_seconds(8e6) == pytest.approx(14 * (1e6 / 125e6 + 1e-4))
    # Hierarchical: 2 (P-1) (S/(P b) + a_l) inside each host, then 2 (H-1) (S/(H B) + a) across hosts.
    t = planner.Topology(4, 2, 125e6, 1e-4, local_bandwidth=1e9, local_latency=1e-5, hierarchical=True)
    assert t.allreduce_seconds(8e6) == pytest.approx(2 * (4e6 / 1e9 + 1e-5) + 6 * (2e6 / 125e6 + 1e-4))
    assert planner.Topology(1, 1, 1e9, 0.0).allreduce_seconds(8e6) == 0.0


def test_probe_fit_inverts_the_ring_cost() -> None:
    # The lab's probe times two sizes on 2 hosts x 2 ranks; solving the ring cost for them gives back its inputs.
    topology = planner.Topology(2, 2, 9.5e6, 2e-4)
    seconds = {size: topology.allreduce_seconds(size) for size in (200_000, 800_000)}
    latency, bandwidth = fit_ring(seconds, ranks=4)
    assert latency == pytest.approx(2e-4) and bandwidth == pytest.approx(9.5e6)
    # By hand: 6 steps of S/4 at 1 MB/s plus 6 x 0.1 ms.
    assert fit_ring({4000: 6 * (1000 / 1e6 + 1e-4), 8000: 6 * (2000 / 1e6 + 1e-4)}, 4) == pytest.approx((1e-4, 1e6))
    # The latency from a 1-element all-reduce when one was timed: 6 hops of 0.2 ms.
    assert fit_ring({4000: 0.0066, 8000: 0.0126}, 4, one_element_s=0.0012) == pytest.approx((2e-4, 1e6))


def test_efficiency_ratio_comes_from_the_step_by_step_ratios() -> None:
    # gradsync 2% slower than torch at N = 1 and 1% at N = 8: E(8) / torch's E(8) = 1.02 / 1.01.
    assert efficiency_ratio([1.02], [1.01]) == "1.010"
    expected = f"{1.02 / 1.02:.3f} ({1.00 / 1.03:.3f}-{1.04 / 1.01:.3f})"  # medians; the extremes paired
    assert efficiency_ratio([1.00, 1.02, 1.04], [1.01, 1.03]) == expected
    assert efficiency_ratio([None], [1.0]) == "-"


def test_lab_scales_the_tuners_starting_and_candidate_caps(monkeypatch: pytest.MonkeyPatch) -> None:
    for module, name in ((buckets, "DEFAULT_FIRST_BUCKET_BYTES"), (buckets, "DEFAULT_BUCKET_CAP_MB")):
        monkeypatch.setattr(module, name, getattr(module, name))  # restored after the test
    monkeypatch.setattr(autotune, "CANDIDATE_CAPS_MB", autotune.CANDIDATE_CAPS_MB)
    scale_tuner_bytes(64)
    # What gradsync's default starts from (torch's 1 + 25 MiB) and what the tuner weighs, both 64 times smaller.
    assert caps.size_limits(None) == [2**20 // 64, 25 * 2**20 // 64]
    assert max(autotune.CANDIDATE_CAPS_MB) == 25 / 64 and min(autotune.CANDIDATE_CAPS_MB) == 0.25 / 64
    assert autotune._limits(25 / 64) == [2**20 // 64, 25 * 2**20 // 64]


def test_predicted_step_overlaps_communication_with_backward() -> None:
    # Two layers of 0.5 MiB, backward 50 ms each: the first bucket's all-reduce hides behind the second layer.
    timeline = planner.timeline_from_profile([(2**19, 0.01, 0.05), (2**19, 0.01, 0.05)])
    link = planner.Topology(2, 1, 2**20 / 0.04, 0.0)  # 40 ms per MiB over a ring of two
    # forward 20 ms; bucket 1 ready at 50 ms, done at 70; bucket 2 ready at 100, done at 120 ms.
    assert planner.predict_step(timeline, link, cap_mb=0.5) == pytest.approx(0.02 + 0.12)
    # One bucket (torch's first bucket holds 1 MiB whatever the cap): ready at 100 ms, done at 140 ms.
    assert planner.predict_step(timeline, link, cap_mb=25.0) == pytest.approx(0.02 + 0.10 + 0.04)


def test_plan_weighs_bf16_and_accumulation() -> None:
    timeline = planner.timeline_from_profile([(8 * 2**20, 0.01, 0.02)] * 4)
    p = planner.plan(timeline, planner.Topology(8, 1, 12.5e6, 1e-4), accumulation=4)
    assert p.options["bf16 compression"] < p.step_s and 0 < p.efficiency < 1
    assert p.options["no_sync x4 (per micro-batch)"] < p.step_s


def test_rates_and_times_parse() -> None:
    assert planner.parse_rate("1gbit") == 125e6 and planner.parse_rate("12.5GB") == 12.5e9
    assert planner.parse_seconds("10us") == pytest.approx(1e-5) and planner.parse_seconds("2ms") == 0.002


def test_synthetic_shapes_are_the_real_models() -> None:
    count = lambda shapes: sum(torch.Size(s).numel() for _, s in shapes)  # noqa: E731
    assert count(resnet50_shapes()) == 25_557_032
    assert count(bert_shapes()) == 109_482_240
    assert count(gpt2_shapes()) == 124_439_808


def _synthetic(rank: int, world_size: int) -> bool:
    model = SyntheticModel("resnet50", scale=4096, layers=8, time_scale=0.01)
    model.value = float(rank + 1)
    ddp = gradsync.DistributedDataParallel(model, bucket_cap_mb=0.05)
    ddp(torch.ones(1, requires_grad=True)).backward()
    expected = (world_size + 1) / 2
    return all(torch.equal(p.grad, torch.full_like(p.grad, expected)) for p in model.params)


@pytest.mark.timeout(90)
def test_synthetic_model_is_averaged_exactly_on_four_ranks() -> None:
    assert spawn(_synthetic, world_size=4, timeout=80) == [True] * 4


@pytest.mark.netlab()
def test_lab_starts_and_cleans_up() -> None:
    with netlab.lab(hosts=3, rate="100mbit", prefix="gstest") as hosts:
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert all(h.namespace in names for h in hosts)
        shown = subprocess.run(
            hosts[2].command(["ip", "addr", "show", hosts[2].interface]), capture_output=True, text=True
        )
        assert hosts[2].address in shown.stdout
    assert "gstest" not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def test_plan_command_prints_a_table(tmp_path: Path) -> None:
    profile = tmp_path / "profile.json"
    profile.write_text("[[4194304, 0.01, 0.02], [4194304, 0.01, 0.02]]")
    done = subprocess.run(
        [sys.executable, "-m", "gradsync", "plan", "--profile", str(profile), "--hosts", "1", "4"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "efficiency" in done.stdout and len(done.stdout.strip().splitlines()) == 3
