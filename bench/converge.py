"""``python -m bench.converge``: methods that send less, judged by the time to reach torch's loss, not step time.

    python -m bench.converge --task gpt --link 1gbit --budget 90
    python -m bench.converge --task gpt --link 100mbit --delay 10ms --budget 90

Each method trains on 2 ranks, each in its own network namespace behind a link shaped to ``--link`` (and
``--delay`` each way), for the same wall-clock budget of training (evaluation pauses the clock). The target is the
validation loss torch's DDP reaches at the end of its budget; a method's time to target is when its validation
curve first reaches it (linearly interpolated between evaluations). Bytes per step are what left rank 0's network
interface, TCP included, over the steps taken.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from bench import netlab
from bench.ranks import wait_ranks

ROOT = Path(__file__).resolve().parents[1]
METHODS = "torch,gradsync,bf16,powersgd,int8,diloco16,diloco64"


def tx_bytes(host: netlab.Host) -> int:
    done = subprocess.run(
        host.command(["cat", f"/sys/class/net/{host.interface}/statistics/tx_bytes"]),
        capture_output=True,
        text=True,
        check=True,
    )
    return int(done.stdout)


def run_method(args: argparse.Namespace, method: str, out: Path) -> dict:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "LOCAL_"))}
    base.update({"WORLD_SIZE": "2", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    with netlab.lab(hosts=2, rate=args.link, delay=args.delay, prefix="gsconv") as hosts:
        sent_before = tx_bytes(hosts[0])
        procs = []
        for h in hosts:
            env = dict(base, RANK=str(h.index), LOCAL_RANK="0", MASTER_ADDR=hosts[0].address, MASTER_PORT="29513")
            env["GLOO_SOCKET_IFNAME"] = h.interface
            argv = [sys.executable, "-m", "bench.converge_worker", "--task", args.task, "--method", method]
            argv += ["--budget", str(args.budget), "--batch", str(args.batch), "--out", str(out)]
            procs.append(subprocess.Popen(h.command(["env", *[f"{k}={v}" for k, v in env.items()], *argv]), cwd=ROOT))
        wait_ranks(procs, args.budget * 6 + 300, f"bench.converge {method}")
        sent = tx_bytes(hosts[0]) - sent_before
    result = json.loads(out.read_text())
    result["bytes_per_step"] = sent / max(1, result["steps"])
    out.write_text(json.dumps(result))
    return result


def time_to(curve: list[list[float]], target: float) -> float | None:
    """When the curve first reaches ``target`` (linear between evaluations); None if it never does."""
    for (t0, l0), (t1, l1) in zip(curve, curve[1:]):
        if l1 <= target:
            return t1 if l0 == l1 else t0 + (t1 - t0) * (l0 - target) / (l0 - l1)
    return None


def summarise(results: dict[str, dict]) -> dict:
    torch_curve = results["torch"]["curve"]
    target, budget = torch_curve[-1][1], torch_curve[-1][0]
    rows = {}
    for method, r in results.items():
        reached = time_to(r["curve"], target)
        rows[method] = {
            "time_to_target_x_torch": None if reached is None else reached / time_to(torch_curve, target),
            "final_loss": r["curve"][-1][1],
            "final_vs_torch": r["curve"][-1][1] / target - 1,
            "bytes_per_step": r["bytes_per_step"],
            "steps": r["steps"],
        }
    return {"target_loss": target, "budget_s": budget, "methods": rows}


def markdown(summary: dict, title: str) -> str:
    lines = [
        f"**{title}**: target = torch's final validation loss {summary['target_loss']:.3f}",
        "",
        "| method | time to target (x torch) | final loss (vs torch) | MiB sent per step | steps |",
        "|---|---:|---:|---:|---:|",
    ]
    for method, r in summary["methods"].items():
        reached = "not reached" if r["time_to_target_x_torch"] is None else f"{r['time_to_target_x_torch']:.2f}"
        lines.append(
            f"| {method} | {reached} | {r['final_loss']:.3f} ({r['final_vs_torch']:+.1%}) | "
            f"{r['bytes_per_step'] / 2**20:.2f} | {r['steps']} |"
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
    parser.add_argument("--task", default="gpt", choices=("gpt", "cnn"))
    parser.add_argument("--methods", default=METHODS)
    parser.add_argument("--link", default="1gbit")
    parser.add_argument("--delay", default=None)
    parser.add_argument("--budget", type=float, default=90.0)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--out", default="bench/results/converge")
    parser.add_argument("--reuse", action="store_true", help="keep the methods already measured in --out")
    args = parser.parse_args(argv)
    reason = netlab.available()
    if reason:
        raise SystemExit(f"bench.converge needs network namespaces: {reason}")
    folder = Path(args.out)
    folder.mkdir(parents=True, exist_ok=True)
    tag = f"{args.task}-{args.link}" + (f"-{args.delay}" if args.delay else "")
    results = {}
    for method in args.methods.split(","):
        path = folder / f"{tag}-{method}.json"
        kept = args.reuse and path.exists() and "bytes_per_step" in json.loads(path.read_text())
        results[method] = json.loads(path.read_text()) if kept else run_method(args, method, path)
    summary = summarise(results)
    title = f"{args.task} on {args.link}" + (f" + {args.delay}" if args.delay else "") + f", {args.budget:g} s budget"
    (folder / f"{tag}-summary.json").write_text(json.dumps(summary, indent=1))
    plot(results, summary, folder / f"{tag}.png", title)
    print(markdown(summary, title))
    return 0


if __name__ == "__main__":
    sys.exit(main())
