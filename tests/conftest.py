import os
import sys

import pytest
import torch

# One thread per process: the ranks of a test share this machine's two cores.
torch.set_num_threads(1)
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
# SWITCH_INTERVAL=1e-6: the interpreter switches threads as often as it can (sys.setswitchinterval), here and in the
# elastic workers the tests launch (tests/scripts/elastic_train.py), so that a field one thread writes and another
# reads without a lock meets the other thread mid-update. Issue 59's check of elastic's thread boundary.
if os.environ.get("SWITCH_INTERVAL"):
    sys.setswitchinterval(float(os.environ["SWITCH_INTERVAL"]))


@pytest.fixture
def group_of_one():
    """A process group of one in this process: enough for constructors that check their arguments."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def pytest_runtest_setup(item: pytest.Item) -> None:
    """``@pytest.mark.netlab(rate=..., delay=...)``: skip, naming the kernel feature (namespaces, tbf, netem), where
    the network-namespace lab cannot make those links here (lab/netlab.py's probe, the one gradsync doctor reports)."""
    marker = item.get_closest_marker("netlab")
    if marker is None:
        return
    from lab import netlab

    reason = netlab.available(**marker.kwargs)
    if reason is not None:
        pytest.skip(f"the network-namespace lab: {reason}")
