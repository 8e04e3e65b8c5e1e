"""What a record of the registry is: a torch name gradsync depends on (:class:`PrivateName`) or a public API that
sets the oldest torch it runs on (:class:`PublicApi`), the releases each was checked in, and the resolvers that
check one in the installed torch (each raises where torch lacks it)."""

from __future__ import annotations

import inspect
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from gradsync.errors import GradsyncError

CHECKED_VERSIONS = ("2.4.0", "2.5.0", "2.6.0", "2.7.0", "2.8.0", "2.9.0", "2.10.0", "2.11.0", "2.12.0", "2.13.0")
FLOOR = "2.4"
RAN = "check() and the accessor run in 2.4.0, 2.8.0 and 2.13.0"
READ = "read in the 2.5.0-2.7.0 and 2.9.0-2.12.0 wheels"


class TorchCompatError(GradsyncError):
    """The installed torch lacks a private name gradsync needs (the message names it and the torch version)."""


@dataclass(frozen=True)
class PrivateName:
    """One torch name gradsync depends on: where, why, which torch releases it was checked in, and how."""

    name: str  # as torch spells it
    used_in: tuple[str, ...]  # gradsync's files that use it (through an accessor here, or compiled.py)
    why: str
    checked: tuple[str, ...]
    how: str
    resolve: Callable[[], object] = field(repr=False, compare=False)  # raises where the installed torch lacks it
    fallback: str = ""  # what gradsync does without it; "" where the accessor fails instead
    seam: str = ""  # "compile": what gradsync.ddp.compiled needs to split graphs; "compile-notice": to warn;
    # "speed": a fast path only, which without the name does what torch does at torch's cost (no import warning)


@dataclass(frozen=True)
class PublicApi:
    """A public torch API gradsync needs that older releases lack: these set the floor with the private names."""

    name: str
    since: str  # the release that introduced it, where that is below the floor it is only a lower bound
    how: str
    resolve: Callable[[], object] = field(repr=False, compare=False)
    fallback: str = ""  # what gradsync does on a release without it; empty: the API sets the floor


def attribute(dotted: str) -> Callable[[], object]:
    """A resolver for ``module.attr.attr`` (the stdlib's ``pkgutil.resolve_name``: the longest importable module
    prefix, then attributes)."""
    return lambda: pkgutil.resolve_name(dotted)


def source_has(dotted: str, *needles: str) -> Callable[[], object]:
    """A resolver that reads ``dotted``'s source and requires each of ``needles`` in it."""

    def resolve() -> object:
        source = inspect.getsource(attribute(dotted)())  # type: ignore[arg-type]
        absent = [n for n in needles if n not in source]
        if absent:
            raise AttributeError(f"{dotted} no longer contains {absent}")
        return True

    return resolve


def takes_parameter(dotted: str, parameter: str) -> Callable[[], object]:
    """A resolver for a function that takes ``parameter``."""
    return lambda: inspect.signature(attribute(dotted)()).parameters[parameter]  # type: ignore[arg-type]


def needed(name: str) -> TorchCompatError:
    """The error an accessor raises when the installed torch lacks ``name`` and gradsync has no other way."""
    return TorchCompatError(
        f"this torch ({torch.__version__}) lacks {name}, which gradsync needs here; gradsync was checked against "
        f"torch {CHECKED_VERSIONS[0]} to {CHECKED_VERSIONS[-1]}."
    )
