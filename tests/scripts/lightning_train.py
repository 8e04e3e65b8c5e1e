"""Train a small LightningModule on 2 CPU processes (started by ``gradsync run``) with the strategy named in argv[1]
("ddp" or "gradsync"); rank 0 saves the final weights to argv[2]."""

import sys

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import gradsync.integrations.lightning  # noqa: F401  (registers strategy="gradsync")


class Regressor(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

    def training_step(self, batch, _index):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def main() -> None:
    strategy, out = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g))
    model = Regressor()
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(data, batch_size=8, shuffle=False))
    if trainer.global_rank == 0:
        torch.save({k: v.clone() for k, v in model.state_dict().items()}, out)


if __name__ == "__main__":
    main()
