"""gradsync.init() and the GRADSYNC_* variables with garbage, missing or contradictory values (each case runs in a
fresh process, so its environment is its own)."""

from __future__ import annotations

import torch

import gradsync
from conformance.sweep.core import case, ranks
from conformance.sweep.util import setenv
from gradsync.testing import free_port
from lab.zoo.toys import Big

CAT = "environment"
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _init(backend: str | None = None, timeout=None, **env: str | None):
    setenv(**{k: None for k in LAUNCH_VARS})
    setenv(**env)
    info = gradsync.init(backend=backend, timeout=timeout)
    return {"rank": info.rank, "world": info.world_size, "backend": info.backend}


@case("env_rank_without_world_size", CAT, "RANK=1 set, WORLD_SIZE missing, gradsync.init()", ["WORLD_SIZE"])
def _():
    return _init(RANK="1")


@case("env_rank0_without_world_size", CAT, "RANK=0 set, WORLD_SIZE missing, gradsync.init()", ["WORLD_SIZE"])
def _():
    return _init(RANK="0")


@case("env_world_size_without_rank", CAT, "WORLD_SIZE=2 set, RANK missing", ["RANK"])
def _():
    return _init(WORLD_SIZE="2")


@case("env_rank_abc", CAT, "RANK=abc WORLD_SIZE=2", ["RANK", "abc"])
def _():
    return _init(RANK="abc", WORLD_SIZE="2")


@case("env_world_size_abc", CAT, "RANK=0 WORLD_SIZE=two", ["WORLD_SIZE", "two"])
def _():
    return _init(RANK="0", WORLD_SIZE="two")


@case("env_rank_negative", CAT, "RANK=-1 WORLD_SIZE=2", ["RANK", "-1"])
def _():
    return _init(RANK="-1", WORLD_SIZE="2")


@case("env_rank_not_below_world", CAT, "RANK=2 WORLD_SIZE=2", ["RANK", "WORLD_SIZE"])
def _():
    return _init(RANK="2", WORLD_SIZE="2")


@case("env_world_size_zero", CAT, "RANK=0 WORLD_SIZE=0", ["WORLD_SIZE"])
def _():
    return _init(RANK="0", WORLD_SIZE="0")


@case("env_local_rank_abc", CAT, "RANK=0 WORLD_SIZE=1 LOCAL_RANK=x", ["LOCAL_RANK"])
def _():
    return _init(RANK="0", WORLD_SIZE="1", LOCAL_RANK="x")


@case(
    "env_master_port_abc",
    CAT,
    "RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=abc",
    ["MASTER_PORT", "abc"],
)
def _():
    return _init(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="abc", GRADSYNC_TIMEOUT="5")


@case(
    "env_master_port_out_of_range",
    CAT,
    "RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=99999",
    ["MASTER_PORT", "99999"],
)
def _():
    return _init(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="99999", GRADSYNC_TIMEOUT="5")


@case(
    "env_master_addr_unresolvable",
    CAT,
    "RANK=0 WORLD_SIZE=1 MASTER_ADDR=no-such-host.invalid (GRADSYNC_TIMEOUT=5)",
    ["MASTER_ADDR", "no-such-host.invalid"],
    timeout=40,
)
def _():
    port = str(free_port())
    return _init(RANK="0", WORLD_SIZE="1", MASTER_ADDR="no-such-host.invalid", MASTER_PORT=port, GRADSYNC_TIMEOUT="5")


@case(
    "env_peer_never_starts",
    CAT,
    "RANK=0 WORLD_SIZE=2, rank 1 never started (GRADSYNC_TIMEOUT=5): init must fail, naming who is missing",
    ["WORLD_SIZE", ("rank 1", "1/2", "ranks [1]", "1 of 2")],
    timeout=40,
)
def _():
    port = str(free_port())
    return _init(RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port, GRADSYNC_TIMEOUT="5")


for _value in ("abc", "-5", "0", "nan"):

    @case(f"env_timeout_{_value}", CAT, f"GRADSYNC_TIMEOUT={_value}, gradsync.init()", ["GRADSYNC_TIMEOUT", _value])
    def _(value=_value):
        return _init(GRADSYNC_TIMEOUT=value)


@case("init_timeout_negative", CAT, "gradsync.init(timeout=-1)", ["timeout", "-1"])
def _():
    return _init(timeout=-1)


@case(
    "init_backend_nccl_without_cuda", CAT, "gradsync.init(backend='nccl') on a machine without CUDA", ["nccl", "CUDA"]
)
def _():
    if torch.cuda.is_available():
        from conformance.sweep.core import Skip

        raise Skip("CUDA is available here")
    return _init(backend="nccl")


@case("init_backend_garbage", CAT, "gradsync.init(backend='glooo')", ["glooo"])
def _():
    return _init(backend="glooo")


@case(
    "init_twice",
    CAT,
    "gradsync.init() twice: the second returns the same info",
    check=lambda v: None if v[0] == v[1] else f"{v[0]} then {v[1]}",
)
def _():
    return _init(), _init()


@case("env_slurm_procid_garbage", CAT, "SLURM_PROCID=abc SLURM_NTASKS=2 under srun", ["SLURM_PROCID"])
def _():
    return _init(SLURM_PROCID="abc", SLURM_NTASKS="2", SLURM_JOB_NODELIST="localhost")


@case(
    "env_slurm_nodelist_garbage",
    CAT,
    "SLURM_PROCID=0 SLURM_NTASKS=1 SLURM_JOB_NODELIST='gpu[a-b]'",
    ["SLURM_JOB_NODELIST"],
)
def _():
    return _init(SLURM_PROCID="0", SLURM_NTASKS="1", SLURM_JOB_NODELIST="gpu[a-b]", GRADSYNC_TIMEOUT="5")


@case("env_debug_maybe", CAT, "GRADSYNC_DEBUG=maybe, then wrap a model", ["GRADSYNC_DEBUG", "maybe"])
def _():
    _init()
    setenv(GRADSYNC_DEBUG="maybe")
    return repr(gradsync.DistributedDataParallel(torch.nn.Linear(2, 2)))[:50]


def _tuning(rank: int, world: int, value: str | None) -> bool:
    setenv(GRADSYNC_BUCKET_TUNING=value)
    torch.manual_seed(0)
    ddp = gradsync.DistributedDataParallel(Big())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    for _step in range(3):
        opt.zero_grad()
        ddp(torch.randn(8, 256)).pow(2).mean().backward()
        opt.step()
    return ddp.reducer.tuning is None


def _off(results: list) -> str | None:
    return None if all(results) else f"ddp.reducer.tuning is set after 3 steps on ranks {results}: tuning ran"


for _value in ("off", "false", "0", "No"):

    @case(
        f"env_bucket_tuning_{_value}",
        CAT,
        f"GRADSYNC_BUCKET_TUNING={_value}: no tuning (ddp.reducer.tuning is None after 3 steps)",
        check=_off,
    )
    def _(value=_value):
        return ranks(_tuning, value)


@case(
    "env_bucket_tuning_unset_control",
    CAT,
    "GRADSYNC_BUCKET_TUNING unset (control: the tuner does run on this model)",
    check=lambda results: None if not any(results) else "ddp.reducer.tuning is None: the control did not tune",
)
def _():
    return ranks(_tuning, None)


@case("env_bucket_tuning_maybe", CAT, "GRADSYNC_BUCKET_TUNING=maybe", ["GRADSYNC_BUCKET_TUNING", "maybe"])
def _():
    return ranks(_tuning, "maybe", must_fail=(0, 1))
