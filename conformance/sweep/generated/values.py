"""Valid domains, and the wrong values generated from them: what users type by mistake.

A parameter's :class:`Domain` says which values are valid; :func:`wrong_values` derives, from the domain alone, the
wrong ones to try (a wrong type, out of range, zero, negative, NaN, inf, huge, empty, ...). A domain is derived
from the parameter's type hint and default where they say enough (``bool``, ``int`` with a default of 0), and is
otherwise written in the table (domains.py), derived from the check the code already does or the meaning of the
argument. ``free`` means no value of the right kind is wrong (a name, a seed), so nothing is generated.
"""

from __future__ import annotations

import dataclasses
import math
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


@dataclasses.dataclass(frozen=True)
class Make:
    """A wrong value built in the case's own process (a tensor, a file), shown as ``text``."""

    build: Callable[[], Any]
    text: str
    shows: tuple[str, ...] = ()  # texts of which one, in an error, shows this value (default: its type's name)

    def __repr__(self) -> str:
        return self.text


@dataclasses.dataclass(frozen=True)
class Domain:
    """``kind``: int, number, bool, choice, path, object, free. ``low``/``high``: the valid range (``open_low``:
    ``low`` itself is not valid). ``bad``: more wrong values, (label, value or :class:`Make`). ``why``: for free, why
    nothing is wrong."""

    kind: str
    low: float | None = None
    high: float | None = None
    open_low: bool = False
    choices: tuple[Any, ...] = ()
    bad: tuple[tuple[str, Any], ...] = ()
    why: str = ""
    optional: bool = False  # None is valid
    good: tuple[tuple[str, Any], ...] = ()  # unusual values that are valid: each must be accepted


def INT(low: int | None = None, high: int | None = None, *bad: tuple[str, Any], optional: bool = False) -> Domain:
    return Domain("int", low=low, high=high, bad=bad, optional=optional)


def NUM(low: float | None = 0.0, high: float | None = None, open_low: bool = True, *bad: tuple[str, Any]) -> Domain:
    return Domain("number", low=low, high=high, open_low=open_low, bad=bad)


def BOOL(optional: bool = False) -> Domain:
    return Domain("bool", optional=optional)


def CHOICE(*choices: Any) -> Domain:
    return Domain("choice", choices=choices)


def OBJ(*bad: tuple[str, Any], good: tuple[tuple[str, Any], ...] = ()) -> Domain:
    return Domain("object", bad=bad, good=good)


def FREE(why: str) -> Domain:
    return Domain("free", why=why)


def PATH(*bad: tuple[str, Any]) -> Domain:
    """A file to read: missing, a directory, and what else the table adds (a file of the wrong kind)."""
    return Domain("path", bad=(("missing path", MISSING), ("a directory", DIRECTORY), *bad))


def _missing() -> str:
    return str(Path(tempfile.mkdtemp(prefix="sweep-")) / "no-such-dir" / "missing.pt")


def _directory() -> str:
    return tempfile.mkdtemp(prefix="sweep-dir-")


def text_file(text: str = "this is not a checkpoint\n", suffix: str = ".txt") -> str:
    fd, name = tempfile.mkstemp(prefix="sweep-", suffix=suffix)
    with open(fd, "w") as fh:
        fh.write(text)
    return name


MISSING = Make(_missing, "a path that does not exist")
DIRECTORY = Make(_directory, "a directory")
NOT_PEM = Make(lambda: text_file("not a certificate\n", ".pem"), "a file that is not PEM")


def wrong_values(domain: Domain) -> list[tuple[str, Any]]:
    """(label, value) for each wrong value of ``domain``."""
    values = _GENERATORS.get(domain.kind, lambda d: [])(domain)
    return [*values, *domain.bad]


def _ints(d: Domain) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = [("wrong type: str", "4"), ("wrong type: float", 2.5), ("NaN", math.nan)]
    if not d.optional:
        out.append(("None", None))
    if d.low is not None:
        below = int(d.low) - 1
        out.append(("zero" if below == 0 else "negative" if below < 0 else f"below {int(d.low)}", below))
        if below > -1:
            out.append(("negative", -1))
    if d.high is not None:
        out.append(("huge", 10**18))
    return out


def _numbers(d: Domain) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = [("wrong type: str", "0.5"), ("NaN", math.nan), ("inf", math.inf), ("-inf", -math.inf)]
    if d.low is not None:
        if d.open_low:
            out.append(("zero" if d.low == 0 else f"at {d.low:g}", float(d.low)))
        if d.low >= 0:
            out.append(("negative", -1.0))
    if d.high is not None:
        out.append(("huge", 1e30))
    return out


_GENERATORS: dict[str, Callable[[Domain], list[tuple[str, Any]]]] = {
    "int": _ints,
    "number": _numbers,
    "bool": lambda d: [("wrong type: str", "false")],
    "choice": lambda d: [("unknown", "nonsense"), ("empty", "")],
    "path": lambda d: [],
    "object": lambda d: [],
    "free": lambda d: [],
}


def built(value: Any) -> Any:
    return value.build() if isinstance(value, Make) else value


def shown(value: Any) -> list[str]:
    """Texts any of which, in an error, shows the value it got."""
    if isinstance(value, Make):
        return []  # built at run time: the case adds the built value's own text
    if isinstance(value, float) and not math.isfinite(value):
        return [str(value), repr(value)]
    texts = [repr(value), str(value), type(value).__name__]
    if isinstance(value, (list, tuple, dict)):  # an error may show the length, or the first wrong element
        texts += [str(len(value)), *(repr(v) for v in list(value)[:3])] + ([] if value else ["empty"])
    return [t for t in texts if t]
