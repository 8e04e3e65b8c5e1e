"""Trains a small model a few steps with gradsync DDP and saves this rank's parameters to OUT_DIR/rank<r>.pt."""

import os
import sys

import torch
from torch import nn

import gradsync

info = gradsync.init(timeout=60)
torch.manual_seed(info.rank)  # different init per host: DDP must broadcast rank 0's
model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
ddp = gradsync.DistributedDataParallel(model)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
g = torch.Generator().manual_seed(100 + info.rank)  # different data per host
for _ in range(5):
    x, y = torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)
    opt.zero_grad()
    nn.functional.mse_loss(ddp(x), y).backward()
    opt.step()
torch.save({k: v.clone() for k, v in model.state_dict().items()}, os.path.join(sys.argv[1], f"rank{info.rank}.pt"))
print(f"host rank {info.rank} of {info.world_size} done", flush=True)
gradsync.shutdown()
