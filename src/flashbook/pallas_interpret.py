"""Run Pallas Mosaic GPU kernels in JAX's GPU interpret mode, in a fresh process with a time
limit, and turn whatever goes wrong into a message that teaches.

Interpret mode runs a warp-specialized kernel on a CPU: each warpgroup a Python thread, SMEM and
GMEM NumPy buffers, TMA and mbarriers simulated, and (``detect_races=True``) a vector-clock race
detector. It is stricter than hardware (a barrier must not complete twice before a wait; every
waiter must observe every phase), and on a misuse it raises in one thread while the others wait
forever. So a student's kernel never runs in the notebook's process: ``run`` ships the functions
(``flashbook.shipping``) to a job process forked by ``multiprocessing``'s fork server (which
imports JAX once, ``PRELOAD``, and the chapter's modules that ``preload`` names), where
``pallas_child`` calls the *target* (a ``"package.module:function"`` that imports JAX inside,
builds a one-CTA kernel with ``interpret=params(...)`` and returns a dict of NumPy arrays) on
each ``Call``. A watchdog there reports a stall with the pending barrier waits; the parent kills
a job past its limit. ``failure`` (``pallas_messages``) then writes one message, quoting the
student's lines where they have source text (``linecache``: notebook cells, files), and the
chapter's ``hint``. The student's code may use ``jax``, ``jnp``, ``lax``, ``pl``, ``plgpu``,
``np``, ``math`` and ``functools`` unimported. The parent never imports JAX; without it
``require_jax`` says how to install it.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import inspect
import json
import multiprocessing
import shutil
import tempfile
import time
import types
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from . import shipping
from .compare import CheckFailure
from .pallas_messages import (EVENTS, INSTALL, JAX_GPU_VERSION, JAX_REQUIREMENTS, JAX_VERSION,
                              JAX_VERSIONS, STDERR, STDOUT, Call, Run, Source, failure, where)
from .planning import code_names
from .versions import at_least

__all__ = ["JAX_VERSION", "JAX_GPU_VERSION", "JAX_VERSIONS", "JAX_REQUIREMENTS", "INSTALL",
           "jax_problem", "require_jax", "params", "Call", "Run", "run", "failure", "run_checked",
           "where", "sources", "unordered"]

TIMEOUT_S = 120                 # a whole job (every call) may take this long
STALL_S = 10.0                  # no CPU used for this long (s): the process is stuck
# What the fork server imports once, before a chapter's ``preload`` (an import that fails, JAX
# missing, is skipped: the job then reports it). The server starts with the first job's list.
PRELOAD = ("jax", "jax.experimental.pallas.mosaic_gpu", f"{__package__}.pallas_child")


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
    if not at_least(have, JAX_VERSION):
        return (f"JAX {have} is too old for the Mosaic GPU interpret mode these checks use "
                f"({JAX_VERSIONS}). Upgrade, then run the check again:\n"
                f"    {INSTALL}")
    return None


def require_jax(what: str = "this check"):
    """Raise CheckFailure saying how to install JAX when it is missing or too old."""
    problem = jax_problem()
    if problem:
        raise CheckFailure(f"{what}: {problem}")


def params(num_threads: int, detect_races: bool = True, tma_threads: int = 4):
    """(Child side.) ``InterpretGPUParams`` for one CTA of ``num_threads`` warpgroups;
    ``tma_threads`` > 1 gives consecutive TMA copies their own vector clocks, so a read ordered
    only after another copy's barrier is a race, as on hardware."""
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    return InterpretGPUParams(num_cores_or_threads=num_threads, detect_races=detect_races,
                              num_tma_threads_per_device=tma_threads)


# ------------------------------------------------------------------------ the parent side

def run(target: str, functions: dict, calls: Sequence[Call], *, timeout: float = TIMEOUT_S,
        stall: float | None = STALL_S, detect_races: bool = True,
        preload: Sequence[str] = ()) -> Run:
    """Run ``calls`` of ``target`` with the student's ``functions`` ({parameter name: function})
    in a fresh process; the kernel's own failures are in the ``Run``, never raised. ``preload``:
    the chapter's modules the fork server imports once (its targets' modules)."""
    job_dir = Path(tempfile.mkdtemp(prefix="flashbook-interpret-"))
    try:
        (job_dir / "functions.pkl").write_bytes(shipping.dumps(functions))
        job = {"target": target, "names": list(functions), "detect_races": detect_races,
               "timeout": timeout, "stall": stall,
               "calls": [{"label": c.label, "params": c.params,
                          "barrier_names": list(c.barrier_names),
                          "smem_names": list(c.smem_names)} for c in calls]}
        (job_dir / "job.json").write_text(json.dumps(job))
        np.savez(job_dir / "inputs.npz", **{f"{i}:{k}": np.asarray(v)
                                           for i, c in enumerate(calls)
                                           for k, v in c.arrays.items()})
        start = time.monotonic()
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload([*PRELOAD, *preload])
        # looked up in sys.modules, where pickle finds it by name: the grader's kernel loads the
        # checks' modules afresh, outside sys.modules
        entry = importlib.import_module(f"{__package__}.pallas_child").run_job
        proc = context.Process(target=entry, args=(str(job_dir),), daemon=True)
        proc.start()
        try:
            proc.join(timeout + 30)                   # the child enforces ``timeout`` itself
            killed = proc.exitcode is None
        finally:
            if proc.exitcode is None:                 # also on KeyboardInterrupt
                proc.kill()
                proc.join()
        return _collect(job_dir, calls, sources(functions), killed, time.monotonic() - start,
                        timeout)
    finally:
        shutil.rmtree(job_dir, ignore_errors=True)


def sources(functions: dict) -> list[Source]:
    """The student's functions and the helpers they call from their own module, as the
    messages quote them (those without source text are left out)."""
    out, seen = [], set()
    todo = [(name, fn, getattr(inspect.unwrap(getattr(fn, "fn", fn)), "__module__", None))
            for name, fn in functions.items()]
    while todo:
        name, fn, module = todo.pop(0)
        fn = inspect.unwrap(getattr(fn, "fn", fn))             # a @triton.jit: its function
        if not isinstance(fn, types.FunctionType) or id(fn) in seen or fn.__module__ != module:
            continue
        seen.add(id(fn))
        try:
            lines, first = inspect.getsourcelines(fn)
        except (OSError, TypeError):
            continue
        out.append(Source(name, fn.__name__, "".join(lines), fn.__code__.co_filename, first))
        todo += [(g, fn.__globals__[g], module) for g in sorted(code_names(fn.__code__))
                 if g in fn.__globals__]
    return out


def _collect(job_dir: Path, calls, shipped: list[Source], killed: bool, wall: float,
             limit: float) -> Run:
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
               log=log, shipped=shipped)


# ----------------------------------------------------------------------- the check

def run_checked(target: str, functions: dict, calls: Sequence[Call], *, title: str,
                hint: str | Callable[[Run], str] = "", **kw) -> list[dict]:
    """``run``, then raise CheckFailure naming the call that failed; returns each call's
    outputs, with its order log under ``"order"`` (None where this JAX's barriers could not be
    instrumented; ``pallas_child.ORDER_DOC``) and the shipped functions under ``"shipped"``."""
    require_jax(title)
    result = run(target, functions, calls, **kw)
    i = result.failed_call
    call = calls[i] if i is not None and i < len(calls) else (calls[0] if calls else None)
    message = failure(result, call, hint=hint(result) if callable(hint) else hint)
    if message:
        label = f", case {call.label}" if call is not None and result.failed_call is not None \
            else ""
        raise CheckFailure(f"{title}{label}: {message}")
    return [dict(c["outputs"] or {}, order=c.get("order"), shipped=result.shipped)
            for c in result.calls]


def unordered(outs: list[dict], what: str) -> str:
    """The report's note where a job's order log is missing (``what`` was not checked)."""
    if all(o.get("order") is not None for o in outs if o):
        return ""
    return (f" ({what} was not checked: this JAX lacks a public barrier operation the order "
            f"log wraps; proven on JAX {JAX_VERSION} and {JAX_GPU_VERSION})")
