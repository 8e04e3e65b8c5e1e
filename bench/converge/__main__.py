"""``python -m bench.converge``: methods that send less, judged by the time to reach torch's loss, not step time.

    M=torch,int8,diloco32,diloco128,streaming32-p4-d2-int4
    python -m bench.converge --link 50mbit --budget 80 --runs 3 --methods $M --out bench/results/converge-lab
    python -m bench.converge --link 400mbit --budget 40 --runs 3 --methods $M --out bench/results/converge-lab

(the first communication-bound, torch 85% on the wire; the second balanced, 42%: README's tables)

Each method trains on 2 ranks, each in its own network namespace behind a link shaped to ``--link`` (and
``--delay`` each way), for the same wall-clock budget of training (evaluation pauses the clock). The target is the
validation loss torch's DDP reaches at the end of its budget; a method's time to target is when its validation
curve first reaches it (linearly interpolated between evaluations), as a multiple of torch's own time to it in the
same run (each method runs ``--runs`` times with seeds 0, 1, ...: the table gives the median and the spread). Bytes
per step are what left rank 0's network interface, TCP included, over the steps taken. A local method is evaluated
on a synchronised model only (bench/converge/worker.py), and a run with fewer than 10 outer steps is flagged: its
figure would be one rank training alone. torch's share of its step spent communicating is 1 - (a local method's
median step, no communication) / (torch's median step).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from lab import netlab
from lab.ranks import wait_ranks
from lab.results import read_json, write_json

ROOT = Path(__file__).resolve().parents[2]
METHODS = "torch,bf16,int8,diloco32,streaming32-p4-d2-int4"
MIN_OUTER_STEPS = 10


def tx_bytes(host: netlab.Host) -> int:
    done = subprocess.run(
        host.command(["cat", f"/sys/class/net/{host.interface}/statistics/tx_bytes"]),
        capture_output=True,
        text=True,
        check=True,
    )
    return int(done.stdout)


def run_method(args: argparse.Namespace, method: str, out: Path, seed: int = 0) -> dict:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "LOCAL_"))}
    base.update({"WORLD_SIZE": "2", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    with netlab.lab(hosts=2, rate=args.link, delay=args.delay, prefix="gsconv") as hosts:
        sent_before = tx_bytes(hosts[0])
        procs = []
        for h in hosts:
            env = dict(base, RANK=str(h.index), LOCAL_RANK="0", MASTER_ADDR=hosts[0].address, MASTER_PORT="29513")
            env["GLOO_SOCKET_IFNAME"] = h.interface
            argv = [sys.executable, "-m", "bench.converge.worker", "--task", args.task, "--method", method]
            argv += ["--budget", str(args.budget), "--batch", str(args.batch), "--out", str(out)]
            argv += ["--warmup", str(args.warmup), "--seed", str(seed), "--eval-every", str(args.eval_every)]
            procs.append(subprocess.Popen(h.command(["env", *[f"{k}={v}" for k, v in env.items()], *argv]), cwd=ROOT))
        wait_ranks(procs, args.budget * 6 + 300, f"bench.converge {method}")
        sent = tx_bytes(hosts[0]) - sent_before
    result = read_json(out)
    result["bytes_per_step"] = sent / max(1, result["steps"])
    write_json(out, result, indent=None)
    return result


def time_to(curve: list[list[float]], target: float) -> float | None:
    """When the curve first reaches ``target`` (linear between evaluations); None if it never does."""
    for (t0, l0), (t1, l1) in zip(curve, curve[1:]):
        if l1 <= target:
            return t1 if l0 == l1 else t0 + (t1 - t0) * (l0 - target) / (l0 - l1)
    return None


def summarise(runs: dict[str, list[dict]]) -> dict:
    """Per method, over the runs: time to torch's final loss (of the same seed) as a multiple of torch's time to it,
    final loss against torch's, bytes per step, steps and outer steps."""
    med = statistics.median
    targets = [r["curve"][-1][1] for r in runs["torch"]]
    rows = {}
    for method, results in runs.items():
        ratios = []
        for r, t, target in zip(results, runs["torch"], targets):
            reached = time_to(r["curve"], target)
            ratios.append(None if reached is None else reached / time_to(t["curve"], target))
        got = [x for x in ratios if x is not None]
        rows[method] = {
            "time_to_target_x_torch": med(got) if len(got) > len(ratios) / 2 else None,
            "ratios": ratios,
            "final_vs_torch": med(r["curve"][-1][1] / target - 1 for r, target in zip(results, targets)),
            "final_loss": med(r["curve"][-1][1] for r in results),
            "bytes_per_step": med(r["bytes_per_step"] for r in results),
            "steps": med(r["steps"] for r in results),
            "outer_steps": med(r.get("outer_steps", 0) for r in results),
            "local": is_local(method),
            "step_s": med(r["step_s"] for r in results),
        }
    local = [row["step_s"] for row in rows.values() if row["local"]]
    comm_share = 1 - med(local) / rows["torch"]["step_s"] if local else None
    return {"target_loss": med(targets), "torch_comm_share": comm_share, "methods": rows}


def is_local(method: str) -> bool:
    return method.startswith(("diloco", "streaming"))


def markdown(summary: dict, title: str) -> str:
    share = summary["torch_comm_share"]
    lines = [
        f"**{title}**: target = torch's final validation loss (median {summary['target_loss']:.3f}); torch spends "
        + (f"{share:.0%} of its step communicating" if share is not None else "? of its step communicating"),
        "",
        "| method | time to target (x torch): median (runs) | final loss vs torch | KiB sent per step | steps | outer "
        "steps |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for method, r in summary["methods"].items():
        runs = ", ".join("-" if x is None else f"{x:.2f}" for x in r["ratios"])
        reached = "not reached" if r["time_to_target_x_torch"] is None else f"{r['time_to_target_x_torch']:.2f}"
        outer = f"{r['outer_steps']:.0f}" if r["local"] else "-"
        if r["local"] and r["outer_steps"] < MIN_OUTER_STEPS:
            outer += f" (under {MIN_OUTER_STEPS}: not DiLoCo)"
        lines.append(
            f"| {method} | {reached} ({runs}) | {r['final_vs_torch']:+.1%} | {r['bytes_per_step'] / 2**10:.1f} | "
            f"{r['steps']:.0f} | {outer} |"
        )
    return "\n".join(lines)


def plot(results: dict[str, dict], summary: dict, out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for method, r in results.items():
        t, loss = zip(*r["curve"])
        ax.plot(t, loss, label=method, linewidth=2 if method == "torch" else 1.2)
    ax.axhline(summary["target_loss"], color="black", linestyle="--", linewidth=0.8, label="target (torch's final)")
    ax.set_xlabel("training seconds (evaluation excluded)")
    ax.set_ylabel("validation loss")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.converge", description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", default="gpt-small", choices=("gpt", "gpt-small", "cnn"))
    parser.add_argument("--methods", default=METHODS)
    parser.add_argument("--link", default="100mbit")
    parser.add_argument("--delay", default=None)
    parser.add_argument("--budget", type=float, default=50.0)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--runs", type=int, default=3, help="runs per method, seeds 0, 1, ...; interleaved")
    parser.add_argument("--warmup", type=int, default=50, help="a local method's synchronous warm-up steps")
    parser.add_argument("--eval-every", type=float, default=2.5, help="training seconds between evaluations")
    parser.add_argument("--out", default="bench/results/converge")
    parser.add_argument("--reuse", action="store_true", help="keep the runs already measured in --out")
    args = parser.parse_args(argv)
    reason = netlab.available()
    if reason:
        raise SystemExit(f"bench.converge needs network namespaces: {reason}")
    folder = Path(args.out)
    folder.mkdir(parents=True, exist_ok=True)
    tag = f"{args.task}-{args.link}" + (f"-{args.delay}" if args.delay else "")
    methods = args.methods.split(",")
    runs: dict[str, list[dict]] = {m: [] for m in methods}
    for seed in range(args.runs):  # interleaved: the machine's noise spreads over every method alike
        for method in methods:
            path = folder / f"{tag}-{method}-seed{seed}.json"
            kept = args.reuse and path.exists() and "bytes_per_step" in read_json(path)
            runs[method].append(read_json(path) if kept else run_method(args, method, path, seed))
    summary = summarise(runs)
    title = f"{args.task} on {args.link}" + (f" + {args.delay}" if args.delay else "") + f", {args.budget:g} s budget"
    write_json(folder / f"{tag}-summary.json", summary)
    plot({m: r[0] for m, r in runs.items()}, summary, folder / f"{tag}.png", title)
    print(markdown(summary, title))
    return 0


if __name__ == "__main__":
    sys.exit(main())
