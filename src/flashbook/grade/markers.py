"""The stable marker every graded cell carries in its source.

Editors (Colab, VS Code, LMS round trips) drop or rewrite cell metadata, but they keep the
cell's text. So every nbgrader solution / graded cell starts with one marker line::

    # flashbook: ch1_softmax_test          (code cells)
    <!-- flashbook: ch1_essay -->          (markdown cells)

``repair`` finds cells by this marker when their nbgrader metadata is missing or wrong.
"""
from __future__ import annotations

import re

from . import cellmeta

_MARKER_RE = re.compile(r"^\s*(?:#|<!--)\s*flashbook:\s*([A-Za-z0-9_.\-]+)\s*(?:-->)?\s*$",
                        re.MULTILINE)


def marker_line(grade_id: str, cell_type: str = "code") -> str:
    if cell_type == "markdown":
        return f"<!-- flashbook: {grade_id} -->"
    return f"# flashbook: {grade_id}"


def find_marker(source: str) -> str | None:
    """The grade id named by the first marker line in ``source``, or None."""
    m = _MARKER_RE.search(source or "")
    return m.group(1) if m else None


def needs_marker(cell) -> bool:
    meta = cellmeta.nbgrader_meta(cell)
    return bool(meta.get("grade_id")) and bool(meta.get("grade") or meta.get("solution")
                                                or meta.get("task"))


def add_markers(nb):
    """Prefix every graded / solution / task cell with its marker line (idempotent).

    Call on the instructor (source) notebook before ``nbgrader generate_assignment``; the
    marker then reaches the student notebook, outside the solution region.
    """
    for cell in nb.cells:
        if not needs_marker(cell):
            continue
        gid = cellmeta.grade_id(cell)
        if find_marker(cell.source) == gid:
            continue
        cell.source = marker_line(gid, cell.cell_type) + "\n" + cell.source
    return nb
