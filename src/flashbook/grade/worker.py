"""Grade one submission. Runs in its own process (``python -m flashbook.grade.worker``), started
by ``autograde`` with a scrubbed environment and a wall-clock limit; reads its job (JSON) on
stdin and writes ``result.json`` and the graded notebooks to the job's private output folder.

Per notebook: repair against the release, put back the instructor's test cells (with the hidden
tests), scan the student's code for tampering (``scan``: flags for the instructor), guard the
test cells (``guard``: checks loaded afresh, pristine state, a per-cell completion token), run it
cell by cell in the sandboxed kernel, score every graded cell. A cell that loops
is interrupted after ``cell_timeout``; a dead kernel or the submission's deadline leaves the
remaining cells unrun (0 points, with the reason) while the cells that ran keep their points.
"""
from __future__ import annotations

import copy
import json
import shutil
import signal
import sys
import time
import traceback
from pathlib import Path

import nbformat

from . import cellmeta, guard, hidden, repair, scan
from .record import FAILED, MANUAL, NOT_RUN, PARTIAL, PASSED, CellResult, NotebookResult, \
    Status, SubmissionResult, zeroed


def instructor_version(student, source):
    """The repaired submission with the instructor's locked and test cells (hidden tests)."""
    nb = copy.deepcopy(student)
    src = {cellmeta.grade_id(c): c for c in source.cells if cellmeta.grade_id(c)}
    for cell in nb.cells:
        gid = cellmeta.grade_id(cell)
        if gid in src:
            cellmeta.set_meta(cell, cellmeta.nbgrader_meta(src[gid]))
            if not cellmeta.is_solution(src[gid]):
                cell.source = src[gid].source
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    return nb


def cell_score(cell, points: float, confirmed: bool = True) -> tuple[float, Status, str]:
    """(score, status, message) of an executed graded code cell.

    Like nbgrader: an error output means 0, a numeric result is partial credit, anything
    else full points. Unlike nbgrader, output on stderr (a warning) costs nothing.
    ``confirmed``: whether the guarded cell printed its completion token (no token, no points).
    """
    for out in cell.get("outputs", []):
        if out.output_type == "error":
            msg = f"{out.get('ename', 'Error')}: {out.get('evalue', '')}".strip().rstrip(":")
            return 0.0, FAILED, msg
    if not confirmed:
        return 0.0, FAILED, guard.NOT_CONFIRMED
    results = [o for o in cell.get("outputs", []) if o.output_type == "execute_result"]
    if results:
        try:
            value = float(results[-1].get("data", {}).get("text/plain", ""))
            return max(0.0, min(value, points)), PARTIAL, f"partial credit {value:g}"
        except ValueError:
            pass
    return float(points), PASSED, ""


def _kernel_exit(client) -> str:
    try:
        code = client.km.provisioner.process.poll()
    except Exception:
        return ""
    if code is None:
        return ""
    if code < 0:
        name = signal.Signals(-code).name
        hint = " (out of memory?)" if name == "SIGKILL" else ""
        return f", killed by {name}{hint}"
    return f", exit code {code}"


def execute(nb, *, kernel: str, workdir: Path, cell_timeout: float, deadline: float,
            kernel_log: Path, hidden_cells: int = 0) -> tuple[dict, str]:
    """Run ``nb`` in place, cell by cell. Returns ({cell index: reason not run}, note).
    ``hidden_cells``: leading cells the grader added (messages count cells after them)."""
    from nbclient.exceptions import CellTimeoutError, DeadKernelError
    from nbgrader.preprocessors import Execute

    # nbgrader's executor: interrupts a cell at its timeout and records the error in the cell
    client = Execute(kernel_name=kernel, timeout=int(cell_timeout), interrupt_on_timeout=True,
                     allow_errors=True, startup_timeout=120)
    client.nb, client.resources = nb, {"metadata": {"path": str(workdir)}}
    not_run, note = {}, ""
    code_cells = [i for i, c in enumerate(nb.cells) if c.cell_type == "code"]
    with open(kernel_log, "wb") as err:
        try:
            with client.setup_kernel(stdout=err, stderr=err):
                for n, i in enumerate(code_cells):
                    left = deadline - time.monotonic()
                    if left < 1:
                        note = "the submission's time limit was reached"
                        not_run.update({j: note for j in code_cells[n:]})
                        break
                    client.timeout = int(max(1, min(cell_timeout, left)))
                    try:
                        client.execute_cell(nb.cells[i], i)
                    except DeadKernelError:
                        note = (f"the kernel died while running cell {i + 1 - hidden_cells}"
                                f"{_kernel_exit(client)}")
                        not_run.update({j: note for j in code_cells[n:]})
                        break
                    except CellTimeoutError:
                        note = (f"cell {i + 1 - hidden_cells} did not stop within the time limit "
                                f"of {client.timeout} s, even when interrupted")
                        not_run.update({j: note for j in code_cells[n:]})
                        break
        except RuntimeError as e:       # kernel did not start
            note = f"the kernel did not start: {e}"
            not_run.update({j: note for j in code_cells if j not in not_run})
    return not_run, note


def grade_notebook(job: dict, nbjob: dict, out: Path, workdir: Path,
                   deadline: float) -> NotebookResult:
    """Grade one notebook of the submission; write the graded notebook to ``out``."""
    name = nbjob["name"]
    source = nbformat.read(nbjob["source"], as_version=4)
    release = nbformat.read(nbjob["release"], as_version=4)
    points = cellmeta.graded_points(source)
    secret = hidden.hidden_lines(source)

    def zero_all(reason) -> NotebookResult:
        return NotebookResult(name, zeroed(points, reason), notes=(reason,))

    path = nbjob.get("submitted")
    if not path or not Path(path).exists():
        return zero_all("no notebook was submitted")
    try:
        student = nbformat.read(path, as_version=4)
        nbformat.validate(student)
    except Exception as e:
        return zero_all(f"the notebook file could not be read ({type(e).__name__}: "
                        f"{str(e).splitlines()[0][:200] if str(e) else ''}); fix or resubmit it")
    fixed, repairs = repair.repair(student, release)
    nb = instructor_version(fixed, source)
    flags = scan.scan(fixed, release, set(guard.imports(source)), guard.PACKAGE)
    plan = guard.apply(nb, source)
    not_run, note = execute(nb, kernel=job["kernel"], workdir=workdir,
                            cell_timeout=job["cell_timeout"], deadline=deadline,
                            kernel_log=out / f"{name}.kernel.log", hidden_cells=1)
    setup_error = "" if 0 in not_run else guard.setup_error(nb)
    not_run = {i - 1: why for i, why in not_run.items() if i > 0}
    confirmed = guard.undo(nb, plan)
    notes = [note] if note else []
    if setup_error:
        notes.append(f"the grader's guard did not start ({setup_error[:300]}); the test cells "
                     "could not run")
    cells: dict[str, CellResult] = {}
    for i, cell in enumerate(nb.cells):
        gid = cellmeta.grade_id(cell)
        if gid not in points:
            for o in cell.get("outputs", []):    # e.g. a SyntaxError in the student's code
                if o.output_type == "error" and i not in not_run:
                    msg = hidden.redact(f"{o.ename}: {o.evalue}", secret)[:300]
                    notes.append(f"cell {i + 1} ({gid or 'not graded'}) raised {msg}")
            continue
        if cell.cell_type != "code":
            cells[gid] = CellResult(None, points[gid], MANUAL, "graded by hand")
        elif i in not_run:
            cells[gid] = CellResult(0.0, points[gid], NOT_RUN, not_run[i])
        else:
            score, status, msg = cell_score(cell, points[gid], confirmed.get(i, True))
            cells[gid] = CellResult(score, points[gid], status,
                                    hidden.redact(hidden.strip_ansi(msg), secret)[:2000])
    # every graded cell gets a result (repair re-inserts missing cells: belt and braces)
    cells = {**zeroed(points, "cell missing"), **cells}
    nbformat.write(nb, out / f"{name}.ipynb")
    return NotebookResult(name, cells, tuple(repairs), tuple(notes), flags)


def run(job: dict) -> SubmissionResult:
    start = time.monotonic()
    deadline = start + job["timeout"]
    out, workdir = Path(job["out"]), Path(job["workdir"])
    notebooks = []
    for nbjob in job["notebooks"]:
        # a fresh work dir per notebook: the student's other files, nothing else
        if workdir.exists():
            shutil.rmtree(workdir)
        workdir.mkdir(parents=True)
        for extra in job.get("files", []):
            shutil.copy(extra, workdir / Path(extra).name)
        notebooks.append(grade_notebook(job, nbjob, out, workdir, deadline))
    return SubmissionResult(job["student"], job["assignment"], tuple(notebooks),
                            seconds=round(time.monotonic() - start, 2))


def main() -> int:
    job = json.loads(sys.stdin.read())
    out = Path(job["out"])
    try:
        result = run(job).to_json()
    except Exception:
        result = {"error": traceback.format_exc()}
    tmp = out / "result.json.tmp"
    tmp.write_text(json.dumps(result))
    tmp.replace(out / "result.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
