"""``python -m conformance.sweep.generated [-k TEXT] [--out PATH] [--list]``: the bad-input sweep generated from the
surface. Results (every case, counts per class, per surface and per owner) go to
``conformance/results/sweep-generated.json``; cases neither clear nor accepted are printed."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from conformance.sweep.core import ROOT
from conformance.sweep.generated.runner import CLASSES, run_all
from lab.results import write_json

BAD = ("vague", "silently accepted", "silently wrong", "hang", "crash")


def counts(rows: list[dict[str, Any]], key: str) -> dict[str, dict[str, int]]:
    table: dict[str, Counter[str]] = {}
    for r in rows:
        table.setdefault(r[key], Counter())[r["class"]] += 1
    return {k: {c: v.get(c, 0) for c in CLASSES if v.get(c, 0)} for k, v in sorted(table.items())}


def report(rows: list[dict[str, Any]]) -> dict[str, Any]:
    total = Counter(r["class"] for r in rows)
    return {
        "counts": {c: total.get(c, 0) for c in CLASSES},
        "total": len(rows),
        "by_surface": counts(rows, "surface"),
        "by_owner": counts(rows, "owner"),
        "cases": rows,
    }


def summary(result: dict[str, Any]) -> None:
    print("\n" + "  ".join(f"{c}: {n}" for c, n in result["counts"].items()) + f"  (of {result['total']})")
    for key in ("by_surface", "by_owner"):
        print(f"\n{key}:")
        for name, row in result[key].items():
            print(f"  {name:20s} " + ", ".join(f"{c} {n}" for c, n in row.items()))
    bad = [r for r in result["cases"] if r["class"] in BAD]
    for r in sorted(bad, key=lambda r: (r["owner"], BAD.index(r["class"]), r["name"])):
        problems = "; ".join(r.get("problems", []))
        print(f"\n* [{r['class']}] ({r['owner']}) {r['name']} = {r['value'][:80]}\n    {problems}")
        print("    " + r["message"].strip().replace("\n", "\n    ")[:600])


def main(argv: list[str] | None = None) -> int:
    from conformance.sweep.generated.generate import all_cases

    parser = argparse.ArgumentParser(prog="python -m conformance.sweep.generated", description=__doc__)
    parser.add_argument("-k", dest="select", help="cases whose name, surface or owner contains this text (a,b: either)")
    parser.add_argument("--out", type=Path, default=ROOT / "conformance" / "results" / "sweep-generated.json")
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--note", default="", help="recorded in the results: what code this ran against, and why")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    wanted = [w for w in (args.select or "").split(",") if w]
    cases = [c for c in all_cases() if not wanted or any(w in f"{c.name} {c.surface} {c.owner}" for w in wanted)]
    if args.list:
        for c in cases:
            print(f"{c.surface:12s} {c.owner:10s} {c.name} = {c.value!r:.60}")
        print(f"{len(cases)} cases")
        return 0
    started = time.monotonic()
    result = report(run_all(cases))
    result["seconds"] = round(time.monotonic() - started, 1)
    import gradsync

    result["library"] = {"gradsync": os.path.dirname(gradsync.__file__), "note": args.note}
    write_json(args.out, json.loads(json.dumps(result, default=repr)))
    summary(result)
    print(f"\n{len(cases)} case(s) in {result['seconds']:.0f}s; results in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
