"""A member lost during the DDP constructor's collectives (the model check, rank 0's state broadcast): outside an
elastic job the constructor raises, as torch's does; in one (``gradsync run --elastic``) it keeps the failure for
the job's State to recover from, and a forward raises it if nothing took it (gradsync/ddp/module.py)."""

import os

import pytest
import torch
from torch import nn

import gradsync
from gradsync.runtime.env import ELASTIC_STORE_VARIABLE
from gradsync.testing import SpawnError, spawn, spawn_failures


def _peer_lost_at_construction(rank: int, world_size: int, elastic: bool) -> None:
    if rank == 1:
        os._exit(1)  # lost as the model is built: its peer's model check finds the connection closed
    if elastic:
        os.environ[ELASTIC_STORE_VARIABLE] = "127.0.0.1:1"  # what `gradsync run --elastic` sets for each worker
    ddp = gradsync.DistributedDataParallel(nn.Linear(4, 1))
    if not elastic:
        raise AssertionError("the constructor returned after its collectives failed")
    ddp(torch.randn(2, 4))  # no elastic State took the failure: the forward raises it


@pytest.mark.timeout(60)
@pytest.mark.parametrize("elastic", [False, True], ids=["plain", "elastic"])
def test_a_peer_lost_during_construction_fails_the_constructor_or_the_first_forward(elastic: bool) -> None:
    failures = spawn_failures(_peer_lost_at_construction, args=(elastic,), timeout=50, pg_timeout=10)
    assert failures[1].kind == "ProcessDied"
    assert failures[0].kind == "CollectiveError", failures[0]
    assert "comparison of the model" in failures[0].message and "failed on rank 0" in failures[0].message
    # Where it was raised: the constructor, or (elastic) the forward that found it untaken.
    assert ("_before_module" in failures[0].traceback) == elastic, failures[0].traceback


def _peer_lost_then_taken(rank: int, world_size: int) -> str:
    if rank == 1:
        os._exit(1)
    os.environ[ELASTIC_STORE_VARIABLE] = "127.0.0.1:1"
    ddp = gradsync.DistributedDataParallel(nn.Linear(4, 1))
    failure = ddp.take_construction_failure()
    assert ddp.take_construction_failure() is None  # taken once: the State raises it and recovers
    return type(failure).__name__


@pytest.mark.timeout(60)
def test_in_an_elastic_job_the_failure_is_taken_once_by_the_state() -> None:
    with pytest.raises(SpawnError) as info:  # rank 1's death
        spawn(_peer_lost_then_taken, timeout=50, pg_timeout=10)
    assert info.value.results[0] == "CollectiveError"
