"""One real elastic rank whose every store operation is recorded (``python -m bench.store_load --record``, started
by ``gradsync run --elastic``): STEPS steps of a tiny model with a prescribed compute of COMPUTE_S per step; the
last local worker exits at LOSE_AT (when set, and only in its first incarnation), so that the record holds a
regroup too. Writes ``<out>/<member>.json``: the member's number and its operations."""

import json
import os
import sys
import time
from pathlib import Path

import torch
from torch import nn

import gradsync
from bench.store_load.recording import RecordingStore
from gradsync import elastic
from gradsync.store import job_store

out = Path(sys.argv[1])
steps, compute_s = int(os.environ.get("STEPS", "80")), float(os.environ.get("COMPUTE_S", "0.05"))
lose_at = int(os.environ.get("LOSE_AT", "0"))
ops: list = []
opened = job_store.open_stores
job_store.open_stores = lambda where, count, timeout=60.0: [
    RecordingStore(s, ops) for s in opened(where, count, timeout)
]


def save(me: int) -> None:
    (out / f"{me}.json").write_text(json.dumps({"me": me, "ops": [list(vars(op).values()) for op in ops]}))


torch.set_num_threads(1)
job = elastic.init(timeout=10)
last_local = int(os.environ["LOCAL_RANK"]) == int(os.environ["LOCAL_WORLD_SIZE"]) - 1
first_life = os.environ.get("GRADSYNC_ELASTIC_INCARNATION", "0") == "0"
torch.manual_seed(0)
model = nn.Linear(16, 16)
ddp = gradsync.DistributedDataParallel(model)
opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
loader = elastic.ElasticLoader(torch.utils.data.TensorDataset(torch.randn(100_000, 16)), batch_size=4, seed=0)


@elastic.run
def train(state):
    state.loader.set_epoch(0)
    for (x,) in state.loader:
        if state.steps >= steps:
            break
        if lose_at and last_local and first_life and state.steps == lose_at:
            save(job.me)
            os._exit(1)
        time.sleep(compute_s)
        state.optimizer.zero_grad()
        state.model(x).square().mean().backward()
        state.step()
    return True


train(elastic.State(job, model=ddp, optimizer=opt, loader=loader))
job.stop()
save(job.me)
