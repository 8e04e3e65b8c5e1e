"""``gradsync run --elastic``: survivors keep running; only a failed worker is restarted, and it rejoins.

torch elastic's agent restarts the whole worker group on any failure. In elastic mode gradsync still supervises with
torch elastic's process contexts (``torch.distributed.elastic.multiprocessing.start_processes``), one per worker,
so that each can be restarted alone: a restarted worker gets ``GRADSYNC_ELASTIC_REJOIN=1`` and is admitted by the
others at their next step boundary (gradsync/elastic).

Where the job's coordination state lives:

- by default, the node whose ``--local-addr`` is the rendezvous endpoint's host (or the only node) hosts the job's
  store, in this launcher process: the workers coordinate through it, so it outlives any of them. If that node is
  lost, the job cannot coordinate and ends: every other launcher sees its connection closed (or the store
  unreachable for ``GRADSYNC_ELASTIC_STORE_LOST_SECONDS``), stops its workers instead of restarting them against a
  store that is gone, says so in one line, and exits. Restart the job from a checkpoint.
- with ``--store etcd://h1:2379,h2:2379,h3:2379``, on an etcd cluster (under ``gradsync/<--rdzv-id>/``): no
  launcher holds anything the job needs, so the job survives losing any one host, the one that started it
  included. Only the etcd cluster losing its quorum ends it, in the same way.
"""

from __future__ import annotations

import contextlib
import datetime
import glob
import os
import signal
import socket
import time
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std, start_processes

from gradsync.elastic.job_status import (
    MAX_WORLD_VARIABLE,
    WORKER_VARIABLE,
    everyone_finished,
    job_done,
    report_exit,
    state_lost,
)
from gradsync.elastic.keys import REJOIN_VARIABLE
from gradsync.errors import ConfigError
from gradsync.launch.run import exception_line
from gradsync.launch.stopped import STOPPED_VARIABLE, StopWatch
from gradsync.log import log
from gradsync.polling import wait_until
from gradsync.runtime import endpoints, run_flags, store_server
from gradsync.runtime.env import ELASTIC_STORE_VARIABLE
from gradsync.store import job_store

# How often the launcher looks at its workers: a worker's exit is reported to the members this long after it at most,
# which adds to a SIGKILLed worker's pause (docs/elastic.md, "Under chaos"). A look is a waitpid and a /proc read.
POLL_S = 0.05


@dataclass
class Worker:
    """One supervised worker process, restarted alone when it fails."""

    local_rank: int
    node: str
    context: Any = None
    restarts: int = 0
    exit_codes: list[int] = field(default_factory=list)
    done: bool = False

    @property
    def name(self) -> str:
        return f"{self.node}/{self.local_rank}/{self.restarts}"


def _min_nodes(nnodes: str) -> int:
    return int(nnodes.split(":")[0])


def _store(args: Any) -> tuple[str, dist.TCPStore | None]:
    """(where the workers find the job's store, the store if this launcher serves it: on the endpoint's address
    only, gradsync/runtime/store_server.py)."""
    if args.store:
        return job_store.etcd_url(args.store, args.rdzv_id, args.rdzv_conf), None
    host, port = endpoints.split(args.rdzv_endpoint, f"--rdzv-endpoint {args.rdzv_endpoint}", run_flags.RDZV_PORT)
    nodes = run_flags.max_nodes(args.nnodes)
    if not store_server.served_here(host, args.local_addr, elastic=True, nodes=nodes):
        return endpoints.join(host, port), None
    store = store_server.serve(host, port, nodes, datetime.timedelta(seconds=600), wait_for_workers=False)
    return endpoints.join(host, store.port), store


def _start(worker: Worker, cmd: str, cmd_args: tuple, env: dict[str, str], log_dir: str) -> None:
    env = dict(env, LOCAL_RANK=str(worker.local_rank), GRADSYNC_ELASTIC_INCARNATION=str(worker.restarts))
    env[WORKER_VARIABLE] = worker.name
    if worker.restarts:
        env[REJOIN_VARIABLE] = "1"
    logs = DefaultLogsSpecs(log_dir=os.path.join(log_dir, f"worker{worker.local_rank}-{worker.restarts}"), tee=Std.ALL)
    worker.context = start_processes(
        name=f"worker{worker.local_rank}",
        entrypoint=cmd,
        args={0: cmd_args},
        envs={0: env},
        logs_specs=logs,
    )


def run_elastic(args: Any, cmd: str, cmd_args: list[str]) -> int:
    """Start ``--nproc-per-node`` workers here, restart any that fails (up to ``--max-restarts`` each), and return
    once all have finished: 0 if every one ended well."""
    where, store = _store(args)
    nproc = int(args.nproc_per_node)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "LOCAL_"))}
    base.update({ELASTIC_STORE_VARIABLE: where, "WORLD_SIZE": str(_min_nodes(args.nnodes) * nproc)})
    base["LOCAL_WORLD_SIZE"] = str(nproc)
    base[MAX_WORLD_VARIABLE] = str(run_flags.max_nodes(args.nnodes) * nproc)  # admission keeps every batch non-empty
    node = f"{args.local_addr or socket.gethostname()}:{os.getpid()}"
    workers = [Worker(r, node) for r in range(nproc)]
    # A short timeout: this launcher must keep restarting its workers while the store's host is unreachable.
    client = store or job_store.open_store(where, timeout=5.0)
    job = Job(client, where, hosting=store is not None)
    job.refuse_a_finished_name(args)
    watch = StopWatch()
    for w in workers:
        _start(w, cmd, tuple(cmd_args), base, args.log_dir)
    while not all(w.done for w in workers):
        time.sleep(POLL_S)
        job.look()
        if job.lost:
            return _stop_without_store(workers, job)
        for w in workers:
            if not w.done:
                _kill_if_stopped(w, watch, job)
                _poll(w, cmd, tuple(cmd_args), base, args, job)
    if job.lost:  # found when the last worker here exited
        return _stop_without_store(workers, job)
    same_error = _one_error(workers, args.log_dir)
    if store is not None and same_error is None:
        # the other hosts' workers may still read their last keys, and their launchers look for the end
        _wait_for_everyone(store, other_launchers=run_flags.max_nodes(args.nnodes) > 1)
    job.look(again=True)
    # Once the members finished, a worker that failed meanwhile (cut off, then too late to rejoin) costs nothing.
    failed = [] if job.done else [w for w in workers if w.exit_codes and w.exit_codes[-1] != 0]
    _say_why_failed(failed, job, args.log_dir, same_error)
    return 1 if failed else 0


def _one_error(workers: list[Worker], log_dir: str) -> str | None:
    """The error every worker here failed with for good, where it is one and the same (a script that cannot run
    here: the members are not waited for, nothing would change); else None."""
    errors = {_last_error(w, log_dir) if w.exit_codes and w.exit_codes[-1] != 0 else None for w in workers}
    return errors.pop() if len(errors) == 1 else None


def _last_error(worker: Worker, log_dir: str) -> str | None:
    """The ``SomeError: message`` line that ended the worker's last attempt, from its stderr log."""
    folder = os.path.join(log_dir, f"worker{worker.local_rank}-{worker.restarts}")
    logs = glob.glob(os.path.join(folder, "**", "stderr.log"), recursive=True)
    if not logs:
        return None
    with open(logs[0], errors="replace") as fh:
        return exception_line([line.rstrip("\n") for line in fh])


def _say_why_failed(failed: list[Worker], job: Job, log_dir: str, same_error: str | None) -> None:
    if job.state_lost:
        log.error(f"gradsync run --elastic: the job cannot go on: {job.state_lost}")
    if same_error is not None:
        log.error(f"gradsync run --elastic: every worker here failed with the same error: {same_error}")
    for w in failed:
        log.error(
            f"gradsync run --elastic: local worker {w.local_rank} failed for good after {w.restarts} restart(s) "
            f"(exit codes {w.exit_codes}); logs in {log_dir}"
        )


def _stop_without_store(workers: list[Worker], job: Job) -> int:
    """The job's store is lost: no worker here can coordinate, and a restarted one would block connecting to it.
    Stop them all and say so once. Each worker judges the store by the same rule and stops with its own error:
    they are given ``WORKERS_STOP_S`` to say it before they are stopped."""
    running = [w for w in workers if not w.done and w.context is not None]
    pending = list(running)

    def all_stopped() -> bool:  # each exit looked at once (torch logs a failed one at every look)
        pending[:] = [w for w in pending if w.context.wait(timeout=0, period=0.05) is None]
        return not pending

    wait_until(all_stopped, WORKERS_STOP_S)
    for w in running:
        w.context.close()
    log.error(
        f"gradsync run --elastic: {job_store.describe(job.where)} is lost: {job.health.lost}; without it the workers "
        "cannot coordinate. Stopped this node's workers; restart the job from its last checkpoint."
    )
    return 1


WORKERS_STOP_S = 15.0  # an etcd client tries every member for 10 s before its operation fails


def _wait_for_everyone(store: dist.TCPStore, other_launchers: bool, seconds: float = 60.0) -> None:
    """Keep the job's store up until every member of the last round reported its training finished, and then, where
    other nodes' launchers may be running, long enough for them to see it (a one-node job ends at once)."""
    if wait_until(lambda: everyone_finished(store), seconds, pause=0.2, max_pause=0.2) and other_launchers:
        time.sleep(3.0)  # the other launchers look once a second: let them see the end


class Job:
    """What this launcher knows of the job through its store: whether the members finished (then a worker that
    exits is not restarted), looked up about once a second and remembered (the store closes after the end), and
    whether the store itself is lost (``lost``: why, or None)."""

    def __init__(self, store: dist.Store, where: str, hosting: bool) -> None:
        self.store = store
        self.where = where
        self.done = False
        self.state_lost: str | None = None  # why no worker holds the job's state: restart none
        self.health = job_store.StoreHealth()
        self._hosting = hosting  # this launcher serves the store: it cannot lose it
        self._looked = 0.0

    @property
    def lost(self) -> str | None:
        return self.health.lost

    def refuse_a_finished_name(self, args: Any) -> None:
        """An etcd store outlives the job: a job whose name finished there would see itself done at once."""
        if job_store.is_etcd(self.where) and job_done(self.store):
            raise ConfigError(
                f"--rdzv-id {args.rdzv_id}: a job of this name already finished on {args.store}. Give this job a "
                f"name of its own, or delete the old one's keys: etcdctl del --prefix gradsync/{args.rdzv_id}/"
            )

    def look(self, again: bool = False) -> None:
        if self.done or self.lost or self.state_lost or (time.monotonic() - self._looked < 1.0 and not again):
            return
        self._looked = began = time.monotonic()
        try:
            self.done = job_done(self.store)
            self.state_lost = state_lost(self.store)
            self.health.ok()
        except Exception as exc:  # the store's host is gone, or out of reach for now (a link down)
            if not self._hosting:
                self.health.failed(exc, since=began)

    def report_exit(self, worker: Worker) -> None:
        if self.done:  # no member waits for anyone now, and the store may have closed with the job
            return
        began = time.monotonic()
        try:
            report_exit(self.store, worker.name)
        except Exception as exc:  # the members find out by the missing heartbeat instead
            if not self._hosting:
                self.health.failed(exc, since=began)
        self.look(again=True)


def _kill_if_stopped(worker: Worker, watch: StopWatch, job: Job) -> None:
    """gradsync/launch/stopped.py: a worker stopped past the grace is reported and killed; _poll then restarts it.
    Reported first: the members need not wait for the kill's exit to be seen (one more look, POLL_S)."""
    for pid in worker.context.pids().values():
        if watch.overdue(pid, time.monotonic()):
            job.report_exit(worker)
            log.warning(
                f"gradsync run --elastic: local worker {worker.local_rank} (pid {pid}) has been stopped by a signal "
                f"for {watch.grace_s:g} s ({STOPPED_VARIABLE}): killing it, so that the others need not wait out "
                "their timeout; it restarts and rejoins"
            )
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _poll(worker: Worker, cmd: str, cmd_args: tuple, env: dict[str, str], args: Any, job: Job) -> None:
    result = worker.context.wait(timeout=0, period=0.05)
    if result is None:
        return
    code = 0 if not result.is_failed() else next(iter(result.failures.values())).exitcode
    worker.exit_codes.append(code)
    if code != 0:
        job.report_exit(worker)
    worker.context.close()
    if code == 0 or job.done or job.lost or job.state_lost or worker.restarts >= args.max_restarts:
        worker.done = True
        if code != 0 and job.done:
            log.warning(
                f"gradsync run --elastic: local worker {worker.local_rank} exited with {code} after the job "
                "finished: the job succeeded, and nothing is lost"
            )
        return
    worker.restarts += 1
    log.warning(
        f"gradsync run --elastic: local worker {worker.local_rank} exited with {code}; restarting it "
        f"({worker.restarts}/{args.max_restarts}); the others keep training"
    )
    _start(worker, cmd, cmd_args, env, args.log_dir)
