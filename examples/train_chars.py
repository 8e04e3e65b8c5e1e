"""Gradient accumulation with no_sync: a small character-level transformer learns to write Python.

The text is the source of Python's own ``argparse`` module (it ships with every Python). Each optimizer step
accumulates ``--accum`` micro-batches: the first ones run under ``ddp.no_sync()`` (gradients add up locally, nothing
is sent), the last one synchronises, so one all-reduce carries the sum of all of them. The result is the same as a
batch ``--accum`` times larger, with 1/accum of the communication (Li et al., section 3.2.4).

    python examples/train_chars.py                                   # one process
    gradsync run --nproc-per-node 2 examples/train_chars.py          # two processes
    gradsync run --nproc-per-node 2 examples/train_chars.py --accum 8 --steps 300
    gradsync run --nproc-per-node 2 examples/train_chars.py --bf16   # mixed precision: bf16 compute, fp32 weights

With ``--bf16`` the wrapper holds the mixed-precision policy (``mixed_precision=gradsync.MixedPrecision(...)``): the
forward and backward compute in bfloat16 on copies made once per forward, gradients are averaged in float32 and
land in the float32 parameters' ``.grad``, so AdamW steps float32 master weights.
"""

from __future__ import annotations

import argparse
import inspect
import math
import time

import torch
from torch import nn

import gradsync

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--steps", type=int, default=150, help="optimizer steps")
parser.add_argument("--accum", type=int, default=4, help="micro-batches per optimizer step")
parser.add_argument("--batch-size", type=int, default=16, help="sequences per micro-batch, per rank")
parser.add_argument("--context", type=int, default=64)
parser.add_argument("--lr", type=float, default=3e-3)
parser.add_argument("--bf16", action="store_true", help="mixed precision: bf16 compute, fp32 reduction and weights")
args = parser.parse_args()

info = gradsync.init()
torch.set_num_threads(1)
torch.manual_seed(0)

# -------------------------------------------------------------------------------------------- data
text = inspect.getsource(argparse)
chars = sorted(set(text))
encode = {c: i for i, c in enumerate(chars)}
data = torch.tensor([encode[c] for c in text], dtype=torch.long)
split = int(0.9 * len(data))
train, val = data[:split], data[split:]
g = torch.Generator().manual_seed(1000 + info.rank)  # each rank draws its own windows


def windows(source: torch.Tensor, n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    starts = torch.randint(0, len(source) - args.context - 1, (n,), generator=gen)
    x = torch.stack([source[s : s + args.context] for s in starts])
    y = torch.stack([source[s + 1 : s + args.context + 1] for s in starts])
    return x.to(info.device), y.to(info.device)


# -------------------------------------------------------------------------------------------- model
class CharTransformer(nn.Module):
    def __init__(self, vocab: int, d: int = 128, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(args.context, d)
        block = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(args.context), persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        return self.head(self.blocks(h, mask=self.mask, is_causal=True))


model = CharTransformer(len(chars)).to(info.device)
policy = gradsync.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if args.bf16 else None
ddp = gradsync.DistributedDataParallel(model, mixed_precision=policy)
optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
log = print if info.is_main else (lambda *a, **k: None)
log(
    f"{info.world_size} rank(s); {len(text):,} characters, vocabulary {len(chars)}; "
    f"{sum(p.numel() for p in model.parameters()):,} parameters; {args.accum} micro-batches per step"
)


def loss_on(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(ddp(x).float().flatten(0, 1), y.flatten())


# -------------------------------------------------------------------------------------------- train
started = time.perf_counter()
for step in range(args.steps):
    optimizer.zero_grad(set_to_none=True)
    for micro in range(args.accum):
        x, y = windows(train, args.batch_size, g)
        if micro < args.accum - 1:
            with ddp.no_sync():  # accumulate locally: no communication
                (loss_on(x, y) / args.accum).backward()
        else:
            (loss_on(x, y) / args.accum).backward()  # one all-reduce averages the sum of all micro-batches
    optimizer.step()
    if step % 25 == 0 or step == args.steps - 1:
        log(f"step {step:4d}  train loss {loss_on(x, y).item():.3f}")

with torch.no_grad():
    model.eval()
    xv, yv = windows(val, 64, torch.Generator().manual_seed(7))
    val_loss = nn.functional.cross_entropy(model(xv).flatten(0, 1), yv.flatten()).item()
log(
    f"done in {time.perf_counter() - started:.1f}s: validation loss {val_loss:.3f} "
    f"(uniform guessing: {math.log(len(chars)):.3f})"
)
if info.is_main:
    print(f"FINAL_VAL_LOSS {val_loss:.4f} UNIFORM {math.log(len(chars)):.4f}")
gradsync.shutdown()
