"""The chaos lab's mechanism on every run (the long soak is bench/elastic/chaos.py): a few faults drawn from a seeded
schedule, two of them at once where the schedule says so, on 4 hosts; nothing lost, every host ends identical."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.elastic.chaos import (  # noqa: E402
    alone,
    alone_by_kind,
    clear_by_kind,
    clear_of_partitions,
    pauses,
    percentile,
    summarize,
)
from bench.elastic.scale import check_models  # noqa: E402
from lab import chaos, etcd_cluster  # noqa: E402


def test_the_schedule_is_the_seeds_alone() -> None:
    a = chaos.schedule(7, budget_s=100, mean_s=10, kinds=chaos.KINDS)
    assert a == chaos.schedule(7, budget_s=100, mean_s=10, kinds=chaos.KINDS)
    assert a != chaos.schedule(8, budget_s=100, mean_s=10, kinds=chaos.KINDS)
    assert all(0 < t < 100 for t, _ in a) and {k for _, k in a} <= set(chaos.KINDS)
    assert 4 <= len(a) <= 20  # about budget / mean


def test_a_pause_is_the_longest_wait_between_steps_after_its_fault() -> None:
    steps = [0.0, 0.1, 0.2] + [1.5 + 0.1 * k for k in range(26)] + [5.0, 5.1]  # steady from 1.5 to 4.0
    faults = [chaos.Fault("sigkill", 0.15, ["h1"], [1]), chaos.Fault("host", 4.05, ["h2"], [2])]
    assert pauses(steps, faults) == pytest.approx([1.3, 0.95])  # 0.2 -> 1.5; then from the fault at 4.05 to 5.0
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0


def test_a_fault_stands_alone_only_without_a_partition_in_reach_or_another_fault_in_its_time() -> None:
    listed = [
        {"kind": "sigkill", "t": 0.0, "pause s": 0.5},  # alone
        {"kind": "link", "t": 10.0, "pause s": 5.0},  # alone: a partition is not in its own reach
        {"kind": "sigkill", "t": 20.0, "pause s": 5.2},  # 10 s after the link's start: it waits for it too
        {"kind": "host", "t": 40.0, "pause s": 3.0},  # the sigkill at 41 lands inside its pause
        {"kind": "sigkill", "t": 41.0, "pause s": 0.6},  # inside the host's pause: one regroup window for both
        {"kind": "pair", "t": 50.0, "pause s": 0.2},  # its second kill, 0.3 s on, lands in the next one's pause
        {"kind": "sigkill", "t": 50.25, "pause s": 4.0},
        {"kind": "sigkill", "t": 60.0, "pause s": 0.7},  # alone
    ]
    assert alone(listed) == [True, True, False, False, False, False, False, True]
    assert alone_by_kind(listed)["sigkill"] == {
        "alone": 2,
        "pause p50 s": 0.5,
        "pause p99 s": 0.7,
        "pause max s": 0.7,
    }

    # Clear of partitions: every fault but the link and the sigkill 10 s after it, bursts included.
    assert clear_of_partitions(listed) == [True, False, False, True, True, True, True, True]
    assert clear_by_kind(listed)["sigkill"] == {
        "faults": 4,
        "pause p50 s": 0.6,
        "pause p99 s": 4.0,
        "pause max s": 4.0,
    }


@pytest.mark.netlab()
# Before the round group's leave(), a host lost whole paused 5.3 s (survivors waited in gloo's collective on each
# other); then 1.1 s, and 0.4 s since heartbeats of 0.1 s. The median pins the first. The tail is not pinned at the
# timeout: a fault that lands while a round forms, or a survivor already inside a collective with a silent peer (gloo
# cannot abort), waits out one timeout, and CI saw one such pause among three. The soak's worst of 374 was 7.0 s
# (docs/elastic.md); a pause past three timeouts means a fault was waited out more than twice, or a livelock.
@pytest.mark.long
@pytest.mark.timeout(300)
def test_a_few_seeded_random_faults_lose_nothing(tmp_path: Path) -> None:
    result = chaos.run(tmp_path, hosts=4, budget_s=24, mean_s=5, seed=3, kinds=("sigkill", "pair", "host"))
    assert len(result.faults) >= 2, result  # the mechanism ran: faults were injected into the running job
    summary = summarize(result, cpu_s=0.0, wall_s=1.0)  # exactly once, identical final parameters, all finished
    assert summary["steps committed"] > 0 and 0.5 < summary["committed fraction"] <= 1.0, summary
    pause_s = sorted(p["pause s"] for p in summary["pauses"])
    assert percentile(pause_s, 50) < chaos.TIMEOUT_S and pause_s[-1] < 3 * chaos.TIMEOUT_S, summary["pauses"]


@pytest.mark.netlab()
@pytest.mark.skipif(etcd_cluster.available() is not None, reason=str(etcd_cluster.available()))
@pytest.mark.lab
@pytest.mark.timeout(300)
def test_on_etcd_members_and_the_first_host_may_fail_too(tmp_path: Path) -> None:
    """The job's store on etcd (a member on each of h0-h2): etcd members killed and restarted, and any host lost,
    h0 (which started the job) among them; one member out at a time, so the cluster keeps its quorum."""
    result = chaos.run(tmp_path, hosts=4, budget_s=30, mean_s=4, seed=9, kinds=("etcd", "host", "sigkill"), etcd=True)
    assert {f.kind for f in result.faults} >= {"etcd", "host"}, result.faults
    summary = summarize(result, cpu_s=0.0, wall_s=1.0)
    assert 0.5 < summary["committed fraction"] <= 1.0, summary


def test_the_scaling_model_is_chosen_by_its_error_on_the_largest_size() -> None:
    linear = check_models({4: 0.5, 8: 0.6, 16: 0.8})
    assert linear["chosen"] == "a + b N" and linear["at 256 ranks s"] == pytest.approx(0.4 + 0.025 * 256)
    logarithmic = check_models({4: 1.0, 8: 1.5, 16: 2.0})
    assert logarithmic["chosen"] == "a + b log2 N" and logarithmic["at 256 ranks s"] == pytest.approx(4.0)
