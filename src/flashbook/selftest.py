"""``flashbook selftest``: does every chapter still run, and still earn full marks, from the
package as it is installed, on this GPU?

For each chapter it

1. runs the solved notebook (``solutions/chN_*.py``, hidden tests included) top to bottom in a
   scratch directory outside the checkout, with ``FLASHBOOK_ROOT`` unset and only the directory
   the running flashbook was imported from on ``PYTHONPATH``: through nbclient when nbclient and
   ipykernel are installed, else as one Python script (GPU machines often have no Jupyter).
   Benchmark cells time in quick mode (``bench.QUICK_ENV``). The chapter fails when a cell
   raises, or when its output holds one of ``FAILURE_PHRASES``;
2. grades it (unless ``grade=False``): a fresh release into a scratch course, the released
   notebook answered with the solution's cells, then ``collect -> autograde -> export`` through
   the ``flashbook`` command line; every lost point is recorded with its reason;
3. merges the outcome, with its provenance, into ``src/flashbook/data/selftest/<gpu>.json``.

README's chapter table shows each chapter's last passing self-check from those records
(``check_cell``; ``publish.update_chapter_table`` writes it when ``flashbook readme`` runs).
The record itself (its schema, ``load``, ``merge``, ``save``, ``source_hash``, ``check_cell``)
is ``selftest_record``'s; this module re-exports it.
"""
from __future__ import annotations

import contextlib
import csv
import importlib.util
import io
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from . import sources as chapter_sources
from .grade.cellmeta import grade_id
from .grade.record import strip_ansi
from .selftest_record import (RECORDS, SCHEMA, check_cell, load, merge, records, save,
                              source_files, source_hash)

ERROR_TAIL = 2000                                             # characters of error text kept
STUDENT = "selftest"                                          # the grading run's student id
NOTEBOOK_RUNNER = ("nbclient", "ipykernel", "nbformat")
GRADING_NEEDS = ("nbgrader", "nbclient", "ipykernel", "jupytext")

# What the chapters print when something did not run (their try/except cells: a stub, a failed
# compile or benchmark, a missing library). A solved notebook that prints one of these failed,
# though no cell raised. tests/test_selftest.py checks that every print in an except clause of
# solutions/ is either here or known to be expected output.
FAILURE_PHRASES = (
    "Could not benchmark",           # ch3, ch4: the benchmark cell caught an exception
    "Could not autotune",            # ch3
    "not implemented yet",           # ch2: a stub where the solution should be
    "Finish Exercise",               # ch1, ch4-ch8: a demo cell met a NotImplementedError
    "Implement naive_attention",     # ch1
    "Skipped until",                 # ch9 (chapters/ch9/figures.when_solved)
    "JAX is not installed",          # ch6: its interpret-mode exercises cannot run
)


# ------------------------------------------------------------------ what a failed run says

def failure_phrase(output: str) -> str | None:
    """The first line of ``output`` that holds a failure phrase, or None."""
    for line in output.splitlines():
        if any(p in line for p in FAILURE_PHRASES):
            return line.strip()
    return None


def missing(modules) -> list[str]:
    return [m for m in modules if importlib.util.find_spec(m) is None]


# ------------------------------------------------------------------ the solved notebook's cells

_MARKER = re.compile(r"^# %%(?P<rest>.*)$")


def read_percent(text: str) -> list[tuple[int, str, str | None]]:
    """(cell index, source, grade id) of the code cells of a jupytext percent source: the few
    rules the chapter sources use, for machines without jupytext."""
    cells, kind, lines, meta = [], None, [], ""

    def close():
        if kind == "code":
            gid = re.search(r'"grade_id":\s*"([^"]+)"', meta)
            cells.append((index, "\n".join(lines).strip("\n"), gid and gid.group(1)))

    index = -1
    for line in text.splitlines():
        m = _MARKER.match(line)
        if not m:
            lines.append(line)
            continue
        close()
        index, lines, meta = index + 1, [], m.group("rest")
        kind = "markdown" if re.match(r"\s*\[(markdown|md)\]", meta) else "code"
    close()
    return cells


def solved_cells(path: Path) -> list[tuple[int, str, str | None]]:
    """The chapter source's code cells, read with jupytext when it is installed."""
    if missing(["jupytext"]):
        return read_percent(path.read_text())
    nb = chapter_sources.read(path)
    return [(i, c.source, grade_id(c)) for i, c in enumerate(nb.cells) if c.cell_type == "code"]


def _cell_name(cell) -> str:
    return f"cell {cell[0]}" + (f" ({cell[2]})" if cell[2] else "")


# ------------------------------------------------------------------ running it outside the checkout

def package_dir() -> Path:
    """The directory the running flashbook was imported from (it holds ``flashbook/``)."""
    return Path(__file__).resolve().parents[1]


def package_kind(root: Path) -> str:
    """"checkout": the running flashbook is the checkout's src/ (an editable install);
    "installed": it comes from elsewhere, so the chapters run on what the package ships."""
    return "checkout" if package_dir().is_relative_to(root.resolve()) else "installed"


def child_env() -> dict:
    """This environment without FLASHBOOK_ROOT, PYTHONPATH only the package's directory, and
    benchmark cells in quick mode."""
    from .bench import QUICK_ENV
    env = {k: v for k, v in os.environ.items() if k not in ("FLASHBOOK_ROOT", "PYTHONPATH")}
    env.update(PYTHONPATH=str(package_dir()), MPLBACKEND="Agg", **{QUICK_ENV: "1"})
    return env


def clip(head: str, body: str) -> str:
    """``head``, then as much of the end of ``body`` as ERROR_TAIL characters leave room for."""
    room = max(0, ERROR_TAIL - len(head) - 1)
    return f"{head}\n{body[-room:] if room else ''}"[:ERROR_TAIL]


def _outcome(output: str, error: str | None, cell) -> dict:
    return {"output": strip_ansi(output), "error": error and strip_ansi(error),
            "cell": cell and _cell_name(cell)}


def run_script(cells, workdir: Path, env: dict, timeout: float) -> dict:
    """Run the code cells as one script with this Python, killed with its process group after
    ``timeout`` s; returns {"output", "error" (None when it ran), "cell" (the failed one)}."""
    lines, starts = [], []
    for cell in cells:
        starts.append((len(lines) + 1, cell))              # the 1-based line of its header
        lines += [f"# %% {_cell_name(cell)}", *cell[1].splitlines(), ""]
    script = workdir / "solved_notebook.py"
    script.write_text("\n".join(lines) + "\n")
    proc = subprocess.Popen([sys.executable, str(script)], cwd=workdir, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        out = proc.communicate(timeout=timeout)[0]
        error = None if proc.returncode == 0 else f"exit code {proc.returncode}"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out = proc.communicate()[0]
        error = f"did not finish within {timeout:g} s"
    output = out.decode(errors="replace")
    where = re.findall(rf'File "{re.escape(str(script))}", line (\d+)', output)
    cell = None
    if error and where:                                    # the innermost frame in the script
        cell = [c for start, c in starts if start <= int(where[-1])][-1]
    return _outcome(output, error and clip(f"{error}:", output), cell)


def _output_text(out) -> str:
    if out.get("output_type") == "stream":
        return out.get("text", "")
    if out.get("output_type") == "error":
        return "\n".join(out.get("traceback", []))
    return out.get("data", {}).get("text/plain", "")


def run_nbclient(cells, workdir: Path, env: dict, timeout: float) -> dict:
    """Run the code cells as a notebook in a fresh kernel (the whole run within ``timeout`` s);
    returns what ``run_script`` does. ``env`` is the kernel's whole environment."""
    import nbformat
    from jupyter_client.manager import KernelManager
    from nbclient import NotebookClient
    nb = nbformat.v4.new_notebook(metadata={"kernelspec": {
        "display_name": "Python 3", "language": "python", "name": "python3"}})
    nb.cells = [nbformat.v4.new_code_cell(c[1]) for c in cells]
    deadline = time.monotonic() + timeout
    error = None
    with tempfile.TemporaryDirectory(prefix="flashbook-kernel-") as sockets:
        km = KernelManager(kernel_name="python3", transport="ipc", ip=os.path.join(sockets, "k"))
        client = NotebookClient(nb, km=km, resources={"metadata": {"path": str(workdir)}},
                                timeout_func=lambda _: max(1, int(deadline - time.monotonic())))
        try:
            client.execute(env=env)         # the kernel's whole environment
        except Exception as e:  # noqa: BLE001 - a cell's error, a timeout, a dead kernel
            error = f"{type(e).__name__}: {e}"
            if not str(e):         # an error of nbclient's own: where it was raised says more
                error = clip(error, traceback.format_exc())
            error = error[-ERROR_TAIL:]
        finally:
            if km.has_kernel:
                km.shutdown_kernel(now=True)
    failed = None
    if error:                  # the cell with an error output, else the first never finished
        errs = [i for i, c in enumerate(nb.cells)
                if any(o.get("output_type") == "error" for o in c.get("outputs", []))]
        unfinished = [i for i, c in enumerate(nb.cells) if c.get("execution_count") is None]
        failed = cells[(errs or unfinished or [0])[0]]
    output = "\n".join(_output_text(o) for c in nb.cells for o in c.get("outputs", []))
    return _outcome(output, error, failed)


def run_chapter(chapter_id: str, root: Path, runner: str, timeout: float) -> dict:
    """Run one solved notebook in a scratch directory; the record's entry for its run."""
    cells = solved_cells(chapter_sources.source(chapter_id, root).path)
    run = run_nbclient if runner == "nbclient" else run_script
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f"flashbook-selftest-{chapter_id}-") as work:
        if Path(work).resolve().is_relative_to(root.resolve()):
            raise ValueError(f"the scratch directory {work} is inside the checkout: set TMPDIR")
        r = run(cells, Path(work), child_env(), timeout)
    phrase = None if r["error"] else failure_phrase(r["output"])
    error = r["error"] or (phrase and clip(f"the output says it failed: {phrase}", r["output"]))
    return {"ran": error is None, "how": runner, "failed_cell": r["cell"],
            "seconds": round(time.monotonic() - start, 1), "error": error}


# ------------------------------------------------------------------ grading through the CLI

def answer(released, solved):
    """``released`` (the student notebook) with every solution cell holding the cell of the
    same grade id in ``solved`` (the instructor's notebook)."""
    from .grade import cellmeta
    answers = {cellmeta.grade_id(c): c.source for c in solved.cells if cellmeta.grade_id(c)}
    for cell in released.cells:
        if cellmeta.is_solution(cell):
            if cellmeta.grade_id(cell) not in answers:
                raise ValueError(f"released cell {cellmeta.grade_id(cell)!r} has no solution")
            cell.source = answers[cellmeta.grade_id(cell)]
    return released


def answered_release(chapter_id: str, root: Path, work: Path):
    """A scratch course under ``work`` with the chapter released into it: (the course's
    folder, the released notebook's path, that notebook answered with the solution's cells)."""
    import nbformat
    from . import notebooks
    from .grade.layout import Course
    course = work / "course"
    course.mkdir()
    shutil.copy2(root / "autograder" / "nbgrader_config.py", course / "nbgrader_config.py")
    (released,) = notebooks.release(root, out_dir=work / "released", course=course,
                                    only=[chapter_id])
    nb = answer(nbformat.read(released, as_version=4),
                Course(course).source_notebook(chapter_id, released.stem))
    return course, released, nb


def _graded(chapter_id: str, root: Path, work: Path, device: str, timeout: float) -> dict:
    import nbformat
    from . import grading_commands
    from .grade.layout import Course, read_results
    course, released, nb = answered_release(chapter_id, root, work)
    handed_in = work / "downloads" / STUDENT / chapter_id     # nbgrader's layout
    handed_in.mkdir(parents=True)
    nbformat.write(nb, handed_in / released.name)
    where = ["--course", str(course)]
    from .bench import QUICK_ENV
    os.environ[QUICK_ENV] = "1"          # the grader's kernels keep it (sandbox._KEEP)
    for argv in (["collect", str(work / "downloads"), "--assignment", chapter_id, *where],
                 ["autograde", chapter_id, "--device", device, "--timeout", str(timeout), *where],
                 ["export", str(work / "grades.csv"), "--assignment", chapter_id, "--no-summary",
                  *where]):
        if grading_commands.run(argv):
            raise RuntimeError(f"flashbook {argv[0]} failed")
    with open(work / "grades.csv", newline="") as f:
        row = next(r for r in csv.DictReader(f) if r["student_id"] == STUDENT)
    result = read_results(Course(course).results_dir(chapter_id))[STUDENT]
    lost = [{"cell": g, "earned": c.score, "possible": c.max_score, "status": c.status,
             "reason": c.message[-ERROR_TAIL:]} for g, c in result.cells.items()
            if c.score is None or c.score < c.max_score]
    return {"status": "graded", "device": device, "earned": float(row[f"{chapter_id}/total"]),
            "possible": float(row[f"{chapter_id}/max"]), "lost": lost, "notes": result.reasons,
            "flags": result.flags}


def grade_chapter(chapter_id: str, root: Path, device: str, timeout: float) -> dict:
    """Grade the solution through release, collect, autograde and export; never raises."""
    lacking = missing(GRADING_NEEDS)
    if lacking:
        return {"status": "skipped", "reason": "grading skipped: nbgrader/nbclient not "
                                               f"installed (missing: {', '.join(lacking)})"}
    start, log = time.monotonic(), io.StringIO()
    try:
        with tempfile.TemporaryDirectory(prefix=f"flashbook-selftest-grade-{chapter_id}-") as w, \
                contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            result = _graded(chapter_id, root, Path(w), device, timeout)
    except Exception as e:  # noqa: BLE001 - a broken pipeline is a finding, not a crash
        result = {"status": "error", "reason": f"{type(e).__name__}: {e}"[-ERROR_TAIL:],
                  "log": log.getvalue()[-ERROR_TAIL:]}
    return {**result, "seconds": round(time.monotonic() - start, 1)}


def full_marks(grading: dict) -> bool:
    """Whether grading found nothing wrong (a skipped grading finds nothing)."""
    if grading["status"] == "skipped":
        return True
    return grading["status"] == "graded" and grading["earned"] == grading["possible"]


# ------------------------------------------------------------------ provenance

def _git(root: Path, *args) -> str | None:
    """git's output in ``root``, or None (no .git, no git, or git refused)."""
    if not (root / ".git").exists():
        return None
    try:
        proc = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True,
                              timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


def git_commit(root: Path) -> str | None:
    return _git(root, "rev-parse", "HEAD") or None


def uncommitted(paths: list[Path], root: Path, commit: str | None = None) -> bool | None:
    """Whether git sees changes to ``paths`` (None: it cannot tell, also when ``commit`` is
    given and the root's git is at another commit: a copy of a checkout with an old .git)."""
    head = git_commit(root)
    if commit and head != commit:
        return None
    status = _git(root, "status", "--porcelain", "--", *map(str, paths))
    return None if status is None else bool(status)


def recorded_commit(root: Path, commit: str | None) -> str | None:
    """The commit a record names: the one given (``--commit``: the caller knows what it copied),
    else the root's git HEAD."""
    return commit or git_commit(root)


def provenance(command: str, root: Path, commit: str | None) -> dict:
    """Where, on what and from which commit this self-check ran (``results.provenance``'s
    versions, the device as the chapters see it, how the package was found)."""
    from . import __version__, results
    from .device import current
    backend = current()
    info = results.provenance(command)
    info.pop("timer", None)
    if not backend.gpu:                  # CPU mode, maybe on a machine that has a GPU
        for key in ("multiprocessors", "memory_gib"):
            info.pop(key, None)
    cc = backend.capability
    info.update(gpu=backend.name, compute_capability=cc and f"{cc[0]}.{cc[1]}",
                driver=info.get("driver") if backend.gpu else None,
                device="gpu" if backend.gpu else "cpu", commit=recorded_commit(root, commit),
                flashbook=__version__, package=package_kind(root),
                package_dir=str(package_dir()), quick_bench=True)
    return info


# ------------------------------------------------------------------ the command

def selftest(root: Path, chapter_ids: list[str] | None = None, out: Path | None = None, *,
             grade: bool = True, runner: str = "auto", timeout: float = 1200,
             command: str = "flashbook selftest", commit: str | None = None,
             echo=print) -> tuple[Path, dict, bool]:
    """Run (and grade) the chapters, merge them into the record ``out`` (default: the
    checkout's ``src/flashbook/data/selftest/<gpu>.json``); returns (path, record, all passed)."""
    from .device import current
    from .results import gpu_slug
    root = Path(root).resolve()
    known = [c.id for c in chapter_sources.sources(root)]
    if not known:
        raise ValueError(f"{root} has no solutions/chN_*.py: run from a checkout (or --root)")
    unknown = sorted(set(chapter_ids or ()) - set(known))
    if unknown:
        raise ValueError(f"no chapter {', '.join(unknown)} in {root / 'solutions'}")
    backend = current()
    if out is None and not backend.gpu:
        raise ValueError("no GPU (or FLASHBOOK_FORCE_CPU=1): records are GPU self-checks; "
                         "give --out to write a CPU one elsewhere")
    out = Path(out) if out else root / RECORDS / f"{gpu_slug(backend.name)}.json"
    if runner == "auto":
        runner = "script" if missing(NOTEBOOK_RUNNER) else "nbclient"
    prov = provenance(command, root, commit)
    passed, record = [], load(out)
    for cid in chapter_ids or known:
        echo(f"{cid}: running the solved notebook ({runner}, package: {prov['package']}) ...")
        ran = run_chapter(cid, root, runner, timeout)
        grading = (grade_chapter(cid, root, "gpu" if backend.gpu else "cpu", timeout) if grade
                   else {"status": "skipped", "reason": "--no-grade"})
        entry = {"passed": ran["ran"] and full_marks(grading), **ran,
                 "sha256": source_hash(cid, root),
                 "uncommitted_changes": uncommitted(source_files(cid, root), root, commit),
                 "grading": grading, "provenance": prov}
        echo(f"{cid}: {summary(entry)}")
        passed.append(entry["passed"])
        record = merge(load(out), {cid: entry})     # after each chapter: a killed run keeps it
        save(out, record)
    return out, record, all(passed)


def summary(entry: dict) -> str:
    g = entry["grading"]
    graded = (f"graded {g['earned']:g}/{g['possible']:g}" if g["status"] == "graded"
              else f"grading {g['status']}: {g['reason'].splitlines()[0]}")
    head = "passed" if entry["passed"] else "FAILED"
    why = "" if entry["ran"] else f"\n  {entry['failed_cell'] or ''} {entry['error'][-600:]}"
    for lost in g.get("lost", ()):
        why += f"\n  lost {lost['possible'] - (lost['earned'] or 0):g} in {lost['cell']}: " \
               f"{(lost['reason'].strip().splitlines() or [''])[0][:200]}"
    return f"{head} ({entry['how']}, {entry['seconds']:g} s; {graded}){why}"
