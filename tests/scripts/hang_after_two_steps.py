"""Two synced steps, then rank 1 hangs without a collective (a stuck data loader, say); rank 0 waits in the next
step's all-reduce. Used to check `gradsync run --watchdog`."""

import time

import torch
from torch import nn

import gradsync

info = gradsync.init(timeout=600)
ddp = gradsync.DistributedDataParallel(nn.Linear(4, 1))
for step in range(100):
    if step == 2 and info.rank == 1:
        while True:
            time.sleep(1)  # stuck_in_data_loading: no progress, no error
    ddp(torch.randn(2, 4)).sum().backward()
