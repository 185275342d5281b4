"""Run Pallas Mosaic GPU kernels in JAX's GPU interpret mode, in a fresh process with a time
limit, and turn whatever goes wrong into a message that teaches (Chapter 6; Exercise 1's K/V
ring and Exercise 4's consumer use it).

JAX's interpret mode (``plgpu.kernel(..., interpret=InterpretGPUParams(...))``) runs a
warp-specialized kernel on a CPU: every warpgroup is a Python thread, SMEM and GMEM are NumPy
buffers, TMA copies and mbarriers are simulated, and with ``detect_races=True`` a vector-clock
race detector reports two accesses to the same SMEM words that no barrier orders. It is strict
where hardware is silent (a barrier must not complete twice before someone waits for it; every
warpgroup that waits on a barrier must wait for all its phases before the kernel ends), and when
it finds a misuse it raises in one thread while the others wait forever: the process hangs.

So a student's kernel never runs in the notebook's process. ``run`` ships the student's
functions *as source text* (``inspect.getsource``, plus the globals they use: modules as import
statements, constants by value, helper functions by their own source) to a child process
``python interpret.py JOBDIR``, which rebuilds them, calls a chapter's kernel builder (the
*target*, ``"flashbook.chapters.ch6.ring:run_ring"``) on NumPy inputs and writes NumPy outputs.
The child is forked from a warm parent that has imported JAX once (``zygote``; a fresh
``python interpret.py JOBDIR`` where that cannot start), still one process per job.
Inside the child (``interpret_child``), a watchdog notices when the process stops using CPU (every warpgroup blocked:
a deadlock, or the rest of the kernel after a barrier error) and reports the barrier waits that
are pending, naming the barriers and the source lines; a hard time limit backs it up, and the
parent kills the child's process group if even that fails. Then ``failure`` writes one message:
barrier misuse, data races (both accesses, with source lines), a deadlock, a crash in the
student's code, or a time-out. The parent never imports JAX: without it, ``require_jax`` says how
to install it.

Works wherever the student's function has source text: a notebook cell (IPython keeps cell
sources in ``linecache``; so do nbgrader's and nbclient's kernels), a ``.py`` file, or code the
test-suite runs with a ``linecache`` entry. Not: a lambda or a function typed at a plain
``python`` prompt. The student's code may use ``jax``, ``jnp``, ``lax``, ``pl``, ``plgpu``,
``np``, ``math`` and ``functools`` without importing them (the child provides them), so the
notebook defines it even where JAX is missing and the check can say how to install it.

Writing a target (Exercise 1's is ``ring.run_ring``): a function in a ``flashbook.chapters``
module, called in the child as ``target(**functions, **arrays, **params, detect_races=...)``,
returning a dict of NumPy arrays. It imports JAX inside (its module must import without it),
builds its kernel with ``interpret=params(num_threads, detect_races)`` (one CTA), and runs it.
The child imports the module through bare packages (``_bare_packages``: no ``flashbook``
``__init__``, so no torch), so it may import sibling modules but not use the package's
top-level names. Each ``Call`` names the warpgroups, the barriers and the SMEM scratch buffers
in allocation order, for the messages.
"""
from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import json
import linecache
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

__all__ = ["JAX_VERSION", "JAX_GPU_VERSION", "JAX_VERSIONS", "JAX_REQUIREMENTS", "INSTALL",
           "jax_problem", "require_jax", "params", "Call", "Run", "run", "failure", "run_checked",
           "where"]

# Which JAX works, stated once: the chapter's setup cell prints JAX_VERSIONS (ch6/jax_setup.py),
# the checks' errors quote it, pyproject's `hopper` extra and CI's pins hold JAX_VERSION.
JAX_VERSION = "0.10.2"          # the JAX whose interpret mode the book's checks are proven on (CI)
JAX_GPU_VERSION = "0.11.2"      # the JAX the Pallas kernels compiled and ran with on an H200
JAX_VERSIONS = (f"the interpret-mode checks are proven on JAX {JAX_VERSION} (CPU wheels, in CI); "
                f"the Pallas kernels compiled and ran on an H200 with JAX {JAX_GPU_VERSION}")
JAX_REQUIREMENTS = (f"jax=={JAX_VERSION}", f"jaxlib=={JAX_VERSION}", "absl-py>=2.5.1")
INSTALL = "pip install " + " ".join(f'"{r}"' for r in JAX_REQUIREMENTS)
TIMEOUT_S = 120                 # a whole job (every call) may take this long
STALL_S = 10.0                  # no CPU used for this long (s): the process is stuck
DEADLOCK_S = 2.0               # no CPU used while warpgroups wait on barriers: a deadlock
GRACE_S = 1.0                  # after a barrier error: the rest of the kernel hangs, soon
_PACKAGE = Path(__file__).resolve().parents[2]          # .../flashbook
# Names a kernel's source may use without importing them (the child provides them).
DEFAULT_IMPORTS = {"jax": "import jax", "jnp": "import jax.numpy as jnp", "lax": "from jax import lax",
             "pl": "import jax.experimental.pallas as pl",
             "plgpu": "import jax.experimental.pallas.mosaic_gpu as plgpu",
             "np": "import numpy as np", "math": "import math", "functools": "import functools"}
EVENTS, STDOUT, STDERR = "events.jsonl", "stdout.txt", "stderr.txt"


if __name__ == "__main__" or getattr(sys.modules.get("flashbook"), "_bare", False):
    CheckFailure = AssertionError       # the child process: it raises none, and has no torch
else:
    from ...compare import CheckFailure
if __name__ != "__main__":     # run as a script, the file only starts the child (at the end)
    from ...shipping import Shipped, all_shipped, ship, to_json


def _fail(message: str):
    raise CheckFailure(message)


# --------------------------------------------------------------------------- JAX present?

def jax_problem() -> str | None:
    """None when JAX's Mosaic GPU interpret mode can be imported by this Python; otherwise why
    not and how to install it. Does not import JAX."""
    importlib.invalidate_caches()                 # it may have been installed a moment ago
    missing = [m for m in ("jax", "jaxlib", "absl") if importlib.util.find_spec(m) is None]
    if missing:
        return (f"the Pallas checks run your kernel in JAX's GPU interpret mode, but "
                f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not installed "
                f"in this Python. Install them, then run the check again (no GPU needed):\n"
                f"    {INSTALL}\n(in a notebook: %pip install ...; {JAX_VERSIONS}).")
    try:
        have = importlib.metadata.version("jax")
    except importlib.metadata.PackageNotFoundError:
        return None
    if _version_tuple(have) < _version_tuple(JAX_VERSION):
        return (f"JAX {have} is too old for the Mosaic GPU interpret mode these checks use "
                f"({JAX_VERSIONS}). Upgrade, then run the check again:\n"
                f"    {INSTALL}")
    return None


def _version_tuple(v: str) -> tuple:
    return tuple(int(x) for x in re.findall(r"\d+", v)[:3])


def require_jax(what: str = "this check"):
    """Raise CheckFailure saying how to install JAX when it is missing or too old."""
    problem = jax_problem()
    if problem:
        _fail(f"{what}: {problem}")


def params(num_threads: int, detect_races: bool = True, tma_threads: int = 4):
    """(Child side, for targets.) ``InterpretGPUParams`` for a single-CTA kernel of
    ``num_threads`` warpgroups. ``tma_threads`` > 1 gives consecutive TMA copies their own
    vector clocks, so a read ordered only after a *different* copy's barrier is a race, as
    on hardware, where copies complete in any order."""
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    return InterpretGPUParams(num_cores_or_threads=num_threads, detect_races=detect_races,
                              num_tma_threads_per_device=tma_threads)


# ------------------------------------------------------------------------ the parent side

@dataclasses.dataclass
class Call:
    """One kernel run of a job: ``target(**functions, **arrays, **params)``."""
    label: str
    arrays: dict
    params: dict
    thread_names: dict | None = None      # warpgroup id -> "the producer warpgroup"
    barrier_names: Sequence[str] = ()     # in allocation order: "full[0]", ...
    smem_names: Sequence[str] = ()        # SMEM scratch buffers in allocation order


@dataclasses.dataclass
class Run:
    """What came back from a job."""
    status: str   # ok | failed | stalled | timeout | killed | died | no-jax | source-error
    calls: list              # per call: dict(outputs=..., races=[...], elapsed=..., done=bool,
                             # order=the order log, ``interpret_child.ORDER_DOC``, or None)
    problems: list           # barrier misuse the interpreter raised (dicts)
    pending: list            # barrier waits pending when the kernel stopped making progress
    error: dict | None       # an exception that ended a call (type, message, frames, text)
    failed_call: int | None  # the call that was running when things went wrong
    wall_s: float
    limit_s: float           # the time limit it ran under
    log: str                 # the tail of the child's stdout and stderr
    shipped: list


def run(target: str, functions: dict, calls: Sequence[Call], *, timeout: float = TIMEOUT_S,
        stall: float | None = STALL_S, detect_races: bool = True) -> Run:
    """Run ``calls`` of ``target`` ("package.module:function", a module of flashbook) with the
    student's ``functions`` ({parameter name: function}) in a fresh process. Returns what came
    back; raises nothing for the kernel's own failures (see ``failure``)."""
    shipped = [ship(fn, name) for name, fn in functions.items()]
    job_dir = Path(tempfile.mkdtemp(prefix="flashbook-interpret-"))
    try:
        job = {"target": target, "functions": [to_json(s) for s in shipped],
               "detect_races": detect_races, "timeout": timeout, "stall": stall,
               "calls": [{"label": c.label, "params": c.params,
                          "barrier_names": list(c.barrier_names),
                          "smem_names": list(c.smem_names)} for c in calls]}
        (job_dir / "job.json").write_text(json.dumps(job))
        np.savez(job_dir / "inputs.npz", **{f"{i}:{k}": np.asarray(v)
                                           for i, c in enumerate(calls)
                                           for k, v in c.arrays.items()})
        env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
                   TF_CPP_MIN_LOG_LEVEL="3", JAX_ENABLE_X64="0")
        env.pop("PYTHONSTARTUP", None)
        start = time.monotonic()
        with open(job_dir / STDOUT, "wb") as out, open(job_dir / STDERR, "wb") as err:
            proc = _start(job_dir, env, out, err)
            killed = False
            try:
                proc.wait(timeout=timeout + 30)       # the child enforces ``timeout`` itself
            except subprocess.TimeoutExpired:
                killed = True
            finally:
                if proc.poll() is None:               # also on KeyboardInterrupt
                    _kill(proc)
        return _collect(job_dir, calls, shipped, killed, time.monotonic() - start, timeout)
    finally:
        shutil.rmtree(job_dir, ignore_errors=True)


_zygote = None           # the warm parent of this process's jobs (``zygote``), once started


def _start(job_dir: Path, env: dict, out, err):
    """The job's process: forked by the warm zygote (started on first use, restarted if it died
    or the environment changed), else a fresh ``python interpret.py JOBDIR``.
    ``FLASHBOOK_INTERPRET_FRESH=1`` always starts a fresh process."""
    global _zygote
    if os.environ.get("FLASHBOOK_INTERPRET_FRESH") != "1":
        try:
            from . import zygote
            if _zygote is None or not _zygote.alive() or _zygote.env != env:
                if _zygote is not None:
                    _zygote.close()
                _zygote = zygote.Zygote(env)
            return _zygote.start(job_dir)
        except (OSError, RuntimeError, ImportError):
            _zygote = None
    return subprocess.Popen([sys.executable, "-u", str(Path(__file__).resolve()), str(job_dir)],
                            stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=env,
                            cwd=job_dir, start_new_session=True)


def _kill(proc):
    try:
        os.killpg(proc.pid, signal.SIGKILL)           # the child's own session: only its tree
    except (ProcessLookupError, PermissionError, AttributeError):
        proc.kill()
    proc.wait()


def _collect(job_dir: Path, calls, shipped, killed: bool, wall: float, limit: float) -> Run:
    events = []
    path = job_dir / EVENTS
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                pass                                  # a line cut off by a kill
    log = ""
    for name in (STDOUT, STDERR):
        p = job_dir / name
        if p.exists():
            text = p.read_text(errors="replace")
            text = "\n".join(l for l in text.splitlines() if not l.startswith("  clock:"))
            log += text[-6000:]
    results = [dict(outputs=None, races=[], elapsed=None, done=False) for _ in calls]
    problems, pending, error, status, current = [], [], None, None, None
    for e in events:
        kind = e["event"]
        if kind == "start":
            current = e["call"]
        elif kind == "race":
            results[e["call"]]["races"].append(e)
        elif kind == "problem":
            problems.append(e)
        elif kind == "done":
            i = e["call"]
            results[i].update(elapsed=e["elapsed"], done=True, racy=e.get("races", False),
                              order=e.get("order"))
            f = job_dir / f"out{i}.npz"
            if f.exists():
                with np.load(f) as z:
                    results[i]["outputs"] = {k: z[k] for k in z.files}
        elif kind in ("stalled", "timeout"):
            status, pending = kind, e.get("pending", [])
        elif kind == "error":
            error = e
        elif kind in ("no-jax", "source-error"):
            status, error = kind, e
        elif kind == "finished" and status is None:
            status = "ok"
    if status is None:
        status = "killed" if killed else ("failed" if error or problems else "died")
    if status == "ok" and (problems or any(r["races"] or r.get("racy") for r in results)):
        status = "failed"
    return Run(status=status, calls=results, problems=problems, pending=pending, error=error,
               failed_call=current if status != "ok" else None, wall_s=wall, limit_s=limit,
               log=log,
               shipped=list(all_shipped(shipped)))


# ----------------------------------------------------------------------- the messages

def _where(site: dict | None, shipped: Sequence[Shipped]) -> str:
    """'line 7 of your `kv_producer`: `plgpu.barrier_wait(...)`' or 'ring.py line 80: `...`'."""
    if not site:
        return "an unknown line"
    file, line = site.get("file", ""), int(site.get("line", 0))
    for s in shipped:
        if file == s.filename and s.line(line) is not None:
            lines = s.source.splitlines()
            return (f"line {line} of your `{s.defines}`: "
                    f"`{_statement(lines, line - s.firstlineno)}`")
    text = _statement(linecache.getlines(file), line - 1)
    try:
        shown = str(Path(file).resolve().relative_to(_PACKAGE.parent))
    except ValueError:
        shown = file
    return f"{shown} line {line}" + (f": `{text}`" if text else "")


def _statement(lines: Sequence[str], i: int) -> str:
    """Line ``i`` as quoted in a message, with the lines that continue its statement (a call
    split over lines), without comments."""
    if not 0 <= i < len(lines):
        return ""
    parts = [_code(lines[i])]
    while (sum(p.count("(") + p.count("[") - p.count(")") - p.count("]") for p in parts) > 0
           and i + 1 < len(lines) and len(parts) < 4):
        i += 1
        parts.append(_code(lines[i]))
    return " ".join(parts)


def _code(line: str) -> str:
    """A source line as quoted in a message: stripped, without its trailing comment."""
    return re.sub(r"\s+#[^'\"]*$", "", line.strip())


def _times(n) -> str:
    return f"{n} time" if n == 1 else f"{n} times"


def _who(thread, names: dict | None) -> str:
    if thread is None:
        return "a warpgroup"
    names = names or {}
    return names.get(int(thread), names.get(str(thread), f"warpgroup {thread}"))


def _ordinal(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def _race_text(r: dict, names, shipped) -> str:
    a, b = r["first"], r["second"]
    where = r.get("buffer") or "an SMEM buffer"
    index = f"[{r['index']}]" if r.get("index") is not None else ""

    def acc(x):
        verb = "wrote" if x["kind"] == "write" else "read"
        return f"{_who(x['thread'], names)} {verb} it at {_where(x['site'], shipped)}"
    return (f"data race on {where}{index}: {acc(b)}, and {acc(a)}, and no barrier orders "
            f"the two accesses.")


def _problem_text(p: dict, names, shipped) -> str:
    who, where = _who(p.get("thread"), names), _where(p.get("site"), shipped)
    bar = p.get("barrier") or "a barrier"
    if p["kind"] == "completed-again":
        return (f"barrier misuse: {bar} completed a phase again before any warpgroup waited "
                f"for its previous phase (the arrival at {where}, by {who}). Every phase of a "
                "barrier must be waited for before the next one completes: here a slot was "
                "refilled (or released) twice in a row.")
    if p["kind"] == "phase-passed":
        return (f"barrier misuse: {who} waits at {where} for the {_ordinal(p['awaited'])} "
                f"completion of {bar}, but it has already completed {_times(p['phase'])}: "
                f"{who} skipped waiting for some of its phases, so the wait can never match.")
    if p["kind"] == "unobserved-phases":
        return (f"barrier misuse at the end of the kernel: {who} waited for {p['observed']} of "
                f"the {p['phase']} completions of {bar}. A warpgroup that waits on a barrier "
                "must wait for every one of its phases before the kernel returns (drain the "
                "final phases).")
    return f"barrier misuse: {p.get('message')} ({who}, {where})"


def _pending_text(w: dict, names, shipped) -> str:
    return (f"{_who(w['thread'], names)} waits at {_where(w['site'], shipped)} for the "
            f"{_ordinal(w['awaited'])} completion of {w.get('barrier') or 'a barrier'}, which "
            f"has completed {_times(w['phase'])}")


def failure(result: Run, call: Call | None = None, *, hint: str = "") -> str | None:
    """None if the job ran every call with no race and no barrier misuse; otherwise the
    message: what happened (in the order the student should fix it), then ``hint``."""
    if result.status == "ok":
        return None
    names = call.thread_names if call else None
    shipped = result.shipped
    if result.status == "no-jax":
        return (f"JAX's Mosaic GPU interpret mode could not be imported in the check's process: "
                f"{result.error.get('message', '')}\nInstall it: {INSTALL}")
    if result.status == "source-error":
        e = result.error
        return (f"your `{e.get('name')}` could not be rebuilt from its source in the check's "
                f"process: {e.get('type')}: {e.get('message')}")
    parts = []
    races = [r for c in result.calls for r in c["races"] if r.get("first")]
    races.sort(key=lambda r: r["first"]["thread"] == r["second"]["thread"])  # two warpgroups first
    for r in races[:2]:
        parts.append(_race_text(r, names, shipped))
    raw = [r["text"] for c in result.calls for r in c["races"] if not r.get("first")]
    if raw and not races:           # a report format this module does not parse
        text = "\n".join(l for l in raw[0].splitlines()[1:] if "clock:" not in l)
        parts.append(f"data race in shared memory (the race detector's report):\n{text[:800]}")
    n = len(races) + len(raw)
    if n > 2:
        parts.append(f"({n - 2} more data races.)")
    elif not n and any(c.get("racy") for c in result.calls):
        parts.append("data race in shared memory (the race detector found one; its report "
                     f"is in the log):\n{result.log[-800:]}")
    for p in result.problems[:2]:
        parts.append(_problem_text(p, names, shipped))
    e = result.error
    if e and not result.problems:
        frames = [f for f in e.get("frames", []) if any(
            f["file"] == s.filename for s in shipped)]
        at = f" at {_where(frames[-1], shipped)}" if frames else ""
        msg = e.get("message", "").strip().splitlines()
        short = " ".join(msg[:3])[:600]
        if e.get("type") == "NameError":
            name = re.search(r"'(\w+)'", short)
            parts.append(f"the kernel failed{at}: NameError: {short}. The check runs your "
                         "function from its source in a separate process: it can use modules "
                         "and plain constants from the notebook, but other objects"
                         + (f" such as `{name.group(1)}`" if name else "")
                         + " must be passed in or defined inside the function.")
        elif e.get("type") == "NotImplementedError" and not at:
            parts.append("not implemented yet (the stub still raises NotImplementedError).")
        else:
            parts.append(f"the kernel failed in the interpreter{at}: {e.get('type')}: {short}")
    if result.status in ("stalled", "timeout", "killed"):
        waits = [_pending_text(w, names, shipped) for w in result.pending]
        if result.status == "stalled":
            head = ("the kernel hung (a deadlock: every warpgroup still running waits on a "
                    "barrier that no one will complete)" if not parts else
                    "then the kernel hung")
        else:
            head = (f"the kernel hung: it did not finish within the time limit "
                    f"({result.limit_s:g} s) and was stopped")
        parts.append(head + (":\n    " + ";\n    ".join(waits) + "." if waits else "."))
    if result.status == "died" and not parts:
        parts.append("the check's process ended unexpectedly (out of memory, or a crash in "
                     f"JAX). Its last output:\n{result.log[-1500:]}")
    if not parts:
        parts.append(f"the check's process ended unexpectedly. Its output:\n{result.log[-1500:]}")
    text = "\n  ".join(parts)
    return text + (f"\n  Hint: {hint}" if hint else "")


def run_checked(target: str, functions: dict, calls: Sequence[Call], *, title: str,
                hint: str | Callable[[Run], str] = "", **kw) -> list[dict]:
    """``run``, then raise CheckFailure naming the call that failed; returns each call's
    outputs, with its order log under ``"order"`` (None where this JAX's barriers could not be
    instrumented; see ``interpret_child.ORDER_DOC``) and the job's shipped functions under
    ``"shipped"`` (for ``where``)."""
    require_jax(title)
    result = run(target, functions, calls, **kw)
    i = result.failed_call
    call = calls[i] if i is not None and i < len(calls) else (calls[0] if calls else None)
    message = failure(result, call, hint=hint(result) if callable(hint) else hint)
    if message:
        label = f", case {call.label}" if call is not None and result.failed_call is not None \
            else ""
        _fail(f"{title}{label}: {message}")
    return [dict(c["outputs"] or {}, order=c.get("order"), shipped=result.shipped)
            for c in result.calls]


def where(site: dict | None, shipped: Sequence[Shipped]) -> str:
    """A source line as the messages name it: 'line 7 of your `kv_producer`: `...`'."""
    return _where(site, shipped)


def _bare_packages():
    """Make ``flashbook.chapters.ch6.<module>`` importable without running the packages'
    ``__init__`` (which imports torch): the child needs numpy and JAX only."""
    root = _PACKAGE
    for name, path in (("flashbook", root), ("flashbook.chapters", root / "chapters"),
                       ("flashbook.chapters.ch6", Path(__file__).resolve().parent)):
        if name not in sys.modules:
            m = types.ModuleType(name)
            m.__path__ = [str(path)]
            m._bare = True
            sys.modules[name] = m


if __name__ == "__main__":
    sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).parent]
    _bare_packages()
    if sys.argv[1] == "--zygote":            # the warm parent of later jobs (``zygote``)
        importlib.import_module("flashbook.chapters.ch6.zygote").serve()
        os._exit(0)
    _child = importlib.import_module("flashbook.chapters.ch6.interpret_child").Child(
        Path(sys.argv[1]))
    try:
        _child.main()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
