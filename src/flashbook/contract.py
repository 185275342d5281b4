"""What a chapter declares about itself, in one place (every chapter has one ``CHAPTER``).

The test suite checks every chapter through its contract (``tests/test_chapters.py``): the
solution passes the visible and the hidden check of every exercise, the student version fails
exactly at its stubs, every known-wrong variant loses points to its bug, and the figures the
prose pastes follow the recorded data. Adding a chapter adds a contract, not test code.

The known-wrong variants (``Variant``) are course material, not package material: each chapter's
live in ``solutions/variants/chN.py`` beside its solution, outside the wheel (they quote the
solution), and ``sources.variants`` loads them from the course's checkout.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Sequence


@dataclasses.dataclass(frozen=True)
class Exercise:
    """One graded test cell: ``check(*entry_points, hidden=False)`` on what the solution cells
    define. The test cell calls the same check (the contract test verifies it does)."""
    grade_id: str                 # the graded test cell, e.g. "ch3_attn_test"
    cells: tuple[str, ...]        # the solution cells it grades, e.g. ("ch3_attn_tile", ...)
    entry: tuple[str, ...]        # names those cells define, passed to ``check`` in this order
    check: Callable               # raises CheckFailure; prints one PASSED line


@dataclasses.dataclass(frozen=True)
class Variant:
    """A known-wrong answer: one solution cell with one classic bug edited in.

    ``edits`` are (old, new) replacements that must each apply exactly once, so the variant
    follows the solution when it changes. ``expect`` (required): text the failure message must
    contain, so the bug is caught for its own reason, not by any failure.
    """
    name: str
    cell: str
    edits: tuple[tuple[str, str], ...]
    expect: str

    def __post_init__(self):
        if not self.expect.strip():
            raise ValueError(f"known-wrong variant {self.name!r}: expect must name the text of "
                             "the failure that catches its bug")

    def apply(self, source: str) -> str:
        for old, new in self.edits:
            if source.count(old) != 1:
                raise ValueError(f"known-wrong variant {self.name!r}: {old!r} occurs "
                                 f"{source.count(old)} times in cell {self.cell} (need exactly 1)")
            source = source.replace(old, new)
        return source


@dataclasses.dataclass(frozen=True)
class Chapter:
    id: str                                       # "ch3": the notebook's prefix and grade-id prefix
    title: str                                    # as in _toc.yml and the README table
    exercises: Sequence[Exercise]
    benchmark: Callable[[], list] | None = None   # ``flashbook bench <id>``: rows to record
    graph_timer: bool = False                     # the benchmark times rows from CUDA graphs
    # the figures the prose pastes in with {glue:text}`key:fmt` roles: recorded rows (of
    # ``results.book_gpu``) ->
    # {key: value}, glued by the notebook's hidden cell (``flashbook.quoted``)
    figures: Callable[[list], dict] | None = None

    def exercise(self, grade_id: str) -> Exercise:
        for ex in self.exercises:
            if ex.grade_id == grade_id:
                return ex
        raise KeyError(f"{self.id} has no exercise {grade_id!r}")
