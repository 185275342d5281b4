"""The process of one Pallas interpret-mode job (``pallas_interpret``; ``run_job``, forked by
the fork server): it rebuilds the student's functions, instruments JAX's interpret mode (barrier
waits, arrivals and errors, the race detector's reports), runs the target's calls and writes one
event a line to ``EVENTS``; a watchdog reports a stall (every warpgroup blocked) with the pending
waits. Each ``done`` event carries the call's order log (``ORDER_DOC``, recorded through JAX's
public API by ``pallas_order_log``). ``unfenced_reads`` finds, in a traced kernel, SMEM that
registers wrote and the TMA or a wgmma reads with no ``commit_smem`` between.

The instruments wrap JAX's private interpret-mode modules (JAX has no public hook for barrier
errors, pending waits or race reports), written for ``pallas_messages.JAX_VERSION``, which
every install pins (tests/test_versions.py); on another JAX each steps aside and the reports
are plainer.
"""
from __future__ import annotations

import importlib
import inspect
import itertools
import json
import os
import re
import sys
import threading
import time
import types
from pathlib import Path

import numpy as np

from . import pallas_order_log, shipping
from .pallas_messages import EVENTS, STDERR, STDOUT

__all__ = ["Child", "run_job", "unfenced_reads", "ORDER_DOC"]

DEADLOCK_S = 2.0               # no CPU used while warpgroups wait on barriers: a deadlock
GRACE_S = 1.0                  # after a barrier error: the rest of the kernel hangs, soon
# Names a kernel's source may use without importing them (the child provides them).
DEFAULT_IMPORTS = {"jax": "import jax", "jnp": "import jax.numpy as jnp",
                   "lax": "from jax import lax", "pl": "import jax.experimental.pallas as pl",
                   "plgpu": "import jax.experimental.pallas.mosaic_gpu as plgpu",
                   "np": "import numpy as np", "math": "import math",
                   "functools": "import functools"}

ORDER_DOC = """An order log: one dict per action, in the order the interpreter ran them: ``thread``
(the warpgroup), ``op`` ("wait": a barrier wait returned; "arrive": an arrival, a TMA copy's
included, made by the warpgroup that issued the copy; "mma": a wgmma was issued), ``barrier``
(its name) and ``phase`` (the completion a wait observed, or the one an arrival counts
towards: 1 for the first), or, for "mma", ``a`` and ``b``, the SMEM buffers it reads. One
warpgroup's entries are in its program order; across warpgroups only the barriers order them."""


class Child:
    """Rebuild, run, report: one JSON line per event, flushed at once, so that what happened
    before a hang or a kill is on disk."""

    def __init__(self, job_dir: Path):
        self.dir = job_dir
        self.job = json.loads((job_dir / "job.json").read_text())
        self.lock = threading.Lock()
        self.events = open(job_dir / EVENTS, "a", buffering=1)
        self.pending: dict[int, dict] = {}      # python thread -> the barrier wait it is in
        self.barriers: dict[int, str] = {}      # id(Barrier) -> name
        self.smem: dict[int, str] = {}          # SMEM buffer id -> name
        self.call = None
        self.ordered = False                    # the order log's wrappers are installed
        self.order: list | None = None          # this call's order log (None: not recorded)
        self.problem_seen = 0.0
        self.start = time.monotonic()

    def emit(self, **event):
        with self.lock:
            self.events.write(json.dumps(event, default=str) + "\n")
            self.events.flush()

    # ---------------------------------------------------------------- the watchdog
    def watchdog(self, parent: int):
        timeout, stall = self.job["timeout"], self.job["stall"]
        cpu, progress = time.process_time(), time.monotonic()
        while True:
            time.sleep(0.2)
            now, c = time.monotonic(), time.process_time()
            if c - cpu > 0.05:
                cpu, progress = c, now
            if os.getppid() != parent:                   # the notebook's kernel is gone
                os._exit(5)
            quiet = now - progress
            if self.problem_seen and quiet > GRACE_S:
                self.stop("stalled")
            if stall and (quiet > stall or (self.pending and quiet > min(stall, DEADLOCK_S))):
                self.stop("stalled")
            if now - self.start > timeout:
                self.stop("timeout")

    def stop(self, why: str):
        pending = []
        for w in list(self.pending.values()):
            bar = w["bar"]
            pending.append(dict(thread=w["thread"], awaited=w["awaited"],
                                phase=getattr(bar, "phase", "?"), site=w["site"],
                                barrier=self.barriers.get(id(bar))))
        self.emit(event=why, call=self.call, pending=pending)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(3)

    # ------------------------------------------------------- interpreter instruments
    def instrument(self):
        """Record barrier waits (for deadlock reports), barrier errors (raised in one thread
        while the others hang) and races (printed), naming barriers and SMEM buffers in
        allocation order. Installed only where JAX's internals match 0.10.2's (0.11 rewrote
        them); they never change what the interpreter does (their failures are swallowed)."""
        try:
            from jax._src.pallas.mosaic.interpret import race_detection_state as rds
        except ImportError:
            return
        self._instrument_races(rds)
        try:
            from jax._src import source_info_util as siu
            from jax._src.pallas.mosaic_gpu import core as mgpu_core
            from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
            from jax._src.pallas.mosaic_gpu.interpret import shared_memory as sm
            B, M = sm.Barrier, sm.GPUSharedMemory
            ok = (list(inspect.signature(B.wait).parameters) ==
                  ["self", "device_id", "local_thread_id", "logging_info"]
                  and list(inspect.signature(B.arrive).parameters) ==
                  ["self", "clock", "logging_info"]
                  and list(inspect.signature(B.deallocate).parameters) == ["self"]
                  and "next_awaited_phase_by_thread" in inspect.getsource(B.__init__)
                  and hasattr(M, "allocate_barrier") and hasattr(M, "allocate_buffer"))
            smem_space = gpu_callbacks.get_memory_space_idx(mgpu_core.MemorySpace.SMEM)
        except Exception:  # noqa: BLE001 - another JAX: no barrier instruments
            return
        if ok:
            self._instrument_barriers(siu, B, M, smem_space)

    def log(self, **entry):
        """One entry of the order log (``ORDER_DOC``), if it is being recorded."""
        if self.order is not None:
            with self.lock:
                self.order.append(entry)

    def _names(self, kind: str) -> list:
        call = self.job["calls"][self.call] if self.call is not None else {}
        return call.get(kind, [])

    def _instrument_barriers(self, siu, B, M, smem_space):
        child = self
        wait0, arrive0, dealloc0 = B.wait, B.arrive, B.deallocate
        alloc_bar0, alloc_buf0 = M.allocate_barrier, M.allocate_buffer

        def quietly(fn, *a, **k):
            try:
                return fn(*a, **k)
            except Exception:  # noqa: BLE001 - bookkeeping must never break the kernel
                return None

        def site(logging_info):
            return _site(siu, getattr(logging_info, "source_info", None))

        def name_barrier(mem, key):
            n, given = len(child.barriers), child._names("barrier_names")
            child.barriers[id(mem[key])] = given[n] if n < len(given) else f"barrier #{n}"

        def name_buffer(key):
            if getattr(key, "memory_space_id", None) == smem_space:
                n, given = len(child.smem), child._names("smem_names")
                child.smem[key.buffer_id] = given[n] if n < len(given) else f"SMEM buffer #{n}"

        def allocate_barrier(self, key, *a, **k):
            new = quietly(lambda: key not in self.mem)
            out = alloc_bar0(self, key, *a, **k)
            if new:
                quietly(name_barrier, self.mem, key)
            return out

        def allocate_buffer(self, key, *a, **k):
            new = quietly(lambda: key not in self.mem)
            out = alloc_buf0(self, key, *a, **k)
            if new:
                quietly(name_buffer, key)
            return out

        def problem(kind, thread, where, bar, **extra):
            child.problem_seen = time.monotonic()
            child.emit(event="problem", kind=kind, call=child.call, thread=thread, site=where,
                       barrier=child.barriers.get(id(bar)), **extra)

        def awaited(bar, thread):
            return bar.next_awaited_phase_by_thread[thread % bar.num_participating_threads]

        def enter(bar, thread, logging_info):
            child.pending[threading.get_ident()] = dict(
                thread=thread, awaited=awaited(bar, thread), bar=bar, site=site(logging_info))

        def wait(self, device_id, local_thread_id, logging_info=None):
            quietly(enter, self, local_thread_id, logging_info)
            try:
                return wait0(self, device_id, local_thread_id, logging_info)
            except ValueError as e:
                msg = str(e)
                quietly(lambda: problem("phase-passed", local_thread_id, site(logging_info),
                                        self, message=msg,
                                        awaited=awaited(self, local_thread_id),
                                        phase=self.phase))
                raise
            finally:
                child.pending.pop(threading.get_ident(), None)

        def arrive(self, clock=None, logging_info=None):
            try:
                return arrive0(self, clock, logging_info)
            except ValueError as e:
                msg = str(e)
                quietly(lambda: problem("completed-again", getattr(logging_info, "thread_id",
                                                                   None),
                                        site(logging_info), self, message=msg))
                raise

        def deallocate(self):
            try:
                return dealloc0(self)
            except ValueError as e:
                msg = str(e)
                m = re.search(r"Thread (\d+) did not observe all phases \((\d+)\).*observed "
                              r"(\d+)", msg)
                quietly(lambda: problem(
                    "unobserved-phases", int(m.group(1)) if m else None, None, self,
                    message=msg, phase=int(m.group(2)) if m else None,
                    observed=int(m.group(3)) if m else None))
                raise

        B.wait, B.arrive, B.deallocate = wait, arrive, deallocate
        M.allocate_barrier, M.allocate_buffer = allocate_barrier, allocate_buffer

    def _instrument_races(self, rds):
        """The race detector prints its reports (module-level ``print``): parse them as
        printed, name the SMEM buffer, record them as events."""
        child = self
        # JAX 0.10.2: "read of <key>[<range>] from <device>, <thread>[,] <file>:<line>:<col>
        # (<function>)"; another format is kept as text
        access = re.compile(r"^\s*(read|write) of (?P<buf>.*?)\[(?P<range>.*)\] from "
                            r"(?P<dev>\d+), (?P<thr>\d+),? (?P<frame>.*)$")
        frame = re.compile(r"^(?P<file>.*?):(?P<line>\d+)(?::\d+)? \((?P<fn>.*)\)$")

        def parse(line: str):
            m = access.match(line)
            if not m:
                return None
            f = frame.match(m.group("frame").strip())
            buf = re.search(r"buffer_id=(\d+)", m.group("buf"))
            idx = re.match(r"\((\d+),", m.group("range"))
            return dict(kind=m.group(1), thread=int(m.group("thr")),
                        site=dict(file=f.group("file"), line=int(f.group("line")),
                                  function=f.group("fn")) if f else None,
                        buffer=child.smem.get(int(buf.group(1))) if buf else None,
                        index=int(idx.group(1)) if idx else None)

        def record(text: str):
            lines = text.splitlines()
            if not (lines and lines[0].startswith("RACE DETECTED")):
                return
            acc = [a for a in (parse(l) for l in lines[1:]) if a]
            if len(acc) == 2:           # the report names the current access first
                second, first = acc
                child.emit(event="race", call=child.call, first=first, second=second,
                           buffer=second["buffer"] or first["buffer"], index=second["index"])
            else:
                child.emit(event="race", call=child.call, first=None, second=None, text=text)

        def race_print(*args, **kw):
            print(*args, **kw)
            try:
                record(" ".join(str(a) for a in args))
            except Exception:  # noqa: BLE001
                pass
        rds.print = race_print

    # ----------------------------------------------------------------------- main
    def rebuild(self) -> dict:
        """The student's functions, with ``DEFAULT_IMPORTS`` in the globals of each (and of
        its helpers) where the notebook had no such name."""
        try:
            functions = shipping.loads((self.dir / "functions.pkl").read_bytes())
        except Exception as e:  # noqa: BLE001 - reported, not raised
            self.emit(event="source-error", name="`, `".join(self.job["names"]),
                      type=type(e).__name__, message=str(e))
            raise SystemExit(0)
        defaults: dict = {}
        for stmt in DEFAULT_IMPORTS.values():
            exec(stmt, defaults)
        todo, seen = list(functions.values()), set()
        while todo:
            fn = todo.pop()
            fn = getattr(fn, "fn", fn)                   # a @triton.jit: its function
            if not isinstance(fn, types.FunctionType) or id(fn.__globals__) in seen:
                continue
            seen.add(id(fn.__globals__))
            for name, value in defaults.items():
                if name != "__builtins__":
                    fn.__globals__.setdefault(name, value)
            todo += [v for v in fn.__globals__.values() if isinstance(v, types.FunctionType)]
        return functions

    def main(self):
        parent = os.getppid()           # the fork server: it ends with the notebook's kernel
        threading.Thread(target=self.watchdog, args=(parent,), daemon=True).start()
        try:
            os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
            # The interpreted kernel runs as Python callbacks; what XLA compiles around them is
            # bookkeeping, so LLVM's optimisation of it only costs compile time (about a tenth
            # of a ring check). Read when this process first uses XLA, after the fork.
            os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                       + " --xla_backend_optimization_level=0").strip()
            import jax
            jax.config.update("jax_platforms", "cpu")
            jax.config.update("jax_enable_x64", False)
            import jax.experimental.pallas.mosaic_gpu  # noqa: F401  (needs absl)
            importlib.import_module("jax._src.pallas.mosaic_gpu.interpret.params")
        except Exception as e:  # noqa: BLE001 - ImportError, or a broken install
            self.emit(event="no-jax", type=type(e).__name__, message=str(e))
            return
        self.emit(event="ready", jax=jax.__version__)
        self.instrument()
        self.ordered = pallas_order_log.install(self)
        functions = self.rebuild()
        mod_name, fn_name = self.job["target"].split(":")
        target = getattr(importlib.import_module(mod_name), fn_name)
        arrays: dict[int, dict] = {}
        with np.load(self.dir / "inputs.npz") as z:
            for k in z.files:
                i, name = k.split(":", 1)
                arrays.setdefault(int(i), {})[name] = z[k]
        for i, call in enumerate(self.job["calls"]):
            self.call = i
            self.barriers.clear()
            self.smem.clear()
            self.order = [] if self.ordered else None
            self.emit(event="start", call=i)
            t0 = time.monotonic()
            try:
                outputs = target(**functions, **arrays.get(i, {}), **call["params"],
                                 detect_races=self.job["detect_races"])
            except BaseException as e:  # noqa: BLE001 - reported, then the job ends
                self.report_error(e)
                return
            np.savez(self.dir / f"out{i}.npz", **{k: np.asarray(v) for k, v in outputs.items()})
            races = False
            try:
                from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
                races = bool(gpu_callbacks.get_races().races_found)
            except Exception:  # noqa: BLE001
                pass
            self.emit(event="done", call=i, elapsed=time.monotonic() - t0, races=races,
                      order=self.order)
            if races:               # the first call with a race is reported; stop there
                break
        self.emit(event="finished")

    def report_error(self, e: BaseException):
        import traceback
        text = "".join(traceback.format_exception(e))
        etype, message = type(e).__name__, str(e)
        frames = [dict(file=f.filename, line=f.lineno, function=f.name)
                  for f in traceback.extract_tb(e.__traceback__)]
        if etype in ("JaxRuntimeError", "XlaRuntimeError"):
            # raised in a warpgroup's thread and flattened into text by the callback machinery
            inner = list(re.finditer(r"^(\w+(?:Error|Exception)): ", message, re.M))
            frames += [dict(file=f, line=int(n), function=fn) for f, n, fn in
                       re.findall(r'File "(.+?)", line (\d+), in (\S+)', message)]
            if inner:
                etype, message = inner[-1].group(1), message[inner[-1].end():]
        self.emit(event="error", call=self.call, type=etype, message=message[-3000:],
                  frames=frames, text=text[-4000:])


def _site(siu, source_info) -> dict | None:
    """The user's frame (file, line, function) of a JAX ``source_info`` (``siu``: JAX's
    ``source_info_util``), or None."""
    tb = getattr(source_info, "traceback", None)
    frames = list(itertools.islice(siu.user_frames(tb), 1)) if tb is not None else []
    return dict(file=frames[0].file_name, line=frames[0].start_line,
                function=frames[0].function_name) if frames else None


def run_job(job_dir: str):
    """The job's process (``pallas_interpret.run``): the job's files as stdio, then the job."""
    job_dir = Path(job_dir)
    try:
        os.chdir(job_dir)
        for fd, name in ((1, STDOUT), (2, STDERR)):
            f = os.open(job_dir / name, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(f, fd)
        sys.stdout = open(1, "w", buffering=1, closefd=False)
        sys.stderr = open(2, "w", buffering=1, closefd=False)
        Child(job_dir).main()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


# --------------------------------------------------------------- the proxy fence, statically

def unfenced_reads(closed_jaxpr) -> list[dict]:
    """Where a traced kernel (``jax.make_jaxpr``) reads through the async proxy (a wgmma
    operand, ``copy_smem_to_gmem``'s source) SMEM that a ref store wrote with no
    ``commit_smem`` between: dicts of the ``store`` and ``read`` sites and ``what`` reads.
    Walks the kernel in program order, once through each loop body and branch, following a ref
    into the jaxprs nested in it."""
    from jax._src import source_info_util as siu

    found, dirty = [], {}                # dirty: root ref -> the store not yet fenced

    def walk(jaxpr, root):
        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            refs = [None if hasattr(v, "val") else root.get(v, v) for v in eqn.invars]
            if name == "swap" and refs and refs[0] is not None:
                dirty[refs[0]] = _site(siu, eqn.source_info)
            elif name == "commit_smem":
                dirty.clear()
            elif name in ("wgmma_ref", "copy_smem_to_gmem"):
                read = refs[1:3] if name == "wgmma_ref" else refs[:1]
                for r in read:
                    if r is not None and r in dirty:
                        found.append(dict(store=dirty[r], read=_site(siu, eqn.source_info),
                                          what=name))
            for key, param in eqn.params.items():
                if key == "cond_jaxpr":          # a while loop's condition writes nothing
                    continue
                for sub in (param if isinstance(param, (tuple, list)) else (param,)):
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        walk(inner, {**root, **_bind(eqn.invars, inner, root)})

    walk(getattr(closed_jaxpr, "jaxpr", closed_jaxpr), {})
    return found


def _bind(outer, inner, root) -> dict:
    """The nested jaxpr's variables that stand for the outer operands (by position: a
    ``run_scoped`` closes over them as constants; a branch, a loop body, a call takes them
    last among its inputs)."""
    outer = [root.get(v, v) if not hasattr(v, "val") else None for v in outer]
    if inner.constvars and len(inner.constvars) == len(outer):
        return {v: o for v, o in zip(inner.constvars, outer) if o is not None}
    if len(inner.invars) > len(outer):
        return {}
    return {v: o for v, o in zip(inner.invars, outer[len(outer) - len(inner.invars):])
            if o is not None}
