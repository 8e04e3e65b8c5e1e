"""Elastic training survives a lost worker without restarting the job: in a lab of 3 hosts (network namespaces) x 1
rank, a worker killed with SIGKILL, stopped with SIGSTOP, or cut off by taking its host's link down; the survivors
keep their processes and carry on within seconds, every sample of every epoch is used exactly once, and the
restarted worker rejoins so that all three hosts end with identical parameters."""

from __future__ import annotations

import re
import shutil
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from gradsync.elastic import ElasticLoader

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from lab import certs, etcd_cluster, netlab  # noqa: E402
from lab.elastic import (  # noqa: E402
    HOSTS,
    SAMPLES,
    admission_seconds,
    any_host_lost,
    check_exactly_once,
    events_of,
    fault_during_regroup,
    finals,
    first_step_after,
    host_paused,
    launch_on_loopback,
    paused,
    pid_of,
    recoveries,
    scenario,
    store_host_lost,
    straggling,
    stuck_steps,
    unrecorded_shares,
)

needs_lab = pytest.mark.netlab()  # the lab's hosts on 1gbit links: namespaces and tbf
needs_etcd = pytest.mark.skipif(etcd_cluster.available() is not None, reason=str(etcd_cluster.available()))


def test_loader_hands_out_every_sample_once_across_world_changes() -> None:
    loader = ElasticLoader(list(range(SAMPLES)), batch_size=4, seed=3)
    seen, position = [], 0
    for world in (3, 3, 2, 2, 3, 1) * 40:  # the membership changes between steps
        if position >= SAMPLES:
            break
        shares = [loader.share(position, world, rank) for rank in range(world)]
        seen += [i for indices, _ in shares for i in indices]
        position += shares[0][1]
    assert sorted(seen) == list(range(SAMPLES))


def test_no_step_leaves_a_rank_an_empty_batch_and_every_sample_is_used_once() -> None:
    """An epoch whose last step would hold fewer samples than ranks (482 samples, 4 ranks x 4: 2 left) gave ranks 2
    and 3 an empty batch, and their collate failed (IndexError): the step before takes them."""
    for samples in (1, 5, 17, 482, 483):
        for world in range(1, 7):
            for batch in (1, 3, 4):
                loader = ElasticLoader(list(range(samples)), batch_size=batch, seed=0)
                seen, position = [], 0
                while position < samples:
                    shares = [loader.share(position, world, r) for r in range(world)]
                    if samples >= world:
                        assert all(indices for indices, _ in shares), (samples, world, batch, position)
                    seen += [i for indices, _ in shares for i in indices]
                    position += shares[0][1]
                assert sorted(seen) == list(range(samples)), (samples, world, batch)


def test_a_rank_left_without_a_sample_repeats_one_and_consumes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Joiners taken in by a failure's round at the epoch's last step: 3 samples left for 5 ranks. Ranks 3 and 4
    get a batch (a sample repeated, as torch's DistributedSampler pads) and record none consumed."""
    from gradsync.elastic import loader as module

    loader = ElasticLoader(torch.arange(20.0), batch_size=4, seed=0)
    loader.position = 17
    left = loader.order()[17:]
    for rank in range(5):
        monkeypatch.setattr(module.dist, "is_initialized", lambda: True)
        monkeypatch.setattr(module.dist, "get_world_size", lambda: 5)
        monkeypatch.setattr(module.dist, "get_rank", lambda rank=rank: rank)
        batch = next(iter(loader))
        assert batch.numel() == 1 and int(batch) in left
        assert loader.last_indices == ([left[rank]] if rank < 3 else [])
    assert loader.can_grow_to(3) and not loader.can_grow_to(5)


def test_a_killed_ranks_unrecorded_share_is_filled_only_within_the_kills_injected() -> None:
    loader = ElasticLoader(range(SAMPLES), batch_size=4, seed=1)
    step = {"epoch": 0, "position": 24, "world": 3}
    recorded = [step | {"rank": r, "indices": loader.share(24, 3, r)[0]} for r in (0, 2)]
    assert unrecorded_shares(recorded, killed=1) == [{"epoch": 0, "indices": loader.share(24, 3, 1)[0]}]
    with pytest.raises(AssertionError, match="1 ranks' committed steps unrecorded, 0 kills"):
        unrecorded_shares(recorded, killed=0)


@pytest.mark.long
@needs_lab
@pytest.mark.timeout(420)
def test_survivors_continue_after_sigkill_and_the_worker_rejoins(tmp_path: Path) -> None:
    reference = scenario(tmp_path, "none", count=0)
    run = scenario(tmp_path, "sigkill")
    out, (_victim, _pid, when) = run["out"], run["faults"][0]
    assert [pid_of(out, "h0"), pid_of(out, "h2")] == run["survivors"]  # unchanged processes
    # A survivor waiting in a collective for the other survivor's data (not the dead worker's) learns of the death
    # only at the group's timeout: gloo cannot abort a collective (abort(), shutdown() and the peer destroying its
    # group leave a pending recv blocked; checked by hand on torch 2.13). Otherwise the launcher's report is fast:
    # 0.3-0.8 s, 2.2 s where gloo's all-reduce failed late; under the 5 s a missed report (heartbeat) would cost.
    blocked = any("Timed out waiting" in log for log in run["logs"])
    assert first_step_after(out, when, run["survivors"]) < (5.0 + 3.0 if blocked else 4.5), recoveries(run["logs"])
    check_exactly_once(out, killed=1)
    ended = finals(out)
    # Admitting the restarted worker holds the members only for the group and the state sync: the joiner pays its
    # slow imports (torch._dynamo, which its optimizer would import) before it asks to join. 2.4-3 s before.
    admissions = admission_seconds(out)
    assert max(admissions, default=0.0) < 1.5, admissions  # none when the joiner came in with the failure round
    assert len({round(f["checksum"], 6) for f in ended if f["steps"] == max(g["steps"] for g in ended)}) == 1
    ref_loss = finals(reference["out"])[0]["loss"]
    assert all(abs(f["loss"] - ref_loss) <= 0.15 * ref_loss + 0.01 for f in ended)


@pytest.mark.long
@needs_lab
@pytest.mark.timeout(300)
def test_a_member_lost_as_a_restarted_worker_builds_its_model_costs_a_round_not_a_restart(tmp_path: Path) -> None:
    """h1's worker SIGKILLed; as the members admit its restarted worker, h2's exits (tests/scripts/elastic_train.py's
    EXIT_AT_ADMISSION), so the joiner's DDP constructor collectives fail. Its State recovers from that failure in
    the same process (the constructor kept it: gradsync/ddp/module.py); before, the joiner died with a traceback
    and its launcher started it again."""
    run = scenario(tmp_path, "sigkill", epochs=6, env={"EXIT_AT_ADMISSION": "h2"})
    out = run["out"]
    assert (out / "exited_at_admission").exists(), recoveries(run["logs"])  # the second fault landed
    assert "the job's next round recovers" in run["logs"][1], run["logs"][1][-3000:]
    started = Counter(p.read_text() for p in out.glob("*.pid"))
    assert started["h1"] == 2, started  # the first worker, then the restart after the kill: no more
    check_exactly_once(out, epochs=6, killed=2)
    ended = finals(out)
    assert len({round(f["checksum"], 6) for f in ended if f["steps"] == max(g["steps"] for g in ended)}) == 1


def _check_hook_and_monitor_ran_throughout(run: dict, hook: str) -> None:
    """Every process that committed steps ran the hook in each of them (one bucket: one call per backward) and its
    Monitor recorded each, across the kill and the rejoin; DiLoCo's members agree on its step count."""
    committed = Counter(e["pid"] for e in events_of(run["out"]))
    ended = finals(run["out"])
    assert len(ended) == HOSTS
    for final in ended:
        assert final["monitor_steps"] >= committed[final["pid"]] > 0, final
        if hook in ("counting", "bf16"):
            assert final["hook_calls"] >= committed[final["pid"]], final
    if hook == "diloco":
        assert len({f["diloco_steps"] for f in ended}) == 1, ended


@pytest.mark.long
@needs_lab
@pytest.mark.timeout(420)
def test_a_comm_hook_and_a_monitor_survive_a_kill_and_the_rejoin(tmp_path: Path) -> None:
    run = scenario(tmp_path, "sigkill", env={"HOOK": "counting", "MONITOR": "1"})
    check_exactly_once(run["out"], killed=1)
    _check_hook_and_monitor_ran_throughout(run, "counting")


@needs_lab
@pytest.mark.timeout(420)
def test_a_loop_kept_in_its_own_shape_survives_a_kill_and_the_rejoin(tmp_path: Path) -> None:
    """state.guard() instead of @elastic.run: the same guarantees, the user's loop unchanged in shape."""
    run = scenario(tmp_path, "sigkill", env={"LOOP": "guard"})
    check_exactly_once(run["out"], killed=1)
    ended = finals(run["out"])
    assert len(ended) == HOSTS
    assert len({round(f["checksum"], 6) for f in ended if f["steps"] == max(g["steps"] for g in ended)}) == 1


@needs_lab
@pytest.mark.lab
@pytest.mark.timeout(420)
@pytest.mark.parametrize("hook", ["bf16", "diloco"])
def test_gradsyncs_hooks_survive_a_kill_and_the_rejoin(tmp_path: Path, hook: str) -> None:
    run = scenario(tmp_path, "sigkill", env={"HOOK": hook, "MONITOR": "1"})
    # DiLoCo's inner steps synchronise nothing, so the members are not in lockstep between outer steps; a regroup
    # carries on from the member furthest ahead, and the others' inner steps since the last outer step (at most a
    # period, 4, each) are dropped with their parameters (README): their samples are skipped, not used twice.
    check_exactly_once(run["out"], killed=1 if hook != "diloco" else HOSTS * 4)
    _check_hook_and_monitor_ran_throughout(run, hook)


@needs_lab
@pytest.mark.lab
@pytest.mark.timeout(420)
@pytest.mark.parametrize("fault", ["link", "sigstop"])
def test_survivors_continue_when_a_worker_goes_silent(tmp_path: Path, fault: str) -> None:
    run = scenario(tmp_path, fault)
    out, (_victim, _pid, when) = run["out"], run["faults"][0]
    # A link down is found by the heartbeat (5 s); a stopped worker by its launcher, which kills it after 0.5 s
    # (gradsync/launch/stopped.py), so the survivors' collective fails at once and the worker restarts.
    bound = 5.0 + 3.0 if fault == "link" else 0.5 + 1.5
    assert first_step_after(out, when, run["survivors"]) < bound, recoveries(run["logs"])
    check_exactly_once(out, killed=1 if fault == "sigstop" else 0)
    # The worker that comes back is admitted at the first step boundary after it asks: no round forms without it.
    futile = [
        r
        for f in finals(out)
        for r in f["recoveries"]
        if "admitting a worker" in r["reason"] and r["world_after"] <= r["world_before"]
    ]
    assert not futile, recoveries(run["logs"])
    assert len(finals(out)) == HOSTS


@needs_lab
@pytest.mark.lab
@pytest.mark.timeout(420)
def test_a_step_stuck_with_its_heartbeat_alive_costs_one_timeout_and_never_a_failed_job(tmp_path: Path) -> None:
    """Issue 59's stuck step: a worker's training thread hangs inside a step while its heartbeat beats on. The others
    go on after the collective timeout (5 s) and no second wait; it rejoins when it wakes; one that wakes after the
    job finished ends with status 0, saying so, and no launcher reports a failure (11.1 s and an exit 1 before)."""
    run = stuck_steps(tmp_path)
    out, logs = run["out"], run["logs"]
    first, when = run["first"]
    said = recoveries(logs)
    assert paused(out, when, run["survivors"], world=2) < 5.0 + 1.5, said
    assert "goes on without worker" in said and "outside every collective" in said, said
    # It woke (committing the step it was stuck in, where that step's all-reduce had completed) and trained on after
    # it rejoined: two steps at least after it woke, none before.
    after = sorted((e["t"], e["step"]) for e in events_of(out) if e["pid"] == first and e["t"] > when)
    assert len(after) >= 2 and after[0][0] > when + 7.5, (after[:3], said)
    # It ends saying the job finished: seen while it was stalled, or, where the others took longer than its 15 s to
    # finish (a loaded machine), as it asked to join again.
    ended_as = ("the job finished while this worker's training thread was stalled", "the job finished before this")
    assert any(said_so in logs[2] for said_so in ended_as), logs[2][-3000:]
    for log in logs:
        assert "restart the job" not in log and "Traceback" not in log, log[-3000:]
    check_exactly_once(out, epochs=6)
    ended = finals(out)
    assert len(ended) == HOSTS - 1  # h2's worker, finished without, reports nothing
    assert len({round(f["checksum"], 6) for f in ended}) == 1


@needs_lab
@pytest.mark.lab
@pytest.mark.timeout(420)
def test_a_host_paused_whole_past_the_timeout_comes_back_in_process(tmp_path: Path) -> None:
    """Issue 59's paused host: its launcher and worker stopped together for 8 s (timeout 5 s), as a frozen VM is,
    so no launcher sees a stopped worker and kills it (the lab's sigstop fault measures that shortcut). The others
    go on after the collective timeout; the same worker process trains again when the host resumes."""
    run = host_paused(tmp_path)
    out, (victim, when), logs = run["out"], run["fault"], run["logs"]
    said = recoveries(logs)
    assert paused(out, when, run["survivors"], world=2) < 5.0 + 1.5, said
    # In-process: the same pid trains on in a round of 3, two steps at least after it resumed (the first may be the
    # step it was paused in, committed where that step's all-reduce had completed).
    back = [e for e in events_of(out) if e["pid"] == victim and e["world"] == 3 and e["t"] > when + 7.5]
    assert len(back) >= 2, (back[:3], said)
    assert not any("restarting it" in log for log in logs), said
    check_exactly_once(out, epochs=6)
    ended = finals(out)
    assert len(ended) == HOSTS and len({round(f["checksum"], 6) for f in ended}) == 1


@needs_lab
@pytest.mark.lab
@pytest.mark.timeout(420)
def test_a_straggler_is_kept_and_named(tmp_path: Path) -> None:
    """Issue 59's straggler: one worker 3 x slower than the others all job long. No round forms (it is never
    evicted), and the round's rank 0 names it, once, as the member the others wait on."""
    run = straggling(tmp_path)
    out, logs = run["out"], run["logs"]
    ended = finals(out)
    assert len(ended) == HOSTS and not any(f["recoveries"] for f in ended), recoveries(logs)
    rank = next(e["rank"] for e in events_of(out) if e["pid"] == run["slow"])
    named = [line for log in logs for line in log.splitlines() if "sets the job's pace" in line]
    assert len(named) == 1 and f"(rank {rank}) sets the job's pace" in named[0], named
    check_exactly_once(out, epochs=5)


@needs_lab
@pytest.mark.lab
@pytest.mark.timeout(420)
def test_a_second_fault_during_the_regroup_costs_a_regroup_not_a_timeout(tmp_path: Path) -> None:
    run = fault_during_regroup(tmp_path)
    out, (_victim, _pid, when) = run["out"], run["faults"][0]
    survivor_log = run["logs"][0]
    assert "group was called off: worker" in survivor_log, recoveries(run["logs"])  # the formation gate ran
    assert "wait timeout" not in survivor_log, recoveries(run["logs"])
    # h0 alone after both: it waited out the 5 s group timeout before the gate (5.1 s measured then).
    assert paused(out, when, run["survivors"], world=1) < 5.0, recoveries(run["logs"])
    check_exactly_once(out, killed=2)
    assert len(finals(out)) == HOSTS


@needs_lab
@pytest.mark.lab
@pytest.mark.timeout(600)
def test_five_failures_in_one_run(tmp_path: Path) -> None:
    run = scenario(tmp_path, "sigkill", count=5, epochs=10)
    check_exactly_once(run["out"], epochs=10, killed=5)
    assert len(finals(run["out"])) == HOSTS


def test_a_member_watched_again_gets_a_fresh_timeout_but_an_exit_stays_final() -> None:
    """A worker stopped past the timeout is dropped, then asks to join: the leader must not judge it by the
    heartbeat count it saw before the stop (each round would then form without it). An exit its launcher
    reported is final."""
    import time

    import torch.distributed as dist

    from gradsync.elastic import keys
    from gradsync.elastic.liveness import HEARTBEAT_S, Liveness
    from gradsync.elastic.verdicts import mark_exited

    store = dist.HashStore()
    store.add(keys.beat(2), 1)
    mark_exited(store, 3)
    told: list[tuple[int, str]] = []
    liveness = Liveness(store, me=1, timeout=3 * HEARTBEAT_S, on_gone=lambda m, why: told.append((m, why)))
    try:
        assert liveness.alive(2) and liveness.alive(3)  # not watched before: watched from now
        time.sleep(6 * HEARTBEAT_S)  # member 2's count stands still (stopped); member 3's launcher saw it exit
        assert not liveness.alive(2) and not liveness.alive(3)
        # each told once, so the members can post it for the rank that will never post its own report
        stopped = f"stopped (no heartbeat for {3 * HEARTBEAT_S:g}s)"  # 0.3s, not rounded to 0s
        assert sorted(told) == [(2, stopped), (3, "exited (its launcher saw it)")], told
        liveness.watch_only([1])  # the round formed without them
        assert liveness.alive(2), "a worker asking to join again was judged by its count from before it stopped"
        assert not liveness.alive(3)
    finally:
        liveness.stop()


@pytest.mark.long
@needs_lab
@pytest.mark.timeout(180)
def test_losing_the_stores_host_ends_the_job_within_seconds_with_one_line(tmp_path: Path) -> None:
    """The job's store lives with the rendezvous host's launcher; when that host is lost the other launchers must
    not restart their workers against a store that is gone (each restart blocked ~60 s connecting, for minutes)."""
    ended = store_host_lost(tmp_path)
    for host, result in ended.items():
        # The launcher's one line (its worker may say it too, from its own next step).
        lines = [line for line in result["output"].splitlines() if "gradsync run --elastic: the job's" in line]
        assert result["seconds"] < 15 and result["code"] == 1, (host, result["seconds"], result["output"][-3000:])
        assert len(lines) == 1 and "is lost" in lines[0] and "restart the job from its last checkpoint" in lines[0]
        assert re.match(r"\d{4}-\d\d-\d\dT[\d:.]+Z gradsync run --elastic: ", lines[0]), lines  # gradsync/log.py


def test_a_launcher_tells_a_store_that_is_gone_from_one_out_of_reach(monkeypatch: pytest.MonkeyPatch) -> None:
    """A closed connection means the process serving the store ended: lost at once. Timeouts (this host's link
    down) may pass: lost only after GRADSYNC_ELASTIC_STORE_LOST_SECONDS. The launcher serving it never loses it."""
    import time

    from gradsync.launch.elastic import Job

    class Failing:
        def __init__(self, message: str) -> None:
            self.message = message

        def check(self, keys: list[str]) -> bool:
            raise RuntimeError(self.message)

    monkeypatch.setenv("GRADSYNC_ELASTIC_STORE_LOST_SECONDS", "0.3")
    closed = Job(Failing("Failed to recv, got 0 bytes. Connection was likely closed."), "h:1", hosting=False)  # type: ignore[arg-type]
    closed.look()
    assert closed.lost is not None and "connection was closed" in closed.lost
    slow = Job(Failing("Socket Timeout"), "h:1", hosting=False)  # type: ignore[arg-type]
    slow.look()
    assert slow.lost is None
    time.sleep(0.4)
    slow.look(again=True)
    assert slow.lost is not None and "unreachable for 0s" in slow.lost
    serving = Job(Failing("Broken pipe"), "h:1", hosting=True)  # type: ignore[arg-type]
    serving.look()
    assert serving.lost is None


@pytest.mark.long
@pytest.mark.timeout(240)
def test_the_store_does_not_grow_with_the_steps(tmp_path: Path) -> None:
    """Elastic touches the store per membership change, not per step: after 2,000 steps it holds as many keys as
    after 200 (each step wrote N + 1 keys that were never deleted before)."""
    import json

    _run_elastic_on_loopback([str(ROOT / "tests" / "scripts" / "elastic_keys.py"), str(tmp_path)], ROOT, STEPS="2000")
    for path in sorted(tmp_path.glob("*.keys")):
        early, late = json.loads(path.read_text())
        assert late == early, f"{path.name}: {early} keys after 200 steps, {late} after 2,000"


@pytest.mark.long
@pytest.mark.timeout(240)
@pytest.mark.parametrize("block", [0, 1], ids=["run", "guard"])
def test_the_docs_elastic_examples_run_as_written(tmp_path: Path, block: int) -> None:
    """The snippets of docs/elastic.md, verbatim, after the migration page's import and the names they assume (a
    model, a dataset, a loss, a number of epochs), under `gradsync run --elastic`. The second (guard) replaces the
    first's last lines: it starts from the same job, model, optimizer and loader."""
    from docs_blocks import blocks as page_blocks

    blocks = [b.code for b in page_blocks("docs/elastic.md", "python", "Surviving failures without a restart")]
    assert len(blocks) == 2, "docs/elastic.md should hold the @run and the guard examples"
    setup = blocks[0][: blocks[0].index("@gradsync.elastic.run")]  # init, model, optimizer, loader
    snippet = blocks[0] if block == 0 else setup + blocks[1]
    preamble = (
        "import torch, gradsync\n"
        "from torch import nn\n"
        "from torch.utils.data import TensorDataset\n"
        "torch.manual_seed(0)\n"
        "model = nn.Linear(8, 1)\n"
        "dataset = TensorDataset(torch.randn(256, 8), torch.randn(256, 1))\n"
        "loss_fn = nn.functional.mse_loss\n"
        "epochs = 2\n"
    )
    script = tmp_path / "train.py"
    script.write_text(preamble + snippet)
    _run_elastic_on_loopback([str(script)], tmp_path)


def _run_elastic_on_loopback(script_and_args: list[str], cwd: Path, **env: str) -> None:
    """``gradsync run --elastic`` with 2 workers on this host, on a free port; it must end well."""
    import os
    import subprocess

    from gradsync.testing import free_port

    port = free_port()
    argv = [sys.executable, "-m", "gradsync", "run", "--elastic", "--nnodes", "1", "--nproc-per-node", "2"]
    argv += ["--rdzv-endpoint", f"127.0.0.1:{port}", *script_and_args]
    variables = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_"))}
    variables.update(PYTHONPATH=str(ROOT), GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", **env)
    done = subprocess.run(argv, env=variables, cwd=cwd, capture_output=True, text=True, timeout=200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def test_a_worker_that_dies_before_registering_leaves_no_one_waiting() -> None:
    """The first worker waits for every number taken to register for round 1; one that took its number and died
    before registering (its heartbeat never moves) is left out after the heartbeat timeout, not waited for."""
    import time

    import torch.distributed as dist

    from gradsync.elastic import keys
    from gradsync.elastic.membership import Membership
    from gradsync.elastic.timeouts import Timeouts

    store = dist.HashStore()
    first = Membership(store, store, Timeouts(heartbeat=0.75, collective=0.75, admission=5))
    try:
        store.add(keys.SEQUENCE, 1)  # worker 2 takes its number, then dies
        start = time.monotonic()
        round_ = first.first_round(expected=2, seconds=30)
        assert round_.members == [1]
        assert time.monotonic() - start < 5, "worker 1 waited for a worker that will never register"
    finally:
        first.stop()


# ------------------------------------------------------------------------------ the job's store on etcd (issue 29)
def _check_one_model_every_sample_once(run: dict) -> None:
    check_exactly_once(run["out"], epochs=run["epochs"], killed=1)
    ended = finals(run["out"])
    assert len(ended) == HOSTS and len({round(f["checksum"], 6) for f in ended}) == 1, ended  # the rejoined too


@pytest.mark.long
@needs_lab
@needs_etcd
@pytest.mark.timeout(300)
def test_on_etcd_the_job_survives_losing_the_host_that_started_it(tmp_path: Path) -> None:
    """h0's launcher, worker and etcd member SIGKILLed mid-epoch: the two survivors carry on in their processes,
    and a fresh launcher on the "rebooted" h0 (its etcd member back with its data) rejoins. With the TCPStore the
    job would end here (test_losing_the_stores_host_ends_the_job_within_seconds_with_one_line)."""
    run = any_host_lost(tmp_path, "host")
    out, (_host, _pid, when) = run["out"], run["faults"][0]
    # No launcher is left on h0 to report the exit: the survivors' all-reduce finds the closed connections, and a
    # round does not wait for a member whose heartbeat stood still for 3 beats. A survivor that was waiting in
    # gloo for the other survivor's data (not the dead one's) fails only at the group's timeout (5 s here).
    # Measured: median 1.98 s over 5 runs, one of 3.87 s (an etcd election, likely); 5.3-6 s before a round stopped
    # waiting for a member whose heartbeat stood still. The bound leaves room for a loaded machine.
    blocked = any("Timed out" in log for log in run["logs"])
    assert paused(out, when, run["survivors"], HOSTS - 1) < (5.0 + 3.0 if blocked else 4.5), recoveries(run["logs"])
    _check_one_model_every_sample_once(run)


@needs_lab
@needs_etcd
@pytest.mark.lab
@pytest.mark.timeout(300)
def test_on_etcd_the_job_survives_the_link_of_the_host_that_started_it(tmp_path: Path) -> None:
    """h0's link down for 8 s: its etcd member is cut off with it (the other two keep the quorum); the survivors
    carry on after the heartbeat timeout, and h0's worker, left out, joins again in-process when the link is back."""
    run = any_host_lost(tmp_path, "link")
    out, (_host, _pid, when) = run["out"], run["faults"][0]
    # Measured: median 7.40 s over 3 runs (the 5 s group timeout, then the round), one of 9.31 s.
    assert paused(out, when, run["survivors"], HOSTS - 1) < 5.0 + 5.0, recoveries(run["logs"])
    assert any("asking to join again" in log for log in run["logs"])
    _check_one_model_every_sample_once(run)


@pytest.mark.long
@needs_etcd
@pytest.mark.timeout(180)
def test_on_etcd_losing_one_member_of_three_changes_nothing_for_training(tmp_path: Path) -> None:
    import time

    with etcd_cluster.cluster(tmp_path / "etcd", members=3) as etcd:
        out = tmp_path / "out"
        out.mkdir()
        job = launch_on_loopback(out, etcd.url, {"STEP_SLEEP": "0.05", "EPOCHS": "1"})
        try:
            while len(events_of(out)) < 20 and job.poll() is None:
                time.sleep(0.1)
            etcd.kill(0)  # the first member every client talks to; maybe the leader
            output = job.communicate(timeout=120)[0]
        finally:
            job.kill()
        assert job.returncode == 0, output[-3000:]
        ended = finals(out)
        assert len(ended) == 2 and len({f["checksum"] for f in ended}) == 1
        assert all(f["recoveries"] == [] for f in ended), [f["recoveries"] for f in ended]


@pytest.mark.long
@needs_etcd
@pytest.mark.timeout(180)
def test_on_etcd_losing_two_members_stops_every_worker_with_the_store_named(tmp_path: Path) -> None:
    """No quorum: the store cannot be written, so no change could be agreed. Every worker stops with one error
    naming the cluster (after GRADSYNC_ELASTIC_STORE_LOST_SECONDS, here 2 s, plus the client's 10 s of trying
    every member), and its launcher stops restarting it; nothing hangs."""
    import time

    with etcd_cluster.cluster(tmp_path / "etcd", members=3) as etcd:
        out = tmp_path / "out"
        out.mkdir()
        env = {"STEP_SLEEP": "0.05", "EPOCHS": "30", "GRADSYNC_ELASTIC_STORE_LOST_SECONDS": "2"}
        job = launch_on_loopback(out, etcd.url, env)
        try:
            while len(events_of(out)) < 20 and job.poll() is None:
                time.sleep(0.1)
            etcd.kill(0)
            etcd.kill(1)
            when = time.monotonic()
            output = job.communicate(timeout=90)[0]
            took = time.monotonic() - when
        finally:
            job.kill()
    assert job.returncode == 1, output[-3000:]
    # Each worker says it: from its next step ("the job's store ... is lost"), or from the store operation that
    # failed (a worker regrouping after the other stopped: "the etcd cluster ... lost its quorum").
    stopped = [line for line in output.splitlines() if "training stops here" in line or "lost its quorum" in line]
    assert len({line.split("]")[0] for line in stopped}) == 2, output[-3000:]
    assert all(etcd.url.removeprefix("etcd://") in line for line in stopped)
    assert took < 45, took


def _train_script(out: Path) -> str:
    """A train.py that runs the lab's elastic training script, writing its results to ``out``."""
    return (
        "import runpy, sys\n"
        f"sys.argv = [{str(ROOT / 'tests' / 'scripts' / 'elastic_train.py')!r}, {str(out)!r}]\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n"
    )


def _run_on_every_host(lab, tmp_path: Path, out: Path, script_for, env_for) -> None:
    """Run ``script_for(host)`` in bash on each namespace host (in its own folder, with a train.py and
    ``env_for(host)`` added to a clean environment); each must succeed and every host end with the same model."""
    import os
    import subprocess

    procs = []
    for host in lab:
        cwd = tmp_path / f"h{host.index}"
        cwd.mkdir(exist_ok=True)  # a test may have put files there (the certificates)
        (cwd / "train.py").write_text(_train_script(out))
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_"))}
        env.update(GLOO_SOCKET_IFNAME=host.interface, EPOCHS="1", PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
        env.update(PATH=f"{Path(sys.executable).parent}:{env['PATH']}", **env_for(host))
        command = host.command(["env", *[f"{k}={v}" for k, v in env.items()], "bash", "-c", script_for(host)])
        procs.append(subprocess.Popen(command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=180)[0])
        except subprocess.TimeoutExpired:
            p.kill()
            logs.append(p.communicate()[0])
    assert all(p.returncode == 0 for p in procs), "\n----\n".join(log[-2000:] for log in logs)
    ended = finals(out)
    assert len(ended) == HOSTS and len({f["checksum"] for f in ended}) == 1


needs_etcdctl = pytest.mark.skipif(
    (certs.available() or (None if shutil.which("etcdctl") else "etcdctl is not installed (Debian: etcd-client)"))
    is not None,
    reason=str(certs.available() or "etcdctl is not installed (Debian: apt-get install etcd-client)"),
)


def _secured_pki(made: certs.Files, folder: Path) -> None:
    """What docs/elastic.md's secured blocks expect in pki/: the CA, the members' and the client's certificates,
    the two users' passwords."""
    pki = folder / "pki"
    pki.mkdir(parents=True)
    names = {"ca.crt": made.ca, "server.crt": made.server_cert, "server.key": made.server_key}
    names |= {"client.crt": made.client_cert, "client.key": made.client_key}
    for name, path in names.items():
        shutil.copy(path, pki / name)
    (pki / "root.password").write_text("root-secret\n")
    (pki / "trainer.password").write_text("trainer-secret\n")


@pytest.mark.long
@needs_lab
@needs_etcd
@needs_etcdctl
@pytest.mark.timeout(300)
def test_the_docs_secured_etcd_blocks_run_as_written(tmp_path: Path) -> None:
    """docs/elastic.md's secured etcd, its three blocks verbatim: the members over TLS (client and peer, client
    certificates wanted) on each of three namespace hosts, the users and auth made once with etcdctl, then the job
    with --store etcd+https:// and torchrun's --rdzv-conf. Every host ends with the same model."""
    import os
    import signal
    import subprocess

    from docs_blocks import block as page_block

    section = "The job's store on a secured etcd"
    members, users, job = (page_block("docs/elastic.md", "bash", section, i, count=3) for i in range(3))
    assert "etcd+https://" in job and "password_file=pki/trainer.password" in job and "secret" not in job
    exports = "\n".join(line for line in users.splitlines() if line.startswith("export "))
    healthy = "for i in $(seq 150); do etcdctl endpoint health --cluster >/dev/null 2>&1 && exit 0; sleep 0.2; done"
    out = tmp_path / "out"
    out.mkdir()
    with netlab.lab(hosts=HOSTS, rate="1gbit", prefix="gssecure", subnet="10.0.0") as lab:
        hosts = list(lab)
        made = certs.make(tmp_path / "made", names=[], addresses=[h.address for h in hosts])
        etcds = []
        try:
            for host in hosts:
                cwd = tmp_path / f"h{host.index}"
                _secured_pki(made, cwd)
                named = ["env", f"NAME=h{host.index}", f"IP={host.address}"]
                argv = host.command([*named, "bash", "-c", members + "\nwait"])
                log = open(cwd / "etcd.log", "w")
                started = subprocess.Popen(argv, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
                etcds.append(started)
            for script in (f"{exports}\n{healthy}\nexit 1", users):
                argv = hosts[0].command(["bash", "-c", script])
                done = subprocess.run(argv, cwd=tmp_path / "h0", capture_output=True, text=True, timeout=60)
                assert done.returncode == 0, done.stdout + done.stderr
            _run_on_every_host(lab, tmp_path, out, lambda host: job, lambda host: {"IP": host.address})
        finally:
            for p in etcds:  # etcd and the bash that waits for it, in their own session
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


@pytest.mark.long
@needs_lab
@pytest.mark.timeout(240)
def test_the_docs_elastic_command_runs_on_three_hosts(tmp_path: Path) -> None:
    """docs/elastic.md's `gradsync run --elastic` command, as written, on three namespace hosts at 10.0.0.1-3, each
    with its own --local-addr (as the block's comment says); train.py is the lab's training script. Every host ends
    with the same model."""
    from docs_blocks import block as page_block

    block = page_block("docs/elastic.md", "bash", "Surviving failures without a restart", 0, count=5)
    assert block.startswith("gradsync run --elastic --nnodes 3") and "--local-addr 10.0.0.1 train.py" in block
    out = tmp_path / "out"
    out.mkdir()
    with netlab.lab(hosts=HOSTS, rate="1gbit", prefix="gsdocel", subnet="10.0.0") as lab:
        script = lambda host: block.replace("--local-addr 10.0.0.1 ", f"--local-addr {host.address} ")  # noqa: E731
        _run_on_every_host(lab, tmp_path, out, script, lambda host: {})


@pytest.mark.long
@needs_lab
@needs_etcd
@pytest.mark.timeout(240)
def test_the_docs_etcd_block_runs_as_written(tmp_path: Path) -> None:
    """docs/elastic.md's etcd block, verbatim, on three namespace hosts at its addresses (10.0.0.1-3, inside the
    namespaces only), each with its NAME and IP; train.py is the lab's training script. Every host ends with the same
    model."""
    from docs_blocks import block as page_block

    block = page_block("docs/elastic.md", "bash", "No single point of failure", count=1)
    assert block.startswith("etcd --name $NAME") and "gradsync run --elastic --store etcd://" in block
    out = tmp_path / "out"
    out.mkdir()
    with netlab.lab(hosts=HOSTS, rate="1gbit", prefix="gsreadme", subnet="10.0.0") as lab:
        # The block leaves etcd running in the background, as on a host; the lab stops it with the namespace.
        script = lambda host: block + "\nstatus=$?; kill %1; exit $status\n"  # noqa: E731
        _run_on_every_host(lab, tmp_path, out, script, lambda host: {"NAME": f"h{host.index}", "IP": host.address})


class _EveryoneAlive:
    """Rounds' view of liveness, for a store-level test: nobody's heartbeat stopped."""

    interval = 0.25

    def alive(self, member: int) -> bool:
        return True

    def still_for(self, member: int) -> float:
        return 0.0

    def last_count(self, member: int) -> int:
        return 0

    def why_dead(self, member: int) -> str:
        return ""


def _rounds(store, me: int):
    from gradsync.elastic.rounds import Rounds
    from gradsync.elastic.timeouts import Timeouts

    return Rounds(store, me, _EveryoneAlive(), Timeouts(heartbeat=1.0, collective=0.2, admission=2.0))  # type: ignore[arg-type]


def _formed(store, number: int, members: list[int], steps: int) -> None:
    import json

    from gradsync.elastic import keys

    store.set(keys.leader(number), str(members[0]))
    store.set(keys.members(number), json.dumps(members))
    store.set(keys.committed(number), str(steps))
    store.set(keys.CURRENT_ROUND, str(number))


def test_a_member_cut_off_while_rounds_formed_without_it_rejoins_and_leads_none() -> None:
    """The chaos soak's fork (8 hosts, a fault every 2 s): a member back from a partition must not decide a round
    from its stale view of the members (it listed itself first, with its older state, and a second group trained
    from it beside the first). It reads the latest round, which leaves it out, and joins again."""
    import torch.distributed as dist

    from gradsync.elastic import keys
    from gradsync.elastic.rounds import Round

    store = dist.HashStore()
    for number, members in ((3, [1, 2, 3]), (4, [2, 3]), (5, [2, 3, 4])):
        _formed(store, number, members, steps=100 * number)
    assert _rounds(store, me=1).agree(Round(3, [1, 2, 3], me=1), steps=300) == (5, [2, 3, 4])
    assert not store.check([keys.leader(6)]) and not store.check([keys.registered(6, 1)])


def test_no_round_starts_from_an_older_state_than_the_last_one_did() -> None:
    """A leader whose registered steps are fewer than the current round started from (it never took that state)
    abandons the round instead of listing it: every member would take rank 0's state, and go back in time."""
    import torch.distributed as dist

    from gradsync.elastic import keys
    from gradsync.elastic.errors import MembershipChanged
    from gradsync.elastic.rounds import Round

    store = dist.HashStore()
    _formed(store, 3, [1, 2], steps=100)
    with pytest.raises(MembershipChanged, match="no member that committed step 100 or later registered"):
        _rounds(store, me=1).agree(Round(3, [1, 2], me=1), steps=50)
    assert not store.check([keys.committed(4)]) and int(store.get(keys.CURRENT_ROUND)) == 3


def test_a_leader_judged_lost_by_a_watcher_still_lists_itself() -> None:
    """Every current member judged lost while a round is decided (the soak's starved heartbeats): the leader, alive
    since it decides, lists itself, so the round starts from a member's state and not a joiner's."""
    import json

    import torch.distributed as dist

    from gradsync.elastic import keys
    from gradsync.elastic.rounds import Round

    store = dist.HashStore()
    _formed(store, 3, [1, 2], steps=100)
    store.add(keys.SEQUENCE, 3)  # workers 1, 2 and a joiner, 3
    store.set(keys.lost(1), "stopped")
    store.set(keys.lost(2), "stopped")
    store.set(keys.joiner(3), "1")
    store.set(keys.registered(4, 3), "0")
    number, members = _rounds(store, me=1).agree(Round(3, [1, 2], me=1), steps=120)
    assert (number, members) == (4, [1, 3]) and json.loads(store.get(keys.committed(4))) == 120


def test_a_step_only_members_that_then_left_committed_is_dropped_and_a_fork_is_not() -> None:
    """The 8-host soak: step 649 completed on two members only (one killed, one cut off and later rejoining with
    the others' state), and the survivors did it again in a smaller world; its update lived in no state that
    lasted. Two histories that both went on are a fork, and stay in the record for the check to fail."""
    from lab.elastic import discarded_steps

    def step(pid: int, t: float, step: int, world: int) -> dict:
        return {"pid": pid, "t": t, "epoch": 0, "step": step, "position": 4 * step, "world": world, "indices": []}

    lost = [step(6, 1.0, 9, 3), step(7, 1.0, 9, 3), step(6, 9.0, 30, 2)]  # 6 rejoins at step 30; 7 died
    survivors = [step(p, t, s, 2) for p in (1, 2) for t, s in ((2.0, 9), (2.1, 10))]

    def kept(events: list[dict], victims: int) -> list[tuple]:
        return sorted((e["pid"], e["t"]) for e in discarded_steps(events, victims, finished={1, 2, 6}))

    assert kept(lost + survivors, 2) == sorted((e["pid"], e["t"]) for e in lost[2:] + survivors)
    with pytest.raises(AssertionError, match="2 ranks' steps were discarded, 1 fault victims"):
        discarded_steps(lost + survivors, victims=1, finished={1, 2, 6})
    fork = [step(6, 1.0, 9, 3), step(6, 1.1, 10, 3)]  # went on beside the survivors
    assert kept(fork + survivors, 5) == sorted((e["pid"], e["t"]) for e in fork + survivors)
