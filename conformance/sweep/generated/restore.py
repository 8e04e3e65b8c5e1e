"""Objects restored from a checkpoint: for each public class with ``load_state_dict``, how to build one, the use
that shows a restored state works, and the states users restore by mistake (empty, not a mapping, saved by another
model, another optimizer, another world size or dataset). ``gradsync.checkpoint.restore`` is swept the same way.
tests/test_generated_sweep.py fails when a public class with ``load_state_dict`` has no entry here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from conformance.sweep.generated import fixtures as fx
from conformance.sweep.generated.values import Make


@dataclasses.dataclass
class Restored:
    make: Callable[[], Any]  # a fresh object, as a resumed run builds it
    use: Callable[[Any], Any]  # what shows the restored state works
    states: tuple[tuple[str, Any], ...]  # (label, a wrong state)
    load: Callable[[Any, Any], Any] = lambda obj, state: obj.load_state_dict(state)
    owner: str = "mine"
    saved: Callable[[], Any] | None = None  # a valid state (default: a fresh object's state_dict()), which must load

    def valid_state(self) -> Any:
        return self.saved() if self.saved is not None else self.make().state_dict()


COMMON = (("empty", {}), ("not a mapping", 3))


def _sampler(cls_name: str, **kwargs: Any) -> Callable[[], Any]:
    def make() -> Any:
        import gradsync

        return getattr(gradsync, cls_name)(**{"num_replicas": 1, "rank": 0, **kwargs})

    return make


def _sampler_states(cls_name: str, **kwargs: Any) -> tuple[tuple[str, Any], ...]:
    other_world = _sampler(cls_name, **{**kwargs, "num_replicas": 2, "rank": 1})
    other_data = _sampler(cls_name, **{**kwargs, "dataset": fx.TOKENS * 3})
    return (
        *COMMON,
        ("saved at another world size", Make(lambda: other_world().state_dict(), "a state of rank 1 of 2")),
        ("saved over another dataset", Make(lambda: other_data().state_dict(), "a state over 30 items")),
        ("an optimizer's state", Make(lambda: torch.optim.SGD(fx.model().parameters(), lr=0.1).state_dict(), "SGD's")),
    )


def _trained_sharded(width: int = 8, cls: type = torch.optim.Adam) -> Any:
    import gradsync

    fx.group1()
    m = fx.model(width=width)
    opt = gradsync.ShardedOptimizer(m.parameters(), cls, lr=0.01)
    fx.train(m, opt, steps=1)
    opt._model = m  # type: ignore[attr-defined]
    opt.consolidate_state_dict(to=0)  # its state_dict() is rank 0's consolidated one
    return opt


def _trained_overlapped(width: int = 8, cls: type = torch.optim.Adam) -> Any:
    from gradsync.optim import OverlappedOptimizer

    d = fx.ddp(width=width)
    opt = OverlappedOptimizer(d, cls, lr=0.01)
    fx.train(d, opt, steps=1)
    opt._model = d  # type: ignore[attr-defined]
    return opt


def _optimizer_states(trained: Callable[..., Any]) -> tuple[tuple[str, Any], ...]:
    return (
        *COMMON,
        ("another model's", Make(lambda: trained(width=16).state_dict(), "the state of a model 16 wide")),
        ("another optimizer's", Make(lambda: trained(cls=torch.optim.SGD).state_dict(), "an SGD state into Adam")),
        ("a plain optimizer's of another model", Make(lambda: _plain_state(16), "torch Adam's over another model")),
    )


def _plain_state(width: int) -> dict[str, Any]:
    m = fx.model(width=width)
    opt = torch.optim.Adam(m.parameters(), lr=0.01)
    fx.train(m, opt, steps=1)
    return opt.state_dict()


def _periodic(cls_name: str, **kwargs: Any) -> Callable[..., Any]:
    def make(width: int = 8) -> Any:
        import gradsync.comm

        d = fx.ddp(width=width)
        obj = getattr(gradsync.comm, cls_name)(d, period=2, **kwargs)
        obj._ddp_for_sweep = d
        return obj

    return make


def _periodic_use(obj: Any) -> None:
    d = obj._ddp_for_sweep
    opt = torch.optim.SGD(d.parameters(), lr=0.1)
    for step in range(3):
        opt.zero_grad()
        d(fx.batch(step)).pow(2).mean().backward()
        opt.step()
        obj.step()


def _periodic_states(make: Callable[..., Any]) -> tuple[tuple[str, Any], ...]:
    def other() -> Any:
        obj = make(width=16)
        _periodic_use(obj)
        return obj.state_dict()

    return (*COMMON, ("another model's", Make(other, "the state of a model 16 wide")))


def _checkpoint_of(width: int) -> dict[str, Any]:
    import gradsync
    from conformance.sweep.generated.values import text_file

    file = text_file("", ".pt")
    gradsync.checkpoint.save(file, model=fx.model(width=width))
    return gradsync.checkpoint.load(file)


def _restore(obj: Any, state: Any) -> Any:
    import gradsync

    return gradsync.checkpoint.restore(state, model=obj, restore_rng=False)


def _elastic_loader() -> Any:
    from gradsync.elastic import ElasticLoader

    return ElasticLoader(fx.DATASET, batch_size=2)


RESTORED: dict[str, Restored] = {
    "gradsync.DistributedSampler": Restored(
        _sampler("DistributedSampler", dataset=fx.TOKENS),
        fx.iterate,
        _sampler_states("DistributedSampler", dataset=fx.TOKENS),
    ),
    "gradsync.LengthGroupedSampler": Restored(
        _sampler("LengthGroupedSampler", dataset=fx.TOKENS, batch_size=2),
        fx.iterate,
        _sampler_states("LengthGroupedSampler", dataset=fx.TOKENS, batch_size=2),
    ),
    "gradsync.DistributedLoader": Restored(
        _sampler("DistributedLoader", dataset=fx.TOKENS, batch_size=2, collate_fn=lambda b: b),
        lambda loader: list(loader),
        _sampler_states("DistributedLoader", dataset=fx.TOKENS, batch_size=2, collate_fn=lambda b: b),
    ),
    "gradsync.ShardedOptimizer": Restored(
        _trained_sharded, lambda opt: fx.train(opt._model, opt), _optimizer_states(_trained_sharded)
    ),
    "gradsync.optim.OverlappedOptimizer": Restored(
        _trained_overlapped, lambda opt: fx.train(opt._model, opt), _optimizer_states(_trained_overlapped)
    ),
    "gradsync.comm.DiLoCo": Restored(_periodic("DiLoCo"), _periodic_use, _periodic_states(_periodic("DiLoCo"))),
    "gradsync.comm.StreamingDiLoCo": Restored(
        _periodic("StreamingDiLoCo", fragments=2),
        _periodic_use,
        _periodic_states(_periodic("StreamingDiLoCo", fragments=2)),
    ),
    # Its state is a step count, the same for any model: another model's is a valid state, not a wrong one.
    "gradsync.comm.PostLocalSGD": Restored(
        _periodic("PostLocalSGD"), _periodic_use, (*COMMON, ("a negative count", {"step_count": -1}))
    ),
    "gradsync.elastic.ElasticLoader": Restored(
        _elastic_loader,
        lambda loader: list(loader),
        (*COMMON, ("saved over another dataset", Make(lambda: _other_elastic_state(), "a state over 30 items"))),
        owner="elastic",
    ),
    "gradsync.DistributedDataParallel": Restored(
        fx.ddp,
        fx.train,
        (*COMMON, ("another model's", Make(lambda: fx.model(width=16).state_dict(), "a model 16 wide's"))),
        owner="ddp",  # nn.Module.load_state_dict, through DDP
    ),
    "gradsync.SyncBatchNorm": Restored(
        lambda: __import__("gradsync").SyncBatchNorm(4),
        lambda bn: bn(torch.randn(4, 4, 3)).sum().backward(),
        (*COMMON, ("another model's", Make(lambda: torch.nn.BatchNorm1d(8).state_dict(), "BatchNorm1d(8)'s"))),
        owner="torch",  # nn.Module.load_state_dict, torch's own
    ),
    "gradsync.checkpoint.restore": Restored(
        fx.model,
        fx.train,
        (
            ("another model's checkpoint", Make(lambda: _checkpoint_of(16), "a checkpoint of a model 16 wide")),
            ("empty", {}),
        ),
        load=_restore,
        saved=lambda: _checkpoint_of(8),
    ),
}


def _other_elastic_state() -> dict[str, Any]:
    from gradsync.elastic import ElasticLoader

    loader = ElasticLoader(list(range(30)), batch_size=2)
    it = iter(loader)
    next(it)
    return loader.state_dict()
