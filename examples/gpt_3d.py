"""3-D parallelism: a small GPT trained with data, tensor and pipeline parallelism at once, DP = 2 x TP = 2 x PP = 2.

Eight ranks form a mesh ("pp", "dp", "tp"). The model's blocks are cut into two pipeline stages. Within a stage,
each attention and MLP layer is split over "tp" by torch's tensor-parallel plan (column-wise in, row-wise out,
Megatron's layout), and the stage is wrapped in gradsync's DistributedDataParallel over "dp". gradsync's
PipelineStage runs torch's 1F1B schedule over "pp". The text is the source of Python's ``argparse`` module, read
character by character.

    gradsync run --standalone --nproc-per-node 8 examples/gpt_3d.py
    gradsync run --standalone --nproc-per-node 8 examples/gpt_3d.py --ddp torch    # the same run with torch's DDP
    gradsync run --standalone --nproc-per-node 8 examples/gpt_3d.py --ddp gradsync torch    # both, in turn

The last stage's first rank prints each step's loss, averaged over the data-parallel ranks, then a JSON line
``{"ddp": ..., "losses": [...]}`` per run (tests/test_gpt_3d.py compares the two runs' lines).
"""

from __future__ import annotations

import argparse
import inspect
import json

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import Schedule1F1B
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import gradsync
from gradsync.pipelining import PipelineStage

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--batch-size", type=int, default=8, help="sequences per step, per data-parallel rank")
parser.add_argument("--microbatches", type=int, default=4)
parser.add_argument("--context", type=int, default=32)
parser.add_argument("--layers", type=int, default=4, help="transformer blocks, split evenly over the 2 stages")
parser.add_argument(
    "--ddp", nargs="+", choices=("gradsync", "torch"), default=["gradsync"], help="whose DDP wraps each stage"
)
args = parser.parse_args()

torch.set_num_threads(1)
dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
pp, dp = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()


# ------------------------------------------------------------------------------------------------------- model
class Attention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.head_dim = d // heads
        self.q, self.k, self.v, self.out = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # Column-wise q, k, v leave this rank its share of the heads: -1 is that share.
        q, k, v = (proj(x).view(b, t, -1, self.head_dim).transpose(1, 2) for proj in (self.q, self.k, self.v))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc, self.proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(nn.functional.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.attn, self.ln2, self.mlp = nn.LayerNorm(d), Attention(d, heads), nn.LayerNorm(d), MLP(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Embedding(nn.Module):
    def __init__(self, vocab: int, d: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(args.context, d)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.tok(idx) + self.pos(torch.arange(idx.shape[1]))


class Head(nn.Module):
    def __init__(self, vocab: int, d: int) -> None:
        super().__init__()
        self.ln, self.out = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(x))


def stage_module(vocab: int, d: int = 64, heads: int = 4) -> nn.Module:
    """This rank's pipeline stage of the whole model (built whole from one seed, so every rank agrees)."""
    torch.manual_seed(0)
    blocks = [Block(d, heads) for _ in range(args.layers)]
    whole = [Embedding(vocab, d), *blocks, Head(vocab, d)]
    half = 1 + args.layers // 2
    return nn.Sequential(*(whole[:half] if pp == 0 else whole[half:]))


def megatron_plan(module: nn.Module) -> dict:
    """Column-wise into each attention and MLP, row-wise out of it; embeddings, norms and the head stay replicated."""
    layouts = {"attn.q": ColwiseParallel, "attn.k": ColwiseParallel, "attn.v": ColwiseParallel}
    layouts |= {"attn.out": RowwiseParallel, "mlp.fc": ColwiseParallel, "mlp.proj": RowwiseParallel}
    return {name: style() for name, _ in module.named_modules() for end, style in layouts.items() if name.endswith(end)}


# -------------------------------------------------------------------------------------------------------- data
text = inspect.getsource(argparse)
chars = sorted(set(text))
data = torch.tensor([chars.index(c) for c in text], dtype=torch.long)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This data-parallel rank's sequences for ``step`` (the same on its tensor- and pipeline-parallel peers)."""
    g = torch.Generator().manual_seed(1000 * step + dp)
    starts = torch.randint(0, len(data) - args.context - 1, (args.batch_size,), generator=g)
    x = torch.stack([data[s : s + args.context] for s in starts])
    return x, torch.stack([data[s + 1 : s + args.context + 1] for s in starts])


# -------------------------------------------------------------------------------------------------------- train
def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def train(ddp: str) -> list[float]:
    """The whole run with ``ddp``'s DistributedDataParallel over "dp": each step's loss, on the last stage."""
    module = stage_module(len(chars))
    module = parallelize_module(module, mesh["tp"], megatron_plan(module))
    if ddp == "gradsync":
        model, stage_type = gradsync.DistributedDataParallel(module, device_mesh=mesh["dp"]), PipelineStage
    else:
        from torch.distributed.pipelining import PipelineStage as TorchPipelineStage

        model = torch.nn.parallel.DistributedDataParallel(module, device_mesh=mesh["dp"])
        stage_type = TorchPipelineStage
    # Before the first forward: torch's DDP swaps the DTensor parameters for local ones, gone from parameters() after.
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, foreach=False)
    stage = stage_type(model, pp, 2, torch.device("cpu"), group=mesh["pp"].get_group())
    schedule = Schedule1F1B(stage, n_microbatches=args.microbatches, loss_fn=loss_fn)
    curve = []
    for step in range(args.steps):
        x, y = batch(step)
        optimizer.zero_grad()
        losses: list[torch.Tensor] = []
        schedule.step(x) if stage.is_first else schedule.step(target=y, losses=losses)
        optimizer.step()
        if stage.is_last:
            loss = torch.stack(losses).mean().detach()
            dist.all_reduce(loss, group=mesh["dp"].get_group())
            curve.append(loss.item() / mesh["dp"].size())
            if dp == 0 and mesh["tp"].get_local_rank() == 0:
                print(f"{ddp} step {step:3d}  loss {curve[-1]:.4f}", flush=True)
    return curve


for ddp in args.ddp:
    curve = train(ddp)
    if pp == 1 and dp == 0 and mesh["tp"].get_local_rank() == 0:  # the last stage's first rank
        print(json.dumps({"ddp": ddp, "losses": curve}), flush=True)
dist.destroy_process_group()
