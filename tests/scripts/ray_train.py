"""gradsync under Ray Train's TorchTrainer (2 CPU workers on a local Ray cluster) against Ray's own prepare_model,
which wraps the model in torch's DDP: each run writes every worker's final parameters into argv[1]. With argv[2],
that script (the docs' Ray block) runs first, as written, on the same local cluster."""

import json
import runpy
import sys

import ray
import torch
from ray.train import ScalingConfig
from ray.train.torch import TorchTrainer, prepare_model
from torch import nn

OUT = sys.argv[1]


def loop(config):
    """Both wrappers in the same workers, one after the other (one TorchTrainer run: each costs ~20 s here)."""
    for wrapper in ("gradsync", "torch"):
        train(wrapper)


def train(wrapper):
    import ray.train

    import gradsync

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    if wrapper == "gradsync":
        model = gradsync.DistributedDataParallel(prepare_model(model, parallel_strategy=None))
    else:
        model = prepare_model(model)  # Ray's own: torch's DDP
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 8, generator=g)
    y = x.sum(1, keepdim=True)
    for _ in range(20):
        opt.zero_grad()
        nn.functional.mse_loss(model(x[rank::world]), y[rank::world]).backward()
        opt.step()
    params = [p.detach().tolist() for p in model.parameters()]
    with open(f"{OUT}/{wrapper}-{rank}.json", "w") as f:
        json.dump(params, f)


ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
if len(sys.argv) > 2:
    runpy.run_path(sys.argv[2], run_name="__main__")
    open(f"{OUT}/docs-block-ran", "w").close()
TorchTrainer(loop, scaling_config=ScalingConfig(num_workers=2, use_gpu=False)).fit()
ray.shutdown()
