"""A full optimizer state dict checked against the optimizer it is loaded into, before anything is changed.

torch's ``Optimizer.load_state_dict`` checks only the number of parameters per group: a state saved by another
model with as many parameters is loaded and fails at the next step (a shape mismatch inside the update), and one
saved by another optimizer class replaces the hyperparameters with ones that lack what this class reads (Adam's
``betas``: ``KeyError`` at the step). Refused here by name, with what was saved and what to load instead.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch.optim import Optimizer

from gradsync.errors import ConfigError
from gradsync.validate import require_state


def check_saved_state(
    where: str,
    saved: object,
    groups: Sequence[Sequence[torch.Tensor]],
    probe: Callable[[], Optimizer],
    current: Sequence[Mapping[str, Any]],
) -> dict[str, Any]:
    """``saved`` if it is a full state dict (torch's layout) that fits parameters ``groups``, saved by this
    optimizer class; else a :class:`ConfigError` naming what does not fit. ``probe``: a fresh optimizer of this
    class over one placeholder parameter; ``current``: each group's hyperparameters now, which fill those a state
    saved by gradsync before 0.1.1 left out (it kept only the ones given, not the class's: Adam's ``betas``)."""
    state = require_state(where, saved, ("state", "param_groups"))
    saved_groups = state["param_groups"]
    if not isinstance(saved_groups, Sequence) or not all(
        isinstance(g, Mapping) and "params" in g for g in saved_groups
    ):
        raise ConfigError(
            f"{where}: the state's param_groups is not a list of groups with 'params': {saved_groups!r:.80}"
        )
    sizes, mine = [len(g["params"]) for g in saved_groups], [len(g) for g in groups]
    if sizes != mine:
        raise ConfigError(
            f"{where}: the state was saved for parameter groups of sizes {sizes}, this optimizer has {mine}; "
            "load the state saved over the same model's parameters, in the same groups."
        )
    filled = [_completed(where, k, g, probe, current[k]) for k, g in enumerate(saved_groups)]
    _check_shapes(where, state["state"], [p for g in groups for p in g], saved_groups)
    return {**state, "param_groups": filled}


def _completed(
    where: str, k: int, group: Mapping[str, Any], probe: Callable[[], Optimizer], current: Mapping[str, Any]
) -> dict[str, Any]:
    """The saved group with every hyperparameter the class keeps: loaded into a probe (torch's ``__setstate__``
    fills what older torch releases did not save), then from ``current``; a group that lacks one and holds
    hyperparameters this class does not know was saved by another optimizer class, and is refused."""
    opt = probe()
    used = set(opt.param_groups[0]) - {"params"}
    opt.load_state_dict({"state": {}, "param_groups": [{**group, "params": [0]}]})
    lacking = sorted(used - set(opt.param_groups[0]))
    foreign = sorted(set(group) - used - {"params"})
    if lacking and foreign:
        raise ConfigError(
            f"{where}: the state's param_groups[{k}] has no {', '.join(map(repr, lacking))}, which this optimizer "
            f"uses, and has {', '.join(map(repr, foreign))}, which it does not: it was saved by another optimizer "
            "class. Load a state saved by the same optimizer class."
        )
    return {**{name: current[name] for name in lacking}, **group}


def _check_shapes(where: str, per_param: object, params: list[torch.Tensor], groups: Sequence[Mapping]) -> None:
    if not isinstance(per_param, Mapping):
        raise ConfigError(f"{where}: the state's 'state' must map parameter indices to states, got {per_param!r:.60}")
    ids = [i for g in groups for i in g["params"]]
    for position, index in enumerate(ids):
        for name, value in dict(per_param.get(index, {})).items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != params[position].shape:
                raise ConfigError(
                    f"{where}: the state of parameter {index} has {name} of shape {tuple(value.shape)}, the "
                    f"parameter is {tuple(params[position].shape)}: it was saved by another model. Load the "
                    "state saved over this model's parameters."
                )


def prober(optimizer_class: type[Optimizer], defaults: Mapping[str, Any]) -> Callable[[], Optimizer]:
    """A fresh ``optimizer_class(**defaults)`` over one placeholder parameter, for :func:`check_saved_state`."""
    return lambda: optimizer_class([torch.zeros(1, requires_grad=True)], **defaults)
