"""Every chapter as a notebook: the solution runs top to bottom in a real kernel, once per run
(the book shows that execution and test_chapters' known-wrong variants are judged against it),
every graded test cell earning its points by the grader's own rule; and notebooks/ equals a
fresh release. (That the student notebook fails only at its stubs is test_student_path's:
graded from the installed wheel.) (Exercises, stubs and known-wrong variants are checked
through the chapters' contracts in test_chapters.py.)"""
import re

import nbformat
import pytest

from conftest import graded_cells
from flashbook import notebooks, sources
from flashbook.grade import cellmeta
from flashbook.grade.record import PASSED

CHAPTERS = sources.sources()
IDS = [c.id for c in CHAPTERS]


def _graded_points(nb) -> dict:
    return {cellmeta.nbgrader_meta(c)["grade_id"]: cellmeta.nbgrader_meta(c)["points"]
            for c in nb.cells if cellmeta.is_graded_test(c)}


def test_every_chapter_has_graded_exercises_and_no_shell_magic():
    assert CHAPTERS, "no chapter sources found in solutions/"
    for ch in CHAPTERS:
        nb = sources.read(ch.path)
        solutions = [c for c in nb.cells if cellmeta.is_solution(c)]
        points = _graded_points(nb)
        assert len(solutions) >= 2 and points and all(p > 0 for p in points.values()), ch.id
        for c in nb.cells:
            if c.cell_type == "code":
                assert not re.search(r"^\s*[!%]", c.source, re.M), f"{ch.id}: shell magic in a cell"
            if cellmeta.is_graded_test(c):
                assert "### BEGIN HIDDEN TESTS" in c.source, f"{ch.id}: test cell without hidden tests"


@pytest.mark.slow
@pytest.mark.parametrize("ch", CHAPTERS, ids=IDS)
def test_solution_runs_top_to_bottom_and_earns_every_point(ch, root, executed_dir):
    nb = notebooks.executed_source(ch, root, executed_dir)   # raises on the first error
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if o.get("output_type") == "error"]
    assert not errors
    scores = graded_cells(nb)
    assert set(scores) == set(_graded_points(sources.read(ch.path))), ch.id
    for gid, (score, status, message, points) in scores.items():
        assert (score, status) == (points, PASSED), f"{gid} earned {score} of {points}: {message}"
    for c in nb.cells:
        if cellmeta.is_graded_test(c):
            out = "".join(o.get("text", "") for o in c.get("outputs", [])
                          if o.get("output_type") == "stream" and o.get("name") == "stdout")
            assert "PASSED" in out, f"{cellmeta.grade_id(c)} printed no PASSED: {out}"


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
        src = sources.read(ch.path)
        hidden = [line.strip() for c in src.cells if cellmeta.is_graded_test(c)
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
            if cellmeta.is_solution(c):
                assert "raise NotImplementedError()" in c.source
        first = nb.cells[0].source
        assert "colab.research.google.com/github/" in first and f"notebooks/{ch.name}.ipynb" in first
        assert "pip" in nb.cells[1].source and "google.colab" in nb.cells[1].source
        assert "torch" not in nb.cells[1].source.split("flashbook @")[0].split("install")[-1]


def test_executed_notebook_cache_is_keyed_by_the_chapter_its_package_and_the_toolkit(root):
    """An edit in the grader, in another chapter's package or in a self-check record must not
    re-execute a chapter; an edit in its source, its package or the toolkit must."""
    package = root / "src" / "flashbook"
    by_id = {c.id: set(notebooks.notebook_inputs(c, root)) for c in CHAPTERS}
    for ch in CHAPTERS:
        inputs = by_id[ch.id]
        assert ch.path in inputs and package / "cases.py" in inputs, ch.id
        assert package / "grade" / "cellmeta.py" in inputs, ch.id
        assert set((package / "chapters" / ch.id).glob("*.py")) <= inputs, ch.id
        assert not inputs & set((package / "grade").glob("auto*.py")), ch.id
        assert not inputs & set((package / "data" / "selftest").glob("*")), ch.id
        others = {p for c in CHAPTERS if c.id != ch.id
                  for p in (package / "chapters" / c.id).rglob("*.py")}
        assert not inputs & others, f"{ch.id}'s cache key holds another chapter's package"
