"""``python -m bench.elastic.chaos``: an elastic job on 8 hosts (network namespaces, 1 rank each) under random
faults, several in flight at once, for a wall-clock budget (lab/chaos.py), checked from the workers' own records
and reported:

    python -m bench.elastic.chaos --hosts 8 --budget 120 --mean 10 --seed 0
    python -m bench.elastic.chaos --hosts 8 --budget 120 --mean 10 --seed 0 --store etcd   # etcd members killed too

Checked: every sample of every epoch used by exactly one committed step; the final parameters identical on every
host; the job finished. Reported: faults injected by kind, steps committed over steps attempted (torchft's measure:
a step a fault aborted is attempted, not committed), the pause after each fault (the longest wait between two of the
job's committed steps before the next fault, at most ``WINDOW_S``) as p50/p95/p99/max by kind, the time until a
victim's host trains again, and the CPU the run used; then the same pauses for the faults that stood alone, with no
partition in reach (:func:`alone`), and for every fault clear of partitions, bursts included
(:func:`clear_of_partitions`). Writes ``bench/results/chaos-<seed>[-etcd].json`` and ``.png``;
``--reread bench/results/chaos-1.json`` prints an earlier run's summary again.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from lab import chaos, etcd_cluster, netlab
from lab.elastic import check_exactly_once, events_of, finals
from lab.results import write_json

WINDOW_S = 15.0  # a pause is looked for this long after its fault (or until the next one)


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank percentile (``q`` in 0..100) of ``values``.

    >>> percentile([1.0, 2.0, 3.0, 4.0], 50), percentile([1.0, 2.0, 3.0, 4.0], 99)
    (2.0, 4.0)
    """
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def step_times(out: Path) -> list[float]:
    """When each committed step was recorded, once per step (its ranks write it within milliseconds)."""
    first: dict[tuple, float] = {}
    for e in events_of(out):
        key = (e["epoch"], e["position"], e["world"], e["step"])
        first[key] = min(first.get(key, e["t"]), e["t"])
    return sorted(first.values())


def pauses(times: list[float], faults: list[chaos.Fault]) -> list[float]:
    """Per fault: the longest gap between consecutive committed steps from the fault to the next fault (at most
    WINDOW_S later). With faults close together one gap can count for both: it is each one's pause."""
    ends = [f.t for f in faults[1:]] + [math.inf]
    found = []
    for fault, end in zip(faults, ends):
        stop = min(end, fault.t + WINDOW_S)
        inside = [t for t in times if fault.t <= t <= stop]
        before = [t for t in times if t < fault.t][-1:]
        after = [t for t in times if t > stop][:1]
        if not inside and not after:  # injected after the job's last step (as it finished): it paused nothing
            found.append(0.0)
            continue
        points = before + inside + after
        # A wait running past the next fault is counted up to it: the rest is the next fault's.
        gaps = (min(b, end) - max(a, fault.t) for a, b in zip(points, points[1:]))
        found.append(max(gaps, default=math.inf))
    return found


# A member cut off, paused whole or stuck in a step holds its peers inside their collective until its timeout (gloo
# cannot abort one): the bound for these, and for the faults that land within their reach, is that timeout.
PARTITIONS = ("link", "split", "paused", "stuck")
PARTITION_REACH_S = chaos.SILENT_S + chaos.TIMEOUT_S  # cut, found lost, healed and admitted again
REGROUP_S = 1.0  # a kill this long before a fault may still be regrouping as it lands


def alone(pauses: Sequence[dict]) -> list[bool]:
    """Per fault (``summarize``'s ``pauses``: kind, t, pause s): whether it stood alone, with no partition in reach
    (one begun within PARTITION_REACH_S before it, itself excepted) and no other fault in its regroup window: none
    whose pause overlaps its own, and no other kill from ``REGROUP_S`` before it to its pause's end (a pair's second
    kill, ``PAIR_GAP_S`` after its first, counted: it may land after the pair's pause ended, as the next fault's
    regroup begins). A fault that overlaps a partition waits for the cut-off member's heartbeat timeout too, whatever
    its own kind, and faults in one regroup window share one pause."""
    partitions = [p["t"] for p in pauses if p["kind"] in PARTITIONS]
    kills = [[p["t"], p["t"] + chaos.PAIR_GAP_S] if p["kind"] == "pair" else [p["t"]] for p in pauses]
    spans = [(k[0], max(k[-1], p["t"] + p["pause s"])) for p, k in zip(pauses, kills)]  # through its last kill

    def shares_a_window(i: int, j: int) -> bool:
        (begin, end), (other, other_end) = spans[i], spans[j]
        return (other < end and begin < other_end) or any(begin - REGROUP_S <= k <= end for k in kills[j])

    return [
        not any(0 <= spans[i][0] - t <= PARTITION_REACH_S and t != spans[i][0] for t in partitions)
        and not any(shares_a_window(i, j) for j in range(len(pauses)) if j != i)
        for i in range(len(pauses))
    ]


def clear_of_partitions(pauses: Sequence[dict]) -> list[bool]:
    """Per fault: whether it is no partition and none began within ``PARTITION_REACH_S`` before it, whatever else
    landed with it (bursts of kills and stops included). The issue's goal is for these; a fault within a partition's
    reach waits for the cut-off member's heartbeat timeout, the partition's own bound."""
    partitions = [p["t"] for p in pauses if p["kind"] in PARTITIONS]
    return [
        p["kind"] not in PARTITIONS and not any(0 <= p["t"] - t <= PARTITION_REACH_S for t in partitions)
        for p in pauses
    ]


def alone_by_kind(pauses: Sequence[dict]) -> dict[str, dict]:
    """The pauses of the faults that stood alone (:func:`alone`), by kind: what one fault costs by itself."""
    return _by_kind(pauses, alone(pauses), "alone")


def clear_by_kind(pauses: Sequence[dict]) -> dict[str, dict]:
    """The pauses of the faults clear of partitions (:func:`clear_of_partitions`), by kind."""
    return _by_kind(pauses, clear_of_partitions(pauses), "faults")


def _by_kind(pauses: Sequence[dict], chosen: Sequence[bool], counted: str) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for kind in sorted({p["kind"] for p in pauses}):
        mine = [p["pause s"] for p, c in zip(pauses, chosen) if c and p["kind"] == kind]
        if mine:
            out[kind] = {
                counted: len(mine),
                "pause p50 s": percentile(mine, 50),
                "pause p99 s": percentile(mine, 99),
                "pause max s": max(mine),
            }
    return out


def back_after(events: list[dict], host_of: dict[int, str], fault: chaos.Fault) -> float:
    """Seconds until the last of the fault's hosts commits a step again (a restarted worker rejoined, or the stopped
    or cut-off one was admitted again); ``host_of``: each worker's host, by pid."""
    silent = chaos.SILENT_S if fault.kind in chaos.SILENT_KINDS else 0.0
    backs = []
    for host in fault.hosts:
        later = [e["t"] for e in events if host_of.get(e["pid"]) == host and e["t"] > fault.t + silent]
        backs.append(min(later, default=math.inf) - fault.t)
    return max(backs)


def summarize(result: chaos.ChaosRun, cpu_s: float, wall_s: float) -> dict:
    out = result.out
    check_exactly_once(out, result.epochs, killed=sum(len(f.pids) for f in result.faults), hosts=result.hosts)
    ended = finals(out)
    checksums = {round(f["checksum"], 9) for f in ended}
    assert len(checksums) == 1, f"the final parameters differ across hosts: {sorted(checksums)}"
    assert len(ended) >= result.hosts, f"{len(ended)} workers finished, of {result.hosts} hosts"
    # Each regroup not made to admit a joiner aborted the step in flight: the steps at which any finished worker
    # recorded one (its members record the same step; a worker that joined late saw only the later ones).
    aborted = {r["step"] for f in ended for r in f["recoveries"] if "admitting" not in r["reason"]}
    committed = max(f["steps"] for f in ended)
    paused = pauses(step_times(out), result.faults)
    events, host_of = events_of(out), {int(p.stem): p.read_text() for p in out.glob("*.pid")}  # read once
    by_kind: dict[str, dict] = {}
    for kind in sorted({f.kind for f in result.faults}):
        mine = [p for p, f in zip(paused, result.faults) if f.kind == kind]
        backs = [back_after(events, host_of, f) for f in result.faults if f.kind == kind]
        by_kind[kind] = {
            "faults": len(mine),
            "pause p50 s": percentile(mine, 50),
            "pause p95 s": percentile(mine, 95),
            "pause p99 s": percentile(mine, 99),
            "pause max s": max(mine),
            "back median s": statistics.median(backs),
        }
    listed = [{"kind": f.kind, "t": f.t, "hosts": f.hosts, "pause s": p} for f, p in zip(result.faults, paused)]
    return {
        "hosts": result.hosts,
        "faults": dict(Counter(f.kind for f in result.faults)),
        "skipped (no host free)": result.skipped,
        "not drawn": result.not_drawn,
        "steps committed": committed,
        "steps attempted": committed + len(aborted),
        "committed fraction": committed / (committed + len(aborted)),
        "by kind": by_kind,
        "pauses": listed,
        "alone by kind": alone_by_kind(listed),
        "clear of partitions by kind": clear_by_kind(listed),
        "cpu used": cpu_s / (wall_s * (os.cpu_count() or 1)),
        "wall s": wall_s,
    }


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    start = min((p["t"] for p in summary["pauses"]), default=0.0)
    for kind in sorted(summary["by kind"]):
        mine = [p for p in summary["pauses"] if p["kind"] == kind]
        ax.scatter([p["t"] - start for p in mine], [p["pause s"] for p in mine], label=kind, s=14)
    ax.set_xlabel("time since the first fault (s)")
    ax.set_ylabel("pause after the fault (s)")
    ax.set_title(f"{summary['hosts']} hosts, {sum(summary['faults'].values())} faults")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.elastic.chaos", description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", type=int, default=8)
    parser.add_argument("--budget", type=float, default=120.0, help="seconds of faults")
    parser.add_argument("--mean", type=float, default=10.0, help="mean seconds between faults")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kinds", nargs="+", default=list(chaos.KINDS), choices=chaos.KINDS)
    parser.add_argument(
        "--epochs", type=int, default=None, help="the job's length (default: the budget's at full speed)"
    )
    parser.add_argument(
        "--store", choices=("tcp", "etcd"), default="tcp", help="the job's store: h0's TCPStore, or etcd on h0-h2"
    )
    parser.add_argument(
        "--results", type=Path, default=Path("bench/results"), help="the folder it writes chaos-<seed>.json and .png in"
    )
    parser.add_argument("--reread", type=Path, help="print an earlier run's summary (its JSON) again, and stop")
    args = parser.parse_args(argv)
    if args.results.suffix in (".json", ".png"):  # refused before a run of many minutes, not after it
        parser.error(f"--results is a folder (chaos-<seed>.json is written in it), not a file: {args.results}")
    if args.reread is not None:
        earlier = json.loads(args.reread.read_text())
        pauses = earlier["pauses"]
        print(
            report(
                earlier | {"alone by kind": alone_by_kind(pauses), "clear of partitions by kind": clear_by_kind(pauses)}
            )
        )
        return 0
    missing = netlab.available() or (etcd_cluster.available() if args.store == "etcd" else None)
    if missing is not None:
        print(f"skipped: {missing}")
        return 1
    began, cpu_before = time.monotonic(), children_cpu()
    result = chaos.run(
        Path(tempfile.mkdtemp(prefix="gschaos")),
        args.hosts,
        args.budget,
        args.mean,
        args.seed,
        args.kinds,
        etcd=args.store == "etcd",
        epochs=args.epochs,
    )
    (result.out / "launchers.log").write_text("\n\n".join(result.logs))  # every worker's lines, for a failure
    (result.out / "faults.json").write_text(json.dumps([dataclasses.asdict(f) for f in result.faults]))
    try:
        summary = summarize(result, children_cpu() - cpu_before, time.monotonic() - began)
    except AssertionError as failed:
        raise AssertionError(f"{failed} (the run's records and launchers.log: {result.out})") from None
    args.results.mkdir(parents=True, exist_ok=True)
    name = f"chaos-{args.seed}" + ("-etcd" if args.store == "etcd" else "")
    write_json(args.results / f"{name}.json", summary | {"store": args.store})
    plot(summary, args.results / f"{name}.png")
    print(report(summary))
    return 0


def report(summary: dict) -> str:
    lines = [
        f"{summary['hosts']} hosts, faults {summary['faults']} ({summary['skipped (no host free)']} skipped: no host "
        f"free), steps committed {summary['steps committed']} of {summary['steps attempted']} attempted "
        f"({summary['committed fraction']:.1%}), CPU used {summary['cpu used']:.0%} of the machine",
        *(f"not drawn: {kind}: {why}" for kind, why in summary["not drawn"].items()),
        f"{'kind':8s} {'faults':>6s} {'p50':>6s} {'p95':>6s} {'p99':>6s} {'max':>6s} {'back':>6s}",
    ]
    for kind, k in summary["by kind"].items():
        lines.append(
            f"{kind:8s} {k['faults']:6d} {k['pause p50 s']:6.2f} {k['pause p95 s']:6.2f} {k['pause p99 s']:6.2f} "
            f"{k['pause max s']:6.2f} {k['back median s']:6.2f}"
        )
    lines.append(f"alone (no partition within {PARTITION_REACH_S:.0f} s before, no other fault in its regroup window):")
    lines.append(f"{'kind':8s} {'alone':>6s} {'p50':>6s} {'p99':>6s} {'max':>6s}")
    for kind, k in summary.get("alone by kind", {}).items():
        lines.append(
            f"{kind:8s} {k['alone']:6d} {k['pause p50 s']:6.2f} {k['pause p99 s']:6.2f} {k['pause max s']:6.2f}"
        )
    lines.append(f"clear of partitions (none begun within {PARTITION_REACH_S:.0f} s before; bursts included):")
    lines.append(f"{'kind':8s} {'faults':>6s} {'p50':>6s} {'p99':>6s} {'max':>6s}")
    for kind, k in summary.get("clear of partitions by kind", {}).items():
        lines.append(
            f"{kind:8s} {k['faults']:6d} {k['pause p50 s']:6.2f} {k['pause p99 s']:6.2f} {k['pause max s']:6.2f}"
        )
    return "\n".join(lines)


def children_cpu() -> float:
    times = os.times()
    return times.children_user + times.children_system + times.user + times.system


if __name__ == "__main__":
    sys.exit(main())
