"""Grade one submission. Runs in its own process (``python -m flashbook.grade.worker``), started
by ``autograde`` with a scrubbed environment and a wall-clock limit; reads its job (JSON) on
stdin and writes ``result.json`` and the graded notebooks to the job's private output folder.

Per notebook: repair against the release, put back the instructor's test cells (with the hidden
tests), scan the student's code for tampering (``scan``: flags for the instructor), guard the
test cells (``guard``: checks loaded afresh, pristine state, a per-cell completion token), run it
cell by cell in the sandboxed kernel, score every graded cell.

A cell that loops is interrupted after ``cell_timeout`` and fails. If the kernel then does not
answer a trivial probe cell (code blocked where SIGINT cannot reach it, e.g. inside a CUDA call
waiting for a GPU kernel that never ends), or if the kernel died, the cell fails with that reason,
the kernel is killed and restarted, the code cells before it that are not graded tests (the
grader's setup, the student's answers) are run again on throwaway copies, and grading goes on
with the next cell (if a graded cell is left); the graded cells that ran keep their scores. At most
``MAX_RESTARTS`` restarts per notebook: a further hang or death, a cell that hangs or kills the
kernel again when run again, or the submission's deadline leaves the remaining cells unrun
(0 points, with the reason) while the cells that ran keep their points.
"""
from __future__ import annotations

import contextlib
import copy
import json
import shutil
import signal
import sys
import time
import traceback
from pathlib import Path

import nbformat

from . import cellmeta, guard, repair, scan
from .record import FAILED, MANUAL, NOT_RUN, PARTIAL, PASSED, CellResult, NotebookResult, \
    Status, SubmissionResult, strip_ansi, zeroed

PROBE_TIMEOUT = 10   # s: a kernel that cannot run `pass` in this long after an interrupt is stuck
MAX_RESTARTS = 2     # per notebook: one that keeps hanging or killing its kernel gets no more
START_ATTEMPTS = 3   # a kernel that dies before it answers is started again (new ports) this often


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


def _errors(cell) -> list:
    return [o for o in cell.get("outputs", []) if o.output_type == "error"]


def _fail(cell, ename: str, evalue: str) -> None:
    """Record an error in ``cell`` (it then scores 0), as the kernel would have."""
    cell.outputs.append(nbformat.v4.new_output("error", ename=ename, evalue=evalue,
                                               traceback=[f"{ename}: {evalue}"]))


def _run(client, nb, i: int, cell, timeout: float) -> str:
    """Run ``cell`` as cell ``i`` of ``nb``. Returns "" when it ended (an error included),
    "timeout" when it ran into ``timeout`` s, "died" when the kernel died."""
    from nbclient.exceptions import CellTimeoutError, DeadKernelError
    client.timeout = int(max(1, timeout))
    keep, start = nb.cells[i], time.monotonic()
    try:
        client.execute_cell(cell, i)
    except DeadKernelError:
        return "died"
    except CellTimeoutError:        # interrupted, and no sign of life within nbclient's iopub wait
        return "timeout"
    finally:
        nb.cells[i] = keep          # nbclient stores the cell it ran there (a probe, a copy)
    # nbgrader's executor (error_on_timeout) interrupts at the timeout and records the error in
    # the cell instead of raising; the wall time catches any other way of giving up on it
    if time.monotonic() - start >= client.timeout or \
            any(o.get("ename") == "CellTimeoutError" for o in _errors(cell)):
        return "timeout"
    return ""


def _trouble(client, nb, i: int, cell, timeout: float) -> str:
    """Run ``cell`` as cell ``i`` of ``nb``: "" when the kernel can go on (the cell may have failed
    or been interrupted), "stuck" when it timed out and the kernel does not answer a probe cell
    after it (SIGINT did not take effect), "died" when the kernel died."""
    outcome = _run(client, nb, i, cell, timeout)
    if outcome != "timeout":
        return outcome
    # the probe asks only whether the kernel answers: when it does not, waiting for its output
    # after the interrupt (nbclient's iopub_timeout) only loses time
    client.iopub_timeout, iopub = 1, client.iopub_timeout
    try:
        probe = _run(client, nb, i, nbformat.v4.new_code_cell("pass"),
                     min(PROBE_TIMEOUT, timeout))
    finally:
        client.iopub_timeout = iopub
    if probe:
        return "died" if probe == "died" else "stuck"
    if not _errors(cell):           # the interrupted cell's own error was not received
        _fail(cell, "CellTimeoutError", f"the cell did not stop within the time limit of "
                                        f"{int(max(1, timeout))} s and was interrupted")
    return ""


def _restart(client, timeout: float) -> str:
    """Kill the kernel (the only cure for one blocked where SIGINT cannot reach it: it also ends
    its CUDA context and GPU work) and connect to a fresh one. Returns why it failed, or ""."""
    from nbclient.util import run_sync
    km = client.km
    try:
        client.kc.stop_channels()   # a fresh client: no stale messages of the old kernel
        # same launch arguments (sandbox, cwd, log); new ports, in case the dying one holds its
        run_sync(km.restart_kernel)(now=True, newports=True)
        client.startup_timeout = int(max(1, timeout))
        client.start_new_kernel_client()
    except Exception as e:
        client.km = km              # nbclient drops it when the client fails: keep it to clean up
        return f"the kernel could not be restarted ({type(e).__name__}: {e})"
    return ""


def _start_kernel(stack: contextlib.ExitStack, client, log) -> None:
    """Start ``client``'s kernel inside ``stack``. A kernel that dies before it answers is started
    again, on new ports: two graders' kernels starting at once can be handed the same free port
    (jupyter_client picks ports by binding and releasing them), and the one that binds second exits
    (the sandbox lets it bind only its own five). No student code has run yet, so a retry is fair."""
    for attempt in range(1, START_ATTEMPTS + 1):
        try:
            stack.enter_context(client.setup_kernel(stdout=log, stderr=log))
            return
        except RuntimeError as e:
            if attempt == START_ATTEMPTS or "died before replying" not in str(e):
                raise
            log.write(f"flashbook grader: the kernel died as it started ({e}); "
                      f"starting it again (attempt {attempt + 1})\n".encode())
            log.flush()
            client.km = client.kc = None        # nbclient has shut the dead one down


def execute(nb, *, kernel: str, workdir: Path, cell_timeout: float, deadline: float,
            kernel_log: Path, hidden_cells: int = 0) -> tuple[dict, list[str]]:
    """Run ``nb`` in place, cell by cell. Returns ({cell index: reason not run}, notes).
    ``hidden_cells``: leading cells the grader added (messages count cells after them)."""
    from nbgrader.preprocessors import Execute

    # nbgrader's executor: interrupts a cell at its timeout and records the error in the cell.
    # At the end the kernel is killed: a stuck one would not answer a shutdown request.
    client = Execute(kernel_name=kernel, timeout=int(cell_timeout), interrupt_on_timeout=True,
                     allow_errors=True, startup_timeout=120, shutdown_kernel="immediate")
    client.nb, client.resources = nb, {"metadata": {"path": str(workdir)}}
    not_run, notes, restarts = {}, [], 0
    broke = set()                   # cells that hung or killed the kernel: never run again
    code_cells = [i for i, c in enumerate(nb.cells) if c.cell_type == "code"]
    time_up = "the submission's time limit was reached"

    def restart(upto: int) -> str:
        """Restart the kernel, then run the code cells before cell ``upto`` that are not graded
        tests again, on throwaway copies: the state that the later cells need. The graded tests
        are not run again: their checks already ran, and they keep their outputs and scores.
        Nor are the cells in ``broke``. Returns why that failed, or ""."""
        left = deadline - time.monotonic()
        if left < 1:
            return time_up
        if why := _restart(client, left):
            return why
        for j in code_cells:
            if j >= upto:
                break
            if j in broke or cellmeta.is_graded_test(nb.cells[j]):
                continue
            left = deadline - time.monotonic()
            if left < 1:
                return time_up
            trouble = _trouble(client, nb, j, copy.deepcopy(nb.cells[j]), min(cell_timeout, left))
            if trouble:
                return (f"after the restart, cell {j + 1 - hidden_cells} "
                        f"{'killed the kernel' if trouble == 'died' else 'hung'} when run again")
        return ""

    with open(kernel_log, "wb") as err:
        try:
            with contextlib.ExitStack() as stack:
                _start_kernel(stack, client, err)
                for n, i in enumerate(code_cells):
                    rest = code_cells[n + 1:]
                    left = deadline - time.monotonic()
                    if left < 1:
                        notes.append(time_up)
                        not_run.update({j: time_up for j in [i, *rest]})
                        break
                    limit = int(max(1, min(cell_timeout, left)))
                    trouble = _trouble(client, nb, i, nb.cells[i], limit)
                    if not trouble:
                        continue
                    # the kernel is dead, or stuck in this cell: the cell fails, and only a new
                    # kernel can run the cells after it
                    broke.add(i)
                    what = (f"the kernel died while running cell {i + 1 - hidden_cells}"
                            f"{_kernel_exit(client)}" if trouble == "died" else
                            f"cell {i + 1 - hidden_cells} did not stop within the time limit "
                            f"of {limit} s, even when interrupted")
                    graded_left = any(cellmeta.is_graded(nb.cells[j]) for j in rest)
                    why = ""
                    if graded_left and restarts == MAX_RESTARTS:
                        why = f"the kernel was restarted {MAX_RESTARTS} times already"
                    elif graded_left:       # else no new kernel is worth its time
                        restarts += 1
                        why = restart(i)
                        if not why:
                            what += ("; the kernel was restarted and the code before it, except "
                                     "the tests, was run again")
                    if why:
                        what += f"; {why}: the cells after it were not run"
                    _fail(nb.cells[i], "DeadKernelError" if trouble == "died"
                          else "CellTimeoutError", what)
                    notes.append(what)
                    if why or not graded_left:
                        not_run.update({j: what for j in rest})
                        break
        except RuntimeError as e:       # kernel did not start
            notes.append(f"the kernel did not start: {e}")
            not_run.update({j: notes[-1] for j in code_cells if j not in not_run})
    return not_run, notes


def grade_notebook(job: dict, nbjob: dict, out: Path, workdir: Path,
                   deadline: float) -> NotebookResult:
    """Grade one notebook of the submission; write the graded notebook to ``out``."""
    name = nbjob["name"]
    source = nbformat.read(nbjob["source"], as_version=4)
    release = nbformat.read(nbjob["release"], as_version=4)
    points = cellmeta.graded_points(source)

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
    not_run, notes = execute(nb, kernel=job["kernel"], workdir=workdir,
                             cell_timeout=job["cell_timeout"], deadline=deadline,
                             kernel_log=out / f"{name}.kernel.log", hidden_cells=1)
    setup_error = "" if 0 in not_run else guard.setup_error(nb)
    not_run = {i - 1: why for i, why in not_run.items() if i > 0}
    confirmed = guard.undo(nb, plan)
    if setup_error:
        notes.append(f"the grader's guard did not start ({setup_error[:300]}); the test cells "
                     "could not run")
    cells: dict[str, CellResult] = {}
    for i, cell in enumerate(nb.cells):
        gid = cellmeta.grade_id(cell)
        if gid not in points:
            for o in cell.get("outputs", []):    # e.g. a SyntaxError in the student's code
                # (a hang or a dead kernel: execute's note already says so)
                if o.output_type == "error" and i not in not_run and o.evalue not in notes:
                    msg = f"{o.ename}: {o.evalue}"[:300]
                    notes.append(f"cell {i + 1} ({gid or 'not graded'}) raised {msg}")
            continue
        if cell.cell_type != "code":
            cells[gid] = CellResult(None, points[gid], MANUAL, "graded by hand")
        elif i in not_run:
            cells[gid] = CellResult(0.0, points[gid], NOT_RUN, not_run[i])
        else:
            score, status, msg = cell_score(cell, points[gid], confirmed.get(i, True))
            cells[gid] = CellResult(score, points[gid], status, strip_ansi(msg)[:2000])
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
