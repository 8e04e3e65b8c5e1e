"""The job's store on etcd (``--store etcd://...``): torch's Store meanings, kept through the loss of one member of
three; a clear error, not a hang, when the cluster has no quorum; torch's gloo rendezvous and gradsync's membership
protocol on it. A cluster of 3 etcd members on loopback ports, started by the test."""

from __future__ import annotations

import datetime
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed as dist

from gradsync.elastic import keys
from gradsync.elastic.membership import Membership
from gradsync.elastic.timeouts import Timeouts
from gradsync.elastic.verdicts import mark_exited
from gradsync.errors import ConfigError
from gradsync.store.etcd_client import EtcdUnavailable
from gradsync.store.etcd_store import EtcdStore, parse_endpoints
from gradsync.store.job_store import StoreHealth, gone_now

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from lab import etcd_cluster  # noqa: E402

pytestmark = pytest.mark.skipif(etcd_cluster.available() is not None, reason=str(etcd_cluster.available()))


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[etcd_cluster.Cluster]:
    with etcd_cluster.cluster(tmp_path_factory.mktemp("etcd"), members=3) as cluster:
        yield cluster


def _store(etcd: etcd_cluster.Cluster, name: str, **kwargs) -> EtcdStore:
    endpoints, _ = parse_endpoints(etcd.url)
    return EtcdStore(endpoints, prefix=f"test/{name}/", **kwargs)


def _exercise(store: dist.Store) -> list:
    """One sequence of every operation the elastic protocol uses, with what each returned."""
    seen: list = []
    store.set("a", "1")
    seen += [store.get("a"), store.check(["a"]), store.check(["a", "b"])]
    seen += [store.add("n", 1), store.add("n", 5), store.add("n", 0), store.get("n")]
    seen += [store.compare_set("l", "", "7"), store.compare_set("l", "", "8"), store.compare_set("l", "7", "9")]
    seen += [store.compare_set("absent", "x", "y"), store.get("l")]
    seen += [store.delete_key("a"), store.delete_key("a"), store.check(["a"])]
    return seen


@pytest.mark.timeout(60)
def test_every_operation_means_what_it_means_on_a_tcpstore(etcd: etcd_cluster.Cluster) -> None:
    tcp = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    assert _exercise(_store(etcd, "meanings")) == _exercise(tcp)


@pytest.mark.timeout(60)
def test_add_is_atomic_across_clients(etcd: etcd_cluster.Cluster) -> None:
    stores = [_store(etcd, "atomic") for _ in range(4)]

    def bump(store: EtcdStore) -> None:
        for _ in range(25):
            store.add("counter", 1)

    threads = [threading.Thread(target=bump, args=(s,)) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert stores[0].add("counter", 0) == 100


@pytest.mark.timeout(60)
def test_a_get_waits_for_its_key_and_names_it_when_it_never_comes(etcd: etcd_cluster.Cluster) -> None:
    store = _store(etcd, "waits", timeout=datetime.timedelta(seconds=0.5))
    threading.Timer(0.2, lambda: _store(etcd, "waits").set("late", "x")).start()
    assert store.get("late") == b"x"
    with pytest.raises(dist.DistStoreError, match="'never'"):
        store.get("never")


_GROUP_ON_ETCD = """
import datetime, sys, time, torch, torch.distributed as dist
from gradsync.store.job_store import open_store
rank = int(sys.argv[1])
start = time.perf_counter()
store = open_store(sys.argv[2])  # kept: a Python store lives only as long as its Python object
prefix = dist.PrefixStore("round1/group/", store)
dist.init_process_group("gloo", store=prefix, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=20))
took = time.perf_counter() - start
x = torch.full((3,), float(rank + 1))
dist.all_reduce(x)
print(x.tolist(), took)
"""


@pytest.mark.long
@pytest.mark.timeout(90)
def test_torchs_gloo_group_forms_and_reduces_on_it(etcd: etcd_cluster.Cluster) -> None:
    """A round's process group rendezvous through a PrefixStore on etcd, as Membership.form_group does (no
    launcher's TCPStore): two processes, torch's init_process_group, one all-reduce."""
    import os
    import subprocess

    env = dict(os.environ, PYTHONPATH=str(ROOT), GLOO_SOCKET_IFNAME="lo")
    where = f"{etcd.url}/gloo-test"
    argv = [sys.executable, "-c", _GROUP_ON_ETCD]
    ranks = [subprocess.Popen([*argv, str(r), where], env=env, stdout=subprocess.PIPE, text=True) for r in range(2)]
    lines = [p.communicate(timeout=60)[0].split() for p in ranks]
    assert all(p.returncode == 0 for p in ranks)
    assert [line[:3] for line in lines] == [["[3.0,", "3.0,", "3.0]"]] * 2
    assert max(float(line[3]) for line in lines) < 5.0, lines  # the rendezvous itself: ~20 ms on loopback


@pytest.mark.timeout(60)
def test_the_membership_protocol_runs_on_it(etcd: etcd_cluster.Cluster) -> None:
    """The same code as on a TCPStore: two workers form round 1, then round 2 without the one that left."""
    timeouts = Timeouts(heartbeat=1.0, collective=1.0, admission=5)
    a = Membership(_store(etcd, "rounds"), _store(etcd, "rounds"), timeouts)
    b = Membership(_store(etcd, "rounds"), _store(etcd, "rounds"), timeouts)
    try:
        rounds = {}
        threads = [threading.Thread(target=lambda m=m: rounds.update({m.me: m.first_round(2, 20)})) for m in (a, b)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert rounds[a.me].members == rounds[b.me].members == [1, 2]
        b.stop()
        mark_exited(a.store, b.me)  # its launcher saw it exit
        assert a.next_round(steps=3).members == [a.me]
    finally:
        a.stop()
        b.stop()


@pytest.mark.timeout(120)
def test_losing_one_member_of_three_is_served_by_the_others(etcd: etcd_cluster.Cluster) -> None:
    store = _store(etcd, "one_lost")
    store.set("before", "1")
    etcd.kill(0)  # the member this client was talking to
    try:
        start = time.monotonic()
        assert store.add("after", 1) == 1 and store.get("before") == b"1"
        assert time.monotonic() - start < 10.0  # a new leader, if it was the leader, then the next member
    finally:
        etcd.restart(0)
        etcd.wait_healthy()


@pytest.mark.timeout(120)
def test_losing_two_members_fails_with_the_cluster_named_not_a_hang(etcd: etcd_cluster.Cluster) -> None:
    store = _store(etcd, "two_lost", unavailable_s=3.0)
    store.set("before", "1")
    etcd.kill(0)
    etcd.kill(1)
    try:
        start = time.monotonic()
        with pytest.raises(EtcdUnavailable, match="lost its quorum") as raised:
            store.set("after", "1")
        assert time.monotonic() - start < 3.0 + 2 * 2.0 + 1.0  # unavailable_s, and a request in flight at most
        assert etcd.url.removeprefix("etcd://") in str(raised.value)
        assert not raised.value.all_refused  # the third member answers: the job waits for it, then stops
    finally:
        etcd.restart(0)
        etcd.restart(1)
        etcd.wait_healthy()


def test_the_store_is_lost_at_once_only_when_no_member_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """A member without a quorum may be this host's own, cut off with it: only a refusal everywhere is final at
    once; anything else counts GRADSYNC_ELASTIC_STORE_LOST_SECONDS first."""
    assert gone_now(EtcdUnavailable("x", all_refused=True)) is not None
    assert gone_now(EtcdUnavailable("x", all_refused=False)) is None
    monkeypatch.setenv("GRADSYNC_ELASTIC_STORE_LOST_SECONDS", "0.2")
    health = StoreHealth()
    health.failed(EtcdUnavailable("x", all_refused=False))
    assert health.lost is None
    time.sleep(0.25)
    health.failed(EtcdUnavailable("x", all_refused=False))
    assert health.lost is not None and "unreachable for 0s" in health.lost


@pytest.mark.parametrize(
    "url, message",
    [
        ("etcd://", "name the etcd members"),
        ("etcd://node0:notaport", "is not HOST:PORT"),
        ("etcd://no-such-host.invalid:2379", "cannot resolve"),
    ],
)
def test_a_bad_store_url_is_refused_by_name(url: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_endpoints(url)


@pytest.mark.timeout(60)
def test_a_launcher_refuses_the_name_of_a_job_that_finished_there(etcd: etcd_cluster.Cluster) -> None:
    """Its keys outlive the job: the same name again would see itself done at once and train nothing."""
    import argparse

    from gradsync.launch.elastic import Job
    from gradsync.store.job_store import etcd_url, open_store

    where = etcd_url(etcd.url, "finished-job")
    store = open_store(where)
    store.set(keys.DONE, "1")
    args = argparse.Namespace(rdzv_id="finished-job", store=etcd.url)
    with pytest.raises(ConfigError, match="already finished on .* etcdctl del --prefix gradsync/finished-job/"):
        Job(store, where, hosting=False).refuse_a_finished_name(args)
    Job(open_store(etcd_url(etcd.url, "fresh-job")), "x", hosting=False).refuse_a_finished_name(args)
