"""``python -m bench.scale``: weak scaling of torch's DDP and gradsync's default on N ranks over H hosts, measured
side by side, and what ``gradsync plan`` predicted for each point.

    python -m bench.scale --model resnet50 --ranks 1,2,4,8,16 --ranks-per-host 2 --link 1gbit --scale 64

Hosts are network namespaces on a bridge (lab/netlab.py), each with its own link shaped to ``--link / --scale``
each way: parameters are ``--scale`` times smaller too (lab/zoo/synthetic.py), so the communication-to-compute ratio
is the unscaled model's on the unscaled link while gloo's CPU work stays small. Ranks on one host share its link
and talk to each other locally. Compute is sleeping (lab/zoo/synthetic.py), so many ranks fit on two cores; every
point records the CPU all ranks used per step, and a point whose ranks used more than ``CPU_BUSY`` of the machine
is flagged: there, waiting for a core may be what was measured.

``--slow-motion K`` runs the same lab K times slower: layer times K times longer and links K times slower, so every
communication-to-compute ratio (and E) is unchanged while the ranks' CPU per second of the step falls K-fold. The
lab's ranks share 2 cores, where a real cluster gives each rank its own; at 16 ranks that sharing, not DDP, sets
the step unless the lab runs slower.

E(N) = step(1) / step(N). The planner's predictions use the link as measured by all-reduces on 4 ranks over 2
hosts (bench/scale/probe.py: per-hop bandwidth and latency), not the nominal rate.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from bench.scale.table import markdown, median_of_runs, medians, summarise
from bench.scale.worker import VARIANTS, torch_caps
from gradsync import planner
from gradsync.reducer.buckets import MIB
from lab import netlab
from lab.ranks import wait_ranks
from lab.results import read_json, write_json
from lab.zoo.synthetic import PROFILES_S, SyntheticModel

ROOT = Path(__file__).resolve().parents[2]
CORES = os.cpu_count() or 1


def _rate(args: argparse.Namespace) -> str:
    """The shaped rate of each host's link: the nominal one divided by the bytes' scale and the slow motion."""
    return f"{planner.parse_rate(args.link) * 8 / args.scale / args.slow_motion / 1e6:.3f}mbit"


def _time_scale(args: argparse.Namespace) -> float:
    return args.time_scale * args.slow_motion


def _delay(args: argparse.Namespace) -> str | None:
    return None if args.delay is None else f"{planner.parse_seconds(args.delay) * args.slow_motion * 1e3:.3f}ms"


def run_point(args: argparse.Namespace, ranks: int, out: Path) -> dict:
    """Start ``ranks`` workers on ceil(ranks / ranks_per_host) namespaces; return rank 0's JSON."""
    hosts = max(1, math.ceil(ranks / args.ranks_per_host))
    base = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "LOCAL_"))}
    base.update({"WORLD_SIZE": str(ranks), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    with netlab.lab(hosts=hosts, rate=_rate(args), delay=_delay(args), prefix="gsscale") as lab:
        procs = []
        for rank in range(ranks):
            host = lab[rank // args.ranks_per_host]
            env = dict(base, RANK=str(rank), LOCAL_RANK=str(rank % args.ranks_per_host), MASTER_ADDR=lab[0].address)
            env.update(MASTER_PORT="29511", GLOO_SOCKET_IFNAME=host.interface)
            argv = [sys.executable, "-m", "bench.scale.worker", "--model", args.model, "--scale", str(args.scale)]
            argv += ["--layers", str(args.layers), "--time-scale", str(_time_scale(args))]
            argv += ["--steps", str(args.steps), "--warmup", str(args.warmup), "--out", str(out)]
            argv += ["--variants", args.variants]
            procs.append(
                subprocess.Popen(host.command(["env", *[f"{k}={v}" for k, v in env.items()], *argv]), cwd=ROOT)
            )
        wait_ranks(procs, args.timeout, "bench.scale")
    result = read_json(out)
    write_json(out, result)  # with this command's provenance, not rank 0's worker's
    return result


def calibrate(args: argparse.Namespace) -> planner.Topology:
    """Per-hop bandwidth and latency as gloo's ring sees them on the lab's links (bench/scale/probe.py)."""
    from bench.scale.probe import probe_ring

    model = SyntheticModel(args.model, scale=args.scale, layers=args.layers, time_scale=_time_scale(args))
    latency_s, bytes_per_s = probe_ring(_rate(args), _delay(args), model.grad_bytes)
    return planner.Topology(1, args.ranks_per_host, bytes_per_s, latency_s, local_bandwidth=2e9, local_latency=1e-4)


def predict(
    args: argparse.Namespace, link: planner.Topology, ranks: int, compute: float = 1.0, limits: list[int] | None = None
) -> float:
    """The planner's step for ``ranks`` with bucket ``limits`` (bytes; default torch's caps, scaled as the lab runs
    them); ``compute`` stretches the prescribed layer times to what one rank measured (sleeps and autograd overhead
    run longer than prescribed), as a timeline recorded by Monitor would."""
    model = SyntheticModel(args.model, scale=args.scale, layers=args.layers, time_scale=_time_scale(args))
    layers = []
    start = 0
    for layer in model.layers:
        nbytes = sum(model.params[i].numel() * 4 for i in range(start, start + len(layer.names)))
        layers.append((nbytes, layer.forward_s * compute, layer.backward_s * compute))
        start += len(layer.names)
    timeline = planner.timeline_from_profile(layers)
    hosts = max(1, math.ceil(ranks / args.ranks_per_host))
    per_host = min(ranks, args.ranks_per_host)
    topology = planner.Topology(hosts, per_host, link.bandwidth, link.latency, link.local_bandwidth, link.local_latency)
    limits = limits or [int(cap * MIB) for cap in torch_caps(args.scale)]
    return planner.predict_step(timeline, topology, 25.0, limits=limits)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="resnet50", choices=sorted(PROFILES_S))
    parser.add_argument("--ranks", default="1,2,4,8,16")
    parser.add_argument("--ranks-per-host", type=int, default=2)
    parser.add_argument("--link", default="1gbit", help="per-host link before scaling")
    parser.add_argument("--delay", default=None, help="netem delay per hop, e.g. 1ms")
    parser.add_argument("--scale", type=float, default=64.0)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--time-scale", type=float, default=1.0)
    parser.add_argument("--slow-motion", type=float, default=1.0, help="run K times slower: layers x K, links / K")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=14)
    parser.add_argument("--variants", default=VARIANTS, help="a subset of " + VARIANTS)
    parser.add_argument("--runs", type=int, default=1, help="runs per point; the table shows their median")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--out", default="bench/results/scale")
    args = parser.parse_args(argv)
    reason = netlab.available()
    if reason:
        raise SystemExit(f"bench.scale needs network namespaces: {reason}")
    folder = Path(args.out)
    folder.mkdir(parents=True, exist_ok=True)
    link = calibrate(args)
    points: list[dict] = []
    compute, forward_one_ms = 1.0, 1.0
    for ranks in [int(n) for n in args.ranks.split(",")]:
        result = median_of_runs(
            [run_point(args, ranks, folder / f"{args.model}-{args.link}-n{ranks}.json") for _ in range(args.runs)]
        )
        default = result["variants"].get("gradsync") or next(iter(result["variants"].values()))
        forward_ms = statistics.median(v["forward_ms"] for v in result["variants"].values())
        if not points:  # the planner's compute timeline: one rank's measured step, no communication
            compute, forward_one_ms = default["median_ms"] / (predict(args, link, 1) * 1e3), forward_ms
        # Compute as the ranks ran it at this N: several ranks share two cores, and the forward (which communicates
        # nothing) shows how much longer their prescribed compute took; a Monitor timeline of this run would too.
        result["compute_stretch"] = forward_ms / forward_one_ms
        stretched = compute * result["compute_stretch"]
        result["predicted_ms"] = predict(args, link, ranks, stretched) * 1e3
        # The default's layout is the tuner's choice, known after the run: priced too, with those caps.
        result["predicted_default_ms"] = predict(args, link, ranks, stretched, default.get("limits")) * 1e3
        result["cpu_busy"] = max(
            v["cpu_s_per_step"] / (v["median_ms"] / 1e3) / CORES for v in result["variants"].values()
        )
        points.append(result)
        print(json.dumps({k: v for k, v in result.items() if k != "variants"} | medians(result)), flush=True)
    summary = summarise(args, link, points)
    name = write_json(folder / f"{args.model}-{args.link}-summary.json", summary)
    print(markdown(summary))
    from bench.scale.plot import plot

    print(f"wrote {name} and {plot(summary, name.with_suffix('.png'))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
