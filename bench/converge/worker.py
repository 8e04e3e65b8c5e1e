"""One rank of the convergence benchmark (bench/converge/): train one method for a wall-clock budget, evaluate
the validation loss at fixed intervals (the clock paused meanwhile), rank 0 writes the curve as JSON.

Tasks: ``gpt`` is the zoo's GPT-style decoder, character-level, on the source of Python's ``argparse`` module (it
ships with every Python; examples/train_chars.py trains on it too); ``gpt-small`` the same decoder at d = 64, 2
layers, context 32 (113k parameters, ~9 ms a step here: thousands of steps in a minute); ``cnn`` is
examples/train_digits.py's CNN on scikit-learn's handwritten digits.

A local method (DiLoCo, Streaming DiLoCo) is evaluated on a synchronised model only, never one rank's own replica:
DiLoCo right after an outer step (its replicas are the anchor then), Streaming DiLoCo on the average of the
replicas, taken for the evaluation and undone after it (:func:`evaluate_synchronised`).
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

import gradsync
from gradsync import comm
from lab.results import write_json


def gpt_task(rank: int, seed: int = 0, small: bool = False) -> tuple[nn.Module, callable, callable, str]:
    from lab.zoo.workloads import TinyGPT

    text = inspect.getsource(argparse)
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text], dtype=torch.long)
    split = int(0.9 * len(data))
    train, val = data[:split], data[split:]
    ctx = 32 if small else 64
    gen = torch.Generator().manual_seed(1000 + rank + 100 * seed)

    def windows(source: torch.Tensor, n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(0, len(source) - ctx - 1, (n,), generator=g)
        x = torch.stack([source[s : s + ctx] for s in starts])
        return x, torch.stack([source[s + 1 : s + ctx + 1] for s in starts])

    torch.manual_seed(seed)
    model = TinyGPT(vocab=len(chars), d=64, layers=2, ctx=ctx) if small else TinyGPT(vocab=len(chars), ctx=ctx)
    val_batches = [windows(val, 32, torch.Generator().manual_seed(7 + k)) for k in range(8)]
    loss = lambda out, y: nn.functional.cross_entropy(out.flatten(0, 1), y.flatten())  # noqa: E731
    return model, (lambda b: windows(train, b, gen)), _evaluator(model, val_batches, loss), "adamw"


def cnn_task(rank: int) -> tuple[nn.Module, callable, callable, str]:
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))
    val_idx, train_idx = order[:360], order[360:]
    gen = torch.Generator().manual_seed(2000 + rank)

    def batch(b: int) -> tuple[torch.Tensor, torch.Tensor]:
        pick = train_idx[torch.randint(0, len(train_idx), (b,), generator=gen)]
        return images[pick], labels[pick]

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(64 * 4 * 4, 128),
        nn.ReLU(),
        nn.Linear(128, 10),
    )
    val_batches = [(images[val_idx], labels[val_idx])]
    return model, batch, _evaluator(model, val_batches, nn.functional.cross_entropy), "adamw"


def _evaluator(model: nn.Module, batches: list, loss) -> callable:
    def evaluate() -> float:
        model.eval()
        with torch.no_grad():
            value = sum(float(loss(model(x), y)) for x, y in batches) / len(batches)
        model.train()
        return value

    return evaluate


def build(method: str, model: nn.Module, lr: float, warmup: int = 0) -> tuple[nn.Module, torch.optim.Optimizer, object]:
    """(the training module, its optimizer, a DiLoCo, a StreamingDiLoCo or None) for ``method``:
    torch, gradsync, bf16, powersgd, int8, ``diloco<H>[-<wire>]``, ``streaming<H>-p<fragments>-d<delay>[-<wire>]``
    (wire: bf16, int8, int4). Local methods warm up with ``warmup`` synchronous steps."""
    if method == "torch":
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        return ddp, torch.optim.AdamW(model.parameters(), lr=lr), None
    ddp = gradsync.DistributedDataParallel(model)
    outer = None
    if method == "bf16":
        ddp.register_comm_hook(None, comm.bf16_compress_hook)
    elif method == "powersgd":
        ddp.register_comm_hook(
            comm.PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=10), comm.powerSGD_hook
        )
    elif method == "int8":
        ddp.register_comm_hook(comm.QuantizedState(None, bits=8), comm.quantized_hook)
    elif method.startswith("diloco"):
        period, _, wire = method.removeprefix("diloco").partition("-")
        outer = comm.DiLoCo(
            ddp, period=int(period), outer_lr=0.7, momentum=0.9, warmup_steps=warmup, compression=wire or None
        )
    elif method.startswith("streaming"):
        period, fragments, delay, *wire = method.removeprefix("streaming").split("-")
        outer = comm.StreamingDiLoCo(
            ddp,
            period=int(period),
            fragments=int(fragments.removeprefix("p")),
            delay=int(delay.removeprefix("d")),
            outer_lr=0.7,
            momentum=0.9,
            warmup_steps=warmup,
            compression=wire[0] if wire else None,
        )
    return ddp, torch.optim.AdamW(model.parameters(), lr=lr), outer


def main() -> None:
    parser = argparse.ArgumentParser()
    for name, kind, default in (
        ("--task", str, "gpt"),
        ("--method", str, "gradsync"),
        ("--budget", float, 90.0),
        ("--batch", int, 32),
        ("--lr", float, 3e-3),
        ("--eval-every", float, 6.0),
        ("--warmup", int, 0),
        ("--seed", int, 0),
        ("--out", str, ""),
    ):
        parser.add_argument(name, type=kind, default=default)
    args = parser.parse_args()
    info = gradsync.init(timeout=300)
    torch.set_num_threads(1)
    if args.task == "cnn":
        model, batch, evaluate, _ = cnn_task(info.rank)
    else:
        model, batch, evaluate, _ = gpt_task(info.rank, args.seed, small=args.task == "gpt-small")
    ddp, opt, outer = build(args.method, model, args.lr, args.warmup)
    diloco = isinstance(outer, comm.DiLoCo)
    curve, steps, outer_steps, trained, next_eval = [(0.0, evaluate())], 0, 0, 0.0, args.eval_every
    step_times: list[float] = []
    while True:
        start = time.perf_counter()
        x, y = batch(args.batch)
        opt.zero_grad(set_to_none=True)
        loss_fn = nn.functional.cross_entropy
        out = ddp(x)
        loss_fn(out.flatten(0, 1), y.flatten()).backward() if out.dim() == 3 else loss_fn(out, y).backward()
        opt.step()
        took_outer = bool(outer.step()) if outer is not None else False
        outer_steps += took_outer
        steps += 1
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the group's step time: every rank agrees on the clock
        trained += float(elapsed)
        step_times.append(float(elapsed))
        # DiLoCo's replicas are one model only right after an outer step (or during warm-up): evaluate there.
        synced_now = not diloco or took_outer or not outer.local
        if synced_now and (trained >= next_eval or trained >= args.budget):
            curve.append((trained, evaluate_synchronised(model, evaluate, average=outer is not None)))
            next_eval += args.eval_every
            if trained >= args.budget:
                break
    if isinstance(outer, comm.StreamingDiLoCo):
        outer_steps = min(outer.outer_steps)  # full passes over the model: every fragment exchanged this often
    if info.rank == 0:
        result = {"task": args.task, "method": args.method, "steps": steps, "outer_steps": outer_steps}
        result |= {"curve": curve, "step_s": statistics.median(step_times), "seed": args.seed}
        result["outer_bytes"] = getattr(outer, "bytes_sent", 0)
        write_json(args.out, result, indent=None)
    gradsync.shutdown()


@torch.no_grad()
def evaluate_synchronised(model: nn.Module, evaluate: callable, average: bool) -> float:
    """The validation loss of the model every rank agrees on, the clock stopped. ``average``: a local method's
    replicas differ, so the evaluation reads their average, put in place for it and taken out after (training goes
    on from each rank's own replica). Every rank computes it; the value is rank 0's (they are equal)."""
    dist.barrier()
    kept = [p.detach().clone() for p in model.parameters()] if average else []
    if average:
        comm.average_parameters(model)
    value = evaluate()
    for p, mine in zip(model.parameters(), kept):
        p.copy_(mine)
    dist.barrier()
    return value


if __name__ == "__main__":
    main()
