"""DistributedDataParallel's constructor with wrong types and out-of-range values (a group of one suffices)."""

from __future__ import annotations

import torch
from torch import nn

import gradsync
from conformance.sweep.core import case, group1
from conformance.sweep.util import batch, flat, loss_of
from lab.zoo.toys import Shallow

CAT = "constructor"


def _ddp(module, **kwargs):
    group1()
    ddp = gradsync.DistributedDataParallel(module, **kwargs)
    return {"buckets": len(ddp.reducer.buckets)}


def _trains(module, **kwargs) -> dict:
    """Wrap, train two steps; in a group of one DDP must equal plain training."""
    group1()
    torch.manual_seed(0)
    ref = Shallow()
    ref.load_state_dict(module.state_dict())
    ddp = gradsync.DistributedDataParallel(module, **kwargs)
    for model in (ddp, ref):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(2):
            opt.zero_grad()
            loss_of(model(batch(step, 0))).backward()
            opt.step()
    diff = max(abs(a - b) for a, b in zip(flat(ddp.module), flat(ref)))
    return {"diff": diff}


def _trained_right(value: dict) -> str | None:
    return None if value["diff"] < 1e-6 else f"wrong numbers: {value['diff']:.3g} from plain training"


@case("ctor_module_string", CAT, "DDP('not a module')", ["nn.Module"])
def _():
    return _ddp("not a module")


@case("ctor_module_none", CAT, "DDP(None)", ["nn.Module"])
def _():
    return _ddp(None)


@case("ctor_module_class", CAT, "DDP(nn.Linear): the class, not an instance", ["nn.Module"])
def _():
    return _ddp(nn.Linear)


@case("ctor_no_trainable", CAT, "DDP of a module whose parameters are all frozen", ["requires", "gradient"])
def _():
    return _ddp(nn.Linear(2, 2).requires_grad_(False))


@case("ctor_no_parameters", CAT, "DDP(nn.ReLU()): a module without parameters", ["parameter"])
def _():
    return _ddp(nn.ReLU())


@case("ctor_meta_device", CAT, "DDP of a module built on the meta device", ["meta", "to_empty"])
def _():
    return _ddp(nn.Linear(4, 4, device="meta"))


@case("ctor_bucket_cap_zero", CAT, "bucket_cap_mb=0", ["bucket_cap_mb", "> 0"])
def _():
    return _ddp(Shallow(), bucket_cap_mb=0)


@case("ctor_bucket_cap_negative", CAT, "bucket_cap_mb=-1", ["bucket_cap_mb", "> 0"])
def _():
    return _ddp(Shallow(), bucket_cap_mb=-1)


@case("ctor_bucket_cap_string", CAT, "bucket_cap_mb='25' (a string)", ["bucket_cap_mb"])
def _():
    return _ddp(Shallow(), bucket_cap_mb="25")


@case("ctor_bucket_cap_nan", CAT, "bucket_cap_mb=float('nan')", ["bucket_cap_mb"])
def _():
    return _ddp(Shallow(), bucket_cap_mb=float("nan"))


@case("ctor_bucket_cap_inf", CAT, "bucket_cap_mb=float('inf')", ["bucket_cap_mb"], check=lambda v: None)
def _():
    return _ddp(Shallow(), bucket_cap_mb=float("inf"))


@case("ctor_bucket_cap_list_negative", CAT, "bucket_cap_mb_list=[1, -1]", ["bucket_cap_mb_list"])
def _():
    return _ddp(Shallow(), bucket_cap_mb_list=[1, -1])


@case("ctor_bucket_cap_tiny", CAT, "bucket_cap_mb=1e-9: one parameter per bucket", check=_trained_right)
def _():
    torch.manual_seed(0)
    return _trains(Shallow(), bucket_cap_mb=1e-9)


@case("ctor_unknown_argument", CAT, "bucket_size=3 (no such argument)", ["bucket_size"])
def _():
    return _ddp(Shallow(), bucket_size=3)


@case("ctor_mixed_precision", CAT, "mixed_precision=object() (not a MixedPrecision)", ["mixed_precision"])
def _():
    return _ddp(Shallow(), mixed_precision=object())


@case("ctor_device_ids_string", CAT, "device_ids='cuda'", ["device_ids", "list"])
def _():
    return _ddp(Shallow(), device_ids="cuda")


@case("ctor_device_ids_int", CAT, "device_ids=0 (not a list)", ["device_ids", "list"])
def _():
    return _ddp(Shallow(), device_ids=0)


@case("ctor_device_ids_two", CAT, "device_ids=[0, 1]", ["device_ids", "one process per"])
def _():
    return _ddp(Shallow(), device_ids=[0, 1])


@case("ctor_device_ids_list_of_string", CAT, "device_ids=['cuda:0'] (strings in the list)", ["device_ids"])
def _():
    return _ddp(Shallow(), device_ids=["cuda:0"])


@case(
    "ctor_device_ids_cpu_module",
    CAT,
    "device_ids=[0] for a CPU module (torch refuses: device_ids is for GPU modules)",
    ["device_ids"],
    check=_trained_right,
)
def _():
    torch.manual_seed(0)
    return _trains(Shallow(), device_ids=[0])


@case("ctor_output_device_string", CAT, "output_device='gpu'", ["output_device"])
def _():
    return _ddp(Shallow(), output_device="gpu")


@case("ctor_process_group_string", CAT, "process_group='gloo' (a string)", ["process_group", "ProcessGroup"])
def _():
    return _ddp(Shallow(), process_group="gloo")


@case("ctor_process_group_int", CAT, "process_group=0", ["process_group", "ProcessGroup"])
def _():
    return _ddp(Shallow(), process_group=0)


@case("ctor_device_mesh_string", CAT, "device_mesh='1d' (a string)", ["device_mesh"])
def _():
    return _ddp(Shallow(), device_mesh="1d")


@case("ctor_no_process_group", CAT, "DDP before any init_process_group", [("gradsync.init", "init_process_group")])
def _():
    return {"ddp": repr(gradsync.DistributedDataParallel(Shallow()))[:40]}


@case(
    "ctor_static_and_find_unused",
    CAT,
    "static_graph=True and find_unused_parameters=True together (torch: static_graph wins)",
    check=_trained_right,
)
def _():
    torch.manual_seed(0)
    return _trains(Shallow(), static_graph=True, find_unused_parameters=True)
