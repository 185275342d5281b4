"""What a chapter declares about itself, in one place (every chapter has one ``CHAPTER``), and
its exercises, which its source states (``exercises_from_source``).

The test suite checks every chapter through its contract (``tests/test_chapters.py``): the
solution passes the visible and the hidden check of every exercise, the student version fails
exactly at its stubs, every known-wrong variant loses points to its bug, and the figures the
prose pastes follow the recorded data. Adding a chapter adds a contract, not test code.

The known-wrong variants (``Variant``) are course material, not package material: each chapter's
live in ``solutions/variants/chN.py`` beside its solution, outside the wheel (they quote the
solution), and ``sources.variants`` loads them from the course's checkout.
"""
from __future__ import annotations

import ast
import dataclasses
import functools
import importlib
import symtable
import sys
import types
from typing import Callable

from .grade import cellmeta


@dataclasses.dataclass(frozen=True)
class Exercise:
    """One graded test cell: ``check(*entry_points, hidden=False)`` on what the solution cells
    define, as the test cell's visible call states it (``exercises_from_source``)."""
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
    benchmark: Callable[[], list] | None = None   # ``flashbook bench <id>``: rows to record
    graph_timer: bool = False                     # the benchmark times rows from CUDA graphs
    # the figures the prose pastes in with {glue:text}`key:fmt` roles: recorded rows (of
    # ``results.book_gpu``) ->
    # {key: value}, glued by the notebook's hidden cell (``flashbook.quoted``)
    figures: Callable[[list], dict] | None = None
    # {grade_id: solution cells}: where an exercise grades fewer cells than ``graded_cells``
    # finds (the chapter says why)
    cells: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict, hash=False)

    @functools.cached_property
    def exercises(self) -> tuple[Exercise, ...]:
        """The exercises the chapter's source states (``exercises_from_source``), read from the
        course's checkout on first use: the wheel has no chapter sources, and nothing a student
        or the grader runs needs them (the tests and ``python -m flashbook.graded_variants``
        do)."""
        from . import sources
        package = sys.modules[f"flashbook.chapters.{self.id}"]   # CHAPTER's own, imported
        nb = sources.read(sources.source(self.id).path)
        return tuple(dataclasses.replace(ex, cells=self.cells.get(ex.grade_id, ex.cells))
                     for ex in exercises_from_source(nb, package))

    def exercise(self, grade_id: str) -> Exercise:
        for ex in self.exercises:
            if ex.grade_id == grade_id:
                return ex
        raise KeyError(f"{self.id} has no exercise {grade_id!r}")


# ------------------------------------------- the exercises, read from the chapter's graded cells

def bindings(nb, package: types.ModuleType) -> dict:
    """The names the notebook binds to its chapter's package (``package``) or to names from it:
    ``from flashbook.chapters import chN`` and ``from flashbook.chapters.chN import x [as y]``."""
    chapter_id = package.__name__.rpartition(".")[2]
    names = {}
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        for node in ast.walk(ast.parse(cell.source)):
            if isinstance(node, ast.ImportFrom) and node.module == "flashbook.chapters":
                names.update({a.asname or a.name: package for a in node.names
                              if a.name == chapter_id})
            elif isinstance(node, ast.ImportFrom) and node.module == package.__name__:
                names.update({a.asname or a.name: _member(package, a.name) for a in node.names})
    return names


def _member(package, name: str):
    """``from package import name``: an attribute, else a submodule."""
    try:
        return getattr(package, name)
    except AttributeError:
        return importlib.import_module(f"{package.__name__}.{name}")


def resolve(expr, names: dict):
    """What a call's function (a name, or attributes of one) is, or None."""
    if isinstance(expr, ast.Name):
        return names.get(expr.id)
    if isinstance(expr, ast.Attribute):
        return getattr(resolve(expr.value, names), expr.attr, None)
    return None


def visible_check_call(source: str) -> ast.Call:
    """A graded test cell's visible check: its one statement before the hidden tests, a call
    whose positional arguments are names and whose keywords are constants."""
    body = ast.parse(source.split("### BEGIN HIDDEN TESTS")[0]).body
    call = body[0].value if len(body) == 1 and isinstance(body[0], ast.Expr) else None
    if not (isinstance(call, ast.Call) and all(isinstance(a, ast.Name) for a in call.args)
            and all(k.arg and isinstance(k.value, ast.Constant) for k in call.keywords)):
        raise ValueError("a graded test cell's visible part must be one check call on names, "
                         f"with constant keywords: {source[:200]!r}")
    return call


def _defines(source: str) -> set[str]:
    """The names a cell binds at its top level: functions, classes, assignments."""
    out = set()
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            out.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
    return out


def _reads(source: str) -> set[str]:
    """The global names a cell's code reads, at its top level or inside its functions and
    classes (their parameters and locals are not globals: ``symtable`` knows the scopes)."""
    top = symtable.symtable(source, "<cell>", "exec")
    out, tables = set(), [top]
    while tables:
        table = tables.pop()
        tables.extend(table.get_children())
        out.update(s.get_name() for s in table.get_symbols()
                   if s.is_referenced() and (table is top or s.is_global()))
    return out


def graded_cells(nb, test_index: int, entry) -> tuple[str, ...]:
    """The solution cells the exercise of graded test cell ``nb.cells[test_index]`` grades, in
    notebook order: the cells that define its entry names, and every solution cell whose names
    those definitions read, directly or through given cells (Chapter 1's ``naive_attention``
    calls the student's ``softmax``: a bug there fails the attention exercise too). A name's
    definition is the last one before the test cell."""
    code = [(i, c) for i, c in enumerate(nb.cells[:test_index])
            if c.cell_type == "code" and not cellmeta.is_graded_test(c)]
    defines = {i: _defines(c.source) for i, c in code}
    seen, todo = set(), list(entry)
    while todo:
        name = todo.pop()
        where = [i for i, _ in code if name in defines[i]]
        if where and where[-1] not in seen:
            seen.add(where[-1])
            todo.extend(_reads(nb.cells[where[-1]].source))
    return tuple(cellmeta.grade_id(nb.cells[i]) for i in sorted(seen)
                 if cellmeta.is_solution(nb.cells[i]))


def exercises_from_source(nb, package: types.ModuleType) -> tuple[Exercise, ...]:
    """The chapter's exercises as its source ``nb`` states them, one per graded test cell in
    notebook order: its grade_id; the check its visible call calls (resolved through the
    notebook's imports of ``package``, the chapter's own), with the call's keywords bound; the
    call's arguments as the entry names; the solution cells it grades (``graded_cells``)."""
    names = bindings(nb, package)
    out = []
    for i, cell in enumerate(nb.cells):
        if not cellmeta.is_graded_test(cell):
            continue
        call = visible_check_call(cell.source)
        check = resolve(call.func, names)
        if check is None:
            raise ValueError(f"{cellmeta.grade_id(cell)}: {ast.unparse(call.func)} is not a "
                             f"name of {package.__name__}")
        if call.keywords:
            check = functools.partial(check, **{k.arg: k.value.value for k in call.keywords})
        entry = tuple(a.id for a in call.args)
        out.append(Exercise(cellmeta.grade_id(cell), graded_cells(nb, i, entry), entry, check))
    return tuple(out)
