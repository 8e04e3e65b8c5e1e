"""Writes the launcher's variables and one all-reduce result to OUT_DIR/rank<r>.json."""

import json
import os
import sys

import torch
import torch.distributed as dist

import gradsync

info = gradsync.init()
t = torch.ones(1)
dist.all_reduce(t)
keys = [
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
]
record = {k: os.environ.get(k) for k in keys} | {"sum": t.item(), "info_rank": info.rank}
with open(os.path.join(sys.argv[1], f"rank{info.rank}.json"), "w") as fh:
    json.dump(record, fh)
gradsync.shutdown()
