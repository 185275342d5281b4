"""What nbgrader's metadata says about a notebook cell: the one place that reads or writes
``cell.metadata["nbgrader"]``.

nbgrader marks cells with ``{"grade_id", "grade", "solution", "locked", "points", ...}``:
a *solution* cell holds the student's answer, a *graded* cell earns points (a test cell, or
an answer graded by hand), a *locked* cell is the instructor's text the student must not change.
"""
from __future__ import annotations

import copy

_KEY = "nbgrader"


def nbgrader_meta(cell) -> dict:
    """The cell's nbgrader metadata ({} if it has none). Change it with ``set_meta``."""
    return cell.get("metadata", {}).get(_KEY) or {}


def set_meta(cell, meta: dict) -> None:
    """Give ``cell`` a copy of ``meta`` (never shared: cells are edited independently)."""
    cell.metadata[_KEY] = copy.deepcopy(meta)


def drop_meta(cell) -> None:
    """Make ``cell`` an ordinary cell: not graded, not a solution, not locked."""
    cell.metadata.pop(_KEY, None)


def grade_id(cell) -> str | None:
    return nbgrader_meta(cell).get("grade_id")


def is_solution(cell) -> bool:
    return bool(nbgrader_meta(cell).get("solution"))


def is_graded(cell) -> bool:
    """Earns points: a test cell, or an answer graded by hand."""
    return bool(nbgrader_meta(cell).get("grade"))


def is_graded_test(cell) -> bool:
    """A test cell: earns points and is the instructor's code, not the student's."""
    return is_graded(cell) and not is_solution(cell)


def is_locked(cell) -> bool:
    """The instructor's source (tests, read-only text), not the student's."""
    meta = nbgrader_meta(cell)
    return not meta.get("solution") and bool(meta.get("locked") or meta.get("grade"))


def points(cell) -> float:
    return float(nbgrader_meta(cell).get("points", 0))


def graded_points(nb) -> dict[str, float]:
    """{grade_id: points} of the notebook's graded cells, in notebook order."""
    return {grade_id(c): points(c) for c in nb.cells if is_graded(c)}
