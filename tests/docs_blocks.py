"""The fenced code blocks of README.md and docs/, for the tests that run them as written.

A test names the page and the heading a block sits under, never a line number or a position in the text, so a
guide can grow without breaking the test that runs it; ``tests/test_docs.py`` checks that every ```python and
```bash block is run by some test.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import lab.public

ROOT = Path(__file__).resolve().parents[1]

# The public packages and modules: the API pages document names through these paths only.
PUBLIC = lab.public.PUBLIC
_FENCE = re.compile(r"^(`{3,}|~{3,})\s*([^`\s]*)")
_HEADING = re.compile(r"^(#{1,6}) (.*)")


@dataclass(frozen=True)
class Block:
    """One fenced block: its page (relative to the checkout), the headings above it, its language and its code."""

    page: str
    headings: tuple[str, ...]
    language: str
    code: str
    line: int

    @property
    def heading(self) -> str:
        return self.headings[-1] if self.headings else ""


def pages() -> list[str]:
    """README.md and every page of the docs site, relative to the checkout."""
    docs = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md") if "_build" not in p.parts)
    return ["README.md", *docs]


def blocks(page: str, language: str | None = None, section: str | None = None) -> list[Block]:
    """The fenced blocks of ``page`` in order; ``language`` keeps one kind (``"python"``, ``"bash"``), ``section``
    only those under a heading that starts with it (its subsections included)."""
    found = [b for b in _parse(page) if language is None or b.language == language]
    if section is not None:
        found = [b for b in found if any(h.startswith(section) for h in b.headings)]
    return found


def block(page: str, language: str, section: str, index: int = 0, count: int | None = None) -> str:
    """The code of one block: the ``index``-th ``language`` block under ``section``; with ``count``, the section must
    hold exactly that many (so a block added or removed there is noticed by the test that runs them)."""
    found = blocks(page, language, section)
    if count is not None:
        assert len(found) == count, f"{page}, {section!r}: {len(found)} {language} blocks, expected {count}"
    assert len(found) > index, f"{page} has no {language} block {index} under a heading {section!r}"
    return found[index].code


def _parse(page: str) -> list[Block]:
    lines = (ROOT / page).read_text().splitlines()
    headings: list[tuple[int, str]] = []
    found: list[Block] = []
    i = 0
    while i < len(lines):
        fence, heading = _FENCE.match(lines[i]), _HEADING.match(lines[i])
        if fence:
            marker, language = fence.group(1), fence.group(2)
            end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == marker), len(lines))
            code = "\n".join(lines[i + 1 : end]) + "\n"
            found.append(Block(page, tuple(h for _, h in headings), language, code, i + 1))
            i = end + 1
            continue
        if heading:
            level = len(heading.group(1))
            headings = [(lv, h) for lv, h in headings if lv < level] + [(level, heading.group(2))]
        i += 1
    return found
