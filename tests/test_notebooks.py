"""Every chapter: the solution runs with all tests passing, the student notebook fails only at its
stubs, known-wrong answers lose points, and notebooks/ equals a fresh release."""
import copy
import importlib
import itertools
import re

import nbformat
import pytest

from flashbook import notebooks

CHAPTERS = notebooks.chapters()
IDS = [c.id for c in CHAPTERS]


def _graded_points(nb) -> dict:
    return {notebooks.grade_meta(c)["grade_id"]: notebooks.grade_meta(c)["points"]
            for c in nb.cells if notebooks.is_graded_test(c)}


def test_every_chapter_has_graded_exercises():
    assert CHAPTERS, "no chapter sources found in solutions/"
    for ch in CHAPTERS:
        nb = notebooks.read_source(ch.source)
        solutions = [c for c in nb.cells if notebooks.is_solution(c)]
        points = _graded_points(nb)
        assert len(solutions) >= 2 and points and all(p > 0 for p in points.values()), ch.id
        ids = [notebooks.grade_meta(c)["grade_id"] for c in nb.cells if notebooks.grade_meta(c)]
        assert len(ids) == len(set(ids)), f"{ch.id}: duplicate grade_id"
        assert all(i.startswith(ch.id + "_") for i in ids), f"{ch.id}: grade_ids need the prefix"
        for c in nb.cells:
            if c.cell_type == "code":
                assert not re.search(r"^\s*[!%]", c.source, re.M), f"{ch.id}: shell magic in a cell"
            if notebooks.is_graded_test(c):
                assert "### BEGIN HIDDEN TESTS" in c.source, f"{ch.id}: test cell without hidden tests"


@pytest.mark.slow
@pytest.mark.parametrize("ch", CHAPTERS, ids=IDS)
def test_solution_runs_top_to_bottom_with_all_tests_passing(ch, root, executed_dir):
    nb = notebooks.executed_source(ch, root, executed_dir)   # raises on the first error
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if o.get("output_type") == "error"]
    assert not errors


@pytest.mark.slow
def test_notebooks_dir_matches_a_fresh_release(root, fresh_release):
    committed = sorted(p.name for p in (root / "notebooks").glob("*.ipynb"))
    fresh = sorted(p.name for p in fresh_release.glob("*.ipynb"))
    assert committed == fresh, "notebooks/ lists other chapters than solutions/: run `make release`"
    for name in fresh:
        a = nbformat.read(root / "notebooks" / name, as_version=4)
        b = nbformat.read(fresh_release / name, as_version=4)
        assert a == b, f"notebooks/{name} differs from a fresh release: run `make release`"


@pytest.mark.slow
def test_student_notebooks_hide_solutions_and_hidden_tests(root, fresh_release):
    for ch in CHAPTERS:
        nb = nbformat.read(fresh_release / f"{ch.name}.ipynb", as_version=4)
        text = nbformat.writes(nb)
        assert "BEGIN SOLUTION" not in text and "HIDDEN TESTS" not in text
        src = notebooks.read_source(ch.source)
        hidden = [line.strip() for c in src.cells if notebooks.is_graded_test(c)
                  for line in c.source.split("### BEGIN HIDDEN TESTS")[1]
                  .split("### END HIDDEN TESTS")[0].splitlines() if line.strip()]
        # lines that also occur outside hidden regions (e.g. "try:") prove nothing
        public = {line.strip() for c in src.cells if c.cell_type == "code"
                  for line in re.sub(r"### BEGIN HIDDEN TESTS.*?### END HIDDEN TESTS", "",
                                     c.source, flags=re.S).splitlines()}
        code = {line.strip() for c in nb.cells if c.cell_type == "code" for line in c.source.splitlines()}
        leaked = [h for h in hidden if h in code and h not in public]
        assert not leaked, f"{ch.id}: hidden test lines in the student notebook: {leaked[:3]}"
        for c in nb.cells:
            if notebooks.is_solution(c):
                assert "raise NotImplementedError()" in c.source
        first = nb.cells[0].source
        assert "colab.research.google.com/github/" in first and f"notebooks/{ch.name}.ipynb" in first
        assert "pip" in nb.cells[1].source and "google.colab" in nb.cells[1].source
        assert "torch" not in nb.cells[1].source.split("flashbook @")[0].split("install")[-1]


def _errored(cell) -> str | None:
    for o in cell.get("outputs", []):
        if o.get("output_type") == "error":
            return f"{o['ename']}: {o['evalue']}"
    return None


@pytest.mark.slow
@pytest.mark.parametrize("ch", CHAPTERS, ids=IDS)
def test_student_notebook_fails_exactly_at_its_stubs(ch, fresh_release):
    nb = nbformat.read(fresh_release / f"{ch.name}.ipynb", as_version=4)
    nb = notebooks.execute(nb, allow_errors=True, timeout=600, env={"FLASHBOOK_FORCE_CPU": "1"})
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        err = _errored(cell)
        gid = notebooks.grade_meta(cell).get("grade_id", "(ungraded cell)")
        if notebooks.is_solution(cell):
            # a stub that defines a function raises only when called; one at top level raises here
            assert err is None or err.startswith("NotImplementedError"), f"stub {gid}: {err}"
        elif notebooks.is_graded_test(cell):
            assert err and ("not implemented" in err.lower() or "NotImplementedError" in err), \
                f"test {gid} should fail because of the stub, got: {err}"
        else:
            assert err is None, f"{ch.id}: a cell that is neither stub nor test failed: {err}\n" \
                                f"{cell.source[:300]}"


# --------------------------------------------------------------------------- known-wrong

def _variants():
    out = []
    for ch in CHAPTERS:
        try:
            mod = importlib.import_module(f"known_wrong.{ch.id}")
        except ModuleNotFoundError:
            continue
        out += [(ch, name, spec) for name, spec in mod.VARIANTS.items()]
    return out


def test_every_exercise_has_known_wrong_variants():
    for ch in CHAPTERS:
        nb = notebooks.read_source(ch.source)
        solution_ids = {notebooks.grade_meta(c)["grade_id"] for c in nb.cells if notebooks.is_solution(c)}
        covered = {spec["grade_id"] for c, _, spec in _variants() if c.id == ch.id}
        assert solution_ids <= covered, f"{ch.id}: no known-wrong variant for {solution_ids - covered}"


_UNIQUE = itertools.count()


class _Runner:
    """Runs a chapter's non-demo code cells in-process and snapshots the globals before each
    solution cell, so each variant re-runs only the notebook from its own exercise on."""

    def __init__(self, ch):
        self.nb = notebooks.read_source(ch.source)
        self.snapshots, ns = {}, notebooks.fresh_module(f"known_wrong_{ch.id}").__dict__
        for i, cell in enumerate(self.nb.cells):
            if cell.cell_type != "code" or notebooks.is_demo(cell):
                continue
            if notebooks.is_solution(cell):
                self.snapshots[notebooks.grade_meta(cell)["grade_id"]] = dict(ns)
            notebooks.exec_cell(cell.source, f"<{ch.id} cell {i}>", ns)

    def score(self, grade_id: str, source: str) -> tuple[float, float, list]:
        """Points earned/possible by the graded test cells after the replaced solution cell."""
        ns = dict(self.snapshots[grade_id])
        cells = [c for c in self.nb.cells if c.cell_type == "code" and not notebooks.is_demo(c)]
        start = next(i for i, c in enumerate(cells) if notebooks.grade_meta(c).get("grade_id") == grade_id)
        notebooks.exec_cell(source, f"<variant {grade_id} {next(_UNIQUE)}>", ns)
        earned = possible = 0.0
        failures = []
        for cell in cells[start + 1:]:   # later exercises may build on this one: run them too
            points = notebooks.grade_meta(cell).get("points", 0) if notebooks.is_graded_test(cell) else 0
            possible += points
            try:
                # every cell gets its own name: Triton reads a kernel's source back lazily
                notebooks.exec_cell(cell.source, f"<test cell {next(_UNIQUE)}>", ns)
                earned += points
            except Exception as e:  # noqa: BLE001 - any failure of a test cell costs its points
                failures.append(f"{notebooks.grade_meta(cell).get('grade_id')}: "
                                f"{type(e).__name__}: {e}")
        return earned, possible, failures


_RUNNERS: dict = {}


@pytest.mark.slow
@pytest.mark.parametrize("ch,name,spec", _variants(), ids=[f"{c.id}-{n}" for c, n, _ in _variants()])
def test_known_wrong_variant_loses_points(ch, name, spec):
    if ch.id not in _RUNNERS:
        _RUNNERS[ch.id] = _Runner(ch)
    runner = _RUNNERS[ch.id]
    # the real solution earns everything, so a loss below is the variant's fault
    real = next(c.source for c in runner.nb.cells if notebooks.grade_meta(c).get("grade_id") == spec["grade_id"])
    earned, possible, _ = runner.score(spec["grade_id"], real)
    assert possible > 0 and earned == possible
    earned, possible, failures = runner.score(spec["grade_id"], copy.copy(spec["source"]))
    assert earned < possible, f"{ch.id} variant {name!r} kept all {possible} points"
    # it must lose them to its bug, not because the edited source stopped running
    crashed = [f for f in failures if "the kernel raised" in f or "NameError" in f]
    assert len(crashed) < len(failures), f"{ch.id} variant {name!r} only crashed: {crashed}"
