"""A kernel stuck where the interrupt cannot reach it (on a GPU: blocked in a CUDA call that waits
for a student's kernel that never ends), or a dead kernel, is restarted: the cell fails, the code
before it is run again in the fresh kernel (not the tests), and grading goes on after it.

On CPU a cell that ignores SIGINT and sleeps stands in for the GPU hang. Each case grades a tiny
notebook end-to-end (``worker.grade_notebook``) in a plain ``python3`` kernel (quick to start; the
sandboxed kernel's restart is exercised by test_grading.py's class, student "crash").
"""
from __future__ import annotations

import json
import sys
import time

import nbformat
import pytest

from flashbook.grade import worker
from flashbook.grade.record import FAILED, NOT_RUN, PASSED

pytestmark = pytest.mark.slow    # each test runs notebook kernels (make test-fast skips them)

CELL_TIMEOUT = 2                 # s: small, so that every hang here costs little
STUCK = ("import signal, time\n"
         "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
         "time.sleep(10**6)")
DIE = "import os\nos._exit(1)"
# the student's answer; appends the kernel's pid to `runs` (in the work dir) each time it runs
ANSWER = "import os\nx = 41\nwith open('runs', 'a') as f:\n    print(os.getpid(), file=f)"
USES_ANSWER = "assert x == 41"


def answer(gid: str, source: str):
    return nbformat.v4.new_code_cell(source, metadata={"nbgrader": {
        "grade_id": gid, "solution": True, "grade": False, "locked": False,
        "schema_version": 3}})


def check(gid: str, source: str, points: float = 1):
    return nbformat.v4.new_code_cell(source, metadata={"nbgrader": {
        "grade_id": gid, "solution": False, "grade": True, "locked": True, "points": points,
        "schema_version": 3}})


@pytest.fixture
def grade(tmp_path):
    """grade(*cells, kernel="python3") -> (NotebookResult, pids of the kernels that ran ANSWER, in order).
    The notebook is its own source, release and submission (it has no hidden tests)."""
    def run(*cells, kernel="python3"):
        path, out, work = tmp_path / "nb.ipynb", tmp_path / "out", tmp_path / "work"
        nbformat.write(nbformat.v4.new_notebook(cells=list(cells)), path)
        out.mkdir()
        work.mkdir()
        job = {"kernel": kernel, "cell_timeout": CELL_TIMEOUT}
        nbjob = {"name": "nb", "source": str(path), "release": str(path), "submitted": str(path)}
        result = worker.grade_notebook(job, nbjob, out, work, time.monotonic() + 120)
        runs = work / "runs"
        return result, runs.read_text().split() if runs.exists() else []
    return run


def test_stuck_kernel_is_restarted_and_grading_goes_on(grade):
    r, pids = grade(answer("ans", ANSWER), check("t_stuck", STUCK, 1),
                    check("t_after", USES_ANSWER, 2))
    stuck = r.cells["t_stuck"]
    assert (stuck.score, stuck.status) == (0, FAILED)
    assert "did not stop within the time limit" in stuck.message
    assert "restarted" in stuck.message
    # the answer ran again in a fresh kernel (another process), and the later test used it
    assert len(pids) == 2 and pids[0] != pids[1]
    assert (r.cells["t_after"].score, r.cells["t_after"].status) == (2, PASSED)
    assert any("restarted" in n for n in r.notes)


def test_interrupted_cell_does_not_restart_the_kernel(grade):
    """A loop that the interrupt stops: the cell fails, the kernel and its state survive."""
    r, pids = grade(answer("ans", ANSWER), answer("loop", "v = 5\nwhile True:\n    pass"),
                    check("t_after", USES_ANSWER + "\nassert v == 5", 2))
    assert (r.cells["t_after"].score, r.cells["t_after"].status) == (2, PASSED)
    assert len(pids) == 1
    assert any("KeyboardInterrupt" in n for n in r.notes), r.notes
    assert not any("restarted" in n for n in r.notes), r.notes


def test_dead_kernel_is_restarted_at_most_twice(grade):
    r, pids = grade(answer("ans", ANSWER), answer("bad", DIE), check("t_mid", USES_ANSWER, 2),
                    check("t_die1", DIE, 1), check("t_mid2", USES_ANSWER, 2),
                    check("t_die2", DIE, 1), check("t_after", USES_ANSWER, 2))
    assert any(n.startswith("the kernel died while running cell 2, exit code 1; the kernel was "
                            "restarted") for n in r.notes), r.notes
    assert (r.cells["t_mid"].score, r.cells["t_mid"].status) == (2, PASSED)
    assert (r.cells["t_die1"].score, r.cells["t_die1"].status) == (0, FAILED)
    assert "the kernel died" in r.cells["t_die1"].message
    assert "exit code 1" in r.cells["t_die1"].message
    # the answer that killed the kernel is not run again after the second restart
    assert (r.cells["t_mid2"].score, r.cells["t_mid2"].status) == (2, PASSED)
    assert len(pids) == 1 + worker.MAX_RESTARTS
    assert r.cells["t_die2"].status == FAILED
    after = r.cells["t_after"]
    assert (after.score, after.status) == (0, NOT_RUN)
    assert f"restarted {worker.MAX_RESTARTS} times" in after.message


@pytest.mark.parametrize("again", [DIE, STUCK], ids=["dies", "hangs"])
def test_answer_that_fails_when_run_again_stops_grading(grade, again):
    """The answer runs the first time, but kills or hangs the fresh kernel when run again: no
    second restart for it, the cells after the dead test are not run."""
    flaky = ANSWER + "\nif len(open('runs').read().split()) > 1:\n" + \
        "\n".join("    " + line for line in again.splitlines())
    r, pids = grade(answer("ans", flaky), check("t_die", DIE, 1), check("t_after", USES_ANSWER, 2))
    assert len(pids) == 2                          # one restart, no more
    assert r.cells["t_die"].status == FAILED
    after = r.cells["t_after"]
    assert (after.score, after.status) == (0, NOT_RUN)
    assert "again" in after.message and "not run" in after.message


def test_kernel_that_dies_as_it_starts_is_started_again(grade, tmp_path, monkeypatch):
    """Two kernels starting at once can be handed the same free port: the one that binds second
    exits before it answers. The grader starts it again; the student loses nothing."""
    spec = tmp_path / "jupyter" / "kernels" / "dies_first"
    spec.mkdir(parents=True)
    first = tmp_path / "started_once"
    launcher = ("import os, sys\n"
                f"if not os.path.exists({str(first)!r}):\n"
                f"    open({str(first)!r}, 'w').close()\n"
                "    sys.exit(3)\n"
                "os.execv(sys.executable, [sys.executable, '-m', 'ipykernel_launcher', '-f', "
                "sys.argv[1]])")
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-c", launcher, "{connection_file}"],
        "display_name": "dies first", "language": "python"}))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    r, pids = grade(answer("ans", ANSWER), check("t_after", USES_ANSWER, 2), kernel="dies_first")
    assert first.exists(), "the first kernel ran (and died)"
    assert (r.cells["t_after"].score, r.cells["t_after"].status) == (2, PASSED), r.notes
    assert len(pids) == 1
    log = (tmp_path / "out" / "nb.kernel.log").read_text()
    assert "starting it again (attempt 2)" in log
