"""The table of public callables: for each, a valid baseline call, the use that shows an accepted value works, and
each parameter's valid domain (values.py derives the wrong values). ``UNSWEPT`` names the public callables that are
not called with user-typed values, and why. tests/test_generated_sweep.py fails when a public callable or one of
its parameters has no entry here.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from conformance.sweep.generated import fixtures as fx
from conformance.sweep.generated.runner import WrongResult
from conformance.sweep.generated.values import (
    BOOL,
    CHOICE,
    FREE,
    INT,
    NUM,
    OBJ,
    PATH,
    Domain,
    Make,
    text_file,
)

GROUP = OBJ(("not a group", "gloo"))
MODULE = OBJ(("a tensor", Make(lambda: torch.zeros(3), "a tensor")), ("None", None))
PLAIN_MODULE = OBJ(("an unwrapped module", Make(fx.model, "an unwrapped nn.Sequential")), ("None", None))
OPT_CLASS = OBJ(
    ("a name", "adam"),
    ("an instance", Make(lambda: torch.optim.SGD(fx.model().parameters(), lr=0.1), "an SGD instance")),
)
NOT_CALLABLE = OBJ(("not callable", 3))
_DEFAULT = "gradsync's own default for the variable, not a value users type"
RECORDS = OBJ(("not a mapping", [1, 2]), ("rank to a non-record", {0: [1, 2]}))


@dataclasses.dataclass
class Target:
    """``kwargs``: a valid baseline call's arguments, built in the case's process. ``use``: what shows an accepted
    value works (a training step, an epoch), given the result and the arguments."""

    kwargs: Callable[[], dict[str, Any]]
    params: dict[str, Domain]
    use: Callable[[Any, dict[str, Any]], Any] | None = None
    group: bool = True  # the baseline needs a process group (of one)
    owner: str = "mine"
    disk: Callable[[dict[str, Any]], str | None] | None = None  # after a refusal: what is wrong on disk, or None


def _train_ddp(d: Any, _kw: dict[str, Any]) -> None:
    fx.train(d)


def _ddp_kwargs() -> dict[str, Any]:
    return {"module": fx.model()}


def _hook(register: Callable[[Any, Any], None]) -> Callable[[Any, dict[str, Any]], None]:
    def use(state: Any, _kw: dict[str, Any]) -> None:
        d = fx.ddp()
        register(d, state)
        fx.train(d)

    return use


def _hierarchical(d: Any, state: Any) -> None:
    from gradsync.comm import hierarchical_hook

    d.register_comm_hook(state, hierarchical_hook)


def _quantized(d: Any, state: Any) -> None:
    from gradsync.comm import quantized_hook

    d.register_comm_hook(state, quantized_hook)


def _with_periodic(obj: Any, kw: dict[str, Any]) -> None:
    opt = torch.optim.SGD(kw["ddp"].parameters(), lr=0.1)
    for step in range(3):
        opt.zero_grad()
        kw["ddp"](fx.batch(step)).pow(2).mean().backward()
        opt.step()
        obj.step()


def _sharded_use(opt: Any, kw: dict[str, Any]) -> None:
    fx.train(kw["_model"], opt)


def _sharded_kwargs() -> dict[str, Any]:
    m = fx.model()
    return {"params": m.parameters(), "optimizer_class": torch.optim.Adam, "lr": 0.01, "_model": m}


def _overlapped_kwargs() -> dict[str, Any]:
    return {"ddp": fx.ddp(), "optimizer_class": torch.optim.Adam, "lr": 0.01}


def _overlapped_use(opt: Any, kw: dict[str, Any]) -> None:
    fx.train(kw["ddp"], opt)


def _dtensor_params() -> Any:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    return [nn.Parameter(distribute_tensor(torch.randn(4, 4), mesh, [Replicate()]))]


def _grouped_by_tokens(sampler: Any, kw: dict[str, Any]) -> None:
    """An epoch; for Hugging Face rows, the lengths must be the token counts (not len(row), the number of fields)."""
    fx.iterate(sampler)
    rows = kw["dataset"]
    if isinstance(rows, list) and rows and isinstance(rows[0], dict) and "input_ids" in rows[0]:
        want = [len(r["input_ids"]) for r in rows]
        if sampler.lengths.tolist() != want:
            raise WrongResult(f"grouped by lengths {sampler.lengths.tolist()}, the rows' input_ids are {want} long")


def _bn_use(bn: Any, _kw: dict[str, Any]) -> None:
    bn.train()
    out = bn(torch.randn(4, bn.num_features if isinstance(bn.num_features, int) else 4, 3))
    out.sum().backward()


def _pipeline_kwargs() -> dict[str, Any]:
    return {"submodule": fx.model(), "stage_index": 0, "num_stages": 1, "device": torch.device("cpu")}


def _monitor_kwargs() -> dict[str, Any]:
    d = fx.ddp()
    return {"ddp": d, "optimizer": torch.optim.SGD(d.parameters(), lr=0.1), "max_steps": 10}


def _monitor_use(mon: Any, kw: dict[str, Any]) -> None:
    fx.train(kw["ddp"], kw["optimizer"])


def _checkpoint_file() -> str:
    import gradsync

    path = text_file("", ".pt")
    gradsync.checkpoint.save(path, model=fx.model())
    return path


_PRIOR = {"prior": "a checkpoint written before"}


def _over_prior(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` writing over an earlier file, which a refused save must leave whole (``_prior``: its path)."""
    import tempfile

    import gradsync

    path = str(Path(tempfile.mkdtemp(prefix="sweep-prior-")) / "ckpt.pt")
    gradsync.checkpoint.atomic_torch_save(_PRIOR, path)
    return {**kwargs, "path": path, "_prior": path}


def _prior_intact(kwargs: dict[str, Any]) -> str | None:
    prior = Path(kwargs["_prior"])
    others = sorted(p.name for p in prior.parent.iterdir() if p != prior)
    if not prior.exists() or torch.load(prior, weights_only=False) != _PRIOR:
        return f"the earlier file {prior} was changed"
    return f"left {others} beside it" if others else None


def _set_rng(state: Any, _kw: dict[str, Any]) -> None:
    torch.rand(1)


def _init_kwargs() -> dict[str, Any]:
    from gradsync.testing import free_port

    fx.world1_env(free_port())
    return {}


def _init_use(_info: Any, _kw: dict[str, Any]) -> None:
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)


def _empty_trace() -> str:
    from gradsync.observe import write_chrome_trace

    path = text_file("", ".json")
    write_chrome_trace({}, path)
    return path


def _steps_file() -> str:
    return text_file('{"not": "a trace"}\n', ".json")


def sampler_params(extra: dict[str, Domain] | None = None) -> dict[str, Domain]:
    base = {
        "dataset": OBJ(("not sized", Make(lambda: iter(range(10)), "an iterator")), ("None", None)),
        "num_replicas": INT(1, optional=True),  # more than the group's is valid, as in torch (no group needed)
        "rank": INT(0, None, ("out of range: rank 1 of 1", 1), optional=True),
        "shuffle": BOOL(),
        "seed": INT(None),
        "drop_last": BOOL(),
    }
    return {**base, **(extra or {})}


# The outer step's arguments DiLoCo and StreamingDiLoCo share.
_OUTER_STEP = {
    "outer_lr": NUM(0.0, None, False),
    "momentum": NUM(0.0, None, False),
    "nesterov": BOOL(),
    "warmup_steps": INT(0),
    "compression": CHOICE(None, "bf16", "fp16"),
}

TABLE: dict[str, Target] = {
    "gradsync.DistributedDataParallel": Target(
        _ddp_kwargs,
        {
            "module": MODULE,
            "device_ids": OBJ(("a CUDA index on a CPU module", [0]), ("a str", "0")),
            "output_device": FREE("torch ignores it for a CPU module (distributed.py: output_device = None)"),
            "dim": FREE("torch scatters inputs along it; any int is a dimension of some input"),
            "broadcast_buffers": BOOL(optional=True),
            "init_sync": BOOL(),
            "process_group": GROUP,
            "bucket_cap_mb": OBJ(("negative", -1.0), ("NaN", math.nan), ("inf", math.inf), ("a str", "big")),
            "find_unused_parameters": BOOL(),
            "check_reduction": FREE("deprecated in torch and ignored by it"),
            "gradient_as_bucket_view": BOOL(),
            "static_graph": BOOL(),
            "delay_all_reduce_named_params": OBJ(("a str", "a.weight"), ("a list of names", ["a.weight"])),
            "param_to_hook_all_reduce": OBJ(("a str", "a.weight"), ("a plain tensor", torch.ones(1))),
            "device_mesh": OBJ(("not a mesh", "dp")),
            "skip_all_reduce_unused_params": BOOL(),
            "bucket_cap_mb_list": OBJ(("negative", [-1.0]), ("NaN", [math.nan]), ("empty", []), ("a number", 25.0)),
            "batched_grad_copy": BOOL(),
            "forward_sync_buffers": BOOL(optional=True),
            "mixed_precision": OBJ(("a str", "bf16"), ("a dtype", torch.bfloat16)),
            "bucket_tuning": BOOL(optional=True),
            "check_desync": BOOL(optional=True),
            "check_for_nan_in_grad": BOOL(),
        },
        _train_ddp,
        owner="ddp",
    ),
    "gradsync.MixedPrecision": Target(
        lambda: {"param_dtype": torch.bfloat16},
        {
            "param_dtype": OBJ(("an integer dtype", torch.int8), ("a str", "bf16")),
            "reduce_dtype": OBJ(("an integer dtype", torch.int32), ("a str", "fp32")),
            "buffer_dtype": OBJ(("a bool dtype", torch.bool), ("a type", float)),
            "cast_forward_inputs": BOOL(),
        },
        group=False,
        owner="ddp",
    ),
    "gradsync.DistributedLoader": Target(
        lambda: {"dataset": fx.DATASET, "batch_size": 2},
        sampler_params({"batch_size": INT(1)}),
        lambda loader, kw: list(loader),
    ),
    "gradsync.DistributedSampler": Target(
        lambda: {"dataset": fx.DATASET}, sampler_params(), lambda s, kw: fx.iterate(s)
    ),
    "gradsync.LengthGroupedSampler": Target(
        lambda: {"dataset": fx.TOKENS, "batch_size": 2},
        sampler_params(
            {
                "dataset": OBJ(
                    ("not sized", Make(lambda: iter(range(10)), "an iterator")),
                    (
                        "dict rows of two sequences",
                        Make(fx.ambiguous_rows, "dict rows {'question', 'answer'}", ("dict", "question")),
                    ),
                    ("ints without lengths", Make(lambda: list(range(10)), "a list of ints", ("int",))),
                    good=(("Hugging Face rows", Make(fx.hf_rows, "dict rows {'input_ids', 'attention_mask'}")),),
                ),
                "model_input_name": OBJ(("not a field of the rows", "input_ids"), ("not a str", 3)),
                "batch_size": INT(1),
                "lengths": OBJ(
                    ("too short", [1, 2]),
                    ("negative", [-1] * 10),
                    ("a str", "0123456789"),
                    ("floats", [1.5] * 10),
                    ("NaN", [math.nan] * 10),
                ),
                "megabatch_mult": INT(1),
                "process_group": GROUP,
            }
        ),
        _grouped_by_tokens,
    ),
    "gradsync.ShardedOptimizer": Target(
        _sharded_kwargs,
        {
            "params": OBJ(
                ("empty", []),
                ("DTensor parameters", Make(_dtensor_params, "DTensor parameters", ("DTensor",))),
                ("None", None),
            ),
            "optimizer_class": OPT_CLASS,
            "process_group": GROUP,
        },
        _sharded_use,
    ),
    "gradsync.SyncBatchNorm": Target(
        lambda: {"num_features": 4},
        {
            "num_features": INT(1),
            "eps": NUM(0.0),
            "momentum": Domain("number", low=0.0, high=1.0, open_low=False, optional=True),
            "affine": BOOL(),
            "track_running_stats": BOOL(),
            "process_group": GROUP,
            "device": FREE("torch.nn.BatchNorm's own argument, checked by torch.empty"),
            "dtype": FREE("torch.nn.BatchNorm's own argument, checked by torch.empty"),
        },
        _bn_use,
    ),
    "gradsync.init": Target(
        _init_kwargs,
        {"backend": CHOICE("gloo", "nccl"), "timeout": NUM(0.0, 1e9)},
        _init_use,
        group=False,
        owner="runtime",
    ),
    "gradsync.comm.DiLoCo": Target(
        lambda: {"ddp": fx.ddp(), "period": 2},
        {
            "ddp": PLAIN_MODULE,
            "period": INT(1),
            **_OUTER_STEP,
        },
        _with_periodic,
    ),
    "gradsync.comm.StreamingDiLoCo": Target(
        lambda: {"ddp": fx.ddp(), "period": 2, "fragments": 2},
        {
            "ddp": PLAIN_MODULE,
            "period": INT(1),
            "fragments": INT(1),
            "delay": INT(0),
            "mixing": Domain("number", low=0.0, high=1.0, open_low=False, optional=True),
            **_OUTER_STEP,
        },
        _with_periodic,
    ),
    "gradsync.comm.QuantizedState": Target(
        lambda: {},
        {
            "process_group": GROUP,
            "bits": OBJ(("unsupported", 2), ("a str", "8"), ("a float", 8.0)),
            "block": INT(1),
            "error_feedback": BOOL(),
            "bytes_sent": FREE("a counter the hook keeps; its starting value is the user's to choose"),
        },
        _hook(_quantized),
    ),
    "gradsync.comm.HierarchicalState": Target(
        lambda: {},
        {
            "process_group": GROUP,
            "host": OBJ(("empty", ""), ("not a str", 3)),
            "piece_bytes": INT(1),
        },
        _hook(_hierarchical),
    ),
    "gradsync.comm.PostLocalSGD": Target(
        lambda: {"ddp": fx.ddp(), "period": 2},
        {"ddp": PLAIN_MODULE, "period": INT(1), "warmup_steps": INT(0)},
        _with_periodic,
    ),
    "gradsync.comm.average_parameters": Target(
        lambda: {"module": fx.model()}, {"module": MODULE, "process_group": GROUP}
    ),
    "gradsync.comm.issues_from_callbacks": Target(
        lambda: {"hook": lambda s, b: None}, {"hook": NOT_CALLABLE}, owner="reducer"
    ),
    "gradsync.comm.bf16_compress_wrapper": Target(
        lambda: {"hook": lambda s, b: None}, {"hook": NOT_CALLABLE}, owner="torch"
    ),
    "gradsync.comm.fp16_compress_wrapper": Target(
        lambda: {"hook": lambda s, b: None}, {"hook": NOT_CALLABLE}, owner="torch"
    ),
    "gradsync.optim.OverlappedOptimizer": Target(
        _overlapped_kwargs, {"ddp": PLAIN_MODULE, "optimizer_class": OPT_CLASS}, _overlapped_use
    ),
    "gradsync.optim.partition": Target(
        lambda: {"sizes": [4, 3, 2], "world_size": 2},
        {"sizes": OBJ(("negative", [-1, 2]), ("a str", "432"), ("None", None)), "world_size": INT(1)},
        group=False,
    ),
    "gradsync.pipelining.PipelineStage": Target(
        _pipeline_kwargs,
        {
            "submodule": MODULE,
            "stage_index": INT(0, None, ("off by one: stage 1 of 1", 1)),
            "num_stages": INT(1),  # 3 stages on one rank is valid: a looped schedule's (torch's Interleaved1F1B)
            "device": OBJ(("a str that is no device", "gpu0")),
            "input_args": FREE("example inputs, any tensors"),
            "output_args": FREE("example outputs, any tensors"),
            "output_grads": FREE("example gradients, any tensors"),
            "input_grads": FREE("example gradients, any tensors"),
            "group": GROUP,
            "dw_builder": NOT_CALLABLE,
            "get_mesh": NOT_CALLABLE,
        },
        owner="pipelining",
    ),
    "gradsync.elastic.ElasticLoader": Target(
        lambda: {"dataset": fx.DATASET, "batch_size": 2},
        {
            "dataset": OBJ(("not sized", Make(lambda: iter(range(10)), "an iterator")), ("None", None)),
            "batch_size": INT(1),
            "seed": INT(None),
            "shuffle": BOOL(),
            "collate_fn": NOT_CALLABLE,
        },
        group=False,
        owner="elastic",
    ),
    "gradsync.elastic.Timeouts": Target(
        lambda: {},
        {"heartbeat": NUM(0.0, 1e9), "collective": NUM(0.0, 1e9), "admission": NUM(0.0, 1e9)},
        group=False,
        owner="elastic",
    ),
    "gradsync.elastic.run": Target(
        lambda: {"train": lambda: None}, {"train": NOT_CALLABLE}, group=False, owner="elastic"
    ),
    "gradsync.observe.Monitor": Target(
        _monitor_kwargs,
        {"ddp": PLAIN_MODULE, "optimizer": OBJ(("not an optimizer", "sgd")), "max_steps": INT(1)},
        _monitor_use,
        owner="observe",
    ),
    "gradsync.observe.arrivals": Target(lambda: {"per_rank": {}}, {"per_rank": RECORDS}, group=False, owner="observe"),
    "gradsync.observe.chrome_trace": Target(
        lambda: {"per_rank": {}}, {"per_rank": RECORDS}, group=False, owner="observe"
    ),
    "gradsync.observe.median_breakdown": Target(
        lambda: {"steps": []},
        {"steps": OBJ(("not records", [1, 2])), "skip_first": INT(0)},
        group=False,
        owner="observe",
    ),
    "gradsync.observe.read_steps": Target(
        lambda: {"path": _empty_trace()},
        {"path": PATH(("not a trace", Make(_steps_file, "a JSON file that is no trace")))},
        group=False,
        owner="observe",
    ),
    "gradsync.observe.slowest_rank": Target(
        lambda: {"per_rank": {}}, {"per_rank": RECORDS}, group=False, owner="observe"
    ),
    "gradsync.observe.write_chrome_trace": Target(
        lambda: {"per_rank": {}, "path": text_file("", ".json")},
        {
            "per_rank": RECORDS,
            "path": OBJ(("a directory", Make(lambda: __import__("tempfile").mkdtemp(), "a directory"))),
        },
        group=False,
        owner="observe",
    ),
    "gradsync.checkpoint.set_rng_state": Target(
        lambda: {"state": __import__("gradsync").checkpoint.rng_state()},
        {"state": OBJ(("empty", {}), ("not a mapping", 3), ("another kind of state", {"torch": "x"}))},
        _set_rng,
        group=False,
    ),
    "gradsync.checkpoint.atomic_torch_save": Target(
        lambda: _over_prior({"obj": {"a": 1}}),
        {
            "obj": OBJ(("not picklable", Make(lambda: {"f": lambda: None}, "a dict holding a lambda"))),
            "path": OBJ(("a directory", Make(lambda: __import__("tempfile").mkdtemp(), "a directory")), ("None", None)),
        },
        group=False,
        disk=_prior_intact,
    ),
    "gradsync.checkpoint.save": Target(
        lambda: _over_prior({"model": fx.model()}),
        {
            "path": OBJ(("a directory", Make(lambda: __import__("tempfile").mkdtemp(), "a directory")), ("None", None)),
            "process_group": GROUP,
        },
        disk=_prior_intact,
    ),
    "gradsync.checkpoint.load": Target(
        lambda: {"path": _checkpoint_file()},
        {
            "path": PATH(("not a checkpoint", Make(text_file, "a text file"))),
            "map_location": OBJ(("not a device", "gpu0")),
        },
        group=False,
    ),
    "gradsync.checkpoint.restore": Target(
        lambda: {"checkpoint": __import__("gradsync").checkpoint.load(_checkpoint_file()), "model": fx.model()},
        {
            "checkpoint": OBJ(
                ("empty", {}), ("not a mapping", 3), ("a path, not loaded", Make(_checkpoint_file, "a path"))
            ),
            "restore_rng": BOOL(),
        },
        group=False,
    ),
    "gradsync.settings.read_bool": Target(
        lambda: {"name": "GRADSYNC_DEBUG", "default": False, "environ": {}},
        {
            "name": FREE("a variable's name"),
            "default": FREE(_DEFAULT),
            "environ": OBJ(("not a mapping", ["GRADSYNC_DEBUG=1"])),
        },
        group=False,
    ),
    "gradsync.settings.read_seconds": Target(
        lambda: {"name": "GRADSYNC_TIMEOUT", "default": 600.0, "environ": {}},
        {
            "name": FREE("a variable's name"),
            "default": FREE(_DEFAULT),
            "environ": OBJ(("not a mapping", ["GRADSYNC_TIMEOUT=1"])),
        },
        group=False,
    ),
    "gradsync.integrations.lightning.GradsyncStrategy": Target(
        lambda: {}, {"monitor": BOOL()}, group=False, owner="integrations"
    ),
    "gradsync.integrations.lightning.GradsyncFabricStrategy": Target(lambda: {}, {}, group=False, owner="integrations"),
    "gradsync.settings.debug": Target(lambda: {}, {"environ": OBJ(("not a mapping", ["x"]))}, group=False),
    "gradsync.settings.bucket_tuning": Target(lambda: {}, {"environ": OBJ(("not a mapping", ["x"]))}, group=False),
    "gradsync.settings.lending": Target(lambda: {}, {"environ": OBJ(("not a mapping", ["x"]))}, group=False),
    "gradsync.settings.in_elastic_job": Target(lambda: {}, {"environ": OBJ(("not a mapping", ["x"]))}, group=False),
    "gradsync.settings.timeout_seconds": Target(
        lambda: {"default": 600.0}, {"default": FREE(_DEFAULT), "environ": OBJ(("not a mapping", ["x"]))}, group=False
    ),
}
TABLE["gradsync.ZeroRedundancyOptimizer"] = TABLE["gradsync.ShardedOptimizer"]

# Public callables no user calls with values of their own typing, and why (each is still reached: see the reason).
UNSWEPT: dict[str, str] = {
    "gradsync.DistInfo": "a record gradsync.init returns",
    "gradsync.GradBucket": "built by the reducer for a comm hook; public for type annotations",
    "gradsync.shutdown": "takes nothing",
    "gradsync.comm.quantized_hook": "a comm hook: DDP calls it with (state, bucket); its state is swept",
    "gradsync.comm.hierarchical_hook": "a comm hook: DDP calls it with (state, bucket); its state is swept",
    "gradsync.comm.powerSGD_hook": "torch's hook, re-exported unchanged",
    "gradsync.comm.PowerSGDState": "torch's class, re-exported unchanged: its checks are torch's",
    "gradsync.comm.allreduce_hook": "torch's hook, re-exported unchanged",
    "gradsync.comm.bf16_compress_hook": "torch's hook, re-exported unchanged",
    "gradsync.comm.fp16_compress_hook": "torch's hook, re-exported unchanged",
    "gradsync.elastic.Membership": "built by gradsync.elastic.init from the launcher's store, not by users",
    "gradsync.elastic.Recovery": "a record gradsync reports",
    "gradsync.elastic.State": "needs a running gradsync run --elastic job; its parts (ElasticLoader) are swept",
    "gradsync.elastic.init": "needs gradsync run --elastic's store; its timeouts are Timeouts' and the variables'",
    "gradsync.observe.StepBreakdown": "a record median_breakdown returns",
    "gradsync.checkpoint.rng_state": "takes nothing",
    "gradsync.integrations.accelerate.gradsync_ddp": "takes nothing",
    "gradsync.testing.RankFailure": "a record spawn reports",
    "gradsync.testing.free_port": "a test helper: any host name is the caller's",
    "gradsync.testing.spawn": "the test helper every multi-rank case of the hand-written sweep runs through",
    "gradsync.testing.spawn_failures": "the test helper every multi-rank case of the hand-written sweep runs through",
}
