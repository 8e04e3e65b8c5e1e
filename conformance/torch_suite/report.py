"""The results file (merged across runs), the counts table and the list of gradsync regressions."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from conformance.torch_suite.not_applicable import NOT_APPLICABLE
from conformance.torch_suite.runner import Outcome
from lab.results import write_json

STATUSES = ("passed", "failed", "skipped", "timeout")
KINDS = ("torch", "gradsync")
BROKEN = ("failed", "timeout")

Results = dict[str, dict[str, Any]]


def load(path: Path, selection: dict[str, str]) -> Results:
    """Per-test entries of an earlier run, for the tests still selected (a gradsync-only rerun keeps torch's)."""
    if not path.exists():
        return {}
    tests = json.loads(path.read_text()).get("tests", {})
    return {name: entry for name, entry in tests.items() if name in selection}


def load_meta(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()).get("meta", {}) if path.exists() else {}


def load_provenance(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()).get("provenance") if path.exists() else None


def record(results: Results, name: str, base: str, kind: str, outcome: Outcome) -> None:
    entry = results.setdefault(name, {})
    entry["base"] = base
    entry[kind] = outcome.to_json()
    annotate(results)


def annotate(results: Results) -> None:
    """(Re)apply the not-applicable list to every entry, also those loaded from an earlier run."""
    for name, entry in results.items():
        entry["not_applicable"] = not_applicable_reason(name, entry.get("base", name))


def not_applicable_reason(name: str, base: str) -> str | None:
    return NOT_APPLICABLE.get(name) or NOT_APPLICABLE.get(base)


def status(entry: dict[str, Any], kind: str) -> str | None:
    return entry.get(kind, {}).get("status")


def counts(results: Results) -> dict[str, Any]:
    table: dict[str, Any] = {
        kind: dict(Counter(status(e, kind) for e in results.values() if kind in e)) for kind in KINDS
    }
    table["not_applicable"] = sum(1 for e in results.values() if e.get("not_applicable"))
    return table


def regressions(results: Results) -> list[dict[str, str]]:
    """Tests torch passes and gradsync fails or hangs, not marked not-applicable: what gradsync should fix."""
    return [
        {"test": name, "summary": e["gradsync"]["summary"], "tail": e["gradsync"]["tail"], "log": e["gradsync"]["log"]}
        for name, e in sorted(results.items())
        if status(e, "torch") == "passed" and status(e, "gradsync") in BROKEN and not e.get("not_applicable")
    ]


def gradsync_only_passes(results: Results) -> list[str]:
    return sorted(n for n, e in results.items() if status(e, "gradsync") == "passed" and status(e, "torch") in BROKEN)


def write(path: Path, results: Results, meta: dict[str, Any], made_by: dict[str, Any] | None = None) -> None:
    """The results file, with its provenance (``made_by``: that of the run that made the results, when only the
    report is refreshed)."""
    document = {
        "meta": meta,
        "counts": counts(results),
        "regressions": regressions(results),
        "gradsync_passes_torch_fails": gradsync_only_passes(results),
        "tests": dict(sorted(results.items())),
    }
    write_json(path, document, made_by=made_by)


def format_table(results: Results) -> str:
    table = counts(results)
    width = max(len(s) for s in STATUSES) + 2
    lines = [f"{'':10}" + "".join(f"{s:>{width}}" for s in STATUSES) + f"{'total':>{width}}"]
    for kind in KINDS:
        row = table[kind]
        cells = "".join(f"{row.get(s, 0):>{width}}" for s in STATUSES)
        lines.append(f"{kind:10}{cells}{sum(row.values()):>{width}}")
    applicable = Counter(status(e, "gradsync") for e in results.values() if "gradsync" in e and not e["not_applicable"])
    cells = "".join(f"{applicable.get(s, 0):>{width}}" for s in STATUSES)
    lines.append(f"{'gradsync*':10}{cells}{sum(applicable.values()):>{width}}")
    lines.append(f"not applicable to gradsync: {table['not_applicable']} (gradsync*: the other tests)")
    return "\n".join(lines)


def format_regressions(results: Results, with_tails: bool = True) -> str:
    found = regressions(results)
    lines = [f"{len(found)} test(s) pass with torch's DDP and fail with gradsync's:"]
    for item in found:
        lines.append(f"- {item['test']}: {item['summary']}")
        if with_tails:
            lines.extend("      " + line for line in item["tail"].splitlines())
    return "\n".join(lines)
