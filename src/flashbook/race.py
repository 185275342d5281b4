"""A race checker for Numba CUDA kernels on the CPU (introduced in Chapter 2).

Numba's CUDA simulator runs a block's threads as Python threads, so a kernel with a missing
``cuda.syncthreads()`` usually still computes the right answer there and fails only on a GPU.
``race_check`` instead runs the kernel in a deterministic SIMT model: threads run one at a time,
in thread order, from barrier to barrier, and every shared-memory access is recorded. Two
threads touching one shared word between the same two barriers, one of them writing, is a
race (``RaceError``); a barrier that not every thread of the block reaches is reported too.

Usage (any chapter)::

    from flashbook.race import race_check
    race_check(kernel, grid, block, args, dyn_smem_bytes)   # args: numpy arrays
"""
from __future__ import annotations

import sys
import threading
import types

import numpy as np

from .compare import CheckFailure


class RaceError(CheckFailure):
    """Two threads of a block touched one shared-memory word between the same two barriers,
    and at least one of them wrote it."""


class _Abort(BaseException):
    pass


class _Dim3:
    __slots__ = ("x", "y", "z")

    def __init__(self, x=1, y=1, z=1):
        self.x, self.y, self.z = x, y, z

    def __repr__(self):
        return f"({self.x}, {self.y}, {self.z})"


def _np_dtype(dtype):
    return np.dtype(getattr(dtype, "name", None) or str(dtype))


class _TrackedShared:
    """A block's shared array that logs who read and wrote each word since the last barrier."""

    def __init__(self, run, name, arr):
        self._run, self._name, self._arr = run, name, arr
        self.shape = arr.shape
        self.size = arr.size
        self.ndim = arr.ndim
        self.dtype = arr.dtype

    def _flat(self, key):
        idx = key if isinstance(key, tuple) else (key,)
        if len(idx) != self._arr.ndim:
            raise IndexError(f"shared array {self._name} has {self._arr.ndim} dims, indexed with "
                             f"{len(idx)}")
        idx = tuple(int(i) for i in idx)
        for i, n in zip(idx, self._arr.shape):
            if not 0 <= i < n:
                raise IndexError(f"index {idx} out of bounds for shared array {self._name} of shape "
                                 f"{self._arr.shape}")
        return idx, int(np.ravel_multi_index(idx, self._arr.shape))

    def __len__(self):
        return len(self._arr)

    def __getitem__(self, key):
        idx, flat = self._flat(key)
        self._run.access(self._name, flat, idx, write=False)
        return self._arr[idx]

    def __setitem__(self, key, value):
        idx, flat = self._flat(key)
        self._run.access(self._name, flat, idx, write=True)
        self._arr[idx] = value


class _SimtRun:
    """Runs one kernel launch thread by thread, in a fixed order, barrier interval by barrier
    interval, and checks every shared-memory access for races."""

    def __init__(self, grid, block, dyn_bytes):
        self.grid = _Dim3(*grid)
        self.block = _Dim3(*block)
        self.dyn_bytes = dyn_bytes
        self.local = threading.local()
        self.cond = threading.Condition()

    # ---- the fake ``cuda`` module the kernel sees
    def fake_cuda(self):
        run = self

        class _Shared:
            @staticmethod
            def array(shape, dtype, alignment=None):
                return run.shared_array(shape, dtype)

        class _Local:
            @staticmethod
            def array(shape, dtype, alignment=None):
                return np.zeros(shape, dtype=_np_dtype(dtype))

        class _FakeCuda(types.SimpleNamespace):
            threadIdx = property(lambda self: run.local.tid)
            blockIdx = property(lambda self: run.local.bid)
            blockDim = property(lambda self: run.block)
            gridDim = property(lambda self: run.grid)

            @staticmethod
            def syncthreads():
                run.barrier()

            @staticmethod
            def grid(ndim):
                t, b, n = run.local.tid, run.local.bid, run.block
                gx, gy = b.x * n.x + t.x, b.y * n.y + t.y
                return gx if ndim == 1 else (gx, gy) if ndim == 2 else (gx, gy, b.z * n.z + t.z)

        return _FakeCuda(shared=_Shared, local=_Local)

    # ---- per-block state
    def shared_array(self, shape, dtype):
        """The k-th shared.array call of a thread returns the block's k-th shared array."""
        k = self.local.n_shared
        self.local.n_shared += 1
        with self.lock:
            if k not in self.shared:
                dt = _np_dtype(dtype)
                if shape == 0 or shape == (0,):
                    if self.dynamic is None:
                        self.dynamic = _TrackedShared(
                            self, "dynamic", np.full(self.dyn_bytes // dt.itemsize, np.nan, dt))
                    self.shared[k] = self.dynamic
                else:
                    name = f"shared#{k}{tuple(int(n) for n in np.atleast_1d(shape))}"
                    self.shared[k] = _TrackedShared(self, name, np.full(shape, np.nan, dt))
            return self.shared[k]

    def access(self, name, flat, idx, write):
        me = self.local.linear
        key = (name, flat)
        readers, writer = self.log.setdefault(key, [set(), None])
        other = None
        if writer is not None and writer != me:
            other = (writer, "wrote")
        elif write and (readers - {me}):
            other = (min(readers - {me}), "read")
        if other is not None:
            them, verb = other
            raise RaceError(
                f"shared-memory race in block {self.local.bid}: thread {self._tid(me)} "
                f"{'writes' if write else 'reads'} {name}{list(idx)} which thread {self._tid(them)} "
                f"{verb} after the same __syncthreads (barrier interval {self.phase}). One of them "
                "must wait for the other: a cuda.syncthreads() is missing between these accesses.")
        if write:
            self.log[key][1] = me
        else:
            readers.add(me)

    def _tid(self, linear):
        x = linear % self.block.x
        y = (linear // self.block.x) % self.block.y
        return (x, y, 0) if self.block.y > 1 else x

    # ---- scheduling: one thread at a time, in thread order, until each reaches a barrier
    def barrier(self):
        me = self.local.linear
        caller = sys._getframe(2)
        site = (caller.f_code.co_filename, caller.f_lineno)
        with self.cond:
            if self.site is None:
                self.site = site
            elif site != self.site:
                self.error = RaceError(
                    f"block {self.local.bid}: thread {self._tid(me)} waits at the cuda.syncthreads() "
                    f"on line {site[1]} while other threads wait at the one on line {self.site[1]}. "
                    "A barrier inside an if that only some threads enter (or a loop that runs a "
                    "different number of times per thread) hangs or corrupts a real GPU: keep every "
                    "syncthreads where all threads of the block reach it.")
                self.abort = True
                self.cond.notify_all()
                raise _Abort()
            self.waiting.add(me)
            self._hand_over(me)
            self.cond.wait_for(lambda: self.abort or (self.turn == me and self.phase_of[me] < self.phase))
            if self.abort:
                raise _Abort()
            self.phase_of[me] = self.phase

    def _hand_over(self, me):
        """Called with the lock held by a thread that stops (barrier or exit)."""
        running = [t for t in range(self.nthreads) if t not in self.waiting and t not in self.done]
        if running:
            self.turn = running[0]
        else:
            if self.waiting and self.done:
                self.error = RaceError(
                    f"block {self.local.bid}: threads {sorted(self._tid(t) for t in self.done)[:8]} "
                    f"returned while threads {sorted(self._tid(t) for t in self.waiting)[:8]} wait "
                    "at cuda.syncthreads(); every thread of a block must reach every barrier "
                    "(a barrier inside a branch that only some threads take hangs or corrupts a "
                    "real GPU).")
                self.abort = True
            elif self.waiting:
                self.phase += 1
                self.site = None
                self.log = {}
                self.waiting = set()
                self.turn = min(t for t in range(self.nthreads) if t not in self.done)
        self.cond.notify_all()

    def run_block(self, fn, args, bid):
        self.nthreads = self.block.x * self.block.y * self.block.z
        self.lock = threading.Lock()
        self.shared, self.dynamic, self.log = {}, None, {}
        self.waiting, self.done = set(), set()
        self.phase, self.turn, self.abort, self.error = 0, 0, False, None
        self.site = None
        self.phase_of = [-1] * self.nthreads

        def body(linear):
            x = linear % self.block.x
            y = (linear // self.block.x) % self.block.y
            self.local.tid = _Dim3(x, y, 0)
            self.local.bid = _Dim3(*bid)
            self.local.linear = linear
            self.local.n_shared = 0
            with self.cond:
                self.cond.wait_for(lambda: self.abort or self.turn == linear)
            try:
                if not self.abort:
                    self.phase_of[linear] = 0
                    fn(*args)
            except _Abort:
                return
            except BaseException as e:  # noqa: BLE001 - reported in the main thread
                with self.cond:
                    if self.error is None:
                        self.error = e if isinstance(e, RaceError) else type(e)(
                            f"thread {self._tid(linear)} of block {self.local.bid}: {e}")
                    self.abort = True
                    self.cond.notify_all()
                return
            with self.cond:
                self.done.add(linear)
                self._hand_over(linear)

        threads = [threading.Thread(target=body, args=(t,), daemon=True) for t in range(self.nthreads)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        if any(t.is_alive() for t in threads):
            with self.cond:
                self.abort = True
                self.cond.notify_all()
            raise RaceError(f"block {bid}: the kernel did not finish (a barrier deadlock?).")
        if self.error is not None:
            raise self.error


def _rebind(fn, fake, seen=None):
    """A copy of the Python function ``fn`` whose global ``cuda`` is ``fake``; the device
    functions it calls are rebound the same way."""
    seen = {} if seen is None else seen
    if fn in seen:
        return seen[fn]
    g = dict(fn.__globals__)
    new = types.FunctionType(fn.__code__, g, fn.__name__, fn.__defaults__, fn.__closure__)
    seen[fn] = new
    cuda_mod = sys.modules.get("numba.cuda")
    for name in fn.__code__.co_names:
        val = g.get(name)
        if name == "cuda" or (val is not None and val is cuda_mod):
            g[name] = fake
        elif val is not None and callable(getattr(val, "py_func", None)):
            g[name] = _rebind(val.py_func, fake, seen)
    return new


def race_check(kernel, grid, block, args, dyn_smem_bytes: int = 0):
    """Execute ``kernel[grid, block, 0, dyn_smem_bytes](*args)`` in a deterministic pure-Python
    SIMT model and raise RaceError on any shared-memory race or divergent barrier.

    Threads run one at a time in thread order from barrier to barrier, so the first thread of a
    block runs ahead of the others as far as CUDA allows: a missing barrier shows up as a read
    and a write of one shared word in the same barrier interval. Arguments are numpy arrays.
    """
    grid = tuple(grid) if isinstance(grid, tuple) else (grid,)
    block = tuple(block) if isinstance(block, tuple) else (block,)
    run = _SimtRun(grid + (1,) * (3 - len(grid)), block + (1,) * (3 - len(block)), dyn_smem_bytes)
    fake = run.fake_cuda()
    fn = _rebind(getattr(kernel, "py_func", kernel), fake)
    for bid in np.ndindex(*grid):
        run.run_block(fn, args, tuple(bid) + (0,) * (3 - len(bid)))
