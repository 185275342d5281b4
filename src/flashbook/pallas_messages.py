"""What both sides of a Pallas interpret-mode job share (``pallas_interpret``, the parent;
``pallas_child``, the job's process): the job directory's files, the records of a job's calls
(``Call``), of the student's functions as quoted (``Source``) and of what came back (``Run``);
which JAX the checks need; and ``failure``, which turns a ``Run`` into one message (barrier
misuse, data races with both accesses' lines, a deadlock, a crash, a time-out). ``pallas_interpret``
re-exports these names.
"""
from __future__ import annotations

import dataclasses
import linecache
import re
import sys
from pathlib import Path
from typing import Sequence

__all__ = ["EVENTS", "STDOUT", "STDERR", "Call", "Source", "Run", "JAX_VERSION",
           "JAX_GPU_VERSION", "JAX_VERSIONS", "JAX_REQUIREMENTS", "INSTALL", "failure", "where"]

EVENTS, STDOUT, STDERR = "events.jsonl", "stdout.txt", "stderr.txt"


@dataclasses.dataclass
class Call:
    """One kernel run of a job: ``target(**functions, **arrays, **params)``."""
    label: str
    arrays: dict
    params: dict
    thread_names: dict | None = None      # warpgroup id -> "the producer warpgroup"
    barrier_names: Sequence[str] = ()     # in allocation order: "full[0]", ...
    smem_names: Sequence[str] = ()        # SMEM scratch buffers in allocation order


@dataclasses.dataclass(frozen=True)
class Source:
    """A student's function as the messages quote it: its source and where it came from."""
    name: str            # the name the check knows it by
    defines: str         # the name its ``def`` binds
    source: str
    filename: str
    firstlineno: int

    def line(self, lineno: int) -> str | None:
        i = lineno - self.firstlineno
        lines = self.source.splitlines()
        return lines[i].strip() if 0 <= i < len(lines) else None


@dataclasses.dataclass
class Run:
    """What came back from a job."""
    status: str   # ok | failed | stalled | timeout | killed | died | no-jax | source-error
    calls: list              # per call: dict(outputs=..., races=[...], elapsed=..., done=bool,
                             # order=the order log, ``pallas_child.ORDER_DOC``, or None)
    problems: list           # barrier misuse the interpreter raised (dicts)
    pending: list            # barrier waits pending when the kernel stopped making progress
    error: dict | None       # an exception that ended a call (type, message, frames, text)
    failed_call: int | None  # the call that was running when things went wrong
    wall_s: float
    limit_s: float           # the time limit it ran under
    log: str                 # the tail of the child's stdout and stderr
    shipped: list            # the student's functions, ``Source``s


# Which JAX works, stated once: pallas_setup prints JAX_VERSIONS, the checks quote it, pyproject's
# `hopper` extra and CI's pins hold JAX_VERSION.
JAX_VERSION = "0.10.2"          # the JAX whose interpret mode the book's checks are proven on (CI)
JAX_GPU_VERSION = "0.11.2"      # the JAX the Pallas kernels compiled and ran with on an H200
JAX_VERSIONS = (f"the interpret-mode checks are proven on JAX {JAX_VERSION} (CPU wheels, in CI); "
                f"the Pallas kernels compiled and ran on an H200 with JAX {JAX_GPU_VERSION}")
JAX_REQUIREMENTS = (f"jax=={JAX_VERSION}", f"jaxlib=={JAX_VERSION}", "absl-py>=2.5.1")
INSTALL = "pip install " + " ".join(f'"{r}"' for r in JAX_REQUIREMENTS)
_PACKAGE = Path(__file__).resolve().parent          # .../flashbook


def where(site: dict | None, shipped: Sequence[Source]) -> str:
    """A source line as the messages name it: 'line 7 of your `kv_producer`: `...`', or
    'flashbook/chapters/ch6/ring.py line 80: `...`'."""
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
    buffer = r.get("buffer") or "an SMEM buffer"
    index = f"[{r['index']}]" if r.get("index") is not None else ""

    def acc(x):
        verb = "wrote" if x["kind"] == "write" else "read"
        return f"{_who(x['thread'], names)} {verb} it at {where(x['site'], shipped)}"
    return (f"data race on {buffer}{index}: {acc(b)}, and {acc(a)}, and no barrier orders "
            f"the two accesses.")


def _problem_text(p: dict, names, shipped) -> str:
    who, line = _who(p.get("thread"), names), where(p.get("site"), shipped)
    bar = p.get("barrier") or "a barrier"
    if p["kind"] == "completed-again":
        return (f"barrier misuse: {bar} completed a phase again before any warpgroup waited "
                f"for its previous phase (the arrival at {line}, by {who}). Every phase of a "
                "barrier must be waited for before the next one completes: here a slot was "
                "refilled (or released) twice in a row.")
    if p["kind"] == "phase-passed":
        return (f"barrier misuse: {who} waits at {line} for the {_ordinal(p['awaited'])} "
                f"completion of {bar}, but it has already completed {_times(p['phase'])}: "
                f"{who} skipped waiting for some of its phases, so the wait can never match.")
    if p["kind"] == "unobserved-phases":
        return (f"barrier misuse at the end of the kernel: {who} waited for {p['observed']} of "
                f"the {p['phase']} completions of {bar}. A warpgroup that waits on a barrier "
                "must wait for every one of its phases before the kernel returns (drain the "
                "final phases).")
    return f"barrier misuse: {p.get('message')} ({who}, {line})"


def _pending_text(w: dict, names, shipped) -> str:
    return (f"{_who(w['thread'], names)} waits at {where(w['site'], shipped)} for the "
            f"{_ordinal(w['awaited'])} completion of {w.get('barrier') or 'a barrier'}, which "
            f"has completed {_times(w['phase'])}")


_SCRIPT_HINT = (" From a Python script, run the check under `if __name__ == \"__main__\":`: "
                "the check's process comes from multiprocessing's fork server, which imports "
                "the script again, and a script that runs the check as it is imported stops "
                "it (\"An attempt has been made to start a new process before the current "
                "process has finished its bootstrapping phase\", printed above).")


def _running_a_script() -> bool:
    """Whether ``__main__`` is a script of the user's (not a notebook kernel, nor a tool such
    as pytest run from its installed package)."""
    path = getattr(sys.modules.get("__main__"), "__file__", None) or ""
    return path.endswith(".py") and "site-packages" not in path


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
        return (f"your `{e.get('name')}` could not be rebuilt in the check's "
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
        at = f" at {where(frames[-1], shipped)}" if frames else ""
        msg = e.get("message", "").strip().splitlines()
        short = " ".join(msg[:3])[:600]
        if e.get("type") == "NameError":
            name = re.search(r"'(\w+)'", short)
            parts.append(f"the kernel failed{at}: NameError: {short}. The check runs your "
                         "function in a separate process, with the modules and values it uses "
                         "from the notebook: a name"
                         + (f" such as `{name.group(1)}`" if name else "")
                         + " must be defined in the notebook or inside the function.")
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
        if result.log.strip():
            parts.append("the check's process ended unexpectedly (out of memory, or a crash in "
                         f"JAX). Its last output:\n{result.log[-1500:]}")
        else:
            parts.append("the check's process ended before it ran your kernel, with no output."
                         + (_SCRIPT_HINT if _running_a_script() else ""))
    if not parts:
        parts.append(f"the check's process ended unexpectedly. Its output:\n{result.log[-1500:]}")
    text = "\n  ".join(parts)
    return text + (f"\n  Hint: {hint}" if hint else "")
