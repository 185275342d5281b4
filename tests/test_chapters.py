"""Every chapter, checked the same way through its contract (``flashbook.contract.Chapter``):

* the contract agrees with the notebook (every graded test cell is an exercise whose check the
  cell calls, visibly and in its hidden tests);
* the known-wrong variants are run in-process from their own cell on, after the chapter's
  definition cells (``scored``: once per run); the baseline they are judged against is the
  chapter's one execution per run (the executed notebook the book shows, test_notebooks'), in
  which the solution earns every point by the grader's own rule;
* the student version (nbgrader's stubs) fails each exercise as "not implemented";
* every known-wrong variant loses points at an exercise that grades its cell, for its bug
  (not because the edited source stopped running);
* the figures the prose pastes (myst-nb glue) are glued from the recorded data and follow it;
* the files a chapter must create or touch exist (CONTRIBUTING lists them).

Adding a chapter adds a contract, not test code.
"""
from __future__ import annotations

import ast
import dataclasses
import functools
import importlib
import itertools
import linecache
import re
from pathlib import Path

import nbformat
import pytest
import yaml

from conftest import graded_cells
from flashbook import chapters, contract, notebooks, quoted, results, sources
from flashbook.check import CheckFailure
from flashbook.grade import cellmeta

ROOT = Path(__file__).resolve().parents[1]
CONTRACTS = chapters.contracts()
IDS = [c.id for c in CONTRACTS]
# A failure that only says the edited source stopped running proves nothing about the check.
CRASH = ("the kernel raised", "NameError", "SyntaxError", "IndentationError", "TypeError")


def _source_nb(chapter_id: str):
    return sources.read(sources.source(chapter_id, ROOT).path)


def _function(check):
    return check.func if isinstance(check, functools.partial) else check


def check_calls(source: str, names: dict, check) -> tuple[int, int]:
    """(visible, hidden): how many calls in a graded test cell's code are calls of ``check``
    itself (its function resolved through the notebook's imports, not its name matched in the
    text), outside and inside the hidden-tests region."""
    lines = source.splitlines()
    begin = next((i + 1 for i, l in enumerate(lines) if "### BEGIN HIDDEN TESTS" in l), None)
    end = next((i + 1 for i, l in enumerate(lines) if "### END HIDDEN TESTS" in l), None)
    visible = hidden = 0
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and contract.resolve(node.func, names) is _function(check):
            inside = begin is not None and begin < node.lineno < (end or len(lines) + 1)
            hidden, visible = hidden + inside, visible + (not inside)
    return visible, hidden


# ------------------------------------------------------------------- the contract itself

@pytest.mark.parametrize("ch", CONTRACTS, ids=IDS)
def test_contract_agrees_with_the_notebook(ch):
    nb = _source_nb(ch.id)
    tests = [c for c in nb.cells if cellmeta.is_graded_test(c)]
    solutions = [cellmeta.grade_id(c) for c in nb.cells if cellmeta.is_solution(c)]
    assert {cellmeta.grade_id(c) for c in tests} == {ex.grade_id for ex in ch.exercises}, \
        f"{ch.id}: the graded test cells and the contract's exercises differ"
    order = {cellmeta.grade_id(c): i for i, c in enumerate(nb.cells) if cellmeta.grade_id(c)}
    names = contract.bindings(nb, importlib.import_module(f"flashbook.chapters.{ch.id}"))
    for ex in ch.exercises:
        cell = nb.cells[order[ex.grade_id]]
        visible, hidden = check_calls(cell.source, names, ex.check)
        assert visible and hidden, (f"{ex.grade_id} does not call {_function(ex.check).__name__} "
                                    f"visibly and in its hidden tests")
        assert cellmeta.points(cell) > 0, ex.grade_id
        for gid in ex.cells:
            assert gid in solutions and order[gid] < order[ex.grade_id], (ex.grade_id, gid)
    assert all(gid.startswith(ch.id + "_") for gid in order), f"{ch.id}: grade ids need the prefix"
    assert len(order) == len([c for c in nb.cells if cellmeta.grade_id(c)]), "duplicate grade_id"


@pytest.mark.parametrize("ch", CONTRACTS, ids=IDS)
def test_a_chapters_narrower_cells_name_its_exercises_and_their_cells(ch):
    """``Chapter.cells`` only narrows what the source states: stale keys or cells fail here."""
    package = importlib.import_module(f"flashbook.chapters.{ch.id}")
    stated = {ex.grade_id: ex.cells for ex in contract.exercises_from_source(_source_nb(ch.id),
                                                                            package)}
    for gid, cells in ch.cells.items():
        assert gid in stated and cells and set(cells) < set(stated[gid]), (gid, stated.get(gid))


def test_the_exercises_are_read_from_the_graded_cells():
    """grade_id, the visible call's check (its keywords bound) and arguments, and the solution
    cells its entry names come from, through given cells and not through parameters."""
    from flashbook.chapters import ch1
    solution = {"grade": False, "solution": True, "locked": False}
    test = {"grade": True, "solution": False, "locked": True, "points": 1}

    def cell(source, meta=None, gid=None):
        c = nbformat.v4.new_code_cell(source)
        if meta:
            c.metadata["nbgrader"] = dict(meta, grade_id=gid)
        return c
    nb = nbformat.v4.new_notebook(cells=[
        cell("from flashbook.chapters import ch1\nimport torch"),
        cell("def softmax(x):\n    return x", solution, "ch1_softmax"),
        cell("def traffic(n):\n    return n", solution, "ch1_traffic"),
        cell("def scores(q, k):\n    return softmax(q @ k)"),                       # given
        cell("def attention(q, k, traffic=None):\n    return scores(q, k) + traffic",
             solution, "ch1_attention"),
        cell("ch1.check_attention(attention, causal=True)\n### BEGIN HIDDEN TESTS\n"
             "ch1.check_attention(attention, causal=True, hidden=True)\n### END HIDDEN TESTS",
             test, "ch1_attention_test"),
    ])
    (ex,) = contract.exercises_from_source(nb, ch1)
    assert (ex.grade_id, ex.cells, ex.entry) == (
        "ch1_attention_test", ("ch1_softmax", "ch1_attention"), ("attention",))
    assert ex.check.func is ch1.check_attention and ex.check.keywords == {"causal": True}
    nb.cells[-1].source = "ch1.check_attention(attention.T)"
    with pytest.raises(ValueError, match="one check call on names"):
        contract.exercises_from_source(nb, ch1)


def test_a_check_call_counts_only_when_it_calls_the_check():
    """A name in a comment or a string, another function whose name contains the check's, or
    a call before the hidden region do not count as the hidden tests' call."""
    from flashbook.chapters import ch1
    names = {"ch1": ch1, "softmax_check": ch1.check_softmax}
    cell = ("ch1.check_softmax_cases(f)  # ch1.check_softmax(f)\nprint('ch1.check_softmax(f)')\n"
            "### BEGIN HIDDEN TESTS\nch1.check_traffic(f, hidden=True)\n### END HIDDEN TESTS\n")
    assert check_calls(cell, names, ch1.check_softmax) == (0, 0)
    cell = ("softmax_check(f)\n### BEGIN HIDDEN TESTS\nif True:\n"
            "    ch1.check_softmax(f, hidden=True)\n### END HIDDEN TESTS\nch1.check_softmax(f)\n")
    assert check_calls(cell, names, functools.partial(ch1.check_softmax, x=1)) == (2, 1)


@pytest.mark.parametrize("ch", CONTRACTS, ids=IDS)
def test_every_solution_cell_has_two_known_wrong_variants_that_apply(ch):
    cells = sources.cells_by_id(_source_nb(ch.id))
    for v in sources.variants(ch.id):
        assert v.apply(cells[v.cell]) != cells[v.cell], v.name      # raises if an edit misses
    per_cell = {gid: sum(v.cell == gid for v in sources.variants(ch.id))
                for gid in cells if cellmeta.is_solution(_cell(ch.id, gid))}
    thin = {gid: n for gid, n in per_cell.items() if n < 2}
    assert not thin, f"{ch.id}: solution cells with fewer than 2 known-wrong variants: {thin}"
    names = [v.name for v in sources.variants(ch.id)]
    assert len(set(names)) == len(names), "duplicate variant names"


def _cell(chapter_id: str, grade_id: str):
    return next(c for c in _source_nb(chapter_id).cells if cellmeta.grade_id(c) == grade_id)


# ----------------------------------------------------------------------- the solution

_UNIQUE = itertools.count()


class Scored:
    """A chapter's notebook without its graded test cells and demo cells run in-process, once:
    the globals before each solution cell, so that a variant re-runs only the notebook from its
    own cell on (graded test cells included), and the errors of the cells that ran (none)."""

    def __init__(self, ch):
        self.ch = ch
        self.cells = [c for c in _source_nb(ch.id).cells
                      if c.cell_type == "code" and not sources.is_demo(c)]
        self.snapshots, self.errors = {}, {}
        ns = sources.fresh_module(f"scored_{ch.id}").__dict__
        for i, cell in enumerate(self.cells):
            if cellmeta.is_graded_test(cell):
                continue                    # the solution's scores: the executed notebook's
            if cellmeta.is_solution(cell):
                self.snapshots[cellmeta.grade_id(cell)] = dict(ns)
            error = self._run(cell.source, ns)
            if error:
                self.errors[cellmeta.grade_id(cell) or f"cell {i}"] = error

    @staticmethod
    def _run(source: str, ns: dict) -> str | None:
        """None if the cell ran, else its error. A cell whose last expression is a number fails
        too: nbgrader would read that number as partial credit. (Every cell gets its own name
        in linecache: Triton reads a kernel's source back lazily.)"""
        name = f"<cell {next(_UNIQUE)}>"
        linecache.cache[name] = (len(source), None, source.splitlines(True), name)
        tree = ast.parse(source)
        last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
        try:
            exec(compile(tree, name, "exec"), ns)
            value = eval(compile(ast.Expression(last.value), name, "eval"), ns) if last else None
        except Exception as e:  # noqa: BLE001 - a failing test cell is an outcome, not a crash
            return f"{type(e).__name__}: {e}"
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return f"PartialCredit: the cell's last value is the number {value}"
        return None

    def first_loss(self, cell_id: str, source: str) -> tuple[str, str] | None:
        """Re-run from solution cell ``cell_id`` (with ``source``) until a graded test cell
        fails: (its grade_id, its error), or None if every later test passes."""
        ns = dict(self.snapshots[cell_id])
        start = next(i for i, c in enumerate(self.cells) if cellmeta.grade_id(c) == cell_id)
        error = self._run(source, ns)
        if error:
            return cell_id, error
        for cell in self.cells[start + 1:]:
            error = self._run(cell.source, ns)
            if error and cellmeta.is_graded_test(cell):
                return cellmeta.grade_id(cell), error
        return None


@functools.cache
def scored(chapter_id: str) -> Scored:
    return Scored(chapters.contract(chapter_id))


@functools.cache
def solution_losses(chapter_id: str, executed_dir: Path) -> dict:
    """{grade id: message} of the graded cells where the chapter's executed notebook (its one
    execution per run, shared with the book and test_notebooks) loses points: none."""
    nb = notebooks.executed_source(sources.source(chapter_id, ROOT), ROOT, executed_dir)
    return {gid: message for gid, (score, _, message, points) in graded_cells(nb).items()
            if score != points}


def _on_one_worker(ch, item, test_id):
    """A test that reads ``scored(ch.id)``, kept on the worker of its chapter's other such tests
    (--dist loadgroup), so that each chapter's cells run in-process once per suite, not once
    per worker."""
    return pytest.param(ch, item, id=test_id, marks=pytest.mark.xdist_group(f"scored-{ch.id}"))


# -------------------------------------------------------------------- student version

def _stubbed(source: str) -> str:
    """What nbgrader makes of a solution cell: the region between the markers becomes a stub."""
    return re.sub(r"^([ \t]*)### BEGIN SOLUTION\n.*?^[ \t]*### END SOLUTION[ \t]*\n?",
                  r"\1# YOUR CODE HERE\n\1raise NotImplementedError()\n", source,
                  flags=re.S | re.M)


@pytest.mark.parametrize("ch", CONTRACTS, ids=IDS)
def test_student_version_fails_each_exercise_as_not_implemented(ch):
    cells = sources.cells_by_id(_source_nb(ch.id))
    stubs = {gid: _stubbed(src) for gid, src in cells.items()
             if cellmeta.is_solution(_cell(ch.id, gid))}
    assert all("raise NotImplementedError()" in s and "BEGIN SOLUTION" not in s
               for s in stubs.values())
    ns = sources.solution_namespace(ch.id, ROOT, replace=stubs)
    for ex in ch.exercises:
        with pytest.raises(CheckFailure, match="not implemented"):
            ex.check(*(ns[name] for name in ex.entry))


# ---------------------------------------------------------------------- known-wrong

VARIANTS = [_on_one_worker(ch, v, f"{ch.id}-{v.name}") for ch in CONTRACTS
            for v in sources.variants(ch.id)]


def test_a_variant_must_name_the_failure_that_catches_it():
    """``expect`` is required and not blank: any failure would otherwise satisfy the variant."""
    from flashbook.contract import Variant
    with pytest.raises(TypeError):
        Variant("v", "cell", ())
    with pytest.raises(ValueError, match="expect"):
        Variant("v", "cell", (), expect="  ")


@pytest.mark.slow
@pytest.mark.parametrize("ch, v", VARIANTS)
def test_known_wrong_variant_loses_points_to_its_bug(ch, v, executed_dir):
    lost = solution_losses(ch.id, executed_dir)
    assert not lost, f"{ch.id}: the solution itself loses points: {lost}"
    s = scored(ch.id)
    assert not s.errors, f"{ch.id}: the solution's cells fail in-process: {s.errors}"
    src = sources.cells_by_id(_source_nb(ch.id))[v.cell]
    lost = s.first_loss(v.cell, v.apply(src))
    assert lost is not None, f"{ch.id} variant {v.name!r} kept every point"
    grade_id, error = lost
    graders = {ex.grade_id for ex in ch.exercises if v.cell in ex.cells}
    assert grade_id in graders, f"{v.name}: lost points at {grade_id}, not at {graders}: {error}"
    assert not any(c in error for c in CRASH), f"{v.name} only crashed: {error[:600]}"
    assert error.startswith(("CheckFailure", "RaceError")), f"{v.name}: {error[:600]}"
    assert v.expect in error, f"{v.name}: expected {v.expect!r} in the failure: {error[:600]}"


# --------------------------------------------------------------- quoted figures and files

def _perturbed(rows, notes: bool, double: bool = False):
    """The rows with each one's timings scaled by its own factor (with ``double``, all by 2: a
    figure the chapter rounds coarsely, Chapter 2's "more than 5000x", moves only with a large
    change) and, with ``notes``, every integer in its note moved by one (not -1, which marks
    "none"): data that every figure computed from it must follow."""
    def bump(note):
        return re.sub(r"(?<![-\d])\d+", lambda m: str(int(m.group()) + 1), note or "")
    out = []
    for i, r in enumerate(rows):
        f = 2 if double else 1 + (i + 1) / 64
        out.append(dataclasses.replace(
            r, note=bump(r.note) if notes else r.note,
            **{k: getattr(r, k) * g for k, g in (("ms", f), ("tflops", 1 / f), ("gbps", 1 / f),
                                                  ("pct_peak", 1 / f)) if getattr(r, k) is not None}))
    return out


@pytest.mark.parametrize("ch", [c for c in CONTRACTS if c.figures], ids=lambda c: c.id)
def test_prose_pastes_the_recorded_figures(ch, monkeypatch):
    """Every {glue:text} role of the prose names a figure the chapter glues, in a hidden cell,
    from its recorded data; every glued figure is pasted; each role's format applies to its
    value as the book formats it; and every value moves when the recorded data moves."""
    nb = _source_nb(ch.id)
    prose = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    figures = quoted.values(ch)
    used = {key for key, _ in quoted.roles(prose)}
    assert used - set(figures) == set(), f"{ch.id}: the prose pastes figures nobody glues"
    assert set(figures) - used == set(), f"{ch.id}: glued figures the prose never pastes"
    assert "{glue" not in quoted.render(prose, figures), f"{ch.id}: a glue role quoted.ROLE missed"
    glue_cells = [c for c in nb.cells if c.cell_type == "code"
                  and f"quoted.glue({ch.id}.CHAPTER)" in c.source]
    assert len(glue_cells) == 1, f"{ch.id}: one code cell must call quoted.glue({ch.id}.CHAPTER)"
    assert "remove-cell" in glue_cells[0].metadata.get("tags", []), \
        f"{ch.id}: the glue cell must be tagged remove-cell (the book hides it)"
    recorded, moved = results.recorded, set()

    def perturbed_reader(notes, double):     # every record the chapter reads, perturbed
        def read(*args, **kwargs):
            found = recorded(*args, **kwargs)
            return found and found._replace(rows=_perturbed(found.rows, notes, double))
        return read
    for notes, double in ((False, False), (True, False), (False, True)):
        monkeypatch.setattr(results, "recorded", perturbed_reader(notes, double))
        try:
            after = quoted.values(ch)
        except (KeyError, ValueError, AttributeError, StopIteration) if notes else ():
            continue             # a lookup keyed by a number in a note (a page size) missed
        moved |= {k for k in figures if after[k] != figures[k]}
    # a problem size (a recorded row's B or N) stays: the perturbation keeps them, so that the
    # chapter's lookups still find their rows; a figure of a stored profile (key chN_profile_*,
    # not benchmark rows) or of a model at a recorded shape (chN_model_*: bytes at the datasheet
    # bandwidth, no timing) is the chapter's own test's to follow
    sizes = {x for r in recorded(ch.id, results.book_gpu(ch.id)).rows for x in (r.B, r.N_q, r.N_k)}
    # and a figure of Chapter 6's FP8 record (ch6_fp8_*), of its forward's ablation (ch6_abl_*)
    # or of Chapter 9's warp-specialized backward's ablation (ch9_ws_*), files of their own, is
    # followed by tests/test_ch6_fp8.py, tests/test_fa3_ablation.py and tests/test_ch9_ws_bwd.py
    stuck = sorted(k for k in figures if k not in moved and figures[k] not in sizes
                   and not k.startswith((f"{ch.id}_profile_", f"{ch.id}_model_", "ch6_fp8_",
                                         "ch6_abl_", "ch9_ws_")))
    assert not stuck, f"{ch.id}: figures that do not follow the recorded data: {stuck}"


def test_chapter_registry_matches_the_sources():
    assert IDS == [s.id for s in sources.sources(ROOT)]


# A chapter's own files that CONTRIBUTING's table marks required ("yes"), as it writes them.
REQUIRED = ("solutions/chN_slug.py", "src/flashbook/chapters/chN/__init__.py",
            "solutions/variants/chN.py", "src/flashbook/chapters/chN/benchmark.py",
            "src/flashbook/data/bench/chN/<gpu>.csv", "src/flashbook/data/bench/chN/<gpu>.json",
            "notebooks/chN_slug.ipynb", "tests/test_chN.py")


def _files(path: str, chapter_id: str, root: Path = ROOT) -> list[Path]:
    return list(root.glob(path.replace("chN", chapter_id).replace("slug", "*")
                          .replace("<gpu>", "*")))


def missing_files(chapter_id: str, root: Path = ROOT) -> list[str]:
    """The required files of a chapter that ``root`` lacks, as the table writes them."""
    return [path for path in REQUIRED if not _files(path, chapter_id, root)]


@pytest.mark.parametrize("ch", CONTRACTS, ids=IDS)
def test_every_file_a_chapter_touches_exists(ch):
    assert not missing_files(ch.id), f"{ch.id} lacks {missing_files(ch.id)} (CONTRIBUTING.md)"
    src = sources.source(ch.id, ROOT)
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    pages = [c["file"] for part in toc["parts"] for c in part["chapters"]]
    assert f"notebooks/{src.name}" in pages, f"{ch.id} is missing from _toc.yml"
    assert (ROOT / "notebooks" / f"{src.name}.ipynb").exists(), "run `make release`"
    readme = (ROOT / "README.md").read_text()
    assert re.search(rf"^\| {ch.id[2:]}\. {re.escape(ch.title)} \| \w+", readme, re.M), \
        f"README's chapter table has no row '| {ch.id[2:]}. {ch.title} | <status> |'"
    title = nbformat.reads(nbformat.writes(_source_nb(ch.id)), as_version=4).cells[0].source
    assert title.startswith(f"# Chapter {ch.id[2:]}: "), f"{ch.id}: the first cell is the title"
    assert ch.benchmark is not None and \
        ch.benchmark.__module__ == f"flashbook.chapters.{ch.id}.benchmark", \
        f"{ch.id}: CHAPTER.benchmark is not its benchmark.py's"
    assert results.book_gpu(ch.id), f"{ch.id} has a benchmark but no recorded single-GPU data"
    for ex in ch.exercises:
        assert _function(ex.check).__module__.startswith(f"flashbook.chapters.{ch.id}."), \
            f"{ex.grade_id}: its check is not in {ch.id}'s package"


def test_a_chapter_missing_a_required_file_fails(tmp_path):
    """A chapter nobody wrote lacks every required file; a copy of Chapter 1's files lacks
    exactly the one taken away."""
    assert missing_files("ch99") == list(REQUIRED)
    for path in REQUIRED:
        for found in _files(path, "ch1"):
            (tmp_path / found.relative_to(ROOT)).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / found.relative_to(ROOT)).write_bytes(found.read_bytes())
    assert missing_files("ch1", tmp_path) == []
    (tmp_path / "src/flashbook/chapters/ch1/benchmark.py").unlink()
    assert missing_files("ch1", tmp_path) == ["src/flashbook/chapters/chN/benchmark.py"]


def test_contributing_lists_the_required_files():
    """CONTRIBUTING's files table says "yes" (required) for exactly the chapter files that
    REQUIRED checks; the shared files it lists are the ones the test above checks."""
    text = (ROOT / "CONTRIBUTING.md").read_text()
    rows = dict(re.findall(r"^\| `([^`]+)` \| (yes|when [^|]+?) \|", text, re.M))
    own = {path for path, need in rows.items() if "chN" in path and need == "yes"}
    assert own == set(REQUIRED), f"CONTRIBUTING.md's required files differ: {own ^ set(REQUIRED)}"
    assert {"_toc.yml", "README.md", "src/flashbook/chapters/__init__.py"} <= set(rows)
