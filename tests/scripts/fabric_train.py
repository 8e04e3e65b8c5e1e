"""Train with Lightning Fabric on 2 CPU processes (``gradsync run``), strategy argv[1] ("ddp" or "gradsync"),
with gradient accumulation through ``fabric.no_backward_sync``; rank 0 saves the weights to argv[2]."""

import sys

import torch
from lightning.fabric import Fabric
from torch import nn

import gradsync.integrations.lightning  # noqa: F401  (registers strategy="gradsync" for Fabric)


def main() -> None:
    strategy, out = sys.argv[1], sys.argv[2]
    fabric = Fabric(strategy=strategy, accelerator="cpu", devices=2)
    fabric.launch()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = fabric.setup(model, optimizer)
    g = torch.Generator().manual_seed(10 + fabric.global_rank)
    for _step in range(3):
        optimizer.zero_grad()
        for micro in range(2):
            x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)
            with fabric.no_backward_sync(model, enabled=micro == 0):
                fabric.backward(nn.functional.mse_loss(model(x), y) / 2)
        optimizer.step()
    if fabric.global_rank == 0:
        torch.save({k: v.clone() for k, v in model.module.state_dict().items()}, out)


if __name__ == "__main__":
    main()
