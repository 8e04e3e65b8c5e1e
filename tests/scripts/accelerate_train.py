"""Train with Hugging Face Accelerate on 2 CPU processes (``gradsync run``), with torch's DDP (argv[1] == "ddp") or
gradsync's (argv[1] == "gradsync", through gradsync_ddp()); rank 0 saves the weights to argv[2]."""

import contextlib
import sys

import torch
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from gradsync.integrations.accelerate import gradsync_ddp


def main() -> None:
    kind, out = sys.argv[1], sys.argv[2]
    with gradsync_ddp() if kind == "gradsync" else contextlib.nullcontext():
        accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(1)
        data = TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g))
        model, optimizer, loader = accelerator.prepare(model, optimizer, DataLoader(data, batch_size=8))
        for x, y in loader:
            with accelerator.accumulate(model):
                accelerator.backward(nn.functional.mse_loss(model(x), y))
                optimizer.step()
                optimizer.zero_grad()
        assert type(model).__module__.startswith("gradsync" if kind == "gradsync" else "torch"), type(model)
        weights = accelerator.unwrap_model(model).state_dict()
    if accelerator.is_main_process:
        torch.save({k: v.clone() for k, v in weights.items()}, out)


if __name__ == "__main__":
    main()
