"""One rank of ``python -m bench.elastic.overhead``, started by ``gradsync run --elastic``: STEPS steps of a tiny
model whose compute is prescribed (a sleep of COMPUTE_S, so 16 ranks fit on 2 cores), alternating blocks of steps
with the elastic commit (``state.step()``) and blocks with a plain ``optimizer.step()``, and writing each step's
boundary-to-boundary time, by kind, to ``<out>/<rank>.json``."""

import json
import os
import sys
import time
from pathlib import Path

import torch
from torch import nn

import gradsync
from gradsync import elastic

out = Path(sys.argv[1])
steps, compute_s = int(os.environ.get("STEPS", "60")), float(os.environ.get("COMPUTE_S", "0.1"))
BLOCK = 5
torch.set_num_threads(1)
job = elastic.init(timeout=30)
torch.manual_seed(0)
model = nn.Linear(64, 64)
ddp = gradsync.DistributedDataParallel(model, bucket_cap_mb=25)
opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
data = torch.utils.data.TensorDataset(torch.randn(100_000, 64))
loader = elastic.ElasticLoader(data, batch_size=4, seed=0)
times: dict[str, list[float]] = {"elastic": [], "plain": []}


@elastic.run
def train(state):
    state.loader.set_epoch(0)
    last = time.perf_counter()
    for i, (x,) in enumerate(state.loader):
        if i >= steps:
            break
        time.sleep(compute_s)  # the prescribed compute
        state.optimizer.zero_grad()
        state.model(x).square().mean().backward()
        # Blocks of BLOCK steps of each kind: a step's cost can move into the next one (the ranks' skew), so only
        # steps inside a block of their kind are kept (the first of each block is the transition).
        kind = "elastic" if (i // BLOCK) % 2 == 0 else "plain"
        if kind == "elastic":
            state.step()
        else:  # the same step without the elastic commit
            state.optimizer.step()
            state.loader.commit()
            state.steps += 1
        now = time.perf_counter()
        if i % BLOCK:
            times[kind].append(now - last)
        last = now
    return True


state = elastic.State(job, model=ddp, optimizer=opt, loader=loader)
train(state)
rank = torch.distributed.get_rank()
(out / f"{rank}.json").write_text(json.dumps(times | {"recoveries": len(state.recoveries)}))
job.stop()
