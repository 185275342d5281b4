"""Every chapter where its users run it: the wheel installed in an environment of its own (no
checkout on the path, no FLASHBOOK_ROOT, another working directory, so solutions/ cannot be
reached), and each chapter's released notebook, left untouched, graded there by the instructor's
real pipeline: ``flashbook collect``, ``autograde`` (worker processes, the sandboxed kernel, the
tamper guard that loads the checks afresh for every graded cell), ``export`` and ``feedback``,
run as commands of that environment.

This is the suite's one truth for "the student notebook fails exactly at its stubs". That the
solution earns every point is the executed notebook's (tests/test_notebooks.py: each chapter's
one execution per run, scored by the grader's own rule); here the solved notebook of the
chapters in ``SOLVED`` also goes the whole way (wheel, sandbox, guard), to show that the
pipeline gives a solved chapter every point. (Every chapter's package and data in the wheel:
tests/test_publishing.py.)
"""
from __future__ import annotations

import copy
import csv
import os
import shutil
import subprocess
import sysconfig
import time
import venv
import zipfile
from pathlib import Path

import nbformat
import pytest

from flashbook import chapters
from flashbook.grade import cellmeta
from flashbook.grade import collect as CO
from flashbook.grade import export as EX
from flashbook.grade import feedback as FB
from flashbook.grade.layout import Course

ROOT = Path(__file__).resolve().parents[1]
CONTRACTS = chapters.contracts()
SUBMISSION_TIMEOUT = 1200          # s: the slowest chapter takes about 2 minutes on 2 cores
SOLVED = ("ch1",)                  # graded solved too: the smallest chapter


@pytest.fixture(scope="session")
def student_python(tmp_path_factory, distributions) -> Path:
    """A Python whose ``flashbook`` is the wheel built from the tracked files: a venv with the
    wheel unpacked into its site-packages, and the pinned toolchain's site-packages added as a
    plain path entry (so the editable install's .pth, which maps flashbook to src/, is not run)."""
    work = tmp_path_factory.mktemp("student")
    env_dir = work / "env"
    venv.create(env_dir, with_pip=False, symlinks=True)
    python = env_dir / "bin" / "python"
    site = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()"
                                "['purelib'])"], capture_output=True, text=True,
                               check=True).stdout.strip())
    with zipfile.ZipFile(distributions["wheel"]) as wheel:
        wheel.extractall(site)
    (site / "toolchain.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    probe = subprocess.run([python, "-c", "import flashbook, flashbook.sources as s; "
                            "print(flashbook.__file__); print((s.repo_root() / 'solutions')"
                            ".exists())"], capture_output=True, text=True, cwd=work,
                           env=student_env())
    assert probe.returncode == 0, probe.stderr[-2000:]
    where, sees_solutions = probe.stdout.split()
    assert where.startswith(str(site)) and sees_solutions == "False", probe.stdout
    return python


def student_env() -> dict:
    """The caller's environment without what would point at the checkout; Jupyter's data files
    (nbconvert's templates) are the toolchain's, as where Jupyter is installed with it."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("FLASHBOOK_ROOT", "PYTHONPATH", "VIRTUAL_ENV")}
    env["JUPYTER_PATH"] = str(Path(sysconfig.get_paths()["data"]) / "share" / "jupyter")
    return env


def flashbook(python: Path, *args, cwd: Path) -> str:
    """Run a ``flashbook`` command in the student environment; returns its output."""
    start, env = time.monotonic(), student_env()
    env["PATH"] = f"{python.parent}:{env.get('PATH', '')}"
    proc = subprocess.run([python, "-m", "flashbook.cli", *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=SUBMISSION_TIMEOUT * 2)
    assert proc.returncode == 0, f"flashbook {args[0]} failed:\n{proc.stdout[-3000:]}\n" \
                                 f"{proc.stderr[-3000:]}"
    print(f"flashbook {args[0]} {args[1]}: {time.monotonic() - start:.1f} s")
    return proc.stdout


def answered(release, source):
    """The released notebook with each answer cell holding the solution's source (by grade id),
    as a student who solved everything would hand it in."""
    answers = {cellmeta.grade_id(c): c.source for c in source.cells
               if cellmeta.is_solution(c) and cellmeta.grade_id(c)}
    nb = copy.deepcopy(release)
    for cell in nb.cells:
        if cellmeta.is_solution(cell):
            cell.source = answers[cellmeta.grade_id(cell)]
    return nb


def _error(cell) -> str | None:
    for o in cell.get("outputs", []):
        if o.output_type == "error":
            return f"{o.ename}: {o.evalue}"
    return None


def _stdout(cell) -> str:
    return "".join(o.get("text", "") for o in cell.get("outputs", [])
                   if o.output_type == "stream" and o.get("name") == "stdout")


@pytest.fixture(scope="module")
def graded(student_python, fresh_release, tmp_path_factory):
    """grade(chapter id) -> (CSV row per student, graded notebook per student, feedback dir),
    each chapter graded once per module, in a copy of the fresh release's course."""
    done = {}

    def grade(chapter_id: str):
        if chapter_id in done:
            return done[chapter_id]
        work = tmp_path_factory.mktemp(f"grade_{chapter_id}")
        course = Course(shutil.copytree(fresh_release.parent / "course", work / "course"))
        (name,) = course.notebook_names(chapter_id)
        release = course.release_notebook(chapter_id, name)
        downloads = work / "downloads"
        downloads.mkdir()
        handed = {"untouched": release}
        if chapter_id in SOLVED:
            handed["solved"] = answered(release, course.source_notebook(chapter_id, name))
        for student, nb in handed.items():
            nbformat.write(nb, downloads / f"{student}_{chapter_id}_{name}.ipynb")
        # autograde as a command of the student environment: its workers and kernels import
        # the wheel. collect, export and feedback are the same code either way (run here).
        CO.collect(downloads, chapter_id, course)
        flashbook(student_python, "autograde", chapter_id, "--course", course.root, "--device",
                  "cpu", "--timeout", SUBMISSION_TIMEOUT, "--workers", len(handed), "--force",
                  cwd=work)
        EX.export(work / "grades.csv", course, [chapter_id], summary=False)
        FB.feedback(chapter_id, course)
        with open(work / "grades.csv") as f:
            rows = {r["student_id"]: r for r in csv.DictReader(f)}
        results = course.results_dir(chapter_id)
        notebooks = {s: nbformat.read(results / s / f"{name}.ipynb", as_version=4)
                     for s in rows}
        done[chapter_id] = rows, notebooks, course.root / "feedback"
        return done[chapter_id]

    return grade


def _on_worker(ch):
    return pytest.param(ch, id=ch.id, marks=pytest.mark.xdist_group(f"student-{ch.id}"))


@pytest.mark.slow
@pytest.mark.parametrize("ch", [_on_worker(c) for c in CONTRACTS if c.id in SOLVED])
def test_the_solved_notebook_earns_every_point_through_the_real_grader(ch, graded):
    rows, notebooks, _ = graded(ch.id)
    row = rows["solved"]
    a = ch.id
    assert row[f"{a}/total"] == row[f"{a}/max"] and float(row[f"{a}/max"]) > 0, \
        f"{a}: the solution earned {row[f'{a}/total']} of {row[f'{a}/max']}: {row[f'{a}/lost']}" \
        f" {row[f'{a}/notes']}"
    assert row[f"{a}/lost"] == "" and row[f"{a}/notes"] == "" and row[f"{a}/flags"] == "", row
    for cell in notebooks["solved"].cells:
        if cell.cell_type != "code":
            continue
        gid = cellmeta.grade_id(cell) or "(not graded)"
        assert _error(cell) is None, f"{a} {gid} raised {_error(cell)}:\n{cell.source[:300]}"
        if cellmeta.is_graded_test(cell):
            assert "PASSED" in _stdout(cell), f"{a} {gid} printed no PASSED: {_stdout(cell)}"


@pytest.mark.slow
@pytest.mark.parametrize("ch", [_on_worker(c) for c in CONTRACTS])
def test_the_untouched_notebook_fails_exactly_at_its_stubs_with_reasons(ch, graded):
    rows, notebooks, feedback = graded(ch.id)
    row, a = rows["untouched"], ch.id
    assert row[f"{a}/flags"] == "", f"{a}: the untouched notebook was flagged: {row[f'{a}/flags']}"
    answered_cells = {ex.grade_id for ex in ch.exercises if ex.cells}
    for gid in answered_cells:
        assert row[f"{a}/{gid}"] == "0", f"{a}: {gid} earned {row[f'{a}/{gid}']} untouched"
    lost = row[f"{a}/lost"]
    assert all(f"{gid}: " in lost for gid in answered_cells), f"a lost cell has no reason: {lost}"
    assert lost.lower().count("not implemented") >= len(answered_cells), lost
    page = "".join(p.read_text() for p in (feedback / "untouched" / a).glob("*.html"))
    assert all(gid in page for gid in answered_cells), "the feedback page lists every lost cell"
    assert page.lower().count("not implemented") >= len(answered_cells), "and says why"
    for cell in notebooks["untouched"].cells:
        if cell.cell_type != "code":
            continue
        err, gid = _error(cell), cellmeta.grade_id(cell) or "(not graded)"
        if cellmeta.is_solution(cell):
            # a stub that defines a function raises only when called; one at top level raises here
            assert err is None or err.startswith("NotImplementedError"), f"stub {gid}: {err}"
        elif cellmeta.is_graded_test(cell):
            assert err and "not implemented" in err.lower() or "NotImplementedError" in (err or ""), \
                f"test {gid} should fail because of the stub, got: {err}"
        else:
            assert err is None, f"{a}: a cell that is neither stub nor test failed: {err}\n" \
                                f"{cell.source[:300]}"
