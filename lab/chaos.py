"""The chaos lab: an elastic job (``gradsync run --elastic``, tests/scripts/elastic_train.py) on N hosts (network
namespaces, 1 rank each) under faults drawn from a seeded schedule for a wall-clock budget, several in flight at
once; then the job's own records checked as a user would check them. ``python -m bench.elastic.chaos`` reports it.

Faults (on a TCPStore h0 is never a victim: its launcher serves the job's store, and a TCPStore lost ends the job by
design; with ``etcd=True`` the job's store is an etcd cluster of a member on each of h0-h2, and every host is one):

- ``sigkill``: a worker SIGKILLed (its launcher restarts it, and it rejoins);
- ``pair``: two workers on two hosts SIGKILLed ``PAIR_GAP_S`` apart (the second inside the first's regroup);
- ``host``: a host's launcher and worker SIGKILLed together, a fresh launcher started there ``HOST_DOWN_S`` later;
- ``sigstop``: a worker stopped past the heartbeat timeout, then continued (it finds itself left out and rejoins;
  its launcher, which sees it stopped, kills it first after 0.2 s: a shortcut, which ``paused`` does not take);
- ``paused``: a host paused whole, its launcher and worker stopped together past the heartbeat timeout, then
  continued, as a frozen VM is (no launcher sees a stopped worker: back in-process);
- ``stuck``: a worker's training thread asleep inside a step past the timeout, its heartbeat beating on (user code,
  a data loader or a file system hung: it says it stalled, is left out, and rejoins when it wakes);
- ``link``: a host's link down past the heartbeat timeout, then up (its worker rejoins the majority);
- ``split``: two hosts cut off together from the rest past the heartbeat timeout, reaching each other but not the
  store (a split brain: the minority must commit nothing of its own), then healed;
- ``loss``: ``LOSS`` of a host's packets dropped for a while (netem: where the kernel lacks it, not drawn, and the
  run's record says why);
- ``etcd``: an etcd member SIGKILLed and started again ``HOST_DOWN_S`` later, with its data (``etcd=True`` only).

With etcd, one member at most is out at a time (killed, its host lost or cut off), so the cluster keeps its quorum:
a fault that would take a second one out is skipped, as one with no host free is.

"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from lab import etcd_cluster, netlab
from lab.elastic import SAMPLES, events_of, finals, inject, kill_all, launch, launch_on, pause_host, pid_of, stick

KINDS = ("sigkill", "pair", "host", "sigstop", "paused", "stuck", "link", "split", "loss", "etcd")
MEMBERS = 3  # with etcd: a member on each of h0..h2
OUT_OF_REACH = ("host", "link", "split", "etcd")  # kinds that take a host's etcd member out for a while
RATE = "1gbit"  # every host's link
LOSS = "5%"
PAIR_GAP_S = 0.3
HOST_DOWN_S = 2.0
STEP_SLEEP_S = 0.05
TIMEOUT_S = 5.0  # the job's heartbeat (and collective) timeout
SILENT_S = TIMEOUT_S + 2.0  # how long a stopped worker, a downed link or a partition stays so
SILENT_KINDS = ("sigstop", "paused", "stuck", "link", "split")
REJOIN_S = 20.0  # a victim's worker started again, importing torch and admitted, on a loaded machine (~3-10 s)
STALLED_S = 90.0  # no committed step for this long while faults are injected: the run fails


@dataclass
class Fault:
    kind: str
    t: float  # time.time() when it was injected
    hosts: list[str]
    pids: list[int]  # the workers it hit, as they were


@dataclass
class ChaosRun:
    out: Path
    hosts: int
    epochs: int
    faults: list[Fault] = field(default_factory=list)
    skipped: int = 0  # scheduled faults with no host free to take them
    not_drawn: dict[str, str] = field(default_factory=dict)  # kinds this kernel cannot inject, and why
    logs: list[str] = field(default_factory=list)


def schedule(seed: int, budget_s: float, mean_s: float, kinds: Sequence[str]) -> list[tuple[float, str]]:
    """Offsets from the start (exponential gaps of mean ``mean_s``) and kinds, drawn from ``seed`` alone.

    >>> schedule(1, 30, 10, ["sigkill"]) == schedule(1, 30, 10, ["sigkill"])
    True
    """
    rng, t, out = random.Random(seed), 0.0, []
    while True:
        t += rng.expovariate(1.0 / mean_s)
        if t >= budget_s:
            return out
        out.append((t, rng.choice(list(kinds))))


def epochs_for(budget_s: float, hosts: int) -> int:
    """Epochs that keep the job training for the budget and ``REJOIN_S`` more at full size with no fault (a step
    ~STEP_SLEEP_S + 0.02 s), so that it outlasts the faults and the last victim has rejoined before it finishes
    (every host must finish). Under faults it runs longer, less so as regroups got shorter: with a pause of 0.25 s
    a SIGKILL, a job sized for the budget alone once finished while a victim's fresh worker was still importing."""
    steps_per_epoch = SAMPLES // (4 * hosts)
    return max(3, int((budget_s + REJOIN_S) / (STEP_SLEEP_S + 0.02) / steps_per_epoch))


def run(
    tmp: Path,
    hosts: int = 8,
    budget_s: float = 120.0,
    mean_s: float = 10.0,
    seed: int = 0,
    kinds: Sequence[str] = KINDS,
    etcd: bool = False,
    epochs: int | None = None,
) -> ChaosRun:
    """Start the job, inject the schedule's faults while the budget lasts, let the job finish; returns the record.
    ``etcd``: the job's store on an etcd cluster (a member on each of h0-h2) instead of h0's TCPStore; ``epochs``:
    the job's length (default :func:`epochs_for` the budget; a long soak under frequent faults wants fewer)."""
    out = tmp / f"chaos-{seed}"
    out.mkdir()
    result = ChaosRun(out, hosts, epochs or epochs_for(budget_s, hosts))
    if "loss" in kinds and netlab.available(delay=True) is not None:
        result.not_drawn["loss"] = f"netem is needed to drop packets: {netlab.available(delay=True)}"
        kinds = [k for k in kinds if k != "loss"]
    if "etcd" in kinds and not etcd:
        result.not_drawn["etcd"] = "the job's store is h0's TCPStore (etcd=True, --store etcd, draws it)"
        kinds = [k for k in kinds if k != "etcd"]
    variables = {"STEP_SLEEP": str(STEP_SLEEP_S), "ELASTIC_TIMEOUT": str(TIMEOUT_S), "EPOCHS": str(result.epochs)}
    with netlab.lab(hosts=hosts, rate=RATE, prefix="gschaos") as lab, _cluster(out, lab, etcd) as cluster:
        procs = launch(lab, out, variables, store=cluster.url if cluster else None, max_restarts=10_000)
        try:
            _wait_for_steps(out, 10)
            injector = _Injector(lab, procs, out, variables, cluster)
            start = time.monotonic()
            for offset, kind in schedule(seed, budget_s, mean_s, kinds):
                time.sleep(max(0.0, start + offset - time.monotonic()))
                if _job_done(out):
                    break
                _check_not_stalled(out)
                fault = injector.inject(kind, random.Random(f"{seed}-{offset}"))
                if fault is None:
                    result.skipped += 1
                else:
                    result.faults.append(fault)
            injector.settle()
            result.logs = _finish(injector.procs, budget_s + 900, out)  # the epochs left after the faults
        finally:
            kill_all(procs, out)
    return result


def _cluster(out: Path, lab: list, etcd: bool) -> contextlib.AbstractContextManager[etcd_cluster.Cluster | None]:
    return etcd_cluster.cluster(out / "etcd", hosts=lab[:MEMBERS]) if etcd else contextlib.nullcontext()


class _Injector:
    """Injects one fault of a kind on hosts that are free (no fault of theirs still in progress, a worker that
    committed a step since it started); slow faults (a stop, a link down, a host's reboot) run in threads."""

    def __init__(
        self,
        lab: list,
        procs: list[subprocess.Popen],
        out: Path,
        variables: dict[str, str],
        cluster: etcd_cluster.Cluster | None = None,
    ) -> None:
        self.lab, self.procs, self.out, self.variables, self.cluster = lab, procs, out, variables, cluster
        self.busy: set[int] = set()  # host indices with a fault in progress
        self.members_out: set[int] = set()  # etcd members killed, or on a host lost or cut off
        self.hit: dict[int, float] = {}  # host index: when its last fault was injected
        self.lock = threading.Lock()
        self.threads: list[threading.Thread] = []

    def inject(self, kind: str, rng: random.Random) -> Fault | None:
        if kind == "etcd":
            return self._kill_member(rng)
        first = 1 if self.cluster is None else 0  # h0's TCPStore: never a victim
        free = [k for k in range(first, len(self.lab)) if k not in self.busy and self._training(k)]
        count = 2 if kind in ("pair", "split") else 1
        if len(free) < count:
            return None
        chosen = rng.sample(free, count)
        if not self._quorum_kept(kind, chosen):
            return None
        pids = [pid_of(self.out, f"h{k}") for k in chosen]
        fault = Fault(kind, time.time(), [f"h{k}" for k in chosen], pids)
        self.hit.update({k: fault.t for k in chosen})
        if kind in ("sigkill", "pair"):
            for i, pid in enumerate(pids):
                if i:
                    time.sleep(PAIR_GAP_S)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        else:
            self._in_thread(kind, chosen, pids[0])
        return fault

    def _quorum_kept(self, kind: str, chosen: list[int]) -> bool:
        """Whether the etcd cluster keeps its quorum through this fault: at most one member out at a time."""
        if self.cluster is None or kind not in OUT_OF_REACH:
            return True
        return sum(k < MEMBERS for k in chosen) + len(self.members_out) <= 1

    def _kill_member(self, rng: random.Random) -> Fault | None:
        assert self.cluster is not None
        if self.members_out:
            return None
        k = rng.randrange(MEMBERS)
        fault = Fault("etcd", time.time(), [f"h{k}"], [])
        cluster = self.cluster
        self.members_out.add(k)
        cluster.kill(k)

        def back() -> None:
            try:
                time.sleep(HOST_DOWN_S)
                cluster.restart(k)
                cluster.wait_healthy([k])
            finally:
                self.members_out.discard(k)

        self._thread(back, f"chaos-etcd-m{k}")
        return fault

    def _training(self, k: int) -> bool:
        """Host k's newest worker is alive and committed a step since the host's last fault (a victim's replacement
        has rejoined: until it writes its pid, the newest pid is the victim's)."""
        with contextlib.suppress(ValueError, OSError):
            pid = pid_of(self.out, f"h{k}")
            os.kill(pid, 0)
            lines = (self.out / f"{pid}.events").read_text().splitlines()
            return bool(lines) and json.loads(lines[-1])["t"] > self.hit.get(k, 0.0)
        return False

    def _in_thread(self, kind: str, chosen: list[int], pid: int) -> None:
        self.busy.update(chosen)
        members = {k for k in chosen if k < MEMBERS} if self.cluster is not None and kind in OUT_OF_REACH else set()
        self.members_out.update(members)

        def work() -> None:
            try:
                if kind == "host":
                    self._reboot(chosen[0], pid)
                elif kind == "split":
                    with netlab.partition(self.lab, set(chosen)):
                        time.sleep(SILENT_S)
                elif kind == "paused":
                    with self.lock:
                        launcher = self.procs[chosen[0]].pid
                    pause_host(launcher, pid, SILENT_S)
                elif kind == "stuck":
                    stick(self.out, pid, SILENT_S)
                    time.sleep(SILENT_S)  # the host stays busy while its step is stuck
                elif kind == "loss":
                    with netlab.lossy(self.lab[chosen[0]], LOSS, RATE):
                        time.sleep(SILENT_S)
                else:
                    inject(kind, self.lab[chosen[0]], pid, SILENT_S)
            finally:
                self.busy.difference_update(chosen)
                self.members_out.difference_update(members)

        self._thread(work, f"chaos-{kind}-{'-'.join(f'h{k}' for k in chosen)}")

    def _thread(self, work, name: str) -> None:
        thread = threading.Thread(target=work, name=name)
        thread.start()
        self.threads.append(thread)

    def _reboot(self, k: int, pid: int) -> None:
        with self.lock:
            launcher = self.procs[k]
        for victim in (launcher.pid, pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim, signal.SIGKILL)
        if self.cluster is not None and k < MEMBERS:
            self.cluster.kill(k)  # the host's etcd member is lost with it
        launcher.communicate()
        time.sleep(HOST_DOWN_S)
        store = None
        if self.cluster is not None:
            if k < MEMBERS:
                self.cluster.restart(k)
                self.cluster.wait_healthy([k])
            store = self.cluster.url
        fresh = launch_on(self.lab[k], self.lab[0], self.out, self.variables, store, len(self.lab), 10_000)
        with self.lock:
            self.procs[k] = fresh

    def settle(self) -> None:
        for thread in self.threads:
            thread.join()


def _check_not_stalled(out: Path) -> None:
    """Fail now, not at the run's end, when the job committed no step for ``STALLED_S`` (every regroup a fault
    causes takes seconds): a soak once sat 25 minutes, until stopped by hand, on a job that had lost every member
    holding its state."""
    now = time.time()
    silent = now - max((p.stat().st_mtime for p in out.glob("*.events")), default=now)
    if silent > STALLED_S:
        raise AssertionError(
            f"the job committed no step for {silent:.0f}s (its records: {out}; each worker's output is "
            "in the gradsync-run-* folder of the temporary directory, named in its launcher's lines)"
        )


def _job_done(out: Path) -> bool:
    return bool(finals(out))


def _wait_for_steps(out: Path, steps: int, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while max((e["step"] for e in events_of(out)), default=0) < steps:
        if time.monotonic() > deadline:
            raise AssertionError(f"the chaos job made fewer than {steps} steps within {timeout:.0f}s")
        time.sleep(0.2)


def _finish(procs: list[subprocess.Popen], timeout: float, out: Path) -> list[str]:
    """Every launcher's output once all exited (killed at ``timeout``); fails, with their output, once the job
    committed no step for ``STALLED_S`` before it finished: a run stalled after its faults once sat until its
    caller's timeout killed it, and every launcher's output went with it."""
    logs: dict[int, str] = {}

    def read(i: int, p: subprocess.Popen) -> None:
        logs[i] = p.communicate()[0]

    readers = [threading.Thread(target=read, args=(i, p), daemon=True) for i, p in enumerate(procs)]
    for reader in readers:
        reader.start()
    deadline, stalled = time.monotonic() + timeout, None
    while any(r.is_alive() for r in readers) and time.monotonic() < deadline and stalled is None:
        time.sleep(1.0)
        try:
            if not _job_done(out):
                _check_not_stalled(out)
        except AssertionError as exc:
            stalled = exc
    killed = [i for i, p in enumerate(procs) if p.poll() is None]
    for i in killed:
        procs[i].kill()
    for reader in readers:
        reader.join(30)
    still = "\n(killed by the chaos lab: still running)"
    ended = [logs.get(i, "") + (still if i in killed else "") for i in range(len(procs))]
    if stalled is not None:
        raise AssertionError(f"{stalled}\n" + "\n----\n".join(log[-3000:] for log in ended))
    failed = [i for i, p in enumerate(procs) if p.returncode != 0]
    if failed:
        raise AssertionError(f"launchers of h{failed} failed:\n" + "\n----\n".join(ended[i][-3000:] for i in failed))
    return ended
