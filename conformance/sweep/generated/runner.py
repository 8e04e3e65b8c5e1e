"""Run generated cases and classify each: one forked child per case, from a parent that imported torch and gradsync
once, so a case costs milliseconds, keeps its environment and monkeypatches to itself, and can hang or die without
taking the sweep with it.

The classes (the brief of issue 58): ``clear`` (an error, not of a bare internal type, that names the argument, shows
what it got and says what to do, raised when the value is given), ``vague`` (an error lacking one of those; the
``problems`` say which), ``silently accepted`` (no error), ``hang`` (still running at the case's deadline: a Python
loop is interrupted by an alarm, anything else killed), ``crash`` (the process died without a Python exception).
``accepted`` is for a value inside its valid domain, ``silently wrong`` for one accepted whose result is wrong,
``skipped`` for a case that cannot run here.
"""

from __future__ import annotations

import dataclasses
import json
import os
import select
import signal
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from conformance.sweep.core import BARE_TYPES, RAW_MARKERS

CLASSES = ("clear", "accepted", "vague", "silently accepted", "silently wrong", "hang", "crash", "skipped")
# An error says what to do when it says what is valid or what to change: one of these words, in some form.
DO_WORDS = (
    "must", "give", "use ", "pass", "set ", "drop", "add ", "expect", "should", "need", "only", "one of", "instead",
    "at least", ">", "<", "try", "make", "call", "choose", "remove", "wrap", "is not", "not a", "allowed", "valid",
    "outside", "check", "load ", "restore", "save ", "build", "give", "write", "fix", "omit", "leave", "refus",
)  # fmt: skip
HARD_MARGIN_S = 10.0  # past the alarm: a case stuck in C (a collective) is killed


class Timeout(BaseException):
    """The case's alarm: still running at its deadline."""


class Skip(Exception):
    """This case cannot run here (the message says why)."""


class WrongResult(Exception):
    """A valid value was accepted, and what it gave is wrong (the message says how): raised by a case's use."""


@dataclasses.dataclass
class Outcome:
    """What a case's run returns to the judge: the error it ended in (None: none) and in which phase.

    ``phase``: "given" (the call that takes the value) or "use" (what the value is for: a step, an iteration);
    ``text``: for a command line, its output; ``code``: its exit code."""

    error: BaseException | None = None
    phase: str = "given"
    text: str = ""
    code: int | None = None
    problems: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class GenCase:
    surface: str  # api, restore, run flag, doctor flag, rdzv-conf, environment
    target: str  # the function, class, command, variable
    param: str  # the parameter, flag, key
    label: str  # what kind of wrong value
    value: Any
    run: Callable[[GenCase], Outcome]
    names: Sequence[str]  # texts of which one, in an error, names the argument
    shows: Sequence[str]  # texts of which one shows the value
    owner: str = ""
    valid: bool = False  # the value is valid: acceptance is right
    timeout: float = 20.0

    @property
    def name(self) -> str:
        return f"{self.target}:{self.param}={self.label}"


def _alarm(_signum: int, _frame: Any) -> None:
    raise Timeout()


def judge(case: GenCase) -> dict[str, Any]:
    """Run ``case`` here (in the child) and classify it."""
    signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, case.timeout)
    try:
        outcome = case.run(case)
    except Timeout:
        return {"class": "hang", "type": "Hang", "message": f"still running after {case.timeout:g}s (interrupted)"}
    except Skip as exc:
        return {"class": "skipped", "type": "Skip", "message": str(exc)}
    except BaseException as exc:  # the case's own machinery failed: a crash of the sweep, said plainly
        return {"class": "crash", "type": type(exc).__name__, "message": "sweep: " + traceback.format_exc()[-2000:]}
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    return classify(case, outcome)


def classify(case: GenCase, outcome: Outcome) -> dict[str, Any]:
    if outcome.error is None and outcome.code in (None, 0):
        if case.valid:
            return {"class": "accepted", "type": "", "message": "accepted (a valid value)"}
        return {"class": "silently accepted", "type": "", "message": outcome.text[-600:] or "no error"}
    if isinstance(outcome.error, WrongResult):
        return {"class": "silently wrong", "type": "", "message": str(outcome.error)}
    if isinstance(outcome.error, Timeout):
        return {"class": "hang", "type": "Hang", "message": f"still running after {case.timeout:g}s (interrupted)"}
    kind = type(outcome.error).__name__ if outcome.error is not None else f"exit {outcome.code}"
    text = f"{kind}: {outcome.error}" if outcome.error is not None else outcome.text
    problems = list(outcome.problems) + _problems(case, kind, text, outcome.phase)
    if case.valid:
        problems.append("refused a valid value")
    return {"class": "vague" if problems else "clear", "type": kind, "message": text[-1500:], "problems": problems}


def _problems(case: GenCase, kind: str, text: str, phase: str) -> list[str]:
    low = text.lower()
    problems = []
    if kind in BARE_TYPES:
        problems.append(f"bare {kind}")
    if "gradsync" not in low and any(m in text for m in RAW_MARKERS):
        problems.append("raw backend error")
    if case.names and not any(n.lower() in low for n in case.names):
        problems.append(f"does not name {case.names[0]}")
    if case.shows and not any(s.lower() in low for s in case.shows):
        problems.append(f"does not show what it got ({case.shows[0]})")
    if not any(w in low for w in DO_WORDS):
        problems.append("does not say what to do")
    if phase != "given":
        problems.append(f"accepted when given; failed only at {phase}")
    return problems


# --------------------------------------------------------------------------------------------- the parent
def run_forked(case: GenCase) -> dict[str, Any]:
    """Fork a child that runs ``case``; classify a child that dies (crash) or outlives its hard deadline (hang)."""
    read_end, write_end = os.pipe()
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:  # the child
        os.close(read_end)
        _child(case, write_end)
    os.close(write_end)
    data, hung = _collect(read_end, case.timeout + HARD_MARGIN_S)
    if hung:
        _kill_group(pid)
    _, status = os.waitpid(pid, 0)
    _kill_group(pid)  # anything the case started and left
    result = _result(data, status, hung, case)
    result["seconds"] = round(time.monotonic() - start, 2)
    return result


def _child(case: GenCase, write_end: int) -> None:
    code = 0
    try:
        os.setsid()
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        result = judge(case)
        os.write(write_end, json.dumps(result, default=repr).encode())
    except BaseException:
        code = 70
    finally:
        os._exit(code)  # no teardown: a process group or gloo thread left behind is not this case's subject


def _collect(fd: int, limit: float) -> tuple[bytes, bool]:
    chunks, deadline = [], time.monotonic() + limit
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            os.close(fd)
            return b"".join(chunks), True
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                os.close(fd)
                return b"".join(chunks), False
            chunks.append(chunk)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _result(data: bytes, status: int, hung: bool, case: GenCase) -> dict[str, Any]:
    if hung:
        return {
            "class": "hang",
            "type": "Hang",
            "message": f"still running after {case.timeout + HARD_MARGIN_S:g}s (killed)",
        }
    if data:
        return json.loads(data)
    how = (
        f"killed by {signal.Signals(os.WTERMSIG(status)).name}" if os.WIFSIGNALED(status) else "exited without a result"
    )
    return {"class": "crash", "type": "Crash", "message": f"the case's process died: {how}"}


def run_all(cases: Sequence[GenCase], progress: bool = True) -> list[dict[str, Any]]:
    results = []
    for i, case in enumerate(cases, start=1):
        outcome = run_forked(case)
        row = {"name": case.name, "surface": case.surface, "target": case.target, "param": case.param,
               "label": case.label, "value": repr(case.value), "owner": case.owner, **outcome}  # fmt: skip
        results.append(row)
        if progress:
            print(f"[{i:4d}/{len(cases)}] {case.name[:80]:80s} {row['class']:17s} {row['seconds']:5.1f}s", flush=True)
    sys.stdout.flush()
    return results
