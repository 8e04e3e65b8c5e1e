"""``gradsync plan``: how far will this model scale on this network, and with which settings? Answered before the
cluster is rented, from a model's backward timeline and the topology.

The model of one step is the bucket-size tuner's (:func:`gradsync.reducer.autotune.predict_finish`): gradients
become ready along the backward timeline, buckets launch in order once full, and one all-reduce runs at a time.
Only the cost of an all-reduce changes with the topology:

- a ring over ``N`` ranks (what gloo runs, and NCCL's ring): ``2 (N-1)`` steps, each moving ``S/N`` bytes over
  every hop at once, so the slowest hop sets the pace: ``2 (N-1) (S / (N B) + a)``, with ``B`` and ``a`` the
  bandwidth and latency of an inter-host hop when there is more than one host;
- hierarchical (hosts with fast local links, as NCCL's tree and 2-D rings do, and gradsync's
  :mod:`gradsync.comm.hierarchical` hook on gloo): reduce-scatter inside each host,
  a ring across the ``H`` hosts with each host's ``S/P`` share per local rank sharing its link, then all-gather
  inside the host: ``2 (P-1) (S / (P b) + a_local) + 2 (H-1) (S / (H B) + a)``.

The step is ``forward + max(backward, end of the last all-reduce) + optimizer``; weak-scaling efficiency is the
one-rank step over the N-rank step. Options it weighs: the bucket cap, bf16 compression (half the bytes) and
``no_sync`` accumulation (one all-reduce per k micro-batches).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from gradsync.errors import ConfigError
from gradsync.reducer import autotune
from gradsync.reducer.buckets import DEFAULT_BUCKET_CAP_MB, MIB


@dataclass(frozen=True)
class Topology:
    """``hosts`` x ``ranks_per_host``; per-hop bandwidth (bytes/s) and latency (s) between and inside hosts."""

    hosts: int
    ranks_per_host: int
    bandwidth: float
    latency: float
    local_bandwidth: float = 50e9
    local_latency: float = 5e-6
    hierarchical: bool = False

    @property
    def ranks(self) -> int:
        return self.hosts * self.ranks_per_host

    def allreduce_seconds(self, nbytes: float) -> float:
        """One all-reduce of ``nbytes`` over every rank (see the module docstring)."""
        return self.link().seconds(int(nbytes))

    def link(self) -> autotune.LinkCost:
        """The all-reduce cost as the tuner's ``latency + bytes / throughput`` line."""
        n, h, p = self.ranks, self.hosts, self.ranks_per_host
        if n == 1:
            return autotune.LinkCost(0.0, float("inf"))
        if not self.hierarchical or h == 1 or p == 1:
            bandwidth, latency = (self.bandwidth, self.latency) if h > 1 else (self.local_bandwidth, self.local_latency)
            return autotune.LinkCost(2 * (n - 1) * latency, bandwidth * n / (2 * (n - 1)))
        local_s_per_byte = 2 * (p - 1) / (p * self.local_bandwidth)
        cross_s_per_byte = 2 * (h - 1) / (h * self.bandwidth)
        latency = 2 * (p - 1) * self.local_latency + 2 * (h - 1) * self.latency
        return autotune.LinkCost(latency, 1.0 / (local_s_per_byte + cross_s_per_byte))


@dataclass(frozen=True)
class Timeline:
    """One rank's step without communication: forward, optimizer, and each gradient's size and ready time (seconds
    from the start of backward), in the order they become ready; ``backward_s`` ends the backward."""

    forward_s: float
    backward_s: float
    optimizer_s: float
    grad_bytes: list[int]
    ready_s: list[float]

    @property
    def total_bytes(self) -> int:
        return sum(self.grad_bytes)


@dataclass(frozen=True)
class Prediction:
    ranks: int
    step_s: float
    efficiency: float
    cap_mb: float
    exposed_comm_s: float
    options: dict[str, float] = field(default_factory=dict)  # option -> predicted step (s)


def predict_step(
    timeline: Timeline,
    topology: Topology,
    cap_mb: float,
    scale_bytes: float = 1.0,
    limits: Sequence[int] | None = None,
) -> float:
    """Seconds per step: forward + the later of backward's end and the last all-reduce's end + optimizer.

    Buckets of ``cap_mb`` after a first one of at most 1 MiB (torch's default layout), or exactly ``limits`` (bytes:
    the first bucket's cap, then the others', as torch's ``bucket_cap_mb_list``)."""
    if topology.ranks == 1:
        return timeline.forward_s + timeline.backward_s + timeline.optimizer_s
    tensors = [torch.empty(max(1, int(b * scale_bytes)), dtype=torch.uint8, device="meta") for b in timeline.grad_bytes]
    if limits is None:
        limits = [min(int(cap_mb * MIB), MIB), int(cap_mb * MIB)]
    order = list(range(len(tensors)))
    end = autotune.predict_finish(tensors, order, timeline.ready_s, limits, topology.link())
    return timeline.forward_s + max(end, timeline.backward_s) + timeline.optimizer_s


def plan(timeline: Timeline, topology: Topology, accumulation: int = 4) -> Prediction:
    """The best bucket cap at this topology, and what bf16 and ``no_sync`` accumulation would give."""
    caps = {cap: predict_step(timeline, topology, cap) for cap in (*autotune.CANDIDATE_CAPS_MB, DEFAULT_BUCKET_CAP_MB)}
    cap = min(caps, key=caps.__getitem__)
    step = caps[cap]
    alone = predict_step(timeline, Topology(1, 1, topology.bandwidth, topology.latency), cap)
    compute = timeline.forward_s + timeline.backward_s + timeline.optimizer_s
    bf16 = predict_step(timeline, topology, cap, scale_bytes=0.5)
    # k micro-batches: k-1 without communication, then one synced; per micro-batch:
    accumulated = ((accumulation - 1) * compute + step) / accumulation
    options = {f"bucket cap {c:g} MiB": s for c, s in caps.items()}
    options.update({"bf16 compression": bf16, f"no_sync x{accumulation} (per micro-batch)": accumulated})
    return Prediction(topology.ranks, step, alone / step, cap, step - compute, options)


# ------------------------------------------------------------------------------------------ timelines
def timeline_from_trace(path: str | Path) -> Timeline:
    """A timeline from a trace written by ``Monitor.export_chrome_trace`` (rank 0's median step). Gradients are
    taken per bucket: its bytes, ready when the bucket was."""
    from gradsync.observe.trace import read_steps

    steps = read_steps(path)[0][1:] or read_steps(path)[0]
    step = steps[len(steps) // 2]
    buckets = sorted(step.buckets, key=lambda b: b.ready)
    return Timeline(
        forward_s=step.forward_end - step.forward_start,
        backward_s=step.backward_end - step.backward_start,
        optimizer_s=max(0.0, step.optimizer_end - step.optimizer_start),
        grad_bytes=[b.nbytes for b in buckets],
        ready_s=[max(0.0, b.ready - step.backward_start) for b in buckets],
    )


def timeline_from_profile(layers: Sequence[tuple[int, float, float]], optimizer_s: float = 0.0) -> Timeline:
    """From ``(grad bytes, forward s, backward s)`` per layer, in forward order: backward runs them in reverse and
    each layer's gradients are ready when its backward ends."""
    _check_profile(layers)
    forward = sum(f for _, f, _ in layers)
    clock, grad_bytes, ready = 0.0, [], []
    for nbytes, _, backward in reversed(layers):
        clock += backward
        grad_bytes.append(nbytes)
        ready.append(clock)
    return Timeline(forward, clock, optimizer_s, grad_bytes, ready)


def _check_profile(layers: Sequence[Sequence[float]]) -> None:
    if not layers:
        raise ConfigError("--profile: the list of layers is empty; give [grad bytes, forward s, backward s] per layer")
    for i, layer in enumerate(layers):
        if len(layer) != 3 or any(not isinstance(v, (int, float)) or v < 0 for v in layer):
            raise ConfigError(
                f"--profile: layer {i} is {list(layer)}; each layer must be [grad bytes, forward s, backward s], "
                "three numbers >= 0"
            )


# ------------------------------------------------------------------------------------------------ CLI
_RATE = re.compile(r"^([\d.]+)\s*([kmgt]?)(bit|bps|b)?$", re.IGNORECASE)


def parse_rate(text: str) -> float:
    """``"1gbit"``, ``"100mbit"``, ``"12.5GB"`` -> bytes per second."""
    match = _RATE.match(text.strip())
    if not match:
        raise ConfigError(f"cannot read the rate {text!r}: write e.g. 1gbit, 100mbit or 12.5GB (bytes per second)")
    value, prefix, unit = match.groups()
    scale = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}[prefix.lower()]
    bits = unit is not None and unit.lower() in ("bit", "bps")
    return float(value) * scale / (8 if bits else 1)


def parse_seconds(text: str) -> float:
    """``"10us"``, ``"0.5ms"``, ``"2e-5"`` -> seconds."""
    for suffix, scale in (("us", 1e-6), ("ms", 1e-3), ("s", 1.0)):
        if text.endswith(suffix):
            return float(text[: -len(suffix)]) * scale
    return float(text)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gradsync plan", description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", help="a trace from Monitor.export_chrome_trace (one rank's measured step)")
    parser.add_argument("--profile", help="JSON list of [grad bytes, forward s, backward s] per layer")
    parser.add_argument("--hosts", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--ranks-per-host", type=int, default=8)
    parser.add_argument("--bandwidth", default="100gbit", help="per-host link, e.g. 10gbit")
    parser.add_argument("--latency", default="10us", help="per hop between hosts")
    parser.add_argument("--local-bandwidth", default="50GB", help="inside a host (NVLink: ~50GB)")
    parser.add_argument(
        "--hierarchical",
        action="store_true",
        help="a topology-aware all-reduce: NCCL's, or gradsync.comm.hierarchical_hook on gloo (its in-host steps cost "
        "CPU this model leaves out: docs/benchmarks.md)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    if any(h < 1 for h in args.hosts):
        raise ConfigError(f"--hosts: every count of hosts must be >= 1, got {args.hosts}")
    if args.ranks_per_host < 1:
        raise ConfigError(f"--ranks-per-host must be >= 1, got {args.ranks_per_host}")
    timeline = _timeline(args)
    rows = []
    for hosts in args.hosts:
        topology = Topology(
            hosts,
            args.ranks_per_host,
            parse_rate(args.bandwidth),
            parse_seconds(args.latency),
            parse_rate(args.local_bandwidth),
            hierarchical=args.hierarchical,
        )
        rows.append(plan(timeline, topology))
    print(json.dumps([r.__dict__ for r in rows], indent=1) if args.json else _table(rows))
    return 0


def _timeline(args: argparse.Namespace) -> Timeline:
    if args.trace:
        return timeline_from_trace(args.trace)
    if args.profile:
        return timeline_from_profile([tuple(x) for x in json.loads(Path(args.profile).read_text())])
    raise ConfigError("give --trace (a Monitor trace of your model) or --profile (per-layer sizes and times)")


def _table(rows: list[Prediction]) -> str:
    lines = ["ranks  step ms  efficiency  best cap  exposed comm ms  bf16 ms  no_sync x4 ms"]
    for r in rows:
        bf16 = r.options["bf16 compression"]
        accum = next(v for k, v in r.options.items() if k.startswith("no_sync"))
        lines.append(
            f"{r.ranks:5d}  {r.step_s * 1e3:7.1f}  {r.efficiency:10.3f}  {r.cap_mb:5g} MiB  "
            f"{r.exposed_comm_s * 1e3:15.1f}  {bf16 * 1e3:7.1f}  {accum * 1e3:13.1f}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
