"""``python -m bench``: variants side by side, in the same processes, steps interleaved.

    python -m bench --model mlp --variants "local;allreduce;torch;gradsync" --link loopback
    python -m bench --model mlp --variants "torch;gradsync;gradsync:hook=bf16" --link 1gbit   # needs root

``--link loopback`` runs 2 ranks on 127.0.0.1; ``--link RATE`` (e.g. 1gbit) runs each rank in its own network
namespace on a bridge shaped to RATE each way (lab/netlab.py). Results: a JSON file and a table; the table's
ratio column is the median of per-step ratios against the ``torch`` variant. A PNG of the step breakdown is written
beside the JSON.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.table import Table

from bench.sidebyside.plot import plot
from gradsync.reducer.rebuild import TRIAL_PAIRS
from gradsync.testing import free_port
from lab import netlab
from lab.ranks import wait_ranks
from lab.results import read_json, write_json
from lab.zoo.workloads import MODELS

ROOT = Path(__file__).resolve().parents[2]


def _worker_argv(args, out: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "bench.sidebyside.worker",
        "--model",
        args.model,
        "--variants",
        args.variants,
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--batch",
        str(args.batch),
        "--out",
        str(out),
        *(["--compile", args.compile, "--backend", args.backend] if getattr(args, "compile", None) else []),
    ]


def _run_ranks(commands: list[list[str]], envs: list[dict[str, str]], timeout: float) -> None:
    wait_ranks([subprocess.Popen(cmd, env=env, cwd=ROOT) for cmd, env in zip(commands, envs)], timeout, "bench")


def run(args) -> dict:
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "LOCAL_"))}
    base.update({"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    if args.link == "loopback":
        port = str(free_port())
        envs = [
            dict(base, RANK=str(r), LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=port, GLOO_SOCKET_IFNAME="lo")
            for r in range(2)
        ]
        _run_ranks([_worker_argv(args, out)] * 2, envs, args.timeout)
    else:
        reason = netlab.available()
        if reason:
            raise SystemExit(f"bench: --link {args.link} needs network namespaces: {reason}")
        with netlab.lab(hosts=2, rate=args.link, delay=args.delay) as hosts:
            envs = [
                dict(
                    base,
                    RANK=str(h.index),
                    LOCAL_RANK="0",
                    MASTER_ADDR=hosts[0].address,
                    MASTER_PORT="29500",
                    GLOO_SOCKET_IFNAME=h.interface,
                )
                for h in hosts
            ]
            _run_ranks(
                [
                    h.command(["env", *[f"{k}={v}" for k, v in e.items()], *_worker_argv(args, out)])
                    for h, e in zip(hosts, envs)
                ],
                envs,
                args.timeout,
            )
    result = read_json(out) | {"link": args.link}
    write_json(out, result)
    return result


def add_compile_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--compile",
        choices=("outer", "inner"),
        default=None,
        help="compile every variant: outer is torch.compile(DDP(model)), inner is DDP(torch.compile(model)) "
        "(nanoGPT's order); local and allreduce compile the plain model",
    )
    parser.add_argument("--backend", default="inductor", help="torch.compile's backend with --compile")


def table(result: dict) -> Table:
    bound = result.get("overlap_bound_ms")
    title = f"{result['model']} on {result['link']}, batch {result['batch']}, {result['steps']} steps"
    if bound:
        title += f"; overlap bound {bound:.1f} ms"
    if result.get("limit_ms"):
        title += f"; limit {result['limit_ms']:.1f} ms (max of the model alone and the all-reduce alone)"
    if result.get("compile"):
        title += f"; compiled ({result['compile']}, {result['backend']})"
    t = Table(title=title)
    columns = ("variant", "median ms", "vs torch", "vs bound", "x limit", "fwd", "bwd", "exposed", "optim", "MiB sent")
    columns += ("opt MiB",)
    for col in columns:
        t.add_column(col, justify="right")
    for spec, v in result["variants"].items():
        ratio = v.get("ratio_vs_torch")
        t.add_row(
            spec,
            f"{v['median_ms']:.1f}",
            f"{ratio:.3f}" if ratio else "-",
            f"{v['median_ms'] / bound:.2f}" if bound else "-",
            f"{v['x_limit']:.2f}" if "x_limit" in v else "-",
            f"{v['forward_ms']:.1f}",
            f"{v['backward_ms']:.1f}",
            f"{v['exposed_comm_ms']:.1f}" if "exposed_comm_ms" in v else "-",
            f"{v['optimizer_ms']:.1f}",
            f"{v['wire_bytes'] / 2**20:.1f}",
            f"{v.get('optimizer_state_bytes', 0) / 2**20:.1f}",
        )
    return t


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="mlp", help=" | ".join(MODELS))
    parser.add_argument("--variants", default="local;allreduce;torch;gradsync", help="';'-separated specs")
    parser.add_argument("--link", default="loopback", help="loopback, or a tc rate such as 1gbit")
    parser.add_argument("--delay", default=None, help="added one-way delay on shaped links, e.g. 1ms")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument(
        "--warmup",
        type=int,
        default=4 + 2 * TRIAL_PAIRS,
        help="unmeasured rounds first; the default lets gradsync's tuner finish its check (rebuild at step 2, "
        "then 2 x TRIAL_PAIRS alternated steps), so figures are the steady state",
    )
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--out", default="bench/results/latest.json")
    add_compile_arguments(parser)
    args = parser.parse_args(argv)
    result = run(args)
    Console(width=150).print(table(result))
    png = plot(result, Path(args.out).with_suffix(".png"))
    print(f"wrote {args.out}" + (f" and {png}" if png else " (no PNG: matplotlib is not installed)"))
    return 0
