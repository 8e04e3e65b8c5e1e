"""Where am I? Read rank and world from torchrun/gradsync or SLURM variables, pick backend and device, and
initialise the process group. One call at the top of a training script; also works as a plain single process."""

from __future__ import annotations

import dataclasses
import datetime
import os
import re
import socket

import torch
import torch.distributed as dist

from gradsync import settings
from gradsync.collectives.groups import release_backend_threads
from gradsync.errors import CollectiveError, ConfigError

# Defined in settings, where collectives reads them too; re-exported here for the launcher and the elastic job.
from gradsync.settings import ELASTIC_STORE_VARIABLE as ELASTIC_STORE_VARIABLE
from gradsync.settings import in_elastic_job as in_elastic_job

DEFAULT_TIMEOUT_S = 600.0  # torch's own default for gloo and NCCL; GRADSYNC_TIMEOUT (seconds) overrides


@dataclasses.dataclass(frozen=True)
class DistInfo:
    """What :func:`init` found: this process's place in the job and the device it should use.

    Example::

        info = gradsync.init()   # a DistInfo
        model = gradsync.DistributedDataParallel(model.to(info.device))
        print(f"rank {info.rank} of {info.world_size} ({info.backend}) on {info.device}")
    """

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        """True on global rank 0 (the rank that logs and writes checkpoints)."""
        return self.rank == 0


def expand_slurm_nodelist(nodelist: str) -> list[str]:
    """``"gpu[01-03,7],login"`` → ``["gpu01", "gpu02", "gpu03", "gpu7", "login"]`` (what ``scontrol show
    hostnames`` prints), so the first host can serve as the rendezvous address without calling scontrol."""
    hosts: list[str] = []
    for prefix, ranges, plain in re.findall(r"([^,\[]+)\[([^\]]+)\]|([^,\[\]]+)", nodelist):
        if plain:
            hosts.append(plain)
            continue
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            if not hi:
                hosts.append(prefix + lo)
                continue
            hosts.extend(f"{prefix}{i:0{len(lo)}d}" for i in range(int(lo), int(hi) + 1))
    return hosts


def discover(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The torchrun-style variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT)
    for this process: taken as they are from torchrun/``gradsync run``, mapped from SLURM under ``srun``, or those
    of a lone process."""
    env = dict(os.environ if environ is None else environ)
    if in_elastic_job(env) and "RANK" not in env:
        raise ConfigError(
            "this worker was started by gradsync run --elastic, whose workers have no fixed RANK (they join rounds): "
            "the script must call gradsync.elastic.init() in place of gradsync.init(), and train in a "
            "gradsync.elastic.State (docs/elastic.md). Or run the script without --elastic."
        )
    if ("RANK" in env) != ("WORLD_SIZE" in env):
        have, missing = ("RANK", "WORLD_SIZE") if "RANK" in env else ("WORLD_SIZE", "RANK")
        raise ConfigError(
            f"{have} is set but {missing} is not: a launcher sets both (torchrun, gradsync run). Without "
            f"{missing} every process would train alone as rank 0; set it, or unset {have} for a single process."
        )
    if "RANK" in env and "WORLD_SIZE" in env:
        out: dict[str, str] = {k: env[k] for k in ("RANK", "WORLD_SIZE") if k in env}
        out["LOCAL_RANK"] = env.get("LOCAL_RANK", "0")
        out["LOCAL_WORLD_SIZE"] = env.get("LOCAL_WORLD_SIZE", "1")
        out["MASTER_ADDR"] = env.get("MASTER_ADDR", "127.0.0.1")
        out["MASTER_PORT"] = env.get("MASTER_PORT", "29500")
        return out
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        return _from_slurm(env)
    return {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}


def _from_slurm(env: dict[str, str]) -> dict[str, str]:
    # Checked here, under SLURM's names: an error about RANK would send the user looking for a variable never set.
    for name, minimum in (("SLURM_PROCID", 0), ("SLURM_NTASKS", 1), ("SLURM_LOCALID", 0), ("SLURM_JOB_ID", 0)):
        if env.get(name):
            _int_var(env, name, minimum)
    job_id = int(env.get("SLURM_JOB_ID") or 0)
    ntasks_per_node = env.get("SLURM_NTASKS_PER_NODE", "").split("(")[0]
    return {
        "RANK": env["SLURM_PROCID"],
        "WORLD_SIZE": env["SLURM_NTASKS"],
        "LOCAL_RANK": env.get("SLURM_LOCALID", "0"),
        "LOCAL_WORLD_SIZE": ntasks_per_node or env.get("SLURM_NTASKS", "1"),
        "MASTER_ADDR": env.get("MASTER_ADDR") or _first_slurm_host(env),
        # Same for every task of the job, different between jobs sharing a node (as Lightning derives it).
        "MASTER_PORT": env.get("MASTER_PORT") or str(15000 + job_id % 20000),
    }


def _first_slurm_host(env: dict[str, str]) -> str:
    name = "SLURM_JOB_NODELIST" if env.get("SLURM_JOB_NODELIST") else "SLURM_NODELIST"
    nodelist = env.get(name) or "127.0.0.1"
    try:
        hosts = expand_slurm_nodelist(nodelist)
    except ValueError:
        hosts = []
    if not hosts:
        raise ConfigError(
            f"{name}={nodelist!r} is not a SLURM node list (such as 'gpu[01-04,07],login1'); its first node "
            "would host the rendezvous. Run under srun, which sets it, or set MASTER_ADDR to that node yourself."
        )
    return hosts[0]


def _int_var(found: dict[str, str], name: str, minimum: int) -> int:
    try:
        value = int(found[name])
    except ValueError:
        raise ConfigError(
            f"{name}={found[name]!r} is not an integer (a launcher sets it; check the environment)."
        ) from None
    if value < minimum:
        raise ConfigError(f"{name}={value} must be >= {minimum}.")
    return value


def init(backend: str | None = None, timeout: float | datetime.timedelta | None = None) -> DistInfo:
    """Initialise the default process group from the environment and return where this process stands.

    Picks NCCL when CUDA is available and gloo otherwise, and sets the CUDA device from LOCAL_RANK. Collectives
    fail after ``timeout`` (default: ``GRADSYNC_TIMEOUT`` seconds, else 600 s) instead of hanging. Run without a
    launcher it forms a group of one, so the same script runs on a laptop. Calling it again returns the same info.

    >>> info = gradsync.init()
    >>> model = gradsync.DistributedDataParallel(model.to(info.device))  # doctest: +SKIP
    """
    backend, timeout = _check_backend(backend), _timeout(timeout)
    found = discover()
    rank, world = _int_var(found, "RANK", 0), _int_var(found, "WORLD_SIZE", 1)
    local_rank, local_world = _int_var(found, "LOCAL_RANK", 0), _int_var(found, "LOCAL_WORLD_SIZE", 1)
    if rank >= world:
        raise ConfigError(f"RANK={rank} is not below WORLD_SIZE={world}: ranks are numbered 0 to WORLD_SIZE-1.")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    device = torch.device("cpu")
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise ConfigError("init(backend='nccl') needs CUDA, which is not available; use 'gloo'.")
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    if dist.is_initialized():
        return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, local_world, device, dist.get_backend())
    if world == 1 and "MASTER_ADDR" not in found:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    else:
        _rendezvous(backend, rank, world, timeout, found)
    return DistInfo(rank, world, local_rank, local_world, device, backend)


def _check_backend(backend: str | None) -> str | None:
    """torch answers an unknown name with a bare AssertionError: name it and the choices here."""
    if backend is None:
        return None
    known = [b for b in dist.Backend.backend_list if b not in ("undefined", "fake")]
    # torch's "cpu:gloo,cuda:nccl" form names a backend per device type.
    names = [part.rpartition(":")[2].strip().lower() for part in str(backend).split(",")]
    if not isinstance(backend, str) or not all(n in known for n in names):
        raise ConfigError(
            f"init(backend={backend!r}): unknown backend; use one of {known} (gloo: CPU, nccl: CUDA), or leave "
            "backend=None to pick nccl with CUDA and gloo without."
        )
    return backend


def _timeout(timeout: float | datetime.timedelta | None) -> datetime.timedelta:
    if timeout is None:
        return datetime.timedelta(seconds=settings.timeout_seconds(DEFAULT_TIMEOUT_S))
    seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not settings.is_timeout(seconds):
        raise ConfigError(
            f"init(timeout={timeout!r}): the timeout must be > 0 (seconds, or a datetime.timedelta; at most "
            f"{settings.MAX_SECONDS:.0e}): how long a "
            "collective may wait for the other ranks before failing. Leave it None for GRADSYNC_TIMEOUT or 600 s."
        )
    return datetime.timedelta(seconds=seconds)


def _rendezvous(backend: str, rank: int, world: int, timeout: datetime.timedelta, found: dict[str, str]) -> None:
    """Meet the other ranks at MASTER_ADDR:MASTER_PORT (rank 0 hosts the store there)."""
    addr, port = _master_address(found)
    os.environ.update({"MASTER_ADDR": addr, "MASTER_PORT": str(port)})
    try:
        dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world, timeout=timeout)
    except (dist.DistStoreError, dist.DistNetworkError) as exc:
        raise CollectiveError(_rendezvous_failed(exc, rank, world, f"{addr}:{port}", timeout)) from exc


def _master_address(found: dict[str, str]) -> tuple[str, int]:
    """MASTER_ADDR and MASTER_PORT, checked before torch retries a bad one until the timeout."""
    addr, text = found["MASTER_ADDR"], found["MASTER_PORT"]
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise ConfigError(
            f"MASTER_PORT={text!r} is not a TCP port (0-65535): set it to a free port on rank 0's host, the same "
            "on every rank (a launcher such as gradsync run sets it)."
        )
    try:
        socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ConfigError(
            f"MASTER_ADDR={addr!r} cannot be resolved ({exc.strerror}): set it to the host name or IP address of "
            "rank 0's machine, as every rank can reach it."
        ) from None
    return addr, port


def _rendezvous_failed(exc: Exception, rank: int, world: int, where: str, timeout: datetime.timedelta) -> str:
    seconds = f"{timeout.total_seconds():g}s"
    joined = re.search(r"(\d+)/(\d+) clients joined", str(exc))
    if joined:
        count = int(joined.group(1))
        return (
            f"init: only {count} of {world} ranks (WORLD_SIZE={world}) joined the rendezvous at {where} within "
            f"{seconds}; {world - count} never arrived. Start every rank (RANK 0 to {world - 1}) with the same "
            "MASTER_ADDR and MASTER_PORT, or lower WORLD_SIZE; ranks that start slowly need a longer GRADSYNC_TIMEOUT."
        )
    return (
        f"init: rank {rank} of WORLD_SIZE={world} could not reach rank 0's store at {where} within {seconds} "
        f"({str(exc).rstrip('.')}). Check that rank 0 is running and that MASTER_ADDR and MASTER_PORT point at "
        "it from this host."
    )


def shutdown() -> None:
    """Wait for every rank, destroy the default process group, and let the backend's threads wind down.
    Call at the end of a script (also safe when nothing was initialised).

    Example::

        info = gradsync.init()
        ...                     # train
        gradsync.shutdown()
    """
    if dist.is_initialized():
        try:
            dist.barrier()
        finally:
            dist.destroy_process_group()
    release_backend_threads()
