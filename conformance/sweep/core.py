"""The sweep's machinery: what a case is, how its outcome is classified, and the helpers cases run with.

A case is a function run in a fresh child process. It either returns a value (handed to the case's ``check``) or
raises. The helpers turn what a multi-rank run or a command line produced into exceptions the classifier knows:
:class:`RankErrors` (some ranks raised), :class:`Refused` (a command failed, with what was wrong with how it
failed), :class:`Hang`, :class:`Crash` and :class:`Skip`.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
CLASSES = ("clear", "accepted", "vague", "silently wrong", "hang", "crash", "skipped")

# Exception types that are never a message meant for a user, whatever their text says.
BARE_TYPES = {
    "AssertionError",
    "KeyError",
    "IndexError",
    "AttributeError",
    "NameError",
    "UnboundLocalError",
    "ZeroDivisionError",
    "RecursionError",
    "UnicodeDecodeError",
}

Keyword = str | tuple[str, ...]  # a tuple: any one of these alternatives
# Text of an error raised from deep inside torch's C++ (gloo, c10d): a raw backend error unless gradsync wraps it.
RAW_MARKERS = ("/__w/pytorch/", "enforce fail at", "torch/csrc/")


@dataclasses.dataclass
class Case:
    """One bad input or fault.

    ``keywords``: an error is ``clear`` if its text holds each of them (case-insensitive; a tuple is a set of
    alternatives). ``check(value)``: None if the returned value is right, else what is wrong with it. A case with
    keywords and no check expects an error; with a check and no keywords, acceptance; with both, either.
    ``rank_keywords`` overrides ``keywords`` for the named ranks of a multi-rank case. ``forbid``: texts that make
    an error misleading (a wrong diagnosis), so vague whatever else it says.
    """

    name: str
    category: str
    how: str
    run: Callable[[], Any]
    keywords: Sequence[Keyword] = ()
    check: Callable[[Any], str | None] | None = None
    timeout: float = 30.0
    rank_keywords: dict[int, Sequence[Keyword]] = dataclasses.field(default_factory=dict)
    allow_types: Sequence[str] = ()  # bare types this case accepts (e.g. a FileNotFoundError is not bare anyway)
    forbid: Sequence[str] = ()

    @property
    def expect(self) -> str:
        if self.keywords and self.check is None:
            return "error: " + ", ".join(_show(k) for k in self.keywords)
        if self.check is not None and not self.keywords:
            return "accepted (checked)"
        return "error (" + ", ".join(_show(k) for k in self.keywords) + ") or accepted (checked)"


CASES: list[Case] = []


def case(
    name: str,
    category: str,
    how: str,
    keywords: Sequence[Keyword] = (),
    check: Callable[[Any], str | None] | None = None,
    timeout: float = 30.0,
    rank_keywords: dict[int, Sequence[Keyword]] | None = None,
    allow_types: Sequence[str] = (),
    forbid: Sequence[str] = (),
) -> Callable[[Callable[[], Any]], Callable[[], Any]]:
    """Register the decorated function as a case."""

    def register(fn: Callable[[], Any]) -> Callable[[], Any]:
        if any(c.name == name for c in CASES):
            raise ValueError(f"duplicate case name {name}")
        kw = tuple(keywords)
        CASES.append(Case(name, category, how, fn, kw, check, timeout, rank_keywords or {}, allow_types, forbid))
        return fn

    return register


def _show(keyword: Keyword) -> str:
    return " | ".join(repr(k) for k in keyword) if isinstance(keyword, tuple) else repr(keyword)


# ------------------------------------------------------------------------------------------------ outcomes
class Hang(Exception):
    """Something was still running at its hard timeout (it has been killed)."""


class Crash(Exception):
    """A process died from a signal or without a Python exception."""


class Skip(Exception):
    """This case cannot run here; the message says why."""


class Refused(Exception):
    """A command failed. ``problems``: what was wrong with how it failed (a traceback, the wrong exit code...)."""

    def __init__(self, message: str, problems: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.problems = list(problems)


class RankErrors(Exception):
    """Some ranks raised: ``errors`` maps rank → (type name, message); ``returned`` maps rank → value."""

    def __init__(self, errors: dict[int, tuple[str, str]], returned: dict[int, Any], must_fail: Sequence[int]) -> None:
        super().__init__("; ".join(f"rank {r}: {k}: {m}" for r, (k, m) in sorted(errors.items())))
        self.errors = errors
        self.returned = returned
        self.must_fail = list(must_fail)


def missing_keywords(text: str, keywords: Iterable[Keyword]) -> list[str]:
    low = text.lower()
    missing = []
    for k in keywords:
        options = k if isinstance(k, tuple) else (k,)
        if not any(o.lower() in low for o in options):
            missing.append(_show(k))
    return missing


def classify(c: Case, run: Callable[[], Any]) -> dict[str, Any]:
    """Run the case here and say what it did: {"class", "type", "message"}."""
    try:
        value = run()
    except Hang as exc:
        return {"class": "hang", "type": "Hang", "message": str(exc)}
    except Crash as exc:
        return {"class": "crash", "type": "Crash", "message": str(exc)}
    except Skip as exc:
        return {"class": "skipped", "type": "Skip", "message": str(exc)}
    except Refused as exc:
        problems = list(exc.problems) + _problems(c, "CommandFailed", str(exc), c.keywords)
        return _error_result("CommandFailed", str(exc), problems)
    except RankErrors as exc:
        return _rank_result(c, exc)
    except Exception as exc:  # the error the case provoked, raised in this process
        kind = type(exc).__name__
        return _error_result(kind, f"{kind}: {exc}", _problems(c, kind, str(exc), c.keywords))
    if c.check is None:
        return {"class": "silently wrong", "type": "", "message": f"no error; returned {_short(value)}"}
    wrong = c.check(value)
    if wrong:
        return {"class": "silently wrong", "type": "", "message": wrong}
    return {"class": "accepted", "type": "", "message": f"accepted; check passed ({_short(value, 200)})"}


def _problems(c: Case, kind: str, message: str, keywords: Sequence[Keyword]) -> list[str]:
    problems = []
    if kind in BARE_TYPES and kind not in c.allow_types:
        problems.append(f"bare {kind}")
    missing = missing_keywords(message, keywords)
    if missing:
        problems.append("lacks " + ", ".join(missing))
    if not keywords:
        problems.append("refused a valid input")
    if "gradsync" not in message.lower() and any(m in message for m in RAW_MARKERS):
        problems.append("raw backend error")
    wrong = [f for f in c.forbid if f.lower() in message.lower()]
    if wrong:
        problems.append("misleading: says " + ", ".join(repr(f) for f in wrong))
    return problems


def _error_result(kind: str, message: str, problems: list[str]) -> dict[str, Any]:
    cls = "vague" if problems else "clear"
    return {"class": cls, "type": kind, "message": message, "problems": problems}


def _rank_result(c: Case, exc: RankErrors) -> dict[str, Any]:
    problems, parts = [], []
    for rank, (kind, message) in sorted(exc.errors.items()):
        keywords = c.rank_keywords.get(rank, c.keywords)
        for p in _problems(c, kind, message, keywords):
            problems.append(f"rank {rank}: {p}")
        parts.append(f"rank {rank}: {kind}: {message}")
    kinds = sorted({k for k, _ in exc.errors.values()})
    silent = [r for r in exc.must_fail if r in exc.returned]
    if silent:
        text = f"rank(s) {silent} went on without an error (returned {_short(exc.returned, 300)}); " + " | ".join(parts)
        return {"class": "silently wrong", "type": "/".join(kinds), "message": text, "problems": problems}
    return _error_result("/".join(kinds), "\n".join(parts), problems)


def _short(value: Any, limit: int = 400) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


# ------------------------------------------------------------------------------------------- multi-rank runs
def ranks(
    fn: Callable[..., Any],
    *args: Any,
    world: int = 2,
    timeout: float = 30.0,
    pg_timeout: float = 10.0,
    dies: Sequence[int] = (),
    must_fail: Sequence[int] = (),
) -> list[Any]:
    """``gradsync.testing.spawn``; returns every rank's value, or raises what the classifier needs.

    ``dies``: ranks the case kills on purpose (their death is not a crash). ``must_fail``: ranks that must raise
    for the case to be an error at all (a rank that goes on is "silently wrong")."""
    from gradsync.testing import SpawnError, spawn

    try:
        return spawn(fn, world_size=world, args=args, timeout=timeout, pg_timeout=pg_timeout)
    except SpawnError as exc:
        failures, returned = exc.failures, exc.results
    hung = [r for r, f in failures.items() if f.kind == "Timeout"]
    if hung:
        others = "; ".join(
            f"rank {r}: {f.kind}: {f.message[:600]}" for r, f in sorted(failures.items()) if r not in hung
        )
        raise Hang(f"rank(s) {hung} still running after {timeout:.0f}s (killed)" + (f"; {others}" if others else ""))
    died = {r: f for r, f in failures.items() if f.kind == "ProcessDied" and r not in dies}
    if died:
        raise Crash("; ".join(f"rank {r} died: {_death(f.message)}" for r, f in sorted(died.items())))
    errors = {r: (f.kind, f.message) for r, f in failures.items() if f.kind != "ProcessDied"}
    if not errors:
        return [returned.get(r) for r in range(world)]
    raise RankErrors(errors, returned, must_fail)


def _death(message: str) -> str:
    """ "exit code -6" → "exit code -6 (SIGABRT)"."""
    try:
        code = int(message.rsplit(" ", 1)[1])
    except (IndexError, ValueError):
        return message
    return f"{message} ({signal.Signals(-code).name})" if code < 0 else f"{message} (no Python exception)"


def group1() -> None:
    """A process group of one (gloo) in this process: enough for argument checks."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


# ----------------------------------------------------------------------------------------- command lines
def clean_env(**extra: str) -> dict[str, str]:
    """This environment without launcher, SLURM or gradsync variables, plus ``extra``."""
    prefixes = ("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "SLURM_", "GRADSYNC_", "TORCHELASTIC_", "GROUP_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(prefixes)}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (torch elastic starts its workers in sessions of their own)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL ``proc`` and everything it started, by pid."""
    for pid in [*descendants(proc.pid), proc.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def run_command(
    argv: Sequence[str], timeout: float, env: dict[str, str] | None = None, cwd: str | Path | None = None
) -> subprocess.CompletedProcess:
    """Run ``argv``; past ``timeout`` kill it and everything it started, and raise :class:`Hang`."""
    proc = subprocess.Popen(
        list(argv),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env if env is not None else clean_env(),
        cwd=cwd or ROOT,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        out, err = proc.communicate()
        tail = (err or "").strip().splitlines()[-8:]
        raise Hang(f"`{' '.join(argv[1:])}` still running after {timeout:.0f}s (killed); stderr tail: {tail}") from None
    for pid in descendants(proc.pid):  # a worker left behind by a launcher that returned
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def gradsync_cli(args: Sequence[str], timeout: float = 30.0, **kwargs: Any) -> subprocess.CompletedProcess:
    return run_command([sys.executable, "-m", "gradsync", *args], timeout, **kwargs)


# A traceback that follows another one of the same chain begins after one of these lines.
_CHAINED = ("The above exception was the direct cause", "During handling of the above exception")


def _tracebacks(stderr: str) -> list[str]:
    """Every traceback printed on ``stderr``, a chain of them (``raise ... from``) counted as one."""
    chains, current = [], ""
    for block in stderr.split("Traceback (most recent call last)")[1:]:
        current += block
        if not any(marker in block for marker in _CHAINED):
            chains.append(current)
            current = ""
    return chains + ([current] if current else [])


def _summary(stderr: str, start: str) -> tuple[str, list[str]]:
    lines = stderr.splitlines()
    begins = [k for k, line in enumerate(lines) if line.startswith(start)]
    if not begins:
        return stderr.strip()[-4000:], [f"no final summary (a line starting {start!r})"]
    return "\n".join(lines[begins[-1] :])[-4000:], []


def refused(
    proc: subprocess.CompletedProcess,
    code: int | None = 2,
    one_line: bool = False,
    traceback_ok: bool = False,
    must_contain: Sequence[str] = (),
    user_script: str | None = None,
    summary_from: str | None = None,
) -> subprocess.CompletedProcess:
    """Judge a command expected to fail: a signal is a crash; exit 0 returns ``proc`` (the case's check decides);
    otherwise raise :class:`Refused` with its stderr, noting a traceback, several lines where one was due, an exit
    code other than ``code``, or a missing ``must_contain`` text (keywords known only at run time).

    ``user_script``: the user's own error is shown as torchrun shows it, so a traceback through that script is
    fine; any other is the tool's. ``summary_from``: the message (which the case's keywords must be found in) is
    only the command's final summary, stderr from the last line starting with this text."""
    if proc.returncode < 0:
        raise Crash(f"killed by {signal.Signals(-proc.returncode).name}; stderr tail: {proc.stderr[-1500:]}")
    if proc.returncode == 0:
        return proc
    text = (proc.stderr.strip() or proc.stdout.strip())[-4000:]
    problems = []
    if summary_from is not None:
        text, missing_summary = _summary(proc.stderr, summary_from)
        problems += missing_summary
    foreign = [t for t in _tracebacks(proc.stderr) if user_script is None or f'File "{user_script}"' not in t]
    if foreign and not traceback_ok:
        problems.append("printed a Python traceback" + (" not through the user's script" if user_script else ""))
    if code is not None and proc.returncode != code:
        problems.append(f"exit code {proc.returncode}, expected {code}")
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    if one_line and len(lines) != 1:
        problems.append(f"{len(lines)} lines on stderr, expected one")
    missing = missing_keywords(proc.stderr + proc.stdout, must_contain)
    if missing:
        problems.append("lacks " + ", ".join(missing))
    raise Refused(f"exit {proc.returncode}: {text}", problems)
