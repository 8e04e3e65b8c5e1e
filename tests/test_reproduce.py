"""bench/reproduce.sh runs exactly the commands written next to the figures in README.md and docs/: every
``python -m bench...`` / ``python -m conformance...`` command in the docs' code appears in it, verbatim up to
whitespace, and names a module that exists with flags that module defines. Nothing is run."""

from __future__ import annotations

import importlib.util
import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "reproduce.sh"
LABS = ("python -m bench", "python -m conformance")


def _docs() -> list[Path]:
    return [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").rglob("*.md") if "_build" not in p.parts)]


def figure_commands(text: str) -> list[str]:
    """The lab commands in markdown ``text``: inline code spans (which may wrap across lines) and indented code
    lines that run a lab, whitespace normalised. Fenced blocks are examples for users, not figures."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    found = []
    for paragraph in re.split(r"\n\s*\n", text):
        spans = re.findall(r"`([^`]+)`", paragraph)
        spans += [line for line in paragraph.splitlines() if line.startswith("    ") and "`" not in line]
        found += [" ".join(s.split()) for s in spans if any(lab in " ".join(s.split()) for lab in LABS)]
    return found


def _script() -> str:
    return " ".join(SCRIPT.read_text().replace("\\\n", " ").split())


def _modules_and_flags(command: str) -> list[tuple[str, list[str]]]:
    """Each ``python -m MODULE ARGS`` inside ``command`` (a for loop may hold one), with its ``--flags``."""
    lexer = shlex.shlex(command.replace("$", ""), posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    segments: list[list[str]] = [[]]
    for token in lexer:
        if token in (";", "&&", "|", "do", "done"):
            segments.append([])
        else:
            segments[-1].append(token)
    return [
        (words[2], [w.split("=")[0] for w in words[3:] if w.startswith("--")])
        for words in segments
        if words[:2] == ["python", "-m"] and len(words) > 2
    ]


def _defines(module: str, flag: str) -> bool:
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin, f"{module}: no such module"
    folder = Path(spec.origin).parent
    return any(f'"{flag}"' in path.read_text() for path in folder.rglob("*.py"))


def test_the_docs_commands_are_found() -> None:
    # The extraction itself: a span wrapped across lines, an indented line, and a fenced block left out.
    text = "see `python -m bench.scale --ranks 1,2\n--link 1gbit` and\n\n    python -m bench.memory --runs 3\n\n"
    text += "```bash\npython -m bench --model mlp\n```\n"
    expected = ["python -m bench.scale --ranks 1,2 --link 1gbit", "python -m bench.memory --runs 3"]
    assert figure_commands(text) == expected
    commands = [c for path in _docs() for c in figure_commands(path.read_text())]
    # The scaling table's command, one that wraps in the docs: if the docs move, the test must still find it.
    assert any(c.startswith("python -m bench.scale --model resnet50") for c in commands), commands
    assert len(commands) >= 15, commands


def test_reproduce_sh_runs_every_figures_command_as_written() -> None:
    script = _script()
    found = [(path.relative_to(ROOT), c) for path in _docs() for c in figure_commands(path.read_text())]
    missing = [f"{path}: {command}" for path, command in found if command not in script]
    assert not missing, "commands next to figures that bench/reproduce.sh does not run:\n" + "\n".join(missing)


def test_every_command_names_a_module_and_flags_it_defines() -> None:
    commands = [c for path in _docs() for c in figure_commands(path.read_text())]
    lines = SCRIPT.read_text().replace("\\\n", " ").splitlines()
    commands += [line for line in lines if "python -m" in line and not line.lstrip().startswith("#")]
    wrong = [
        f"{module} {flag} (in: {command})"
        for command in commands
        for module, flags in _modules_and_flags(command)
        for flag in flags
        if not _defines(module, flag)
    ]
    assert not wrong, "flags the module does not define:\n" + "\n".join(wrong)
