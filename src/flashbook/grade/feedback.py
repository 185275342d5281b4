"""``flashbook feedback``: one HTML page per student and notebook, from the graded results.

The page shows the score table (which checks failed, and the harness's message), the repairs
``collect`` made, and the student's notebook with its outputs — with the *released* test cells
(as the student saw them) and, for each test cell, only its verdict. Nothing else is hidden: an
error or a print of the student's code shows as it ran, and may quote a hidden test (hidden tests
are more cases, not secrets: the instructor guide says so).
"""
from __future__ import annotations

import copy
import html
from pathlib import Path

import nbformat

from . import cellmeta
from .layout import META_DIR, Course, read_results
from .record import PASSED, NotebookResult, SubmissionResult, strip_ansi


def _fmt(x) -> str:
    return "–" if x is None else f"{x:g}"


def summary_html(result: SubmissionResult, nb_result: NotebookResult, repairs: list[str]) -> str:
    rows = []
    for gid, c in nb_result.cells.items():
        rows.append(f"<tr><td><code>{html.escape(gid)}</code></td>"
                    f"<td>{_fmt(c.score)} / {_fmt(c.max_score)}</td>"
                    f"<td>{'✔' if c.status == PASSED else '✘'} {html.escape(c.status)}</td>"
                    f"<td><pre style='white-space:pre-wrap;margin:0'>"
                    f"{html.escape(c.message)}</pre></td></tr>")
    parts = [f"<h1>Feedback: {html.escape(result.assignment)} / "
             f"{html.escape(nb_result.name)}</h1>",
             f"<p>Student <b>{html.escape(result.student)}</b> — score "
             f"<b>{nb_result.score:g} / {nb_result.max_score:g}</b></p>"]
    if nb_result.notes:
        parts.append("<p><b>What went wrong while grading:</b></p><ul>" + "".join(
            f"<li>{html.escape(n)}</li>" for n in nb_result.notes) + "</ul>")
    if nb_result.flags:
        parts.append("<p><b>Flagged for the instructor's review</b> (code that an answer has no "
                     "use for: it was graded as usual, and the checks ran out of its reach):</p>"
                     "<ul>" + "".join(
                         f"<li><code>{html.escape(f.cell)}</code>, line {f.line}: "
                         f"{html.escape(f.what)}</li>" for f in nb_result.flags) + "</ul>")
    parts.append("<table><tr><th>check</th><th>points</th><th>result</th><th>message</th></tr>"
                 + "".join(rows) + "</table>")
    parts.append("<p>Each check cell runs the visible checks you saw and hidden tests with more "
                 "cases; the message is the first failure.</p>")
    if repairs and repairs != ["nothing to repair"]:
        parts.append("<p><b>Repairs made to your notebook before grading:</b></p><ul>" + "".join(
            f"<li>{html.escape(r)}</li>" for r in repairs) + "</ul>")
    return "\n".join(parts)


def student_notebook(graded, release, nb_result: NotebookResult):
    """The graded notebook as the student may see it."""
    nb = copy.deepcopy(graded)
    released = {cellmeta.grade_id(c): c for c in release.cells if cellmeta.grade_id(c)}
    for cell in nb.cells:
        gid = cellmeta.grade_id(cell)
        solution = cellmeta.is_solution(cell)
        if gid in released and not solution:
            cell.source = released[gid].source          # the released text: no hidden tests
        if cell.cell_type != "code":
            continue
        if gid in nb_result.cells and not solution:
            c = nb_result.cells[gid]
            cell.outputs = [nbformat.v4.new_output(
                "stream", name="stdout",
                text=f"{c.status.upper()} {_fmt(c.score)}/{_fmt(c.max_score)}  {c.message}\n")]
            continue
        for out in cell.get("outputs", []):
            if out.output_type == "error":
                out.traceback = [strip_ansi("\n".join(out.traceback))]
    return nb


def feedback(a: str, course: Course | None = None, results_root: Path | None = None,
             students: list[str] | None = None) -> list[Path]:
    """Write feedback/<student>/<a>/<nb>.html for every graded student; returns the paths."""
    from nbconvert import HTMLExporter      # slow to import: only when feedback is written
    course = course or Course()
    results_dir = course.results_dir(a, results_root)
    results = read_results(results_dir)
    exporter = HTMLExporter()
    written = []
    for student, result in sorted(results.items()):
        if students and student not in students:
            continue
        log_file = course.submission_dir(a, student) / META_DIR / "repair.log"
        repairs = log_file.read_text().splitlines() if log_file.exists() else []
        for nb_result in result.notebooks:
            name = nb_result.name
            release = course.release_notebook(a, name)
            graded_path = results_dir / student / f"{name}.ipynb"
            graded = nbformat.read(graded_path, as_version=4) if graded_path.exists() \
                else nbformat.v4.new_notebook()
            nb = student_notebook(graded, release, nb_result)
            head = summary_html(result, nb_result, repairs)
            nb.cells.insert(0, nbformat.v4.new_markdown_cell(head))
            body, _ = exporter.from_notebook_node(nb)
            out = course.feedback_dir(a, student) / f"{name}.html"
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(body)
            written.append(out)
    return written
