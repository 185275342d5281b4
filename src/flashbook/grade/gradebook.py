"""``flashbook export --nbgrader``: flashbook's grades into nbgrader's own gradebook.

For a course run on plain nbgrader: after ``flashbook autograde``, the gradebook
(``<course>/gradebook.db``) holds what ``nbgrader autograde`` would have put there, written through
nbgrader's API as its own ``SaveAutoGrades`` does, so that ``nbgrader export``, formgrader and
manual grading work:

* per graded cell, ``Grade.auto_score`` is flashbook's score; ``Grade.manual_score`` is never
  written, so a score an instructor entered in formgrader survives every re-export (and, as in
  nbgrader, a cell with a manual score stays marked for review);
* per solution cell, ``Comment.auto_comment`` holds the messages of the test cells that grade it
  (why points were lost) and, on the notebook's first solution cell, what went wrong while
  grading and what was repaired; ``Comment.manual_comment`` is never written;
* the graded notebook is copied to ``autograded/<student>/<assignment>/`` for formgrader's views.

The assignment, its notebooks and cells come from ``nbgrader generate_assignment`` (``flashbook
release`` runs it in the course directory): without them this refuses, saying so.
"""
from __future__ import annotations

import shutil
import warnings
from pathlib import Path

from . import cellmeta
from .layout import Course, read_results
from .record import NotebookResult


def db_url(course: Course) -> str:
    return f"sqlite:///{course.root / 'gradebook.db'}"


def comment_targets(nb) -> dict[str, str]:
    """{graded cell's grade id: the solution cell its messages are written on} — the cell itself
    when it is an answer graded by hand, else the last solution cell before it."""
    targets, last = {}, None
    for cell in nb.cells:
        gid = cellmeta.grade_id(cell)
        if cellmeta.is_solution(cell):
            last = gid
        if cellmeta.is_graded(cell) and last is not None:
            targets[gid] = last
    return targets


def _comments(nb_result: NotebookResult, targets: dict[str, str], solutions: list[str]) -> dict:
    """{solution cell: auto comment} from the cells' messages, notes and repairs."""
    texts: dict[str, list[str]] = {s: [] for s in solutions}
    if solutions:
        first = texts[solutions[0]]
        first += [f"while grading: {n}" for n in nb_result.notes]
        first += [f"repaired: {r}" for r in nb_result.repairs]
    for gid, cell in nb_result.cells.items():
        if cell.message and gid in targets:
            texts[targets[gid]].append(f"{gid} ({cell.score or 0:g}/{cell.max_score:g}): "
                                       f"{cell.message}")
    return {s: "\n".join(t) or None for s, t in texts.items()}


def export_gradebook(course: Course, assignments: list[str], results_root: Path | None = None,
                     course_id: str | None = None) -> dict:
    """Write every stored result of ``assignments`` into the course's gradebook; returns
    {"grades": n written, "students": [...], "unknown": ["assignment/notebook/cell", ...]}."""
    from nbgrader.api import Gradebook, MissingEntry   # imported here: slow, and only needed here

    report = {"grades": 0, "students": set(), "unknown": []}
    with Gradebook(db_url(course), **({"course_id": course_id} if course_id else {})) as gb, \
            warnings.catch_warnings():
        # nbgrader's add_submission makes SQLAlchemy warn about its own autoflush (harmless;
        # its autograde does the same)
        warnings.filterwarnings("ignore", message=".*not in session.*")
        for a in assignments:
            try:
                gb.find_assignment(a)
            except MissingEntry:
                raise FileNotFoundError(
                    f"assignment {a!r} is not in {course.root / 'gradebook.db'}: release it in this "
                    f"course directory first (`flashbook release {a}` or `nbgrader "
                    f"generate_assignment {a}`)") from None
            for student, result in sorted(read_results(course.results_dir(a, results_root)).items()):
                gb.update_or_create_student(student)
                gb.update_or_create_submission(a, student)
                for nbr in result.notebooks:
                    _write_notebook(gb, course, a, student, nbr, report)
                    graded = course.results_dir(a, results_root) / student / f"{nbr.name}.ipynb"
                    if graded.exists():
                        dest = course.root / "autograded" / student / a / graded.name
                        dest.parent.mkdir(parents=True, exist_ok=True)
                        shutil.copyfile(graded, dest)
                report["students"].add(student)
    report["students"] = sorted(report["students"])
    return report


def _write_notebook(gb, course, a, student, nbr, report) -> None:
    """One notebook's grades and comments; what the gradebook does not know goes to the report."""
    from nbgrader.api import MissingEntry
    try:
        source = course.source_notebook(a, nbr.name)
    except FileNotFoundError:
        source = course.release_notebook(a, nbr.name)
    targets = comment_targets(source)
    solutions = [cellmeta.grade_id(c) for c in source.cells if cellmeta.is_solution(c)]
    for gid, cell in nbr.cells.items():
        try:
            grade = gb.find_grade(gid, nbr.name, a, student)
        except MissingEntry:
            report["unknown"].append(f"{a}/{nbr.name}/{gid}")
            continue
        grade.auto_score = cell.score        # None: an answer graded by hand
        # nbgrader's own rule (SaveAutoGrades): a manual score or no auto score needs review
        grade.needs_manual_grade = grade.manual_score is not None or grade.auto_score is None
        report["grades"] += 1
    for sol, text in _comments(nbr, targets, solutions).items():
        try:
            gb.find_comment(sol, nbr.name, a, student).auto_comment = text
        except MissingEntry:
            report["unknown"].append(f"{a}/{nbr.name}/{sol}")
    gb.db.commit()
