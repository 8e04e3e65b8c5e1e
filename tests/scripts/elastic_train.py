"""An elastic job (``gradsync run --elastic``): a small regression over 480 samples, EPOCHS (3) epochs, batch 4 per
rank; DEVICE=cuda puts the model and each batch on this worker's GPU (tests/gpu/: the round's gloo group carries
CUDA tensors through host copies).

Writes into argv[1]: ``<pid>.events`` (one JSON line per committed step: the samples this rank consumed, the time,
its rank, world size and the epoch position the step started at), ``<pid>.final`` (the final parameters' checksum,
loss and recoveries). A worker started with STEP_SLEEP slows each step (so the test has time to kill things
mid-epoch).
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import TensorDataset

import gradsync
from gradsync import elastic

out = Path(sys.argv[1])
if os.environ.get("SWITCH_INTERVAL"):  # tests/conftest.py says why
    sys.setswitchinterval(float(os.environ["SWITCH_INTERVAL"]))
pid = os.getpid()
(out / f"{pid}.pid").write_text(os.environ.get("GRADSYNC_HOST", "?"))
torch.set_num_threads(1)
g = torch.Generator().manual_seed(0)
x = torch.randn(480, 8, generator=g)
data = TensorDataset(x, x @ torch.randn(8, 1, generator=g) + 0.1 * torch.randn(480, 1, generator=g))

if os.environ.get("FORMATION_GATE") == "off":  # the bench's "before": members go straight to init_process_group
    from gradsync.elastic import round_group

    round_group.arrive = lambda store, round_, seconds: None
if os.environ.get("EXIT_BEFORE_FORMING") == os.environ.get("GRADSYNC_HOST"):
    # A second fault inside one regroup window, placed exactly: this worker exits (once: its restart does not) as it
    # reaches the formation gate of a round after the first, so the round was agreed with it and it never arrives.
    from gradsync.elastic import round_group

    arrive, marker = round_group.arrive, out / "exited_before_forming"

    def exit_before_arriving(store, round_, seconds):
        if round_.number > 1 and not marker.exists():
            marker.write_text(str(pid))
            os._exit(1)
        return arrive(store, round_, seconds)

    round_group.arrive = exit_before_arriving

# The lab's "stuck" fault (SIGUSR2, lab/elastic.py's stick): the training thread sleeps for the seconds in
# <pid>.stuck inside its step while its heartbeat thread goes on beating (user code, a data loader or a file system
# hung).
signal.signal(signal.SIGUSR2, lambda *_: time.sleep(float((out / f"{pid}.stuck").read_text())))
job = elastic.init(timeout=float(os.environ.get("ELASTIC_TIMEOUT", "5")))
torch.manual_seed(0)
DEVICE = torch.device(os.environ.get("DEVICE", "cpu"))
if DEVICE.type == "cuda":  # the workers of a host share its GPUs
    DEVICE = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)).to(DEVICE)
ddp = gradsync.DistributedDataParallel(model, bucket_cap_mb=25)
opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
if os.environ.get("EXIT_AT_ADMISSION") == os.environ.get("GRADSYNC_HOST"):
    # A member lost as a restarted worker builds its model: this worker exits (once) as it begins the first round of
    # 3 after the start, the one that admits the restarted worker, so that worker's construction collectives fail.
    rebuild, admitting = ddp.rebuild_for_new_group, out / "exited_at_admission"

    def exit_at_admission():
        if torch.distributed.get_world_size() == 3 and not admitting.exists():
            admitting.write_text(str(pid))
            os._exit(1)
        rebuild()

    ddp.rebuild_for_new_group = exit_at_admission
loader = elastic.ElasticLoader(data, batch_size=4, seed=1)
events = open(out / f"{pid}.events", "a")
# HOOK=counting|bf16 registers a comm hook that counts its calls, HOOK=diloco attaches DiLoCo; MONITOR=1 a Monitor:
# each must survive every regroup, on the survivors and on the worker that joins.
hook_calls = [0]
diloco = gradsync.comm.DiLoCo(ddp, period=4) if os.environ.get("HOOK") == "diloco" else None
if os.environ.get("HOOK") in ("counting", "bf16"):
    reduce = gradsync.comm.allreduce_hook if os.environ["HOOK"] == "counting" else gradsync.comm.bf16_compress_hook

    def counting_hook(state, bucket):
        hook_calls[0] += 1
        return reduce(state, bucket)

    ddp.register_comm_hook(None, counting_hook)
monitor = gradsync.observe.Monitor(ddp, opt) if os.environ.get("MONITOR") else None


# STRAGGLER=h1: that host's worker sleeps 3 x STEP_SLEEP a step (a slower member, which must be kept).
STEP_S = float(os.environ.get("STEP_SLEEP", "0")) * (
    3 if os.environ.get("STRAGGLER") == os.environ.get("GRADSYNC_HOST") else 1
)


def one_step(state, epoch, xb, yb):
    xb, yb = xb.to(DEVICE), yb.to(DEVICE)
    state.optimizer.zero_grad()
    # SLEEP_AT=forward: the step's time is spent before backward, so a kill lands there and the survivors
    # learn of it from a failed all-reduce; by default after it.
    before_backward = os.environ.get("SLEEP_AT") == "forward"
    loss = nn.functional.mse_loss(state.model(xb), yb)
    time.sleep(STEP_S if before_backward else 0)
    loss.backward()
    time.sleep(0 if before_backward else STEP_S)
    indices, before, position = list(state.loader.last_indices), state.steps, state.loader.position
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    try:
        state.step()
        if diloco is not None:
            diloco.step()
    finally:  # a step can be committed and then raise (to admit a joiner): it still counts
        if state.steps > before:
            record = {"epoch": epoch, "position": position, "indices": indices, "t": time.time()}
            events.write(json.dumps(record | {"step": state.steps, "rank": rank, "world": world}) + "\n")
            events.flush()


EPOCHS = int(os.environ.get("EPOCHS", "3"))


@elastic.run
def train(state):
    for epoch in range(state.epoch, EPOCHS):
        state.loader.set_epoch(epoch)
        for xb, yb in state.loader:
            one_step(state, epoch, xb, yb)
        state.epoch = epoch + 1


def train_in_its_own_loop(state):
    """LOOP=guard: the same training, the loop's own shape kept with state.guard()."""
    try:
        state.begin()
        for epoch in range(state.epoch, EPOCHS):
            state.loader.set_epoch(epoch)
            for xb, yb in state.loader:
                with state.guard():
                    one_step(state, epoch, xb, yb)
            state.epoch = epoch + 1
        state.finish()
    except elastic.JobFinished:
        sys.exit(0)


state = elastic.State(job, model=ddp, optimizer=opt, loader=loader, epoch=0)
train_in_its_own_loop(state) if os.environ.get("LOOP") == "guard" else train(state)
if job.finished_without_me:  # (re)started after the others finished: it trained nothing, so it reports nothing
    sys.exit(0)
with torch.no_grad():
    loss = nn.functional.mse_loss(model(data.tensors[0].to(DEVICE)), data.tensors[1].to(DEVICE)).item()
checksum = sum(float(p.detach().double().sum()) * (i + 1) for i, p in enumerate(model.parameters()))
final = {"checksum": checksum, "loss": loss, "recoveries": [r.__dict__ for r in state.recoveries], "steps": state.steps}
final |= {"hook_calls": hook_calls[0], "monitor_steps": len(monitor.steps) if monitor else 0, "pid": pid}
final |= {"diloco_steps": diloco.step_count if diloco else 0}
(out / f"{pid}.final").write_text(json.dumps(final))
job.stop()
