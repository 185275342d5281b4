"""The grading pipeline: unit tests (fast) and an end-to-end class (slow) on the tiny fixture
assignment tests/fixtures/grading/fx1_basics.py (add: 1 point, norm: 2, rev: 3)."""
from __future__ import annotations

import argparse
import ast
import copy
import csv
import dataclasses
import hashlib
import io
import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import nbformat
import pytest

sys.path.insert(0, str(Path(__file__).parent / "fixtures" / "grading"))
import course as C  # noqa: E402

from conftest import shared_once  # noqa: E402
from flashbook import cli, notebooks, sources  # noqa: E402
from flashbook.grade import autograde as AG  # noqa: E402
from flashbook.grade import cellmeta, markers, merge, repair, worker  # noqa: E402
from flashbook.grade import cli as grade_cli  # noqa: E402
from flashbook.grade import collect as CO  # noqa: E402
from flashbook.grade import export as EX  # noqa: E402
from flashbook.grade import feedback as FB  # noqa: E402
from flashbook.grade import gradebook as GB  # noqa: E402
from flashbook.grade.layout import Course, CourseNotGiven, course_root, read_results  # noqa: E402
from flashbook.grade.record import (MANUAL, NOT_RUN, PASSED, CellResult,  # noqa: E402
                                    NotebookResult, SubmissionResult)

A, NB = "fx1", "fx1_basics"
ADD = "def add(a, b):\n    return a + b"
NORM = "def norm(xs):\n    return math.sqrt(sum(x * x for x in xs))"
REV = "def rev(xs):\n    return list(reversed(xs))"


def solved(nb, add=ADD, norm=NORM, rev=REV):
    for gid, code in (("fx1_add", add), ("fx1_norm", norm), ("fx1_rev", rev)):
        if code is not None:
            nb = C.answer(nb, gid, code)
    return nb


def gid(cell):
    return C.grade_id(cell)


@pytest.fixture(scope="session")
def fx1_courses(tmp_path_factory, worker_id) -> Path:
    """fx1 released by nbgrader once per run, into ``course`` and, from its older source
    fx1_basics_v0, into ``old_course``: templates, read only (copy a course before writing in
    it)."""
    def release(out: Path):
        C.release(out / "course", A, NB)
        C.release(out / "old_course", A, "fx1_basics_v0", name=NB)
    return shared_once(tmp_path_factory, worker_id, "fx1_courses", release)


def released_course(fx1_courses: Path, into: Path, which: str = "course"):
    """(a copy of a released fx1 course at ``into``, its released notebook)."""
    course = Course(shutil.copytree(fx1_courses / which, into))
    return course, course.release_notebook(A, NB)


@pytest.fixture(scope="module")
def released(fx1_courses, tmp_path_factory):
    return released_course(fx1_courses, tmp_path_factory.mktemp("course") / "course")


# ------------------------------------------------------------------ unit tests (fast)

def test_markers_are_added_once_and_found():
    nb = C.sources.read(C.HERE / f"{NB}.py")
    once = markers.add_markers(copy.deepcopy(nb))
    twice = markers.add_markers(copy.deepcopy(once))
    graded = [c for c in once.cells if markers.needs_marker(c)]
    assert len(graded) == 6
    assert [c.source for c in once.cells] == [c.source for c in twice.cells]
    assert all(markers.find_marker(c.source) == gid(c) for c in graded)
    assert markers.find_marker("x = 1\n# flashbook: ch1_a_test\n") == "ch1_a_test"
    assert markers.find_marker("<!-- flashbook: ch2_essay -->\ntext") == "ch2_essay"
    assert markers.find_marker("# flashbook is great") is None


def test_release_hides_hidden_tests_and_keeps_markers(released):
    course, rel = released
    hidden = [line.strip() for c in course.source_notebook(A, NB).cells
              for line in c.source.splitlines() if '"hidden: ' in line]
    assert len(hidden) == 3
    released_code = "\n".join(c.source for c in rel.cells)
    assert "HIDDEN TESTS" not in json.dumps(rel) and not [h for h in hidden if h in released_code]
    assert {markers.find_marker(c.source) for c in rel.cells} >= {"fx1_add", "fx1_add_test"}


def test_released_book_notebooks_have_no_hidden_tests():
    """Every notebook students get from the repository (notebooks/) is free of the hidden-test
    regions its chapter source has (nbgrader's release strips them)."""
    released = sorted((C.REPO / "notebooks").glob("*.ipynb"))
    assert released
    chapters = {ch.name: ch for ch in sources.sources(C.REPO)}
    for path in released:
        assert path.stem in chapters, f"{path}: no solutions/{path.stem}.py"
        assert "### BEGIN HIDDEN TESTS" in chapters[path.stem].path.read_text(), path
        assert "HIDDEN TESTS" not in path.read_text(), path


def test_repair_stripped_metadata_duplicates_and_deleted_cells(released):
    course, rel = released
    nb = solved(rel)
    for cell in nb.cells:                              # an editor dropped all metadata and ids
        cell.metadata = {}
        cell["id"] = "x" + cell["id"]
    rev = next(i for i, c in enumerate(nb.cells) if markers.find_marker(c.source) == "fx1_rev")
    stub = next(c for c in rel.cells if gid(c) == "fx1_rev")
    nb.cells.insert(rev + 1, copy.deepcopy(stub))      # duplicated (untouched) after the answer
    nb.cells = [c for c in nb.cells if markers.find_marker(c.source) != "fx1_norm_test"]
    fixed, log = repair.repair(nb, rel)
    ids = [gid(c) for c in fixed.cells if gid(c)]
    assert ids == [gid(c) for c in rel.cells if gid(c)]          # order and presence as released
    rev_cell = next(c for c in fixed.cells if gid(c) == "fx1_rev")
    assert "reversed" in rev_cell.source                          # the student's answer was kept
    text = "\n".join(log)
    assert "lost its nbgrader metadata" in text and "appeared 2 times" in text
    assert "'fx1_norm_test' was missing" in text


def test_repair_restores_edited_test_cell_and_changed_metadata(released):
    course, rel = released
    nb = solved(rel)
    test = next(c for c in nb.cells if gid(c) == "fx1_add_test")
    test.source = "# flashbook: fx1_add_test\npass  # I removed the check"
    test.metadata["nbgrader"]["points"] = 100
    sol = next(c for c in nb.cells if gid(c) == "fx1_norm")
    sol.metadata["nbgrader"]["grade_id"] = "something_else"          # marker still says fx1_norm
    fixed, log = repair.repair(nb, rel)
    ref = next(c for c in rel.cells if gid(c) == "fx1_add_test")
    got = next(c for c in fixed.cells if gid(c) == "fx1_add_test")
    assert got.source == ref.source and cellmeta.points(got) == 1
    assert any("differed from the release" in line for line in log)
    assert any("said 'something_else'" in line for line in log)
    assert sum(gid(c) == "fx1_norm" for c in fixed.cells) == 1


def test_collect_names_roster_zip_layout_and_no_overwrite(released, tmp_path):
    course, rel = released
    src = tmp_path / "downloads"
    (src / "dave" / A).mkdir(parents=True)
    nbformat.write(rel, src / "doe_jane_12345_fx1_basics.ipynb")
    nbformat.write(rel, src / "dave" / A / f"{NB}.ipynb")
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr(f"{NB}.ipynb", nbformat.writes(rel))
    (src / "smith_ann_777_fx1.zip").write_bytes(buf.getvalue())
    (src / "Lee Kim_assignsubmission_file_fx1_basics.ipynb").write_text(nbformat.writes(rel))
    (src / "readme.pdf").write_bytes(b"%PDF")
    roster = tmp_path / "roster.csv"
    roster.write_text("id,first_name,last_name,lms_id\ns1,Jane,Doe,12345\ns3,Kim,Lee,\n")
    r = CO.collect(src, A, course, roster)
    assert sorted(r["collected"]) == ["777", "dave", "s1", "s3"]
    assert r["not_in_roster"] == ["777", "dave"] and r["ignored"] == ["readme.pdf"]
    assert (course.submission_dir(A, "s1") / f"{NB}.ipynb").exists()
    assert (course.submission_dir(A, "777") / ".flashbook" / "repair.log").exists()
    again = CO.collect(src, A, course, roster)
    assert again["collected"] == {} and len(again["skipped"]) == 4
    forced = CO.collect(src, A, course, roster, force=True)
    assert len(forced["collected"]) == 4
    assert list((course.submission_dir(A, "s1") / ".flashbook").glob("replaced-*/"))
    with pytest.raises(ValueError, match="column 'id'"):
        bad = tmp_path / "bad.csv"
        bad.write_text("name\nx\n")
        CO.collect(src, A, course, bad)


def test_shards_partition_students_stably():
    students = [f"s{i}" for i in range(50)]
    parts = [[s for s in students if AG.in_shard(s, (i, 3))] for i in range(3)]
    assert sorted(sum(parts, [])) == sorted(students) and all(parts)
    assert AG.parse_shard("1/3") == (1, 3)
    for bad in ("3/3", "x", "1-3"):
        with pytest.raises(ValueError):
            AG.parse_shard(bad)


# ------------------------------------------------- the package stands on its own

GRADE_DIR = Path(AG.__file__).parent


def test_grade_imports_nothing_of_the_book():
    """grade/ imports its siblings and third-party code only, never flashbook.notebooks & co."""
    for path in sorted(GRADE_DIR.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                names = [("." * node.level) + (node.module or "")]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                outside = name.startswith("..") or (name.startswith("flashbook") and
                                                    not name.startswith("flashbook.grade"))
                assert not outside, f"{path.name}:{node.lineno} imports {name}"


def test_nbgrader_metadata_is_read_in_cellmeta_only():
    for path in sorted(GRADE_DIR.glob("*.py")):
        if path.name != "cellmeta.py":
            assert '"nbgrader"' not in path.read_text(), path


def test_cellmeta_reads_what_nbgrader_wrote():
    test = nbformat.v4.new_code_cell("assert True", metadata={"nbgrader": {
        "grade_id": "t", "grade": True, "solution": False, "locked": True, "points": 2}})
    answer = nbformat.v4.new_code_cell("x = 1", metadata={"nbgrader": {
        "grade_id": "a", "grade": False, "solution": True, "locked": False}})
    plain = nbformat.v4.new_code_cell("y = 2")
    assert [cellmeta.grade_id(c) for c in (test, answer, plain)] == ["t", "a", None]
    assert [cellmeta.is_graded_test(c) for c in (test, answer, plain)] == [True, False, False]
    assert [cellmeta.is_solution(c) for c in (test, answer, plain)] == [False, True, False]
    assert [cellmeta.is_locked(c) for c in (test, answer, plain)] == [True, False, False]
    nb = nbformat.v4.new_notebook(cells=[answer, test, plain])
    assert cellmeta.graded_points(nb) == {"t": 2.0}
    cellmeta.set_meta(plain, cellmeta.nbgrader_meta(test))
    assert cellmeta.nbgrader_meta(plain) == cellmeta.nbgrader_meta(test)
    assert cellmeta.nbgrader_meta(plain) is not cellmeta.nbgrader_meta(test)
    cellmeta.drop_meta(plain)
    assert cellmeta.nbgrader_meta(plain) == {} and "nbgrader" not in plain.metadata


def test_course_dir_is_given_never_guessed(monkeypatch, tmp_path):
    """--course, else $FLASHBOOK_COURSE, else the CLI's default; the package alone has none."""
    monkeypatch.delenv("FLASHBOOK_COURSE", raising=False)
    for make in (Course, course_root):
        with pytest.raises(CourseNotGiven, match="--course DIR or set FLASHBOOK_COURSE"):
            make()
    bare = argparse.ArgumentParser()
    grade_cli.add_subcommands(bare.add_subparsers())          # no default course
    with pytest.raises(CourseNotGiven):
        grade_cli.course_from_args(bare.parse_args(["feedback", A]))

    def cli_course(*argv):
        return grade_cli.course_from_args(cli.build_parser().parse_args(["feedback", A, *argv]))
    assert cli_course().root == (sources.repo_root() / "autograder").resolve()
    monkeypatch.setenv("FLASHBOOK_COURSE", str(tmp_path / "env"))
    assert Course().root == cli_course().root == tmp_path / "env"       # beats the default
    assert cli_course("--course", str(tmp_path / "flag")).root == tmp_path / "flag"


# ------------------------------------------------------------------ the result record

def a_result() -> SubmissionResult:
    return SubmissionResult("s1", A, (
        NotebookResult("nb1", {"t1": CellResult(1.0, 1.0, PASSED),
                               "essay": CellResult(None, 2.0, MANUAL, "graded by hand")},
                       repairs=("fx1_add had lost its nbgrader metadata: restored",),
                       notes=("the kernel died",)),
        NotebookResult("nb2", {"t2": CellResult(0.0, 3.0, NOT_RUN, "the kernel died")},
                       notes=("the kernel died",))),
        seconds=1.5, device="cpu", graded_at="2024-01-01T00:00:00",
        submitted_sha256={"nb1": "ab", "nb2": ""})


def test_result_record_round_trips_through_json():
    r = a_result()
    data = json.loads(json.dumps(r.to_json()))
    assert SubmissionResult.from_json(data) == r
    assert (r.score, r.max_score, r.reasons) == (1.0, 6.0, ["the kernel died"])
    assert data["cells"]["t2"] == {"score": 0.0, "max_score": 3.0, "status": "not run",
                                   "message": "the kernel died"}
    assert r.timeless() == SubmissionResult.from_json({**data, "seconds": 9, "graded_at": "x"}
                                                      ).timeless()


def test_results_written_before_the_record_still_load():
    """The older result.json: the same keys (the record writes a superset); a failed grading
    listed its zeroed cells at the top level only."""
    failed = {"student": "s1", "assignment": A, "reasons": ["stopped"],
              "notebooks": [{"name": NB, "cells": {}, "repairs": [], "notes": ["stopped"]}],
              "cells": {"fx1_add_test": {"score": 0.0, "max_score": 1.0, "status": "not run",
                                         "message": "stopped"}},
              "score": 0.0, "max_score": 1.0, "device": "cpu", "graded_at": "2024-01-01T00:00",
              "submitted_sha256": {NB: "ab"}, "worker_log": "Traceback"}
    graded = {**failed, "reasons": [], "seconds": 2.0, "score": 1.0, "notebooks": [
        {"name": NB, "cells": {"fx1_add_test": {"score": 1.0, "max_score": 1.0,
                                                "status": "passed", "message": ""}},
         "repairs": ["fixed"], "notes": []}]}
    graded["cells"] = graded["notebooks"][0]["cells"]
    del graded["worker_log"]
    for old in (failed, graded):
        new = SubmissionResult.from_json(old).to_json()
        assert {k: new[k] for k in old if k != "notebooks"} == \
            {k: v for k, v in old.items() if k != "notebooks"}


def test_worker_result_loads_and_is_stored_as_written(released, tmp_path, monkeypatch):
    """What the worker writes (here: no kernel needed, nothing submitted) is a record that
    autograde stores and export / feedback read back."""
    course, _ = released
    out, results = tmp_path / "out", tmp_path / "results" / A
    out.mkdir()
    job = {"student": "nobody", "assignment": A, "out": str(out), "workdir": str(tmp_path / "w"),
           "kernel": "unused", "timeout": 60, "cell_timeout": 10, "files": [],
           "notebooks": [{"name": NB, "source": str(course.source_dir(A) / f"{NB}.ipynb"),
                          "release": str(course.release_dir(A) / f"{NB}.ipynb"),
                          "submitted": str(tmp_path / "missing.ipynb")}]}
    monkeypatch.setattr(sys, "stdin", io.StringIO(json.dumps(job)))
    assert worker.main() == 0
    written = json.loads((out / "result.json").read_text())
    r = SubmissionResult.from_json(written)
    assert r.to_json() == written
    assert (r.student, r.score, r.max_score) == ("nobody", 0, 6)
    assert r.reasons == ["no notebook was submitted"]
    assert {c.status for c in r.cells.values()} == {NOT_RUN}
    AG.record(course, A, r, out, results, [NB], "cpu")
    stored = read_results(results)["nobody"]
    assert stored.graded_at and stored.timeless() == dataclasses.replace(
        r, device="cpu", submitted_sha256={NB: ""}).timeless()


def test_gradebook_comments_go_on_the_answer_a_check_grades_and_unreleased_is_refused(
        released, tmp_path):
    course, _ = released
    targets = GB.comment_targets(course.source_notebook(A, NB))
    assert targets == {"fx1_add_test": "fx1_add", "fx1_norm_test": "fx1_norm",
                       "fx1_rev_test": "fx1_rev"}
    with pytest.raises(FileNotFoundError, match="flashbook release fx9"):
        GB.export_gradebook(course, ["fx9"])
    # a result naming a cell the gradebook does not know: written around it, and reported
    course = Course(shutil.copytree(course.root, tmp_path / "course"))
    cells = {"fx1_add_test": CellResult(1.0, 1.0, PASSED),
             "fx1_gone_test": CellResult(0.0, 2.0, NOT_RUN, "no such check any more")}
    result = SubmissionResult("ghost", A, (NotebookResult(NB, cells),))
    (tmp_path / "results" / A / "ghost").mkdir(parents=True)
    (tmp_path / "results" / A / "ghost" / "result.json").write_text(json.dumps(result.to_json()))
    report = GB.export_gradebook(course, [A], tmp_path / "results")
    assert report == {"grades": 1, "students": ["ghost"], "unknown": [f"{A}/{NB}/fx1_gone_test"]}


# ------------------------------------------------------------- end-to-end class (slow)

STEAL = '''\
import os, sys, linecache
for path, mode in ((r"{course}/source/fx1/fx1_basics.ipynb", "r"),
                   (r"{course}/gradebook.db", "a"),
                   (r"{course}/results/fx1/alice/result.json", "w"),
                   (r"{course}/submitted/alice/fx1/fx1_basics.ipynb", "w")):
    try:
        with open(path, mode) as f:
            f.write("pwned") if mode != "r" else print(f.read())
        print("NOT BLOCKED", path)
    except OSError as e:
        print("blocked", type(e).__name__)
def add(a, b):
    caller = sys._getframe(1).f_code.co_filename          # print the test cell's source
    print("".join(linecache.getlines(caller)))
    return a + b
'''

# Implements add only, and hides every error from IPython (its error display, a custom exception
# handler), print and the display hook: without the guard's completion token it scored 6 of 6.
SILENCER = C.SILENCE_ERRORS + '''\
def add(a, b):
    return a + b
'''

# student -> (expected score, expected reason fragment or None)
EXPECTED = {
    "alice": (6, None), "untouched": (0, None), "partial": (4, None), "addonly": (1, None),
    "dup": (6, None), "stripped": (6, None), "deleted": (6, None), "edited": (4, None),
    "old": (3, None), "malformed": (0, "could not be read"), "syntax": (5, "SyntaxError"),
    "loop": (3, "did not stop within the time limit"), "crash": (4, "kernel died"), "thief": (6, None),
    "10015": (6, None), "silencer": (1, None),
}
# the students whose code the tampering scan flags (every other one raises no flag)
FLAGGED = {"thief", "silencer"}
# the students graded twice more in two shards, and compared with the single run
SHARD_SUBSET = ["alice", "untouched", "partial", "dup", "malformed", "thief", "10015"]


def make_class(course: Course, rel, old_rel, src: Path):
    """A folder of downloads as an LMS gives them: one per case of EXPECTED."""
    src.mkdir()

    def put(student, nb):
        nbformat.write(nb, src / f"{student}_{A}_{NB}.ipynb")
    put("alice", solved(rel))
    put("untouched", rel)
    put("partial", solved(rel, norm="def norm(xs):\n    return math.sqrt(sum(x * x for x in xs"
                                     " if x > 0))"))           # fails the hidden case only
    put("addonly", solved(rel, norm=None, rev=None))
    dup = solved(rel)
    i = next(i for i, c in enumerate(dup.cells) if gid(c) == "fx1_rev")
    dup.cells.insert(i + 1, copy.deepcopy(next(c for c in rel.cells if gid(c) == "fx1_rev")))
    j = next(i for i, c in enumerate(dup.cells) if gid(c) == "fx1_add_test")
    dup.cells.insert(j, copy.deepcopy(dup.cells[j]))
    for c in dup.cells:
        c.pop("id", None)
    dup.nbformat_minor = 4
    put("dup", dup)
    stripped = solved(rel)
    for c in stripped.cells:
        c.metadata = {}
    put("stripped", stripped)
    deleted = solved(rel)
    deleted.cells = [c for c in deleted.cells if gid(c) != "fx1_norm_test"]
    put("deleted", deleted)
    edited = solved(rel, norm="def norm(xs):\n    return 5.0")
    next(c for c in edited.cells if gid(c) == "fx1_norm_test").source = "# I fixed the test\npass"
    put("edited", edited)
    put("old", solved(old_rel, rev=None))
    (src / f"malformed_{A}_{NB}.ipynb").write_text(nbformat.writes(solved(rel))[:500])
    put("syntax", solved(rel, add="def add(a, b)\n    return a + b"))
    put("loop", solved(rel, rev="import time\ndef rev(xs):\n    while True:\n        try:\n"
                                "            time.sleep(0.1)\n        except KeyboardInterrupt:\n"
                                "            pass"))       # ignores the interrupt: a real hang
    put("crash", solved(rel, norm="import os\ndef norm(xs):\n    os._exit(3)"))
    put("thief", solved(rel, add=STEAL.format(course=course.root)))
    put("silencer", solved(rel, add=SILENCER, norm=None, rev=None))
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr(f"submission/{NB}.ipynb", nbformat.writes(solved(rel)))
    (src / "carol_lee_10015_fx1.zip").write_bytes(buf.getvalue())


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# s: an honest fx1 cell runs in milliseconds; "loop" hangs in its cell for this long, then for
# as long again in the grader's probe (6 s made its submission take 18 s, 3 s 12 s)
CELL_TIMEOUT = 3


@pytest.fixture(scope="module")
def graded_class(fx1_courses, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("class")
    course, rel = released_course(fx1_courses, tmp / "course")   # only this class in it
    _, old_rel = released_course(fx1_courses, tmp / "old_course", "old_course")
    src = tmp / "downloads"
    make_class(course, rel, old_rel, src)
    report = CO.collect(src, A, course)
    (course.root / "results" / A / "alice").mkdir(parents=True, exist_ok=True)
    db_before = _sha(course.root / "gradebook.db")
    summary = AG.autograde(A, course, timeout=25, cell_timeout=CELL_TIMEOUT, workers=2,
                           progress=False)
    pages = FB.feedback(A, course)
    out = EX.export(tmp / "grades.csv", course)
    return {"course": course, "src": src, "collect": report, "summary": summary,
            "pages": pages, "export": out, "db_before": db_before, "tmp": tmp}


def in_class(test):
    """A test of the graded class: slow, and kept on one pytest-xdist worker (each worker that
    runs one of these tests grades the whole class first)."""
    return pytest.mark.slow(pytest.mark.xdist_group("fx1_class")(test))


def _rows(path: Path) -> dict:
    with open(path, newline="") as f:
        return {r["student_id"]: r for r in csv.DictReader(f)}


@in_class
def test_class_every_grade_exact_and_every_problem_explained(graded_class):
    rows = _rows(graded_class["export"]["csv"])
    assert set(rows) == set(EXPECTED)
    for student, (score, reason) in EXPECTED.items():
        row = rows[student]
        assert float(row["fx1/total"]) == score, (student, row)
        assert row["fx1/max"] == "6"
        if reason:
            assert reason in row["fx1/notes"], (student, row["fx1/notes"])
    # per-cell columns, one per graded cell
    assert [rows["partial"][f"fx1/{g}"] for g in ("fx1_add_test", "fx1_norm_test",
                                                  "fx1_rev_test")] == ["1", "0", "3"]
    # the kernel died in norm's check: restarted, the answers replayed, rev's check still earns
    assert rows["crash"]["fx1/fx1_rev_test"] == "3"
    res = json.loads((graded_class["course"].root / "results" / A / "crash" / "result.json")
                     .read_text())
    assert res["cells"]["fx1_rev_test"]["status"] == "passed"
    assert "exit code 3" in res["cells"]["fx1_norm_test"]["message"]


@in_class
def test_class_tampering_is_flagged_and_earns_nothing(graded_class):
    """A submission that hides its errors from IPython gets what its real answers earn, with the
    reason; the scan flags it (cell, line, what) in the record, the CSV and the feedback page."""
    rows = _rows(graded_class["export"]["csv"])
    flagged = {s for s, row in rows.items() if row["fx1/flags"]}
    assert flagged == FLAGGED, {s: rows[s]["fx1/flags"] for s in flagged ^ FLAGGED}
    s = rows["silencer"]
    assert [s[f"fx1/{g}"] for g in ("fx1_add_test", "fx1_norm_test", "fx1_rev_test")] == \
        ["1", "0", "0"]
    assert "fx1_add:3 calls get_ipython()" in s["fx1/flags"], s["fx1/flags"]
    assert "rebinds 'print'" not in s["fx1/flags"]           # builtins.print: an attribute
    assert "rebinds an attribute of a module: builtins.print" in s["fx1/flags"]
    assert "fx1_add:" in rows["thief"]["fx1/flags"] and "_getframe" in rows["thief"]["fx1/flags"]
    res = read_results(graded_class["course"].root / "results" / A)["silencer"]
    assert res.cells["fx1_norm_test"].message == worker.guard.NOT_CONFIRMED or \
        "NotImplementedError" in res.cells["fx1_norm_test"].message
    assert res.notebooks[0].flags and res.notebooks[0].flags[0].cell == "fx1_add"
    page = next(p for p in graded_class["pages"] if p.parts[-3] == "silencer").read_text()
    assert "Flagged for the instructor" in page and "get_ipython()" in page
    alice = next(p for p in graded_class["pages"] if p.parts[-3] == "alice").read_text()
    assert "Flagged for the instructor" not in alice
    md = graded_class["export"]["md"].read_text()
    assert "fx1 / silencer: fx1_add:" in md


@in_class
def test_class_graded_notebooks_show_no_guard(graded_class):
    """The guard's setup cell, wrappers and tokens are gone from the graded notebooks: the test
    cells read as the instructor wrote them, and their PASSED lines are kept."""
    course = graded_class["course"]
    src = course.source_notebook(A, NB)
    want = {gid(c): c.source for c in src.cells if gid(c)}
    graded = nbformat.read(course.root / "results" / A / "alice" / f"{NB}.ipynb", as_version=4)
    assert len(graded.cells) == len(src.cells)
    text = nbformat.writes(graded)
    assert "flashbook-ok-" not in text and "_flashbook_guard" not in text
    for c in graded.cells:
        if gid(c) in want and not cellmeta.is_solution(c):
            assert c.source == want[gid(c)]


@in_class
def test_class_repairs_are_logged_and_no_file_is_lost(graded_class):
    course, src = graded_class["course"], graded_class["src"]
    log = {s: "\n".join(v) for s, v in graded_class["collect"]["collected"].items()}
    assert "appeared 2 times" in log["dup"]
    assert "lost its nbgrader metadata" in log["stripped"]
    assert "'fx1_norm_test' was missing" in log["deleted"]
    assert "differed from the release" in log["edited"]
    assert "'fx1_rev' was missing" in log["old"]
    assert "could not be read" in log["malformed"]
    kept = {_sha(p) for p in (course.root / "submitted").glob(f"*/{A}/.flashbook/original/*")}
    for p in src.iterdir():
        if p.suffix == ".zip":
            with zipfile.ZipFile(p) as z:
                assert {hashlib.sha256(z.read(n)).hexdigest() for n in z.namelist()} <= kept
        else:
            assert _sha(p) in kept, p


@in_class
def test_class_sandbox_protects_the_source_gradebook_and_others(graded_class):
    course = graded_class["course"]
    assert _sha(course.root / "gradebook.db") == graded_class["db_before"]
    alice = json.loads((course.root / "results" / A / "alice" / "result.json").read_text())
    assert alice["score"] == 6
    graded = nbformat.read(course.root / "results" / A / "thief" / f"{NB}.ipynb", as_version=4)
    out = "".join(o.get("text", "") for c in graded.cells for o in c.get("outputs", []))
    assert out.count("blocked") == 4 and "NOT BLOCKED" not in out


@in_class
def test_class_results_are_records(graded_class):
    """Every result.json of the class (kernel runs, crashes, hangs) is a record, read back as
    it was written."""
    paths = sorted((graded_class["course"].root / "results" / A).glob("*/result.json"))
    assert len(paths) == len(EXPECTED)
    for path in paths:
        data = json.loads(path.read_text())
        assert SubmissionResult.from_json(data).to_json() == data, path


@in_class
def test_class_feedback_and_summary(graded_class):
    pages = {p.parts[-3]: p for p in graded_class["pages"]}
    assert set(pages) == set(EXPECTED)
    partial = pages["partial"].read_text()
    assert "negative entries (did you square them?)" in partial      # the harness's hint
    assert "4 / 6" in partial
    assert "kernel died" in pages["crash"].read_text()
    exp = graded_class["export"]
    assert exp["png"].stat().st_size > 1000 and "fx1/fx1_norm_test" in exp["md"].read_text()


@in_class
def test_class_resume_and_shards_merge_to_the_same_grades(graded_class):
    course, tmp = graded_class["course"], graded_class["tmp"]
    again = AG.autograde(A, course, timeout=25, progress=False)
    assert again["graded"] == [] and len(again["skipped"]) == len(EXPECTED)
    shards = []
    for i in range(2):
        root = tmp / f"shard{i}"
        AG.autograde(A, course, timeout=25, cell_timeout=CELL_TIMEOUT, shard=(i, 2),
                     results_root=root, students=SHARD_SUBSET, progress=False)
        shards.append(root)
    assert all((s / A).is_dir() for s in shards)
    merged = tmp / "merged"
    report = merge.merge(A, shards, course, results_root=merged)
    assert sorted(report["merged"]) == sorted(SHARD_SUBSET)
    one = _rows(graded_class["export"]["csv"])
    two = _rows(EX.export(tmp / "merged.csv", course, [A], merged, summary=False)["csv"])
    assert two == {s: one[s] for s in SHARD_SUBSET}


@in_class
def test_class_grades_reach_nbgrader_gradebook_and_manual_scores_survive(graded_class):
    """`flashbook export --nbgrader` fills nbgrader's gradebook as nbgrader's autograde would: per
    cell the CSV's scores, the messages as comments on the answer cells; `nbgrader export` then
    agrees with flashbook's CSV, and a score entered by hand (formgrader) survives a re-export."""
    from nbgrader.api import Gradebook
    tmp = graded_class["tmp"]
    course = Course(shutil.copytree(graded_class["course"].root, tmp / "nbgrader_course"))
    rows = _rows(graded_class["export"]["csv"])
    cells = ("fx1_add_test", "fx1_norm_test", "fx1_rev_test")
    assert cli.main(["export", str(tmp / "nb.csv"), "--nbgrader", "--no-summary",
                     "--course", str(course.root)]) == 0

    with Gradebook(GB.db_url(course)) as gb:
        for s, row in rows.items():
            for g in cells:
                want = float(row[f"fx1/{g}"]) if row[f"fx1/{g}"] else None
                assert gb.find_grade(g, NB, A, s).auto_score == want, (s, g)
            assert gb.find_submission(A, s).score == float(row["fx1/total"]), s
        partial = gb.find_comment("fx1_norm", NB, A, "partial").auto_comment
        assert partial.startswith("fx1_norm_test (0/2): "), partial
        assert "exit code 3" in gb.find_comment("fx1_norm", NB, A, "crash").auto_comment
        assert gb.find_comment("fx1_add", NB, A, "alice").auto_comment is None
        assert "could not be read" in gb.find_comment("fx1_add", NB, A, "malformed").auto_comment
    assert (course.root / "autograded" / "alice" / A / f"{NB}.ipynb").exists()   # formgrader

    with Gradebook(GB.db_url(course)) as gb:          # the instructor regrades by hand
        gb.find_grade("fx1_norm_test", NB, A, "partial").manual_score = 1.5
        gb.db.commit()
    GB.export_gradebook(course, [A])                  # a later export, e.g. after a regrade
    with Gradebook(GB.db_url(course)) as gb:
        grade = gb.find_grade("fx1_norm_test", NB, A, "partial")
        assert (grade.manual_score, grade.auto_score, grade.score) == (1.5, 0.0, 1.5)
        assert grade.needs_manual_grade                # nbgrader's rule: a manual score is reviewed
    proc = notebooks.nbgrader(["export", "--to", "nbgrader_grades.csv"], course.root)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with open(course.root / "nbgrader_grades.csv", newline="") as f:
        after = {r["student_id"]: float(r["score"]) for r in csv.DictReader(f)}
    assert after.pop("partial") == float(rows["partial"]["fx1/total"]) + 1.5
    assert after == {s: float(r["fx1/total"]) for s, r in rows.items() if s != "partial"}


def test_gpu_probe_reports_an_unusable_gpu():
    """On this CPU-only machine the probe's CUDA call fails: the reason is given, not a crash."""
    why = AG.gpu_problem("0", attempts=2, wait_s=0.0)
    assert why is not None and why.startswith("GPU 0 is not healthy (") and why.endswith(")"), why


def test_a_grading_worker_starts_without_torch():
    """The worker and the sandbox launcher run once per submission: importing flashbook must not
    import torch or matplotlib there (about 3 s a process; flashbook's toolkit is lazy)."""
    probe = subprocess.run([sys.executable, "-c", "import sys, flashbook.grade.worker, "
                            "flashbook.grade.sandbox; "
                            "print(sorted({'torch', 'matplotlib'} & set(sys.modules)))"],
                           capture_output=True, text=True, check=True)
    assert probe.stdout.strip() == "[]", probe.stdout + probe.stderr
