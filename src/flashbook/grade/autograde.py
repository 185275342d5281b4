"""``flashbook autograde``: grade every submission of an assignment, each in its own process.

One worker process per submission (``worker.py``) with a scrubbed environment and a wall-clock
limit (killed with its whole process group when over); its kernel runs sandboxed (``sandbox.py``).
The parent alone writes the results store: ``results/<assignment>/<student>/result.json`` plus
the graded notebook. Students with a result are skipped unless ``force`` (resumable);
``shard=(i, n)`` grades the students whose id hashes to i (0-based), for job arrays.
"""
from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import zlib
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from tqdm import tqdm

from . import cellmeta, guard, sandbox
from .layout import META_DIR, RESULT_FILE, Course, write_json
from .record import NotebookResult, SubmissionResult, zeroed

GRACE_S = 30     # the worker enforces the limit itself; past limit + grace it is killed


class GpuUnhealthy(RuntimeError):
    """The GPU a submission would get failed its health probe: the submission waits."""


def parse_shard(text: str | None) -> tuple[int, int] | None:
    """'2/4' -> (2, 4): the third of four shards (0-based, as SLURM_ARRAY_TASK_ID)."""
    if not text:
        return None
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise ValueError(f"--shard wants i/n, e.g. 0/4, got {text!r}") from None
    if not 0 <= i < n:
        raise ValueError(f"--shard {text}: need 0 <= i < n (shards are numbered from 0)")
    return i, n


def in_shard(student: str, shard: tuple[int, int] | None) -> bool:
    """Stable: a student's shard depends on their id only, not on who else submitted."""
    return shard is None or zlib.crc32(student.encode()) % shard[1] == shard[0]


def gpu_ids() -> list[str]:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        return [g for g in visible.split(",") if g.strip()]
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout
    except FileNotFoundError:
        out = ""
    ids = [str(i) for i, line in enumerate(out.splitlines()) if line.startswith("GPU ")]
    if not ids:
        raise RuntimeError("--device gpu: no GPU found (nvidia-smi -L lists none)")
    return ids


# Run in a fresh process on the GPU a submission is about to get: a CUDA call must complete and
# (almost) all the memory must be free, so a previous submission's fault or leftover process
# cannot cost the next one points.
_GPU_PROBE = (
    "import sys, torch\n"
    "x = torch.ones(1 << 20, device='cuda'); assert float(x.sum()) == 1 << 20\n"
    "free, total = torch.cuda.mem_get_info()\n"
    "need = float(sys.argv[1]) * total\n"
    "assert free >= need, f'only {free / 2**30:.1f} of {total / 2**30:.1f} GiB free'\n")


def gpu_problem(gpu: str, share: float = 1.0, attempts: int = 5,
                wait_s: float = 3.0) -> str | None:
    """None when GPU ``gpu`` is healthy: a CUDA call completes and 90 % of this worker's
    ``share`` of the memory is free. Otherwise why not, after ``attempts`` tries (a killed
    process can take a few seconds to give its memory back)."""
    why = ""
    for i in range(attempts):
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": gpu}
        try:
            proc = subprocess.run([sys.executable, "-c", _GPU_PROBE, str(0.9 * share)], env=env,
                                  timeout=120,
                                  capture_output=True, text=True)
            if proc.returncode == 0:
                return None
            why = (proc.stderr.strip().splitlines() or ["probe failed"])[-1]
        except subprocess.TimeoutExpired:
            why = "a CUDA call did not complete within 120 s"
        if i + 1 < attempts:
            time.sleep(wait_s)
    return f"GPU {gpu} is not healthy ({why})"


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else ""


def _failed(student: str, a: str, points: dict[str, dict[str, float]], reason: str,
            worker_log: str | None = None) -> SubmissionResult:
    """A result with 0 for every graded cell, for a submission the worker could not grade."""
    return SubmissionResult(student, a, tuple(
        NotebookResult(n, zeroed(pts, reason), notes=(reason,)) for n, pts in points.items()),
        worker_log=worker_log)


def _points(course: Course, a: str, names: list[str]) -> dict[str, dict[str, float]]:
    """{notebook: {grade_id: points}} from the instructor's notebooks."""
    return {n: cellmeta.graded_points(course.source_notebook(a, n)) for n in names}


def needs_local_ports(course: Course, a: str, names: list[str]) -> bool:
    """Whether the assignment's graded code starts processes that talk over loopback TCP
    (Chapter 8's ring over gloo): its source notebook says so in its metadata,
    ``{"flashbook": {"local_ports": true}}`` (the instructor's copy, never the submission's)."""
    for n in names:
        path = course.source_dir(a) / f"{n}.ipynb"
        try:
            meta = json.loads(path.read_text()).get("metadata", {})
        except (OSError, ValueError):
            continue
        if meta.get("flashbook", {}).get("local_ports") is True:
            return True
    return False


def grade_one(course: Course, a: str, student: str, names: list[str], *, scratch: Path,
              device: str, gpu: str | None, timeout: float, cell_timeout: float,
              memory_mb: int | None, user: str | None, gpu_share: float = 1.0,
              points: dict[str, dict[str, float]]) -> tuple[SubmissionResult, Path]:
    """Grade one student in a worker process; returns (result, folder with graded notebooks)."""
    sub = course.submission_dir(a, student)
    box = Path(tempfile.mkdtemp(prefix=f"{len(os.listdir(scratch))}-", dir=scratch))
    private, work, jup = box / "private", box / "work", box / "jupyter"
    for d in (private, jup):
        d.mkdir(mode=0o700)
    os.chmod(box, 0o711)                      # the kernel's user may pass through to work/
    kernel = sandbox.write_kernelspec(jup, work, memory_mb if device == "cpu" else None, user,
                                      local_ports=needs_local_ports(course, a, names))
    files = [str(p) for d in (sub, course.source_dir(a)) for p in sorted(d.glob("*"))
             if p.is_file() and p.suffix != ".ipynb" and p.name != META_DIR]
    job = {"student": student, "assignment": a, "out": str(private), "workdir": str(work),
           "kernel": kernel, "timeout": timeout, "cell_timeout": cell_timeout, "files": files,
           "notebooks": [{"name": n, "source": str(course.source_dir(a) / f"{n}.ipynb"),
                          "release": str(course.release_dir(a) / f"{n}.ipynb"),
                          "submitted": str(sub / f"{n}.ipynb")} for n in names]}
    extra = {"JUPYTER_PATH": str(jup), "JUPYTER_RUNTIME_DIR": str(private / "rt")}
    if gpu is not None and gpu_share < 1.0:
        extra[guard.GPU_SHARE_ENV] = f"{gpu_share:.4f}"
    env = sandbox.scrubbed_env(work, device, gpu, extra)
    log = open(private / "worker.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "flashbook.grade.worker"], cwd=private,
                            env=env, stdin=subprocess.PIPE, stdout=log, stderr=log,
                            start_new_session=True)
    try:
        proc.communicate(json.dumps(job).encode(), timeout=timeout + GRACE_S)
        killed = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        killed = True
    finally:
        log.close()
    if killed:
        return _failed(student, a, points,
                       f"grading did not finish within {timeout:g} s and was stopped"), private
    result_file = private / "result.json"
    # the worker writes its result, or {"error": traceback} when it failed
    output = json.loads(result_file.read_text()) if result_file.exists() else {}
    if output and "error" not in output:
        return SubmissionResult.from_json(output), private
    tail = (output.get("error") or (private / "worker.log").read_text(errors="replace"))[-1500:]
    return _failed(student, a, points, "the grader failed on this submission "
                   f"(exit code {proc.returncode}): {tail.strip().splitlines()[-1:]}",
                   worker_log=tail), private


def autograde(a: str, course: Course | None = None, *, device: str = "cpu",
              timeout: float = 600, cell_timeout: float | None = None, workers: int = 1,
              shard: tuple[int, int] | None = None, force: bool = False,
              results_root: Path | None = None, memory_mb: int | None = 4096,
              user: str | None = None, students: list[str] | None = None,
              progress: bool = True) -> dict:
    """Grade assignment ``a``; returns {"graded": [...], "skipped": [...], "problems": {...},
    "flagged": {student: [flag, ...]}} (``flagged``: possible tampering, for review)."""
    course = course or Course()
    names = course.notebook_names(a)
    for n in names:
        course.release_notebook(a, n)         # a clear error if it was never released
    points = _points(course, a, names)
    results = course.results_dir(a, results_root)
    todo = [s for s in (students or course.students(a)) if in_shard(s, shard)]
    skipped = [s for s in todo if (results / s / RESULT_FILE).exists() and not force]
    todo = [s for s in todo if s not in skipped]
    user = sandbox.sandbox_user(user)
    if user:
        # the sandboxed kernel must not read the solutions, gradebook or other submissions
        for d in (course.root, results):
            d.mkdir(parents=True, exist_ok=True)
            os.chmod(d, 0o700)
    gpus = gpu_ids() if device == "gpu" else [None]
    if device == "gpu" and workers < 1:
        workers = len(gpus)
    slots: queue.Queue = queue.Queue()
    for k in range(max(1, workers)):
        slots.put(gpus[k % len(gpus)])
    # Workers that share a GPU each get an equal share of its memory (the kernel caps itself at
    # start-up), so one submission that allocates everything cannot fail its neighbours.
    share = 1.0 / -(-max(1, workers) // len(gpus)) if device == "gpu" else 1.0
    cell_timeout = min(cell_timeout or timeout, timeout)
    keep = bool(os.environ.get("FLASHBOOK_KEEP_SCRATCH"))   # debugging the grader itself
    scratch = Path(tempfile.mkdtemp(prefix="flashbook-grade-"))
    os.chmod(scratch, 0o711)
    summary = {"graded": [], "skipped": skipped, "problems": {}, "flagged": {}}

    def task(student):
        gpu = slots.get()
        try:
            problem = gpu_problem(gpu, share) if gpu is not None else None
            if problem:               # not graded now, not lost: a later run grades it
                raise GpuUnhealthy(problem)
            return grade_one(course, a, student, names, scratch=scratch, device=device,
                             gpu=gpu, gpu_share=share, timeout=timeout, cell_timeout=cell_timeout,
                             memory_mb=memory_mb, user=user, points=points)
        finally:
            slots.put(gpu)

    try:
        with ThreadPoolExecutor(max(1, workers)) as pool, \
                tqdm(total=len(todo), desc=f"autograde {a}", unit="nb",
                     disable=not progress) as bar:
            futures = {pool.submit(task, s): s for s in todo}
            for fut in as_completed(futures):
                student = futures[fut]
                try:
                    result, private = fut.result()
                except GpuUnhealthy as e:
                    summary["problems"][student] = [f"not graded: {e}; run autograde again"]
                    bar.update(1)
                    continue
                except Exception as e:          # never let one student stop the batch
                    result, private = _failed(student, a, points,
                                              f"grading crashed: {e!r}"), None
                record(course, a, result, private, results, names, device)
                if private is not None and not keep:
                    shutil.rmtree(private.parent, ignore_errors=True)
                summary["graded"].append(student)
                if result.reasons:
                    summary["problems"][student] = result.reasons
                if result.flags:
                    summary["flagged"][student] = result.flags
                bar.update(1)
    finally:
        if not keep:
            shutil.rmtree(scratch, ignore_errors=True)
    return summary


def record(course: Course, a: str, result: SubmissionResult, private: Path | None,
           results: Path, names: list[str], device: str) -> None:
    """Write the student's result and graded notebooks into the results store."""
    dest = results / result.student
    dest.mkdir(parents=True, exist_ok=True)
    for n in names:
        if private is not None and (private / f"{n}.ipynb").exists():
            shutil.copy(private / f"{n}.ipynb", dest / f"{n}.ipynb")
    sub = course.submission_dir(a, result.student)
    result = dataclasses.replace(
        result, device=device, graded_at=datetime.datetime.now().isoformat(timespec="seconds"),
        submitted_sha256={n: _sha256(sub / f"{n}.ipynb") for n in names})
    write_json(dest / RESULT_FILE, result.to_json())
