"""Hidden tests: find their lines in the instructor notebook, and keep them out of anything a
student receives (a student's code can print its caller's source or put it in an error)."""
from __future__ import annotations

import re

BEGIN, END = "### BEGIN HIDDEN TESTS", "### END HIDDEN TESTS"
REDACTED = "[hidden test]"
_MIN_LEN = 8      # shorter lines ("pass", ")") say nothing and occur everywhere


def hidden_lines(nb) -> list[str]:
    """The non-trivial lines inside hidden-test regions of ``nb``'s cells, longest first."""
    lines = set()
    for cell in nb.cells:
        inside = False
        for line in cell.get("source", "").splitlines():
            s = line.strip()
            if s.startswith(BEGIN):
                inside = True
            elif s.startswith(END):
                inside = False
            elif inside and len(s) >= _MIN_LEN:
                lines.add(s)
    return sorted(lines, key=len, reverse=True)


def redact(text: str, lines: list[str]) -> str:
    """``text`` with every hidden-test line replaced by a placeholder."""
    if not text:
        return text
    for s in lines:
        if s in text:
            text = text.replace(s, REDACTED)
    return text


def leaks(text: str, lines: list[str]) -> list[str]:
    """Hidden-test lines that occur in ``text`` (for tests and a final check on feedback)."""
    return [s for s in lines if s in text]


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def strip_ansi(text: str) -> str:
    return _ANSI.sub("", text or "")
