"""``python -m bench.elastic.recovery``: how long elastic training pauses when it loses a worker or a host, in the
elastic fault lab (lab/elastic.py: a job started with ``gradsync run --elastic`` on 3 hosts, network namespaces, x 1
rank, running tests/scripts/elastic_train.py; tests/test_elastic.py asserts on the same runs):

    python -m bench.elastic.recovery --runs 3
    python -m bench.elastic.recovery --runs 3 --detected-by allreduce

which reports, per SIGKILL of one worker: how long the survivors paused (the kill to their next committed step,
against their usual step), how long until the restarted worker committed a step again (rejoined over the network),
how long the survivors stopped to admit it (the new group and the state sync), and how long a fresh job takes from
launch to its first step, the least a restart-from-checkpoint pays on top of the work lost since the checkpoint.
With the job's store on etcd, h0 (the host that started the job) lost whole, or cut off:

    python -m bench.elastic.recovery --runs 5 --etcd host
    python -m bench.elastic.recovery --runs 3 --etcd link

A second fault inside the regroup window (h1 SIGKILLed, h2 exiting as it reaches the next round's formation gate),
with whether the gate called the round off (gradsync/elastic/round_group.py):

    python -m bench.elastic.recovery --runs 3 --during-regroup
    python -m bench.elastic.recovery --runs 3 --during-regroup --gate-off    # before the gate, for comparison

A step stuck with its heartbeat alive (lab/elastic.py's ``stuck_steps``: h1's training thread asleep 8 s mid-job,
timeout 5 s, then h2's for 15 s as the job ends), with whether the round's leader went without it because it said it
stalled (gradsync/elastic/verdicts.py's Stall), and whether any launcher reported a failure:

    python -m bench.elastic.recovery --runs 3 --stuck

A host paused whole (lab/elastic.py's ``host_paused``: h1's launcher and worker stopped together for 8 s, timeout
5 s, as a frozen VM is; the launcher never sees its worker stopped alone, so no shortcut kills it), with whether the
same worker process trained again in a round of 3 (back in-process):

    python -m bench.elastic.recovery --runs 3 --paused-host

A straggler (lab/elastic.py's ``straggling``: h1's worker 3 x slower than the others all job long): how many rounds
formed (none: it is kept), and the shares of time outside collectives that the round's rank 0 reported for it and
for the others (gradsync/elastic/pace.py):

    python -m bench.elastic.recovery --runs 3 --straggler
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from lab import netlab
from lab.elastic import (
    HOSTS,
    admission_seconds,
    any_host_lost,
    check_exactly_once,
    events_of,
    fault_during_regroup,
    finals,
    first_step_after,
    host_paused,
    paused,
    recoveries,
    scenario,
    straggling,
    stuck_steps,
)


def measure(tmp: Path, detected_by: str = "agreement") -> dict[str, float]:
    """One SIGKILL of h1's worker, mid-epoch; the figures the module docstring lists. ``detected_by``: where the
    step's time is spent, so where the kill lands: "agreement" (after backward: the step's agreement finds the
    death) or "allreduce" (before it: the survivors' all-reduce fails)."""
    started = time.time()
    run = scenario(tmp, "sigkill", env={"SLEEP_AT": "forward"} if detected_by == "allreduce" else {})
    out, (_victim, pid, when) = run["out"], run["faults"][0]
    events = sorted(events_of(out), key=lambda e: e["t"])
    survivor_times = [e["t"] for e in events if e["pid"] == run["survivors"][0]]
    before = [b - a for a, b in zip(survivor_times, survivor_times[1:]) if b < when][-10:]
    rejoined = min(e["t"] for e in events if e["pid"] not in (*run["survivors"], pid) and e["t"] > when)
    return {
        "usual step s": statistics.median(before),
        "survivors paused s": first_step_after(out, when, run["survivors"]),
        "worker back s": rejoined - when,
        "survivors held to admit it s": max(admission_seconds(out), default=0.0),
        "fresh job to first step s": events[0]["t"] - started,
    }


def measure_any_host(tmp: Path, fault: str) -> dict[str, float]:
    """The job on etcd, h0 lost (``fault``: "host" or "link"); the survivors' pause, and whether a survivor was
    blocked in gloo until the group's timeout (then the pause is that timeout's, not the detection's)."""
    run = any_host_lost(tmp, fault)
    out, (_host, _pid, when) = run["out"], run["faults"][0]
    check_exactly_once(out, epochs=run["epochs"], killed=1)
    pause = paused(out, when, run["survivors"], HOSTS - 1)
    return {
        "survivors paused s": pause,
        "a survivor blocked in gloo": float(any("Timed out" in log for log in run["logs"])),
        "h0 back s": min(e["t"] for e in events_of(out) if e["t"] > when + pause and e["world"] == HOSTS) - when,
    }


def longest_stall(out: Path, when: float, pid: int) -> float:
    """The longest wait between two of ``pid``'s committed steps after ``when``: the regroups' pause, whichever
    world it ended in (without the gate the restarted workers are back by then, so the survivor is never alone)."""
    times = sorted(e["t"] for e in events_of(out) if e["pid"] == pid)
    return max(b - a for a, b in zip(times, times[1:]) if b > when)


def measure_during_regroup(tmp: Path, gate: bool = True) -> dict[str, float]:
    """Two faults in one regroup window: h0's pause to its first step alone, and whether the round agreed with h2
    was called off at its gate (else the pause is the group's timeout)."""
    run = fault_during_regroup(tmp, env=None if gate else {"FORMATION_GATE": "off"})
    out, (_host, _pid, when) = run["out"], run["faults"][0]
    check_exactly_once(out, killed=2)
    return {
        "survivor's longest stall s": longest_stall(out, when, run["survivors"][0]),
        "round called off at the gate": float("group was called off" in run["logs"][0]),
        "waited out a timeout": float("wait timeout" in run["logs"][0]),
    }


def trained_again(out: Path, pid: int, after: float, when: float) -> float:
    """Seconds from ``when`` to ``pid``'s second committed step after ``after``: its first is most often the step it
    was in when it stopped, committed as it resumes if that step's all-reduce had completed (else this counts one
    step late); then it joins again."""
    times = sorted(e["t"] for e in events_of(out) if e["pid"] == pid and e["t"] > after)
    return times[1] - when if len(times) > 1 else float("nan")


def measure_stuck(tmp: Path) -> dict[str, float]:
    """The survivors' pause after h1's step stuck (5 s of it the collective timeout), when h1 trained again after it
    woke (:func:`trained_again`), and whether the second stuck step, which wakes after the job finished, ended as
    such."""
    run = stuck_steps(tmp)
    out, (first, when), logs = run["out"], run["first"], run["logs"]
    check_exactly_once(out, epochs=6)
    return {
        "survivors paused s": paused(out, when, run["survivors"], HOSTS - 1),
        "left out as stalled": float("goes on without worker" in recoveries(logs)),
        "h1 training again s": trained_again(out, first, when, when),
        "h2 ended as finished": float("the job finished while this worker's training thread" in logs[2]),
    }


def measure_paused_host(tmp: Path) -> dict[str, float]:
    run = host_paused(tmp)
    out, (victim, when) = run["out"], run["fault"]
    check_exactly_once(out, epochs=6)
    return {
        "survivors paused s": paused(out, when, run["survivors"], HOSTS - 1),
        "h1 back in-process s": trained_again(out, victim, when + 8.0, when),  # resumed after the 8 s pause
        "h1 restarted": float(any("restarting it" in log for log in run["logs"])),
    }


def measure_straggler(tmp: Path) -> dict[str, float]:
    run = straggling(tmp)
    check_exactly_once(run["out"], epochs=5)
    said = [line for log in run["logs"] for line in log.splitlines() if "sets the job's pace" in line]
    shares = [float(x) for x in re.findall(r"(\d+)% ", said[0])] if said else [float("nan")] * 2
    return {
        "rounds formed": float(sum(len(f["recoveries"]) for f in finals(run["out"]))),
        "reported": float(len(said)),
        "its share outside %": shares[0],
        "the others' share %": shares[1],
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.elastic.recovery", description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument(
        "--detected-by",
        choices=("agreement", "allreduce"),
        default="agreement",
        help="where the kill lands: after backward (the agreement finds it) or before (an all-reduce fails)",
    )
    parser.add_argument(
        "--etcd",
        choices=("host", "link"),
        default=None,
        help="the job's store on etcd (a member per host), and h0, which started the job, lost: whole (SIGKILL of "
        "its launcher, worker and etcd member, then a fresh launcher) or its link down for 8 s",
    )
    parser.add_argument("--during-regroup", action="store_true", help="a second fault inside the regroup window")
    parser.add_argument("--gate-off", action="store_true", help="with --during-regroup: no formation gate (before)")
    parser.add_argument("--stuck", action="store_true", help="steps stuck with their heartbeats alive")
    parser.add_argument("--paused-host", action="store_true", help="a host's launcher and worker paused together")
    parser.add_argument("--straggler", action="store_true", help="one worker 3 x slower than the others")
    args = parser.parse_args(argv)
    if netlab.available() is not None:
        print(f"skipped: {netlab.available()}")
        return 1
    tmp = lambda: Path(tempfile.mkdtemp(prefix="gselastic"))  # noqa: E731
    if args.straggler:
        rows = [measure_straggler(tmp()) for _ in range(args.runs)]
    elif args.paused_host:
        rows = [measure_paused_host(tmp()) for _ in range(args.runs)]
    elif args.stuck:
        rows = [measure_stuck(tmp()) for _ in range(args.runs)]
    elif args.during_regroup:
        rows = [measure_during_regroup(tmp(), not args.gate_off) for _ in range(args.runs)]
    elif args.etcd:
        rows = [measure_any_host(tmp(), args.etcd) for _ in range(args.runs)]
    else:
        rows = [measure(tmp(), args.detected_by) for _ in range(args.runs)]
    for key in rows[0]:
        values = [r[key] for r in rows]
        print(f"{key:28s} median {statistics.median(values):6.2f}   runs {', '.join(f'{v:.2f}' for v in values)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
