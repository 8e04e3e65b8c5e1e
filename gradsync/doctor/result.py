"""What one check of ``gradsync doctor`` found."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal

Status = Literal["ok", "warn", "fail", "skip"]


@dataclass(frozen=True)
class Result:
    """One check's verdict. ``fail``: a job with these flags would fail here; ``warn``: it may, or it works with a
    caveat; ``skip``: the check does not apply (or could not run, and says why). ``optional``: only gradsync's lab
    needs this (tests and benchmarks in network namespaces), so it never fails a job."""

    name: str
    status: Status
    detail: str
    fix: str = ""
    optional: bool = False

    def as_json(self) -> dict[str, object]:
        return asdict(self)


def fails_a_job(results: list[Result]) -> bool:
    """Whether a job with these flags would fail: some check that a job needs failed."""
    return any(r.status == "fail" and not r.optional for r in results)
