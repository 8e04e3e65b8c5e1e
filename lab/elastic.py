"""The elastic fault lab: a job started with ``gradsync run --elastic`` on 3 hosts (network namespaces) x 1 rank,
running tests/scripts/elastic_train.py, and faults injected into it (SIGKILL, SIGSTOP, a link taken down, the host
of the job's store lost). tests/test_elastic.py asserts on these runs; ``python -m bench.elastic.recovery`` times
them."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from gradsync.elastic import ElasticLoader
from gradsync.testing import free_port
from lab import etcd_cluster, netlab

ROOT = Path(__file__).resolve().parents[1]
SAMPLES, EPOCHS, HOSTS = 480, 3, 3


def launch(
    lab: list, out: Path, env_extra: dict[str, str], store: str | None = None, max_restarts: int = 8
) -> list[subprocess.Popen]:
    """One launcher per host. ``store``: ``--store``'s value (an etcd cluster), else h0's launcher serves it."""
    return [launch_on(host, lab[0], out, env_extra, store, len(lab), max_restarts) for host in lab]


def launch_on(
    host,
    first,
    out: Path,
    env_extra: dict[str, str],
    store: str | None = None,
    nnodes: int = HOSTS,
    max_restarts: int = 8,
) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "LOCAL_"))}
    env.update(GLOO_SOCKET_IFNAME=host.interface, GRADSYNC_HOST=f"h{host.index}", PYTHONPATH=str(ROOT))
    env.update(OMP_NUM_THREADS="1", **env_extra)
    argv = [sys.executable, "-m", "gradsync", "run", "--elastic", "--nnodes", str(nnodes), "--nproc-per-node", "1"]
    argv += ["--max-restarts", str(max_restarts), "--local-addr", host.address]
    if store:  # the job's store is etcd's: no rendezvous endpoint (gradsync run refuses one it would not use)
        argv += ["--store", store, "--rdzv-id", f"lab-{out.name}"]
    else:
        argv += ["--rdzv-endpoint", f"{first.address}:29650"]
    argv += [str(ROOT / "tests" / "scripts" / "elastic_train.py"), str(out)]
    command = host.command(["env", *[f"{k}={v}" for k, v in env.items()], *argv])
    return subprocess.Popen(
        command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )


def launch_on_loopback(
    out: Path, store: str | None, env_extra: dict[str, str], nproc: int = 2, rdzv_conf: str = ""
) -> subprocess.Popen:
    """One launcher with ``nproc`` workers on this host's loopback, the job's store on the etcd cluster ``store``
    (reached as ``rdzv_conf`` says: TLS files, a user), or, with ``store`` None, in the launcher on a free port."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "LOCAL_"))}
    env.update(GLOO_SOCKET_IFNAME="lo", GRADSYNC_HOST="h0", PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **env_extra)
    argv = [sys.executable, "-m", "gradsync", "run", "--elastic", "--nnodes", "1", "--nproc-per-node", str(nproc)]
    argv += ["--max-restarts", "2"]
    if store is None:
        argv += ["--rdzv-endpoint", f"127.0.0.1:{free_port()}"]
    else:
        argv += ["--store", store, "--rdzv-id", f"loopback-{out.name}-{os.getpid()}"]
    argv += ["--rdzv-conf", rdzv_conf] if rdzv_conf else []
    argv += [str(ROOT / "tests" / "scripts" / "elastic_train.py"), str(out)]
    return subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def kill_all(procs: list[subprocess.Popen], out: Path) -> None:
    """Leave no launcher or worker of the run behind (the workers run in sessions of their own), after a failure too."""
    for pid in [p.pid for p in procs] + [int(f.stem) for f in out.glob("*.pid")]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def events_of(out: Path) -> list[dict]:
    found = []
    for path in out.glob("*.events"):
        pid = int(path.stem)
        found += [json.loads(line) | {"pid": pid} for line in path.read_text().splitlines() if line]
    return found


def pid_of(out: Path, host: str) -> int:
    pids = [int(p.stem) for p in out.glob("*.pid") if p.read_text() == host]
    return max(pids, key=lambda pid: (out / f"{pid}.pid").stat().st_mtime)


def wait_steps(out: Path, steps: int, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while max((e["step"] for e in events_of(out)), default=0) < steps:
        assert time.monotonic() < deadline, f"fewer than {steps} steps within {timeout}s"
        time.sleep(0.1)


def finish(procs: list[subprocess.Popen], timeout: float = 240) -> list[str]:
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=timeout)[0])
        except subprocess.TimeoutExpired:
            p.kill()
            logs.append(p.communicate()[0])
    assert all(p.returncode == 0 for p in procs), "\n----\n".join(log[-3000:] for log in logs)
    return logs


def check_exactly_once(out: Path, epochs: int = EPOCHS, killed: int = 0, hosts: int = HOSTS) -> None:
    """Every sample of every epoch was in exactly one committed step's batch on exactly one rank.

    A worker SIGKILLed after its step committed but before it wrote the line leaves a hole in the record, not in
    the training: such a step (the other ranks recorded it with a world size larger than the ranks recorded) gets
    the missing ranks' shares from the loader's own partition. So does a survivor whose all-reduce failed in a step
    another member committed: the next round takes that member's state, so the step counts on every member (its
    gradients were everyone's), though this one never recorded it. At most ``hosts - 1`` per kill injected.
    The converse, a step committed only by members that then left the job's history, is dropped
    (:func:`discarded_steps`).
    """
    recorded = discarded_steps(events_of(out), killed, {int(p.stem) for p in out.glob("*.final")})
    events = recorded + unrecorded_shares(recorded, killed, hosts)
    for epoch in range(epochs):
        counts = Counter(i for e in events if e["epoch"] == epoch for i in e["indices"])
        assert sorted(counts) == list(range(SAMPLES)) and set(counts.values()) == {1}, f"epoch {epoch}"


def discarded_steps(events: list[dict], victims: int, finished: set[int]) -> list[dict]:
    """``events`` less the steps whose update no state of the job kept: a step whose all-reduce completed on some
    members only (gloo's ring ends at different times on each), all of which then left the job's history before
    their next step (killed, or cut off and later rejoining with the others' state), while the survivors failed
    it and did it again (the same step number, in a new round). A step whose members went on to the next step is
    never dropped: two of those are a fork (a worker's last step went on if the worker finished: ``finished``, the
    pids that wrote their ``.final``). At most one rank's record per fault victim."""
    following: dict[int, int] = {}  # id(event): the step its worker recorded next
    for pid in {e["pid"] for e in events}:
        mine = sorted((e for e in events if e["pid"] == pid), key=lambda e: e["t"])
        following.update({id(a): b["step"] for a, b in zip(mine, mine[1:])})
        if pid in finished:
            following[id(mine[-1])] = mine[-1]["step"] + 1
    by_step: dict[tuple, list[dict]] = {}
    for e in events:
        by_step.setdefault((e["epoch"], e["step"], e["position"], e["world"]), []).append(e)
    redone = Counter((epoch, step) for epoch, step, _, _ in by_step)
    dropped = [
        key
        for key, recorded in by_step.items()
        if redone[key[:2]] > 1 and all(following.get(id(e)) != key[1] + 1 for e in recorded)
    ]
    count = sum(len(by_step[key]) for key in dropped)
    assert count <= victims, f"{count} ranks' steps were discarded, {victims} fault victims"
    return [e for key, recorded in by_step.items() if key not in dropped for e in recorded]


def unrecorded_shares(events: list[dict], killed: int, hosts: int = HOSTS) -> list[dict]:
    by_step: dict[tuple, list[dict]] = {}
    for e in events:
        by_step.setdefault((e["epoch"], e["position"], e["world"]), []).append(e)
    filled = []
    for (epoch, position, world), recorded in by_step.items():
        loader = ElasticLoader(range(SAMPLES), batch_size=4, seed=1)
        loader.set_epoch(epoch)
        missing = sorted(set(range(world)) - {e["rank"] for e in recorded})
        filled += [{"epoch": epoch, "indices": loader.share(position, world, r)[0]} for r in missing]
    allowed = killed * (hosts - 1)
    assert len(filled) <= allowed, f"{len(filled)} ranks' committed steps unrecorded, {killed} kills injected"
    return filled


def finals(out: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in out.glob("*.final")]


def first_step_after(out: Path, when: float, pids: list[int]) -> float:
    return min(e["t"] for e in events_of(out) if e["t"] > when and e["pid"] in pids) - when


def paused(out: Path, when: float, pids: list[int], world: int) -> float:
    """From the fault to the survivors' first step in the new world of ``world`` ranks (a step committed just after
    the fault, before the survivors noticed it, does not end the pause)."""
    return min(e["t"] for e in events_of(out) if e["t"] > when and e["pid"] in pids and e["world"] == world) - when


def admission_seconds(out: Path) -> list[float]:
    """How long the members stopped at each step boundary that admitted a worker (a new group, the state sync)."""
    return [r["seconds"] for f in finals(out) for r in f["recoveries"] if r["world_after"] > r["world_before"]]


def recoveries(logs: list[str]) -> str:
    """The workers' recovery lines (who was lost, how it was found: the launcher's report or a heartbeat, and how
    long the new round took): what a pause longer than expected needs explained."""
    return "\n".join(line for log in logs for line in log.splitlines() if "gradsync elastic:" in line)


def scenario(
    tmp_path: Path, fault: str, count: int = 1, epochs: int = EPOCHS, env: dict[str, str] | None = None
) -> dict:
    """``env``: more of the training script's variables (HOOK, MONITOR: see tests/scripts/elastic_train.py)."""
    with lab_job(tmp_path, fault, **{"EPOCHS": str(epochs), **(env or {})}) as (lab, procs, out):
        return inject_and_finish(lab, procs, out, fault, count)


def fault_during_regroup(tmp_path: Path, env: dict[str, str] | None = None) -> dict:
    """Two faults in one regroup window: h1's worker SIGKILLed mid-epoch, and h2's worker exiting as it reaches the
    next round's formation gate (the round was agreed with it: tests/scripts/elastic_train.py's
    EXIT_BEFORE_FORMING). h0's worker is the one survivor; both others restart and rejoin."""
    with lab_job(tmp_path, "during_regroup", **{"EXIT_BEFORE_FORMING": "h2", **(env or {})}) as (_lab, procs, out):
        wait_steps(out, 15)
        survivor, victim = pid_of(out, "h0"), pid_of(out, "h1")
        when = time.time()
        os.kill(victim, signal.SIGKILL)
        wait_after(out, when, [survivor])
        logs = finish(procs)
        second = int((out / "exited_before_forming").read_text())
        faults = [("h1", victim, when), ("h2", second, when)]
        return {"out": out, "survivors": [survivor], "faults": faults, "logs": logs}


def store_host_lost(tmp_path: Path, wait: float = 60.0) -> dict:
    """The host serving the job's store lost: h0's launcher (which serves it) and its worker SIGKILLed mid-epoch.
    Returns, for the other two launchers, how long each took to end after the kill, its exit code and its output."""
    with lab_job(tmp_path, "store_host") as (_lab, procs, out):
        wait_steps(out, 15)
        worker = pid_of(out, "h0")
        when = time.monotonic()
        os.kill(procs[0].pid, signal.SIGKILL)
        os.kill(worker, signal.SIGKILL)
        ended = {}
        for host, p in zip(("h1", "h2"), procs[1:]):
            try:
                output = p.communicate(timeout=max(1.0, wait - (time.monotonic() - when)))[0]
            except subprocess.TimeoutExpired:
                p.kill()
                output = p.communicate()[0] + "\n(killed by the lab: still running)"
            ended[host] = {"seconds": time.monotonic() - when, "code": p.returncode, "output": output}
        return ended


def any_host_lost(tmp_path: Path, fault: str = "host", down_s: float | None = None) -> dict:
    """The job on an etcd cluster of 3 members, one per host, and h0 (which started it) lost mid-epoch: ``fault``
    "host": its launcher, worker and etcd member SIGKILLed, then, after ``down_s``, the host "rebooted" (its etcd
    member restarted with its data, a fresh launcher; 3 s: the replacement must arrive while the job runs); "link":
    its link down for ``down_s`` (8 s: past the heartbeat timeout).

    The "host" job runs twice the usual epochs: the rebooted h0 trains again 8-9 s after the kill here, and with 3
    epochs the job ended 0.5-2 s after that (on a loaded CI machine once before it: h0 then has nothing to report).
    The returned ``epochs`` is the job's."""
    down_s = down_s if down_s is not None else (3.0 if fault == "host" else 8.0)
    epochs = 2 * EPOCHS if fault == "host" else EPOCHS
    out = tmp_path / f"any_host_{fault}"
    out.mkdir()
    with netlab.lab(hosts=HOSTS, rate="1gbit", prefix="gselastic") as lab:
        with etcd_cluster.cluster(tmp_path / f"etcd_{fault}", hosts=lab) as etcd:
            variables = {"STEP_SLEEP": "0.05", "ELASTIC_TIMEOUT": "5", "EPOCHS": str(epochs)}
            procs = launch(lab, out, variables, store=etcd.url)
            try:
                wait_steps(out, 15)
                survivors = [pid_of(out, "h1"), pid_of(out, "h2")]
                victim = pid_of(out, "h0")
                when = time.time()
                if fault == "host":
                    for pid in (procs[0].pid, victim):
                        os.kill(pid, signal.SIGKILL)
                    etcd.kill(0)
                    procs[0].communicate()
                    wait_after(out, when, survivors)
                    time.sleep(max(0.0, down_s - (time.time() - when)))
                    etcd.restart(0)
                    procs[0] = launch_on(lab[0], lab[0], out, variables, store=etcd.url)
                else:
                    inject("link", lab[0], victim, down_s)
                logs = finish(procs)
                faults = [("h0", victim, when)]
                return {"out": out, "survivors": survivors, "faults": faults, "logs": logs, "epochs": epochs}
            finally:
                kill_all(procs, out)


def inject_and_finish(lab: list, procs: list[subprocess.Popen], out: Path, fault: str, count: int) -> dict:
    wait_steps(out, 15)
    survivors = [pid_of(out, "h0"), pid_of(out, "h2")]
    faults, when = [], 0.0
    for k in range(count):
        victim = "h2" if fault == "sigkill" and k % 2 else "h1"
        pid = training_pid(out, victim, since=when)  # a restarted victim has rejoined and committed a step
        when = time.time()
        faults.append((victim, pid, when))
        inject(fault, lab[int(victim[1])], pid)
        wait_after(out, when, [pid_of(out, h) for h in ("h0", "h1", "h2") if h != victim])
    logs = finish(procs)
    return {"out": out, "survivors": survivors, "faults": faults, "logs": logs}


def training_pid(out: Path, host: str, since: float, timeout: float = 60) -> int:
    deadline = time.monotonic() + timeout
    while not any(e["pid"] == pid_of(out, host) and e["t"] > since for e in events_of(out)):
        assert time.monotonic() < deadline, f"the worker on {host} made no step within {timeout}s"
        time.sleep(0.1)
    return pid_of(out, host)


def inject(fault: str, host, pid: int, seconds: float = 8.0) -> None:
    """Inject ``fault`` into the worker ``pid`` on ``host``. A worker that exited between being chosen and signalled
    (a fault before this one ended it) takes no fault: the 8-host soak's lab once died on that race."""
    if fault == "sigkill":
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    elif fault == "sigstop":
        try:
            os.kill(pid, signal.SIGSTOP)
        except ProcessLookupError:
            return
        time.sleep(seconds)
        with contextlib.suppress(ProcessLookupError):  # its launcher killed it (gradsync/launch/stopped.py)
            os.kill(pid, signal.SIGCONT)
    elif fault == "link":
        subprocess.run(["ip", "-n", host.namespace, "link", "set", host.interface, "down"], check=True)
        time.sleep(seconds)
        subprocess.run(["ip", "-n", host.namespace, "link", "set", host.interface, "up"], check=True)


@contextlib.contextmanager
def lab_job(tmp_path: Path, name: str, **variables: str) -> Iterator[tuple[list, list[subprocess.Popen], Path]]:
    """The lab's job on its 3 hosts (0.05 s steps, timeout 5 s; ``variables``: more of the training script's), its
    records in ``tmp_path/name``: yields the hosts, the launchers and that folder, and leaves no launcher or worker
    behind on the way out."""
    out = tmp_path / name
    out.mkdir()
    with netlab.lab(hosts=HOSTS, rate="1gbit", prefix="gselastic") as lab:
        procs = launch(lab, out, {"STEP_SLEEP": "0.05", "ELASTIC_TIMEOUT": "5", **variables})
        try:
            yield lab, procs, out
        finally:
            kill_all(procs, out)


def stick(out: Path, pid: int, seconds: float) -> None:
    """The worker ``pid``'s training thread sleeps ``seconds`` inside its step, its heartbeat thread beating on
    (tests/scripts/elastic_train.py's SIGUSR2): a step stuck in user code, a data loader or a file system."""
    (out / f"{pid}.stuck").write_text(str(seconds))
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGUSR2)


def stuck_steps(tmp_path: Path, epochs: int = 6) -> dict:
    """Two steps stuck with their heartbeats alive, on 3 hosts: h1's for 8 s mid-job (past the 5 s timeout: the
    others go on, and it rejoins when it wakes), then h2's for 15 s near the end (the job finishes without it, and
    it wakes to a finished job: it must end with status 0, its launcher too). Returns the first's time and pid, the
    survivors' pids, the second's pid, and the launchers' output."""
    total = epochs * SAMPLES // (4 * HOSTS)  # steps, at 3 ranks of batch 4
    with lab_job(tmp_path, "stuck", EPOCHS=str(epochs)) as (_lab, procs, out):
        wait_steps(out, 15)
        first, survivors, when = pid_of(out, "h1"), [pid_of(out, "h0"), pid_of(out, "h2")], time.time()
        stick(out, first, 8.0)
        wait_after(out, when, [first], timeout=60)  # it woke and rejoined
        wait_steps(out, total - 25)
        second = pid_of(out, "h2")
        stick(out, second, 15.0)
        logs = finish(procs)
        return {"out": out, "first": (first, when), "survivors": survivors, "second": second, "logs": logs}


def pause_host(launcher: int, worker: int, seconds: float) -> None:
    """A host paused whole (a VM frozen, a host suspended): its launcher and its worker stopped together for
    ``seconds``, then continued. The launcher is stopped first and continued last, so that it never sees its worker
    stopped alone (it would kill it: gradsync/launch/stopped.py), as on a real frozen host."""
    os.kill(launcher, signal.SIGSTOP)
    os.kill(worker, signal.SIGSTOP)
    time.sleep(seconds)
    os.kill(worker, signal.SIGCONT)
    os.kill(launcher, signal.SIGCONT)


def host_paused(tmp_path: Path, seconds: float = 8.0) -> dict:
    """h1 paused whole for ``seconds`` (past the 5 s heartbeat timeout) mid-job, on 3 hosts: the others go on
    without it, and it comes back in-process (the same worker process) when it resumes."""
    with lab_job(tmp_path, "paused", EPOCHS="6") as (_lab, procs, out):
        wait_steps(out, 15)
        victim, survivors, when = pid_of(out, "h1"), [pid_of(out, "h0"), pid_of(out, "h2")], time.time()
        pause_host(procs[1].pid, victim, seconds)
        logs = finish(procs)
        return {"out": out, "fault": (victim, when), "survivors": survivors, "logs": logs}


def straggling(tmp_path: Path) -> dict:
    """h1's worker 3 x slower than the others all job long (tests/scripts/elastic_train.py's STRAGGLER), on 3 hosts:
    it must be kept, and named as the one the others wait on (gradsync/elastic/pace.py)."""
    with lab_job(tmp_path, "straggler", EPOCHS="5", STRAGGLER="h1") as (_lab, procs, out):
        wait_steps(out, 1)
        slow = pid_of(out, "h1")
        return {"out": out, "slow": slow, "logs": finish(procs)}


def wait_after(out: Path, when: float, pids: list[int], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not any(e["t"] > when and e["pid"] in pids for e in events_of(out)):
        assert time.monotonic() < deadline, "the survivors made no step after the fault"
        time.sleep(0.05)
