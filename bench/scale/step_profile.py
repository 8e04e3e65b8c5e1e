"""``python -m bench.scale.step_profile``: where gradsync's reducer spends a backward, by cProfile, on the model
``bench.scale.step_cpu`` measures (one rank, gloo, the scaling lab's synthetic model at 1/128 of its parameters, no
prescribed compute). Printed per step: the torch and gloo calls the reducer makes (the copies, the scaling, the
all-reduces), each with its Python caller, then the reducer's own Python, function by function. cProfile adds a
fixed cost to every Python call, so the Python rows are inflated against the C ones: read them as shares, and
``step_cpu`` for the totals.

    python -m bench.scale.step_profile --model gpt2
    python -m bench.scale.step_profile --model resnet50
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
from collections.abc import Sequence

import torch
import torch.distributed as dist

from bench.scale.step_cpu import SCALE, build_model
from lab.zoo.synthetic import SHAPES

_OURS = "/gradsync/"


def _profile(model: torch.nn.Module, steps: int, warmup: int) -> pstats.Stats:
    x = torch.ones(1, requires_grad=True)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        model(x).backward()

    for _ in range(warmup):
        step()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        step()
    profiler.disable()
    return pstats.Stats(profiler)


def _short(path: str, line: int, name: str) -> str:
    return f"{path.split(_OURS)[-1]}:{line}({name})" if _OURS in path else name


def _rows(stats: pstats.Stats, steps: int) -> tuple[list[tuple[float, str]], list[tuple[float, str]]]:
    """(C calls made from gradsync's frames, by callee and caller; gradsync's own Python, by function), in ms/step."""
    calls: list[tuple[float, str]] = []
    python: list[tuple[float, str]] = []
    for (path, line, name), (_cc, _nc, own, _cum, callers) in stats.stats.items():  # type: ignore[attr-defined]
        if _OURS in path:
            python.append((own / steps * 1e3, _short(path, line, name)))
        elif path == "~":
            for (c_path, c_line, c_name), (_c, _n, c_own, _cum2) in callers.items():
                if _OURS in c_path:
                    calls.append((c_own / steps * 1e3, f"{name} from {_short(c_path, c_line, c_name)}"))
    return sorted(calls, reverse=True), sorted(python, reverse=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.scale.step_profile", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(SHAPES), default="gpt2")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args(argv)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    torch.set_num_threads(1)
    stats = _profile(build_model("gradsync", args.model, SCALE), args.steps, args.warmup)
    calls, python = _rows(stats, args.steps)
    for title, rows in (("torch and gloo calls made by gradsync", calls), ("gradsync's own Python", python)):
        print(f"{title}: {sum(ms for ms, _ in rows):.3f} ms/step under cProfile")
        for ms, what in rows[: args.top]:
            print(f"  {ms:7.3f}  {what}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
