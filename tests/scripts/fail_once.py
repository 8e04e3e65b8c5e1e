"""Rank 1 dies in the first attempt, after the group is up; the restarted attempt trains a few steps."""

import os
import sys

import torch
import torch.distributed as dist

dist.init_process_group("gloo")  # plain torch, as a torchrun script would do
rank = dist.get_rank()
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
t = torch.ones(1)
dist.all_reduce(t)
if attempt == 0 and rank == 1:
    print("fail_once: rank 1 crashing on purpose", file=sys.stderr, flush=True)
    os._exit(7)  # a crash; sys.exit with a live gloo group ends in SIGABRT ("terminate called ...")
for _ in range(3):
    dist.all_reduce(t)
print(f"attempt {attempt} rank {rank} done", flush=True)
dist.destroy_process_group()
