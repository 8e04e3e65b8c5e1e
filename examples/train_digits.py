"""Train a small CNN on scikit-learn's handwritten digits, data-parallel with gradsync.

The dataset (1,797 8×8 images) ships inside scikit-learn: nothing is downloaded. Each rank trains on its own shard;
gradients are averaged during backward, so 2 ranks × batch 32 train exactly like 1 process × batch 64.

    # one process
    python examples/train_digits.py
    # two processes on this machine
    gradsync run --nproc-per-node 2 examples/train_digits.py
    # survive a crashed worker: restart from the last checkpoint
    gradsync run --nproc-per-node 2 --max-restarts 2 examples/train_digits.py --resume
    # two hosts (run on each, with that host's own address; host A at 10.0.0.1 serves the rendezvous)
    gradsync run --nnodes 2 --nproc-per-node 1 --rdzv-endpoint 10.0.0.1:29400 --local-addr 10.0.0.1 \
        examples/train_digits.py

Afterwards rank 0 prints where each step's time went; ``--trace trace.json`` also writes a timeline for
``gradsync report trace.json`` or ui.perfetto.dev.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.distributed as dist
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from torch.utils.data import TensorDataset

import gradsync
from gradsync import checkpoint
from gradsync.observe import Monitor

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--epochs", type=int, default=12)
parser.add_argument("--batch-size", type=int, default=32, help="per rank")
parser.add_argument("--lr", type=float, default=3e-3)
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--out", type=Path, default=Path("runs/digits"), help="checkpoint directory")
parser.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt if it exists")
parser.add_argument("--trace", type=Path, help="write a Chrome-trace timeline of all ranks here")
parser.add_argument("--max-steps", type=int, default=0, help="stop after this many steps (0: no limit)")
args = parser.parse_args()

# -------------------------------------------------------------------------------------------- where am I
info = gradsync.init()
torch.set_num_threads(1)  # ranks share the CPU cores; one thread each avoids oversubscription
console = Console()
log = console.print if info.is_main else (lambda *a, **k: None)
log(f"[bold]gradsync[/] digits: {info.world_size} rank(s), backend {info.backend}, device {info.device}")

# -------------------------------------------------------------------------------------------- data
digits = load_digits()
images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0  # (N, 1, 8, 8) in [0, 1]
labels = torch.tensor(digits.target, dtype=torch.long)
train_idx, test_idx = train_test_split(list(range(len(labels))), test_size=0.2, random_state=0, stratify=digits.target)
train_set = TensorDataset(images[train_idx], labels[train_idx])
test_set = TensorDataset(images[test_idx], labels[test_idx])
loader = gradsync.DistributedLoader(train_set, batch_size=args.batch_size, shuffle=True, seed=args.seed)

# -------------------------------------------------------------------------------------------- model
torch.manual_seed(args.seed)
model = nn.Sequential(
    nn.Conv2d(1, 32, 3, padding=1),
    nn.ReLU(),
    nn.Conv2d(32, 64, 3, padding=1),
    nn.ReLU(),
    nn.MaxPool2d(2),  # 8x8 -> 4x4
    nn.Flatten(),
    nn.Dropout(0.2),
    nn.Linear(64 * 4 * 4, 128),
    nn.ReLU(),
    nn.Linear(128, 10),
).to(info.device)
ddp = gradsync.DistributedDataParallel(model)
optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
monitor = Monitor(ddp, optimizer)

# -------------------------------------------------------------------------------------------- resume
ckpt_path = args.out / "checkpoint.pt"
start_epoch, step = 0, 0
if args.resume and ckpt_path.exists():
    extras = checkpoint.restore(
        checkpoint.load(ckpt_path, map_location=info.device), model=ddp, optimizer=optimizer, loader=loader
    )
    start_epoch, step = extras["epoch"], extras["step"]
    log(f"resumed from {ckpt_path}: epoch {start_epoch}, step {step}")


def evaluate() -> float:
    """Accuracy on the whole test set: each rank scores every world_size-th sample, then one all-reduce."""
    model.eval()
    mine = torch.arange(info.rank, len(test_set), info.world_size)
    x, y = test_set.tensors[0][mine].to(info.device), test_set.tensors[1][mine].to(info.device)
    with torch.no_grad():
        correct_total = torch.tensor([(model(x).argmax(1) == y).sum().item(), len(y)], dtype=torch.float64)
    dist.all_reduce(correct_total)
    model.train()
    return (correct_total[0] / correct_total[1]).item()


# -------------------------------------------------------------------------------------------- train
started = time.perf_counter()


def epoch_bar() -> Progress:
    """One bar per epoch, printed when its epoch ends, so each epoch's line follows its own bar (one Progress for
    every epoch would keep all the bars in rich's live region, below every line printed meanwhile)."""
    columns = (TextColumn("epoch {task.fields[epoch]}"), BarColumn(), MofNCompleteColumn())
    columns += (TextColumn("loss {task.fields[loss]:.3f}"), TimeElapsedColumn())
    return Progress(*columns, console=console, disable=not info.is_main)


accuracy = 0.0
for epoch in range(start_epoch, args.epochs):
    loader.set_epoch(epoch)
    finished_epoch = True
    with epoch_bar() as progress:
        task = progress.add_task("train", total=len(loader), epoch=epoch, loss=float("nan"))
        for x, y in loader:
            x, y = x.to(info.device), y.to(info.device)
            loss = nn.functional.cross_entropy(ddp(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # gradients are averaged across ranks, overlapped with this backward
            optimizer.step()
            step += 1
            progress.update(task, advance=1, loss=loss.item())
            if args.max_steps and step >= args.max_steps:
                finished_epoch = False  # the loader's state records how far into this epoch we got
                break
    accuracy = evaluate()
    next_epoch = epoch + 1 if finished_epoch else epoch
    checkpoint.save(ckpt_path, model=ddp, optimizer=optimizer, loader=loader, epoch=next_epoch, step=step)
    log(f"epoch {epoch}: test accuracy {accuracy:.2%} (checkpoint: {ckpt_path})")
    if args.max_steps and step >= args.max_steps:
        break

log(f"[bold green]done[/]: {step} steps in {time.perf_counter() - started:.1f}s, test accuracy {accuracy:.2%}")
monitor.print_summary(console)
if args.trace:
    monitor.export_chrome_trace(args.trace)
    log(f"timeline: {args.trace} (gradsync report {args.trace})")
if info.is_main:
    print(f"FINAL_ACCURACY {accuracy:.4f}")
gradsync.shutdown()
