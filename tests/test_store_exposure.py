"""Who can reach the job's store: from another host, the stores gradsync's launchers serve answer on the job's
address and not on another address of the same host (torch's own server listens on every interface). Two network
namespace hosts, h0 with a second address on another subnet that h1 can reach too (docs/elastic.md, "Who can reach
the job's store")."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lab import netlab

SCRIPT = Path(__file__).parent / "scripts" / "hold_store.py"
OTHER = "10.77.1"  # a second subnet on the same bridge: h0 is .1 there, h1 .2
PROBE = """
import json, socket, sys
found = {}
for target in sys.argv[1:]:
    host, port = target.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=2).close()
        found[target] = "answers"
    except ConnectionRefusedError:
        found[target] = "refused"
    except OSError as exc:
        found[target] = type(exc).__name__
print(json.dumps(found))
"""


def _reach(host: netlab.Host, *targets: str) -> dict[str, str]:
    """What a TCP connect from ``host`` to each ``HOST:PORT`` of ``targets`` found."""
    done = subprocess.run(host.command([sys.executable, "-c", PROBE, *targets]), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def _launch(host: netlab.Host, flags: list[str], out: Path, *script_args: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "LOCAL_"))}
    env.update(GLOO_SOCKET_IFNAME=host.interface, OMP_NUM_THREADS="1")
    argv = [sys.executable, "-m", "gradsync", "run", "--nnodes", "1", "--nproc-per-node", "1", *flags]
    argv += ["--local-addr", host.address, str(SCRIPT), str(out), *script_args]
    command = host.command(["env", *[f"{k}={v}" for k, v in env.items()], *argv])
    return subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )


def _wait_for(check, what: str, procs: list[subprocess.Popen], seconds: float = 90) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            outputs = [p.communicate(timeout=5)[0][-2000:] if p.poll() is not None else "(running)" for p in procs]
            pytest.fail(f"{what} within {seconds:.0f}s: {outputs}")
        time.sleep(0.3)


@pytest.mark.long
@pytest.mark.netlab()
@pytest.mark.timeout(180)
def test_the_stores_answer_on_the_jobs_address_only(tmp_path: Path) -> None:
    with netlab.lab(hosts=2, rate="1gbit", prefix="gsexpose") as (h0, h1):
        for host in (h0, h1):
            netlab._sh("ip", "-n", host.namespace, "addr", "add", f"{OTHER}.{host.index + 1}/24", "dev", host.interface)
        static, elastic = tmp_path / "static", tmp_path / "elastic"
        static.mkdir()
        elastic.mkdir()
        procs = [
            _launch(h0, ["--rdzv-endpoint", f"{h0.address}:29471"], static, "init"),
            _launch(h0, ["--elastic", "--rdzv-endpoint", f"{h0.address}:29472"], elastic),
        ]
        try:
            _wait_for(lambda: (static / "master.json").exists(), "the static job's rank 0 never joined", procs)
            job, other = h0.address, f"{OTHER}.1"
            _wait_for(lambda: _reach(h1, f"{job}:29472")[f"{job}:29472"] == "answers", "no elastic store", procs)
            master = json.loads((static / "master.json").read_text())
            found = _reach(h1, f"{job}:29471", f"{other}:29471", f"{job}:29472", f"{other}:29472")
            # gradsync run's rendezvous store and --elastic's job store: on the job's address only.
            assert found == {
                f"{job}:29471": "answers",
                f"{other}:29471": "refused",
                f"{job}:29472": "answers",
                f"{other}:29472": "refused",
            }, found
            # Rank 0's own store (torch's env:// rendezvous in the worker, MASTER_PORT, a fresh port each round) is
            # torch's: on every interface, as docs/elastic.md says.
            assert master["addr"] == job
            workers = _reach(h1, f"{job}:{master['port']}", f"{other}:{master['port']}")
            assert set(workers.values()) == {"answers"}, workers
        finally:
            (static / "stop").write_text("")
            (elastic / "stop").write_text("")
            assert procs[0].wait(timeout=60) == 0, procs[0].communicate()[0][-3000:]
            os.killpg(procs[1].pid, signal.SIGKILL)  # --elastic keeps its store up for the other hosts a while
            procs[1].wait(timeout=30)
