"""Every case of the sweep, one module per category; importing this package registers them all in order."""

from __future__ import annotations

from conformance.sweep.cases import (  # noqa: F401  (imported to register their cases)
    checkpoint,
    constructor,
    data,
    environment,
    hooks,
    launcher,
    misc,
    mismatch,
    optimizer,
    rank_dependent,
    training,
)
from conformance.sweep.core import CASES, Case


def by_name() -> dict[str, Case]:
    return {c.name: c for c in CASES}
