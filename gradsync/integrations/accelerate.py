"""Hugging Face Accelerate: ``with gradsync_ddp():`` makes ``accelerator.prepare(model)`` wrap with gradsync.

Accelerate builds torch's ``DistributedDataParallel`` itself, in ``Accelerator.prepare_model``, and recognises it
later with ``isinstance(model, torch.nn.parallel.DistributedDataParallel)`` (``unwrap_model``, ``no_sync``,
``trigger_sync_in_backward``). It offers no hook to choose another wrapper, so the least invasive way that works is
to let that name mean gradsync's class while you train: an explicit, reversible context manager.

Example::

    from accelerate import Accelerator
    from gradsync.integrations.accelerate import gradsync_ddp

    with gradsync_ddp():
        accelerator = Accelerator()
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        for x, y in loader:
            optimizer.zero_grad()
            accelerator.backward(loss_fn(model(x), y))
            optimizer.step()

Limits, because it swaps a module attribute:

- inside the block, everything that looks up ``torch.nn.parallel.DistributedDataParallel`` gets gradsync's class,
  including code that wants torch's; code that imported the name before the block keeps torch's class;
- the swap is process-wide (not per thread); nesting is allowed, and leaving the block restores torch's class;
- ``DistributedDataParallelKwargs`` handlers pass their arguments through (gradsync accepts torch's names).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.nn.parallel
import torch.nn.parallel.distributed

from gradsync.ddp import DistributedDataParallel

_PLACES = (torch.nn.parallel, torch.nn.parallel.distributed)


@contextlib.contextmanager
def gradsync_ddp() -> Iterator[type[DistributedDataParallel]]:
    """Inside the block, ``torch.nn.parallel.DistributedDataParallel`` is gradsync's class.

    Example::

        from accelerate import Accelerator
        from gradsync.integrations.accelerate import gradsync_ddp

        with gradsync_ddp():
            accelerator = Accelerator()
            model, optimizer = accelerator.prepare(model, optimizer)   # model is now gradsync's DDP
    """
    saved = [place.DistributedDataParallel for place in _PLACES]  # type: ignore[attr-defined]
    try:
        for place in _PLACES:
            place.DistributedDataParallel = DistributedDataParallel  # type: ignore[attr-defined,misc]
        yield DistributedDataParallel
    finally:
        for place, original in zip(_PLACES, saved):
            place.DistributedDataParallel = original  # type: ignore[attr-defined,misc]
