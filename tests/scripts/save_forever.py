"""Saves a ~40 MB checkpoint over and over to argv[1]; every tensor holds the iteration number."""

import sys

import torch

from gradsync.checkpoint import atomic_torch_save

i = 0
while True:
    atomic_torch_save({"i": i, "weights": torch.full((10_000_000,), float(i))}, sys.argv[1])
    print(f"saved {i}", flush=True)
    i += 1
