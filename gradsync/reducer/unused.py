"""Which parameters will get no gradient in this backward: a walk of the autograd graph from the outputs.

torch's DDP does the same walk in C++ (``Reducer::prepare_for_backward``) when ``find_unused_parameters=True``:
a parameter whose ``AccumulateGrad`` node is not reachable from any output tensor will never fire its hook, so the
reducer must count it ready itself or its bucket would never be launched.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch


def reachable_parameter_ids(outputs: Iterable[torch.Tensor]) -> set[int]:
    """``id()`` of every leaf tensor whose gradient the outputs' graph would accumulate."""
    reached: set[int] = set()
    seen: set = set()
    stack = []
    for t in outputs:
        if t.grad_fn is not None:
            stack.append(t.grad_fn)
        elif t.requires_grad:  # a parameter returned as-is
            reached.add(id(t))
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # AccumulateGrad nodes hold their leaf
        if variable is not None:
            reached.add(id(variable))
        for child, _ in node.next_functions:
            if child is not None and child not in seen:
                stack.append(child)
    return reached


def unused_parameter_indices(outputs: Iterable[torch.Tensor], params: Sequence[torch.Tensor]) -> list[int]:
    """Indices into ``params`` of the parameters the outputs do not depend on."""
    reached = reachable_parameter_ids(outputs)
    return [i for i, p in enumerate(params) if id(p) not in reached]
