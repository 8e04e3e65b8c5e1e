"""A package's public names, imported at their first use (PEP 562's module ``__getattr__``) instead of with the
package.

``gradsync`` and ``gradsync.elastic`` export this way so that the ``gradsync`` command (the launcher, report, plan,
doctor) imports only what it runs: a launcher that imported the whole library would first import torch.compile's
and DTensor's machinery (seconds of CPU on a busy machine) before starting any worker, and a training worker imports
it anyway, at its optimizer's first step. ``import gradsync`` then ``gradsync.DistributedDataParallel(...)`` or
``from gradsync.elastic import State`` work as with eager imports.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy(package: str, defined_in: Mapping[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``, whose public name ``n`` is defined in module ``defined_in[n]``
    (the submodule ``package.n`` itself where that is its value).

    >>> getattr_, dir_ = lazy("gradsync", {"GradsyncError": "gradsync.errors"})
    >>> getattr_("GradsyncError").__name__, "GradsyncError" in dir_()
    ('GradsyncError', True)
    """

    def __getattr__(name: str) -> Any:
        where = defined_in.get(name)
        if where is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module = importlib.import_module(where)
        value = module if where == f"{package}.{name}" else getattr(module, name)
        setattr(importlib.import_module(package), name, value)  # the next lookup is an ordinary attribute
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(importlib.import_module(package))) | set(defined_in))

    return __getattr__, __dir__
