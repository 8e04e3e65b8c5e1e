"""Synthetic-compute models: real parameter and gradient tensors with the per-layer shapes of ResNet-50, BERT-base
and GPT-2 small, whose forward and backward take a prescribed time (a sleep inside a custom autograd Function), so
that many ranks fit on two cores: a waiting rank sleeps instead of burning a core.

Layer times come from a stated profile: each model's fwd+bwd time per step on one V100 at the DDP paper's batch
sizes (``PROFILES_S``), split across layers in proportion to their multiply-adds (``_cost``: a convolution's
parameters times its output positions; a transformer matrix's parameters; embedding lookups nearly free), backward
twice forward. Gradients become ready in reverse layer order, as in a real backward. The gradients are what a real
backward would produce in size and order, filled with known values, so averaging can be checked exactly.

Scaling (``scale``): parameter counts are divided by ``scale`` and link rates too (bench/scale/), which keeps the
communication-to-compute ratio while gloo's CPU work stays small enough for 2 cores.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

# Per-step (forward + backward) compute on one V100, fp32, the DDP paper's per-GPU batch sizes: ResNet-50 at 32
# images and BERT-base at 128-token sequences, 16 per GPU (Li et al., VLDB 2020, section 5); GPT-2 small at 8 x 1024
# tokens. Forward is a third of the step, backward two thirds (the usual 1:2 ratio).
PROFILES_S = {"resnet50": 0.105, "bert": 0.160, "gpt2": 0.190}


def resnet50_shapes() -> list[tuple[str, tuple[int, ...]]]:
    shapes: list[tuple[str, tuple[int, ...]]] = [("conv1", (64, 3, 7, 7)), ("bn1", (64,)), ("bn1.b", (64,))]
    inplanes = 64
    for stage, (planes, blocks) in enumerate(zip((64, 128, 256, 512), (3, 4, 6, 3))):
        for b in range(blocks):
            p = f"layer{stage + 1}.{b}"
            shapes += [(f"{p}.conv1", (planes, inplanes, 1, 1)), (f"{p}.bn1", (planes,)), (f"{p}.bn1.b", (planes,))]
            shapes += [(f"{p}.conv2", (planes, planes, 3, 3)), (f"{p}.bn2", (planes,)), (f"{p}.bn2.b", (planes,))]
            shapes += [(f"{p}.conv3", (planes * 4, planes, 1, 1)), (f"{p}.bn3", (planes * 4,))]
            shapes += [(f"{p}.bn3.b", (planes * 4,))]
            if b == 0:
                shapes += [(f"{p}.down", (planes * 4, inplanes, 1, 1)), (f"{p}.down.bn", (planes * 4,))]
                shapes += [(f"{p}.down.bn.b", (planes * 4,))]
            inplanes = planes * 4
    return shapes + [("fc", (1000, 2048)), ("fc.b", (1000,))]


def _transformer(prefix: str, layers: int, d: int, ff: int, qkv_fused: bool) -> list[tuple[str, tuple[int, ...]]]:
    shapes: list[tuple[str, tuple[int, ...]]] = []
    for i in range(layers):
        p = f"{prefix}.{i}"
        if qkv_fused:
            shapes += [(f"{p}.attn.qkv", (3 * d, d)), (f"{p}.attn.qkv.b", (3 * d,))]
        else:
            for name in ("q", "k", "v"):
                shapes += [(f"{p}.attn.{name}", (d, d)), (f"{p}.attn.{name}.b", (d,))]
        shapes += [(f"{p}.attn.out", (d, d)), (f"{p}.attn.out.b", (d,)), (f"{p}.ln1", (d,)), (f"{p}.ln1.b", (d,))]
        shapes += [(f"{p}.ff1", (ff, d)), (f"{p}.ff1.b", (ff,)), (f"{p}.ff2", (d, ff)), (f"{p}.ff2.b", (d,))]
        shapes += [(f"{p}.ln2", (d,)), (f"{p}.ln2.b", (d,))]
    return shapes


def bert_shapes() -> list[tuple[str, tuple[int, ...]]]:
    embed = [("word", (30522, 768)), ("position", (512, 768)), ("type", (2, 768)), ("ln", (768,)), ("ln.b", (768,))]
    return embed + _transformer("layer", 12, 768, 3072, False) + [("pooler", (768, 768)), ("pooler.b", (768,))]


def gpt2_shapes() -> list[tuple[str, tuple[int, ...]]]:
    embed = [("wte", (50257, 768)), ("wpe", (1024, 768))]
    return embed + _transformer("h", 12, 768, 3072, True) + [("ln_f", (768,)), ("ln_f.b", (768,))]


SHAPES = {"resnet50": resnet50_shapes, "bert": bert_shapes, "gpt2": gpt2_shapes}


class _Timed(torch.autograd.Function):
    """Sleeps ``forward_s`` in forward and ``backward_s`` in backward; the gradient of each parameter is
    ``value`` everywhere (the rank's own number, so the average is known)."""

    @staticmethod
    def forward(ctx, x, forward_s, backward_s, value, *params):  # type: ignore[override]
        time.sleep(forward_s)
        ctx.backward_s, ctx.value, ctx.shapes = backward_s, value, [p.shape for p in params]
        return x.clone()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        time.sleep(ctx.backward_s)
        grads = [torch.full(shape, ctx.value) for shape in ctx.shapes]
        return (grad, None, None, None, *grads)


@dataclass(frozen=True)
class Layer:
    names: list[str]
    forward_s: float
    backward_s: float


class SyntheticModel(nn.Module):
    """``model`` ("resnet50", "bert", "gpt2") with parameters ``scale`` times smaller, grouped into ``layers``
    groups of consecutive tensors, each taking its share of the profiled step time (times ``time_scale``)."""

    def __init__(self, model: str, scale: float = 1.0, layers: int = 24, time_scale: float = 1.0) -> None:
        super().__init__()
        shapes = SHAPES[model]()
        self.params = nn.ParameterList(nn.Parameter(torch.zeros(_scaled(s, scale))) for _, s in shapes)
        costs = [_cost(model, name, shape) for name, shape in shapes]
        self.layers = _split(costs, layers, PROFILES_S[model] * time_scale)
        self.value = 1.0  # what this rank's gradients hold; set per rank to check the averages
        # Each layer's parameters, listed once: slicing the ParameterList in every forward builds a new module per
        # layer (~1.5 ms of CPU per forward), which the lab's shared cores would charge to whichever DDP runs.
        params, self._members = list(self.params), []
        for layer in self.layers:
            self._members.append(params[: len(layer.names)])
            params = params[len(layer.names) :]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer, members in zip(self.layers, self._members):
            x = _Timed.apply(x, layer.forward_s, layer.backward_s, self.value, *members)
        return x.sum()

    @property
    def grad_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.params)


def _scaled(shape: tuple[int, ...], scale: float) -> tuple[int, ...]:
    """The shape with its first dimension divided by ``scale`` (at least 1): the same tensors, fewer bytes."""
    return (max(1, math.ceil(shape[0] / scale)), *shape[1:])


# Output positions per ResNet-50 stage at 224 x 224 input (conv1: 112 x 112, then 56, 28, 14, 7).
_RESNET_POSITIONS = {"conv1": 112 * 112, "layer1": 56 * 56, "layer2": 28 * 28, "layer3": 14 * 14, "layer4": 7 * 7}


def _cost(model: str, name: str, shape: tuple[int, ...]) -> float:
    """Relative multiply-adds of the layer owning this tensor."""
    params = math.prod(shape)
    if model == "resnet50":
        return params * _RESNET_POSITIONS.get(name.split(".")[0], 1)
    if name in ("word", "position", "type", "wte", "wpe"):
        return params * 1e-3  # a lookup; GPT-2's tied output projection is counted in the last layer below
    return params


def _split(costs: Sequence[float], layers: int, step_s: float) -> list[Layer]:
    total = sum(costs)
    per_group = math.ceil(len(costs) / layers)
    out = []
    for start in range(0, len(costs), per_group):
        share = sum(costs[start : start + per_group]) / total
        names = [str(i) for i in range(start, min(start + per_group, len(costs)))]
        out.append(Layer(names, step_s * share / 3, 2 * step_s * share / 3))
    return out
