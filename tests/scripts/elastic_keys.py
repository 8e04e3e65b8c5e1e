"""An elastic job of many fast steps (``gradsync run --elastic``): writes the job store's key count after 200
steps and a second, and at the end, into argv[1]/<rank>.keys, so a test can check the store does not grow with
the steps."""

import json
import os
import sys
import time
from pathlib import Path

import torch
from torch import nn

import gradsync
from gradsync import elastic
from gradsync.elastic import keys

out, steps = Path(sys.argv[1]), int(os.environ.get("STEPS", "2000"))
torch.set_num_threads(1)
job = elastic.init(timeout=30)
torch.manual_seed(0)
ddp = gradsync.DistributedDataParallel(nn.Linear(4, 1), bucket_cap_mb=25)
opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
loader = elastic.ElasticLoader(torch.utils.data.TensorDataset(torch.randn(steps * 8, 4)), batch_size=2, seed=0)
counts = []
started = time.monotonic()


@elastic.run
def train(state):
    for i, (x,) in enumerate(state.loader):
        state.optimizer.zero_grad()
        state.model(x).sum().backward()
        state.step()
        # early: past 200 steps and 1 s, so the heartbeat threads made their keys (a beat, the admission counter)
        early = not counts and i >= 200 and time.monotonic() - started > 1.0
        if early or state.steps >= steps:
            # the end's own keys (done, finished) may already be there: another rank can finish first
            counts.append(len([k for k in job.store.list_keys() if k not in (keys.DONE, keys.FINISHED)]))
            if os.environ.get("LIST_KEYS"):
                print(i, sorted(job.store.list_keys()), flush=True)
        if state.steps >= steps:
            break


train(elastic.State(job, model=ddp, optimizer=opt, loader=loader))
(out / f"{torch.distributed.get_rank()}.keys").write_text(json.dumps(counts))
job.stop()
