"""``python -m conformance.sweep [-k SUBSTRING] [--out conformance/results/sweep.json] [--list] [--isolated]``: run the
bad-input sweep.

Each case runs in its own process under a hard timeout: a child forked from a zygote that has imported torch
and gradsync once (:mod:`conformance.sweep.zygote`), or with ``--isolated`` a fresh interpreter per case
(:mod:`conformance.sweep.child`; slower, nothing shared). Results are written after every case; then a table of counts
per class and every case that is neither ``clear`` nor ``accepted`` is printed. With ``-k``, the cases that ran
replace their entries in an existing ``--out`` file and the others are kept.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from conformance.sweep.cases import by_name
from conformance.sweep.core import CASES, CLASSES, ROOT, Case, clean_env, descendants, kill_tree
from lab.results import write_json

STARTUP_SECONDS = 30.0  # a fresh interpreter importing torch, and spawn's forkserver, on a busy machine
FORK_MARGIN_SECONDS = 10.0  # beyond a case's timeout, for a child forked from the zygote
BAD = ("vague", "silently wrong", "hang", "crash")


class Zygote:
    """The parent's handle on :mod:`conformance.sweep.zygote`: send a case, wait for its end, kill it if it hangs."""

    def __init__(self) -> None:
        self.start()

    def start(self) -> None:
        # Rank processes inherit the forkserver's stderr, the zygote's: a file, not this terminal.
        self.stderr = tempfile.NamedTemporaryFile(prefix="sweep-zygote-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "conformance.sweep.zygote"],
            cwd=ROOT,
            env=clean_env(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            text=True,
            start_new_session=True,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=_pump, args=(self.proc.stdout, self.lines), daemon=True).start()
        self._expect("ready", STARTUP_SECONDS * 2)

    def _expect(self, word: str, timeout: float) -> list[str] | None:
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            return None
        parts = line.split()
        if not parts or parts[0] != word:
            raise RuntimeError(f"sweep zygote said {line!r}, expected {word!r}")
        return parts[1:]

    def run(self, c: Case, out: Path, log: Path) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{c.name}\t{out}\t{log}\n")
        self.proc.stdin.flush()
        started = self._expect("started", 60)
        if started is None:
            raise RuntimeError("sweep zygote did not start the case")
        pid, helpers = int(started[0]), {int(p) for p in started[1:]}
        limit = c.timeout + FORK_MARGIN_SECONDS
        ended = self._expect("exit", limit)
        hung = ended is None
        if hung:
            self._kill_case(helpers)
            ended = self._expect("exit", 30)
        if ended is None or int(ended[0]) != pid:
            raise RuntimeError(f"sweep zygote lost case {c.name}")
        logged = log.read_text(errors="replace") if log.exists() else ""
        if hung:
            return {"class": "hang", "type": "Hang", "message": f"the case still ran after {limit:.0f}s (killed)"}
        status = int(ended[1])
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        return _read(out, code, logged)

    def _kill_case(self, helpers: set[int]) -> None:
        """Everything below the zygote but its helpers: the case's child, what it started, and its ranks (which the
        forkserver forked)."""
        for pid in descendants(self.proc.pid):
            if pid not in helpers:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def close(self) -> None:
        kill_tree(self.proc)
        self.stderr.close()
        os.unlink(self.stderr.name)


def _pump(stream: Any, lines: queue.Queue[str]) -> None:
    for line in stream:
        lines.put(line.strip())
    lines.put("eof")


def run_forked(zygote: Zygote, c: Case) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="sweep-", ignore_cleanup_errors=True) as tmp:
        out, log = Path(tmp) / "result.json", Path(tmp) / "log.txt"
        start = time.monotonic()
        result = zygote.run(c, out, log)
        result.setdefault("seconds", round(time.monotonic() - start, 2))
        result["wall_seconds"] = round(time.monotonic() - start, 2)
        result["log_tail"] = (log.read_text(errors="replace") if log.exists() else "")[-3000:]
    return result


def run_case(c: Case) -> dict[str, Any]:
    """Run ``c`` in a child process; classify a child that outlives its deadline or dies without a result."""
    limit = c.timeout + STARTUP_SECONDS
    with tempfile.TemporaryDirectory(prefix="sweep-", ignore_cleanup_errors=True) as tmp:
        out = Path(tmp) / "result.json"
        start = time.monotonic()
        proc = subprocess.Popen(
            [sys.executable, "-m", "conformance.sweep.child", c.name, str(out)],
            cwd=ROOT,
            env=clean_env(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        try:
            log, _ = proc.communicate(timeout=limit)
        except subprocess.TimeoutExpired:
            kill_tree(proc)
            log, _ = proc.communicate()
            result = {"class": "hang", "type": "Hang", "message": f"the case still ran after {limit:.0f}s (killed)"}
        else:
            result = _read(out, proc.returncode, log)
        result.setdefault("seconds", round(time.monotonic() - start, 2))
        result["wall_seconds"] = round(time.monotonic() - start, 2)
        result["log_tail"] = (log or "")[-3000:]
    return result


def _read(out: Path, code: int, log: str) -> dict[str, Any]:
    if out.exists():
        return json.loads(out.read_text())
    how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code} without a result"
    return {"class": "crash", "type": "Crash", "message": f"the case's process died: {how}; output tail: {log[-1500:]}"}


def describe(c: Case) -> dict[str, Any]:
    return {"name": c.name, "category": c.category, "how": c.how, "expect": c.expect, "timeout": c.timeout}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m conformance.sweep", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "-k", dest="select", help="run only cases whose name or category contains this text (a,b: either)"
    )
    parser.add_argument("--out", type=Path, default=ROOT / "conformance" / "results" / "sweep.json")
    parser.add_argument("--list", action="store_true", help="list the selected cases and exit")
    parser.add_argument("--isolated", action="store_true", help="a fresh interpreter per case (slower)")
    args = parser.parse_args(argv)
    cases = by_name()
    wanted = [w for w in (args.select or "").split(",") if w]
    chosen = [c for c in CASES if not wanted or any(w in c.name or w in c.category for w in wanted)]
    if args.list:
        for c in chosen:
            print(f"{c.name:45s} {c.category:22s} {c.expect}")
        print(f"{len(chosen)} of {len(CASES)} cases")
        return 0
    if not chosen:
        print(f"no case matches -k {args.select!r}", file=sys.stderr)
        return 2
    results = _previous(args.out, cases) if args.select else {}
    started = time.monotonic()
    zygote = None if args.isolated else Zygote()
    try:
        _run_all(chosen, zygote, results, cases, args.out)
    finally:
        if zygote is not None:
            zygote.close()
    print(f"\n{len(chosen)} case(s) in {time.monotonic() - started:.0f}s; results in {args.out}\n")
    summary(results)
    return 0


def _run_all(
    chosen: list[Case], zygote: Zygote | None, results: dict[str, dict[str, Any]], cases: dict[str, Case], out: Path
) -> None:
    for i, c in enumerate(chosen, start=1):
        if zygote is None:
            outcome = run_case(c)
        else:
            try:
                outcome = run_forked(zygote, c)
            except RuntimeError as exc:  # the zygote itself failed: say so, start another
                outcome = {"class": "crash", "type": "Crash", "message": f"sweep harness: {exc}", "wall_seconds": 0}
                zygote.close()
                zygote.start()
        result = {**describe(c), **outcome}
        results[c.name] = result
        print(f"[{i:3d}/{len(chosen)}] {c.name:45s} {result['class']:15s} {result['wall_seconds']:6.1f}s", flush=True)
        _write(out, results, cases)


def _previous(path: Path, cases: dict[str, Case]) -> dict[str, dict[str, Any]]:
    if not path.exists():
        return {}
    try:
        old = json.loads(path.read_text())["cases"]
    except (ValueError, KeyError, TypeError):
        return {}
    return {r["name"]: r for r in old if r.get("name") in cases}


def _write(path: Path, results: dict[str, dict[str, Any]], cases: dict[str, Case]) -> None:
    ordered = [results[name] for name in cases if name in results]
    counts = Counter(r["class"] for r in ordered)
    # The provenance is the last command's: with -k, the cases it reran merged into the earlier results.
    write_json(path, {"counts": {k: counts.get(k, 0) for k in CLASSES}, "total": len(ordered), "cases": ordered})


def summary(results: dict[str, dict[str, Any]]) -> None:
    counts = Counter(r["class"] for r in results.values())
    categories = sorted({r["category"] for r in results.values()})
    width = max(len(c) for c in categories + ["category"])
    head = f"{'category':{width}s} " + " ".join(f"{k:>8s}" for k in _short_names()) + f" {'total':>6s}"
    print(head)
    print("-" * len(head))
    for cat in categories:
        mine = Counter(r["class"] for r in results.values() if r["category"] == cat)
        print(f"{cat:{width}s} " + " ".join(f"{mine.get(k, 0):8d}" for k in CLASSES) + f" {sum(mine.values()):6d}")
    print("-" * len(head))
    print(f"{'all':{width}s} " + " ".join(f"{counts.get(k, 0):8d}" for k in CLASSES) + f" {len(results):6d}")
    bad = [r for r in results.values() if r["class"] in BAD]
    skipped = [r for r in results.values() if r["class"] == "skipped"]
    if bad:
        print(f"\n{len(bad)} case(s) neither clear nor accepted:")
    for r in sorted(bad, key=lambda r: BAD.index(r["class"])):
        print(f"\n* [{r['class']}] {r['name']} ({r['category']}): {r['how']}")
        print(f"  expected: {r['expect']}")
        if r.get("problems"):
            print(f"  problems: {'; '.join(r['problems'])}")
        message = r["message"] if len(r["message"]) <= 1200 else r["message"][:1200] + " [...]"
        print(textwrap.indent(message, "    "))
    for r in skipped:
        print(f"\n* [skipped] {r['name']}: {r['message']}")


def _short_names() -> list[str]:
    return ["clear", "accepted", "vague", "silent", "hang", "crash", "skipped"]


if __name__ == "__main__":
    sys.exit(main())
