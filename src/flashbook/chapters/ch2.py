"""Chapter 2 helpers: from flash.cu to Numba-CUDA.

What lives here (and not in the chapter's notebook):

* input checks and the launchers that turn torch tensors into the flat float32 buffers the
  chapter's kernels read (``launch_fa1``, ``launch_fa2_rows``, ``launch_fa2_tiled``);
* the graded checks (``check_fa1_literal``, ``check_fa1_bounded``, ``check_launch_config``,
  ``check_fa2_rows``, ``check_fa2_tiled``), including the neighbour-head **canary** check and a
  deterministic **shared-memory race checker** (the Numba simulator is not a race detector);
* the HBM traffic model of the two loop orders (``hbm_traffic``);
* the tile diagrams (``draw_schedule``) and the plot of measured results (``plot_ladder``).

Kernels in this chapter work on flat (1-D) float32 buffers, as flash.cu does with raw pointers:
element (b, h, n, x) of a (B, H, N, d) tensor sits at ``((b * H + h) * N + n) * d + x``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import io
import math
import threading
import types
from typing import Callable

import numpy as np
import torch

from .. import reference
from ..check import CheckFailure, assert_close
from ..device import current

# numba-cuda 0.30 still calls np.row_stack, which numpy 2.5 removed; alias it before numba
# compiles anything (harmless on older numpy).
if not hasattr(np, "row_stack"):  # pragma: no cover - depends on the numpy version
    np.row_stack = np.vstack

#: Dynamic shared memory a Numba kernel may ask for at launch. Every CUDA GPU since Kepler allows
#: 48 KiB per block without an opt-in (cudaFuncSetAttribute), and Numba has no opt-in.
DEFAULT_SMEM_LIMIT = 48 * 1024


#: Largest head dimension the chapter's kernels accept (their local arrays are sized by it).
D_MAX = 128


# ----------------------------------------------------------------------------- inputs

def check_qkv(q, k, v, *, name: str = "attention", d_max: int = D_MAX):
    """Raise ValueError with a clear message unless q, k, v are usable by the chapter's kernels.

    They must be torch tensors shaped (B, H, N, d), all the same shape, float32, contiguous,
    on one device, with N >= 1 and 1 <= d <= d_max.
    """
    for label, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}: {label} must be a torch.Tensor, got {type(t).__name__}.")
        if t.dim() != 4:
            raise ValueError(f"{name}: {label} must be 4-d (B, H, N, d), got shape {tuple(t.shape)}.")
    if not (q.shape == k.shape == v.shape):
        raise ValueError(f"{name}: q, k and v must have the same shape (B, H, N, d); got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}.")
    for label, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype != torch.float32:
            raise ValueError(f"{name}: {label} is {t.dtype}; these kernels are float32 only "
                             "(convert with .float()).")
        if not t.is_contiguous():
            raise ValueError(f"{name}: {label} is not contiguous (a transposed or sliced view?); "
                             "the kernels index flat row-major buffers: pass .contiguous().")
    if not (q.device == k.device == v.device):
        raise ValueError(f"{name}: q, k, v are on different devices ({q.device}, {k.device}, "
                         f"{v.device}).")
    want = current().device
    if q.device.type != want:
        raise ValueError(f"{name}: tensors are on {q.device} but this runtime's kernels run on "
                         f"{want} ({current().kind}).")
    B, H, N, d = q.shape
    if min(B, H, N) < 1:
        raise ValueError(f"{name}: empty input (B={B}, H={H}, N={N}).")
    if not 1 <= d <= d_max:
        raise ValueError(f"{name}: head dimension d={d} is outside 1..{d_max}.")


def as_flat(t: torch.Tensor):
    """A flat view a Numba kernel can take: a numpy array on CPU (the simulator), a device
    array sharing the tensor's memory on a GPU. No copy either way."""
    flat = t.reshape(-1)
    if flat.device.type == "cpu":
        return flat.numpy()
    from numba import cuda
    return cuda.as_cuda_array(flat.detach(), sync=False)


def kernel_source(kernel) -> str:
    fn = getattr(kernel, "py_func", kernel)
    try:
        return inspect.getsource(fn)
    except (OSError, TypeError):
        return ""


def is_stub(obj) -> bool:
    """True when a kernel or factory is still the exercise stub (it raises NotImplementedError)."""
    src = kernel_source(obj)
    return "raise NotImplementedError" in src and "BEGIN SOLUTION" not in src


def _require_impl(obj, what):
    if is_stub(obj):
        raise NotImplementedError(f"{what} is still the stub (raise NotImplementedError).")


# ----------------------------------------------------------------------- launchers

@dataclasses.dataclass(frozen=True)
class Flat:
    """Flat buffers of one problem (what the kernels see) plus its shape."""
    B: int
    H: int
    N: int
    d: int
    Q: object
    K: object
    V: object
    O: object


def fa1_smem_bytes(Bc: int, Br: int, d: int) -> int:
    """Dynamic shared memory flash.cu asks for: Qi, Kj, Vj (Bc x d each) and S (Br x Bc), float32."""
    return 4 * (3 * Bc * d + Bc * Br)


def launch_fa1(kernel, q, k, v, Bc: int = 32, *, grid=None, smem: int | None = None,
               buffers: dict | None = None, check: bool = True):
    """Run a flash.cu-shaped kernel ``kernel(Q, K, V, N, d, Tc, Tr, Bc, Br, scale, l, m, O)``.

    Like the seed's host code: grid (B, H), one block of Bc threads per (batch, head), Br = Bc,
    l = 0 and m = -inf in global memory, O = 0. Returns O as a (B, H, N, d) tensor.
    ``buffers`` may supply oversized flat arrays (used by the canary check).
    """
    _require_impl(kernel, "the FA1 kernel")
    if check:
        check_qkv(q, k, v, name="launch_fa1")
    B, H, N, d = q.shape
    Br = Bc
    Tc = Tr = math.ceil(N / Bc)
    scale = np.float32(1.0 / math.sqrt(d))
    if buffers is None:
        O = torch.zeros_like(q)
        l = torch.zeros(B, H, N, device=q.device)
        m = torch.full((B, H, N), -math.inf, device=q.device)
        bufs = dict(Q=as_flat(q), K=as_flat(k), V=as_flat(v), l=as_flat(l), m=as_flat(m), O=as_flat(O))
    else:
        O, bufs = None, buffers
    smem = fa1_smem_bytes(Bc, Br, d) if smem is None else smem
    grid = grid or (B, H)
    kernel[grid, Bc, 0, smem](bufs["Q"], bufs["K"], bufs["V"], N, d, Tc, Tr, Bc, Br, scale,
                              bufs["l"], bufs["m"], bufs["O"])
    return O


_ROWS_CACHE: dict = {}


def rows_kernel(factory: Callable, d: int, Bc: int):
    """``factory(d, Bc)``, compiled once per (factory, d, Bc)."""
    _require_impl(factory, "make_fa2_rows")
    key = (factory, d, Bc)
    if key not in _ROWS_CACHE:
        kern = factory(d, Bc)
        if kern is None:
            raise CheckFailure("make_fa2_rows returned None: it must return the @cuda.jit kernel.")
        _ROWS_CACHE[key] = kern
    return _ROWS_CACHE[key]


def _fa2_buffers(q, k, v, buffers):
    """(O, flat buffers) for an FA2 launch: a fresh O, or the caller's buffers (canary checks)."""
    if buffers is not None:
        return None, buffers
    O = torch.empty_like(q)
    return O, dict(Q=as_flat(q), K=as_flat(k), V=as_flat(v), O=as_flat(O))


def launch_fa2_rows(factory, q, k, v, Bc: int = 32, Br: int = 64, *, buffers=None, check=True):
    """Run the FA2-order kernel ``factory(d, Bc)(Q, K, V, N, scale, O)``.

    Grid (ceil(N / Br), B * H): block x is a tile of Br query rows, block y a (batch, head);
    Br threads per block, one per query row. The kernel's K and V tiles (Bc x d each) are static
    shared arrays. There are no l or m arrays: they live in registers.
    """
    if check:
        check_qkv(q, k, v, name="launch_fa2_rows")
    if not (1 <= Bc <= 128 and 1 <= Br <= 1024):
        raise ValueError(f"launch_fa2_rows: need 1 <= Bc <= 128 and 1 <= Br <= 1024, got Bc={Bc}, Br={Br}.")
    B, H, N, d = q.shape
    if 8 * Bc * d > DEFAULT_SMEM_LIMIT:
        raise ValueError(f"launch_fa2_rows: K and V tiles need {8 * Bc * d} B of shared memory "
                         f"(Bc={Bc}, d={d}), more than {DEFAULT_SMEM_LIMIT} B; use a smaller Bc.")
    kern = rows_kernel(factory, d, Bc)
    scale = np.float32(1.0 / math.sqrt(d))
    O, bufs = _fa2_buffers(q, k, v, buffers)
    kern[(math.ceil(N / Br), B * H), Br](bufs["Q"], bufs["K"], bufs["V"], N, scale, bufs["O"])
    return O


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """How flash.cu's kernel is launched (Exercise 3 fills one in)."""
    grid: tuple      # (B, H): one block per (batch, head)
    block: int       # threads per block (= Bc, one per row)
    smem: int        # dynamic shared memory in bytes
    Tc: int          # number of K/V tiles
    Tr: int          # number of Q tiles


@dataclasses.dataclass(frozen=True)
class TiledConfig:
    """Tile shape of the register-tiled kernel.

    A block computes BM query rows against BN keys at a time with (BN // TN) x (BM // TM)
    threads; thread (tx, ty) owns score rows ty + (BM // TM) * r (r < TM), score columns
    tx + (BN // TN) * c (c < TN) and output columns tx + (BN // TN) * c (c < d // (BN // TN)).
    """
    BM: int = 64
    BN: int = 32
    TM: int = 4
    TN: int = 4

    @property
    def threads(self) -> tuple[int, int]:
        return self.BN // self.TN, self.BM // self.TM

    def smem_bytes(self, d: int) -> int:
        """Q (BM x d+1), K (BN x d+1), V (BN x d), P (BM x BN), partial maxima (BM x BN//TN)."""
        ntx = self.BN // self.TN
        return 4 * (self.BM * (d + 1) + self.BN * (d + 1) + self.BN * d + self.BM * self.BN
                    + self.BM * ntx)

    def validate(self, d: int):
        ntx, nty = self.threads
        problems = []
        if self.BM % self.TM or self.BN % self.TN:
            problems.append("BM must be a multiple of TM and BN of TN")
        elif d % ntx:
            problems.append(f"d={d} must be a multiple of BN // TN = {ntx}")
        elif ntx * nty > 1024:
            problems.append(f"{ntx * nty} threads per block > 1024")
        if self.smem_bytes(d) > DEFAULT_SMEM_LIMIT:
            problems.append(f"needs {self.smem_bytes(d)} B of shared memory > {DEFAULT_SMEM_LIMIT} B")
        if problems:
            raise ValueError(f"tiled config {self} with d={d}: " + "; ".join(problems) + ".")


def tiled_config(d: int, gpu: bool | None = None) -> TiledConfig:
    """The tile shape the chapter uses for head dimension d (small tiles in the simulator)."""
    gpu = current().gpu if gpu is None else gpu
    if not gpu:
        return TiledConfig(16, 16, 2, 2) if d % 8 == 0 else TiledConfig(8, 8, 2, 2)
    if d <= 64 and d % 8 == 0:
        return TiledConfig(64, 32, 4, 4)
    if d % 8 == 0:
        return TiledConfig(32, 16, 4, 2)
    return TiledConfig(16, 8, 2, 2) if d % 4 == 0 else TiledConfig(8, 2, 2, 2)


_TILED_CACHE: dict = {}


def tiled_kernel(factory: Callable, d: int, cfg: TiledConfig):
    """``factory(d, BM, BN, TM, TN)``, compiled once per (factory, d, config)."""
    _require_impl(factory, "make_fa2_tiled")
    key = (factory, d, cfg)
    if key not in _TILED_CACHE:
        kern = factory(d, cfg.BM, cfg.BN, cfg.TM, cfg.TN)
        if kern is None:
            raise CheckFailure("make_fa2_tiled returned None: it must return the @cuda.jit kernel.")
        _TILED_CACHE[key] = kern
    return _TILED_CACHE[key]


def launch_fa2_tiled(factory, q, k, v, cfg: TiledConfig | None = None, *, buffers=None, check=True):
    """Run the register-tiled kernel ``factory(d, BM, BN, TM, TN)(Q, K, V, N, scale, O)``.

    Grid (ceil(N / BM), B * H), block (BN // TN, BM // TM); static shared memory only.
    """
    if check:
        check_qkv(q, k, v, name="launch_fa2_tiled")
    B, H, N, d = q.shape
    cfg = cfg or tiled_config(d)
    cfg.validate(d)
    kern = tiled_kernel(factory, d, cfg)
    scale = np.float32(1.0 / math.sqrt(d))
    O, bufs = _fa2_buffers(q, k, v, buffers)
    kern[(math.ceil(N / cfg.BM), B * H), cfg.threads](bufs["Q"], bufs["K"], bufs["V"], N, scale,
                                                      bufs["O"])
    return O


# ------------------------------------------------------------------ shared-memory races

class RaceError(AssertionError):
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
                    name = f"shared#{k}{tuple(np.atleast_1d(shape))}"
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
        import sys
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
    import sys
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


# -------------------------------------------------------------------------- checks

@dataclasses.dataclass(frozen=True)
class Problem:
    B: int
    H: int
    N: int
    d: int
    Bc: int = 8
    Br: int | None = None

    def describe(self):
        br = f", Br={self.Br}" if self.Br is not None else ""
        return f"(B={self.B}, H={self.H}, N={self.N}, d={self.d}, Bc={self.Bc}{br})"


def _qkv(p: Problem, seed: int, device=None):
    g = torch.Generator().manual_seed(seed)
    device = device or current().device
    return tuple(torch.randn(p.B, p.H, p.N, p.d, generator=g).to(device) for _ in range(3))


def _run_kernel(fn, what):
    """Call a launcher; turn simulator/launch errors into teaching messages."""
    try:
        return fn()
    except NotImplementedError:
        raise CheckFailure(f"{what}: not implemented yet (the stub still raises "
                           "NotImplementedError).") from None
    except IndexError as e:
        raise CheckFailure(
            f"{what}: the kernel indexed past the end of an array: {e}\n  (tid is the thread, "
            "ctaid the block.) In flash.cu's tail tile, threads whose row is >= N still load and "
            "store: guard every global load and store with the row (or key) index < N.") from None
    except RaceError as e:
        raise CheckFailure(f"{what}: {e}") from None


def _compare(o, p: Problem, q, k, v, what, hint):
    want = reference.attention(q.double(), k.double(), v.double())
    assert_close(o, want, what=what, dims=("b", "h", "row", "col"), dtype=torch.float32,
                 atol=1e-5, rtol=1e-5, hint=hint)


_HINT_FA1 = ("compare with flash.cu line by line: m and l are read before and written after each "
             "step, O is rescaled by l_prev * exp(m_prev - m_new) and the new block by "
             "exp(m_tile - m_new), both divided by l_new; S is scaled by 1/sqrt(d).")


def _race(kernel, p: Problem, launch: str, what: str, factory_cfg: TiledConfig | None = None):
    """Run the race checker on one small problem (numpy buffers)."""
    q, k, v = (t.cpu() for t in _qkv(p, seed=99, device="cpu"))
    B, H, N, d = p.B, p.H, p.N, p.d
    scale = np.float32(1.0 / math.sqrt(d))
    Q, K, V = (t.reshape(-1).numpy().copy() for t in (q, k, v))
    O = np.zeros(B * H * N * d, np.float32)
    if launch == "fa1":
        l = np.zeros(B * H * N, np.float32)
        m = np.full(B * H * N, -np.inf, np.float32)
        T = math.ceil(N / p.Bc)
        args = (Q, K, V, N, d, T, T, p.Bc, p.Bc, scale, l, m, O)
        fn = lambda: race_check(kernel, (B, H), (p.Bc,), args, fa1_smem_bytes(p.Bc, p.Bc, d))  # noqa: E731
    elif launch == "fa2":
        Br = p.Br or p.Bc
        kern = rows_kernel(kernel, d, p.Bc)
        args = (Q, K, V, N, scale, O)
        fn = lambda: race_check(kern, (math.ceil(N / Br), B * H), (Br,), args, 0)  # noqa: E731
    else:
        cfg = factory_cfg
        kern = tiled_kernel(kernel, d, cfg)
        args = (Q, K, V, N, scale, O)
        fn = lambda: race_check(kern, (math.ceil(N / cfg.BM), B * H), cfg.threads, args, 0)  # noqa: E731
    _run_kernel(fn, f"{what}, race check {p.describe()}")
    got = torch.from_numpy(O).reshape(B, H, N, d)
    _compare(got, p, q, k, v, f"{what}, race check {p.describe()} (threads run one after "
             "another)", "a result that changes when threads run in another order is a race.")


def check_fa1_literal(kernel, hidden: bool = False):
    """The literal port of flash.cu: correct when N is a multiple of the tile (Bc = Br)."""
    _require_or_fail(kernel, "fa1_literal_kernel")
    cases = [Problem(1, 2, 16, 4, 8), Problem(1, 1, 32, 8, 16), Problem(2, 1, 16, 16, 8)]
    if hidden:
        cases += [Problem(1, 2, 48, 16, 16), Problem(2, 2, 8, 8, 8), Problem(1, 1, 4, 32, 4)]
        if current().gpu:
            cases += [Problem(2, 4, 256, 64, 32), Problem(1, 2, 512, 32, 32)]
    for i, p in enumerate(cases):
        q, k, v = _qkv(p, seed=10 + i)
        what = f"fa1_literal_kernel {p.describe()}"
        o = _run_kernel(lambda: launch_fa1(kernel, q, k, v, p.Bc), what)
        _compare(o, p, q, k, v, what, _HINT_FA1)
    if hidden:
        _race(kernel, Problem(1, 1, 16, 4, 8), "fa1", "fa1_literal_kernel")
    print(f"PASSED fa1_literal_kernel: {len(cases)} cases" + (" + race check" if hidden else ""))


def _require_or_fail(obj, what):
    if is_stub(obj):
        raise CheckFailure(f"{what}: not implemented yet (the stub still raises NotImplementedError).")


def canary_buffers(p: Problem, q, k, v, *, with_lm: bool, fill: float = 1.0e4):
    """Flat buffers one head longer than the problem: the extra 'neighbour head' holds huge
    K/V/Q values (reading them wrecks the softmax) and canary values in O, l, m."""
    B, H, N, d = p.B, p.H, p.N, p.d
    dev = q.device
    extra = N * d

    def padded(t, value):
        return torch.cat([t.reshape(-1), torch.full((extra,), value, device=dev)])

    bufs = {"Q": padded(q, fill), "K": padded(k, fill), "V": padded(v, fill),
            "O": torch.cat([torch.zeros(B * H * N * d, device=dev),
                            torch.full((extra,), 777.0, device=dev)])}
    if with_lm:
        bufs["l"] = torch.cat([torch.zeros(B * H * N, device=dev), torch.full((N,), 555.0, device=dev)])
        bufs["m"] = torch.cat([torch.full((B * H * N,), -math.inf, device=dev),
                               torch.full((N,), 333.0, device=dev)])
    return bufs


def _canary(kernel, p: Problem, launch: str, what: str, cfg=None):
    """Run with a neighbour head behind the last one; its O/l/m rows must stay untouched."""
    q, k, v = _qkv(p, seed=1234)
    bufs = canary_buffers(p, q, k, v, with_lm=(launch == "fa1"))
    views = {name: as_flat(t) for name, t in bufs.items()}
    if launch == "fa1":
        call = lambda: launch_fa1(kernel, q, k, v, p.Bc, buffers=views)  # noqa: E731
    elif launch == "fa2":
        call = lambda: launch_fa2_rows(kernel, q, k, v, p.Bc, p.Br or p.Bc, buffers=views)  # noqa: E731
    else:
        call = lambda: launch_fa2_tiled(kernel, q, k, v, cfg, buffers=views)  # noqa: E731
    _run_kernel(call, f"{what}, canary {p.describe()}")
    if current().gpu:
        torch.cuda.synchronize()
    n_real = p.B * p.H * p.N * p.d
    tail = bufs["O"][n_real:]
    changed = torch.nonzero(tail != 777.0).flatten()
    if changed.numel():
        rows = sorted({int(i) // p.d for i in changed})
        raise CheckFailure(
            f"{what}, canary {p.describe()}: the kernel wrote into the NEXT head's output rows "
            f"{rows[:10]} (they held the canary 777.0). Threads of the last tile whose row is >= N "
            "still store O: in a real batch those rows belong to the neighbouring head (a race "
            "between two blocks). Store only rows < N.")
    for name, val in (("l", 555.0), ("m", 333.0)):
        if name in bufs:
            t = bufs[name][p.B * p.H * p.N:]
            bad = torch.nonzero(t != val).flatten().tolist()
            if bad:
                raise CheckFailure(
                    f"{what}, canary {p.describe()}: the kernel wrote {name} of the NEXT head's rows "
                    f"{bad[:10]}. Store {name} only for rows < N.")
    o = bufs["O"][:n_real].reshape(p.B, p.H, p.N, p.d)
    _compare(o, p, q, k, v, f"{what}, canary {p.describe()} (with a neighbour head of huge "
             "values after the last head)",
             "rows past N in the last K/V tile belong to the next head: load zeros there and give "
             "those columns a score of -inf so they get no weight.")


_HINT_BOUNDS = ("a tail tile has fewer than Bc valid keys and Br valid queries: load 0 for rows >= N, "
                "give keys >= N the score -inf (so exp gives 0), and skip the O/l/m stores of rows >= N.")


def check_fa1_bounded(kernel, hidden: bool = False):
    """The bounds-fixed FA1 kernel: correct for every N, neighbour head untouched."""
    _require_or_fail(kernel, "fa1_bounded_kernel")
    cases = [Problem(1, 2, 13, 4, 8), Problem(1, 1, 1, 8, 8), Problem(1, 2, 31, 8, 16),
             Problem(1, 1, 33, 4, 16)]
    if hidden:
        cases += [Problem(1, 1, 50, 8, 16), Problem(2, 1, 7, 16, 8), Problem(1, 3, 17, 4, 4),
                  Problem(1, 1, 64, 8, 16)]
        if current().gpu:
            cases += [Problem(2, 3, 1000, 64, 32), Problem(1, 2, 333, 32, 32)]
    for i, p in enumerate(cases):
        q, k, v = _qkv(p, seed=20 + i)
        what = f"fa1_bounded_kernel {p.describe()}"
        o = _run_kernel(lambda: launch_fa1(kernel, q, k, v, p.Bc), what)
        _compare(o, p, q, k, v, what, _HINT_BOUNDS)
    canaries = [Problem(1, 2, 13, 4, 8)] + ([Problem(2, 1, 33, 8, 16), Problem(1, 1, 5, 4, 8)]
                                             if hidden else [])
    for p in canaries:
        _canary(kernel, p, "fa1", "fa1_bounded_kernel")
    if hidden:
        _race(kernel, Problem(1, 1, 11, 4, 8), "fa1", "fa1_bounded_kernel")
    print(f"PASSED fa1_bounded_kernel: {len(cases)} cases + {len(canaries)} canary checks"
          + (" + race check" if hidden else ""))


def check_launch_config(smem_bytes: Callable, launch_config: Callable, hidden: bool = False):
    """``smem_bytes(Bc, Br, d)`` and ``launch_config(B, H, N, d, Bc=32, Br=32, max_smem=None)``."""
    what = "smem_bytes"
    table = [((32, 32, 64), 28672), ((32, 32, 128), 53248), ((16, 16, 16), 4096)]
    if hidden:
        table += [((8, 8, 4), 640), ((64, 32, 64), 57344), ((32, 64, 32), 20480)]
    for args, want in table:
        got = _call(smem_bytes, *args, what=what)
        if got != want:
            raise CheckFailure(f"smem_bytes(Bc={args[0]}, Br={args[1]}, d={args[2]}) = {got}, "
                               f"expected {want}: Qi, Kj, Vj are Bc x d floats each, S is Br x Bc "
                               "floats, and a float is 4 bytes.")
    # A configuration that fits must come back with the right numbers and print nothing.
    cases = [(1, 8, 1024, 64, 32, 32, 49152), (2, 3, 13, 16, 8, 8, 49152)]
    if hidden:
        cases += [(1, 1, 1, 128, 32, 32, 99 * 1024), (4, 2, 100, 8, 16, 16, 4096)]
    for B, H, N, d, Bc, Br, lim in cases:
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            try:
                cfg = _call(launch_config, B, H, N, d, Bc=Bc, Br=Br, max_smem=lim, what="launch_config")
            except ValueError as e:
                raise CheckFailure(f"launch_config(B={B}, H={H}, N={N}, d={d}, Bc={Bc}, Br={Br}, "
                                   f"max_smem={lim}) raised ValueError({e}) but the kernel needs "
                                   f"{smem_bytes(Bc, Br, d)} B, which fits in max_smem={lim} B "
                                   "(a device that allows more must be able to use it).") from None
        if buf.getvalue():
            raise CheckFailure(f"launch_config printed {buf.getvalue().strip()!r}: a library must "
                               "not print on every call (flash.cu's printf); return or raise.")
        want = dict(grid=(B, H), block=Bc, smem=smem_bytes(Bc, Br, d), Tc=math.ceil(N / Bc),
                    Tr=math.ceil(N / Br))
        for key, val in want.items():
            got = getattr(cfg, key, None)
            if got != val:
                raise CheckFailure(f"launch_config(B={B}, H={H}, N={N}, d={d}, Bc={Bc}, Br={Br}).{key}"
                                   f" = {got!r}, expected {val!r}.")
    # Configurations that do not fit must raise ValueError naming both numbers.
    bad = [(1, 8, 1024, 128, 32, 32, 49152)]
    if hidden:
        bad += [(1, 1, 64, 64, 64, 64, 49152), (1, 1, 16, 16, 16, 16, 4095)]
    for B, H, N, d, Bc, Br, lim in bad:
        need = 4 * (3 * Bc * d + Bc * Br)
        try:
            _call(launch_config, B, H, N, d, Bc=Bc, Br=Br, max_smem=lim, what="launch_config")
        except ValueError as e:
            msg = str(e)
            if str(need) not in msg.replace(",", "") or str(lim) not in msg.replace(",", ""):
                raise CheckFailure(f"launch_config raised ValueError({msg!r}) for d={d}, Bc={Bc}, "
                                   f"Br={Br}, max_smem={lim}: say how much shared memory is needed "
                                   f"({need} B) and how much the device allows ({lim} B).") from None
            continue
        raise CheckFailure(f"launch_config(B={B}, H={H}, N={N}, d={d}, Bc={Bc}, Br={Br}, "
                           f"max_smem={lim}) did not raise: the kernel needs {need} B of shared memory, "
                           f"more than {lim} B, so the launch would fail (and flash.cu would "
                           "silently return zeros). Raise ValueError.")
    # Arguments that make no sense must raise ValueError too.
    nonsense = [dict(B=0, H=1, N=16, d=16), dict(B=1, H=1, N=16, d=16, Bc=0, Br=0)]
    if hidden:
        nonsense += [dict(B=1, H=1, N=-3, d=16), dict(B=1, H=1, N=16, d=16, Bc=16, Br=8),
                     dict(B=1, H=1, N=16, d=16, Bc=2048, Br=2048, max_smem=10**9)]
    for kw in nonsense:
        try:
            _call(launch_config, **kw, what="launch_config")
        except ValueError:
            continue
        raise CheckFailure(f"launch_config({', '.join(f'{a}={b}' for a, b in kw.items())}) did not "
                           "raise ValueError: check the arguments (positive sizes, Bc == Br as the "
                           "kernel assumes, at most 1024 threads per block).")
    print(f"PASSED smem_bytes + launch_config: {len(table) + len(cases) + len(bad) + len(nonsense)} cases")


def _call(fn, *args, what, **kwargs):
    try:
        return fn(*args, **kwargs)
    except NotImplementedError:
        raise CheckFailure(f"{what}: not implemented yet (the stub still raises "
                           "NotImplementedError).") from None


FA2_PARAMS = ["Q", "K", "V", "N", "scale", "O"]


def _check_params(factory, args, what):
    try:
        kern = factory(*args)
    except NotImplementedError:
        raise CheckFailure(f"{what}: not implemented yet (the stub still raises "
                           "NotImplementedError).") from None
    if kern is None:
        raise CheckFailure(f"{what} returned None: it must return the @cuda.jit kernel.")
    params = list(inspect.signature(getattr(kern, "py_func", kern)).parameters)
    if len(params) != len(FA2_PARAMS):
        raise CheckFailure(f"the kernel from {what} takes ({', '.join(params)}); it must take exactly "
                           f"({', '.join(FA2_PARAMS)}). In FA2 order m, l and the output "
                           "accumulator stay on chip: there are no l, m arrays in global memory.")


def check_fa2_rows(factory, hidden: bool = False):
    """The FA2-order kernel from ``make_fa2_rows(d, Bc)``: Q tiles in the grid, m/l/acc on chip."""
    _require_or_fail(factory, "make_fa2_rows")
    _check_params(factory, (8, 8), "make_fa2_rows")
    cases = [Problem(1, 2, 13, 4, 8, 8), Problem(1, 1, 1, 8, 8, 8), Problem(1, 1, 33, 8, 16, 8),
             Problem(2, 1, 31, 4, 8, 16)]
    if hidden:
        cases += [Problem(1, 1, 50, 16, 16, 16), Problem(1, 3, 17, 4, 4, 8), Problem(2, 2, 32, 8, 8, 8),
                  Problem(1, 1, 40, 32, 8, 4)]
        if current().gpu:
            cases += [Problem(2, 3, 1000, 64, 32, 32), Problem(1, 2, 300, 128, 32, 64)]
    for i, p in enumerate(cases):
        q, k, v = _qkv(p, seed=30 + i)
        what = f"make_fa2_rows {p.describe()}"
        o = _run_kernel(lambda: launch_fa2_rows(factory, q, k, v, p.Bc, p.Br), what)
        _compare(o, p, q, k, v, what,
                 "per K/V tile: m_new = max(m, rowmax(S)), rescale l and acc by exp(m - m_new), add "
                 "exp(S - m_new) and exp(S - m_new) @ V; divide acc by l once, at the end.")
    canaries = [Problem(1, 2, 13, 4, 8, 8)] + ([Problem(1, 1, 21, 8, 8, 16)] if hidden else [])
    for p in canaries:
        _canary(factory, p, "fa2", "make_fa2_rows")
    if hidden:
        _race(factory, Problem(1, 1, 12, 4, 8, 4), "fa2", "make_fa2_rows")
    print(f"PASSED make_fa2_rows: {len(cases)} cases + {len(canaries)} canary checks"
          + (" + race check" if hidden else ""))


def check_fa2_tiled(factory, hidden: bool = False):
    """The register-tiled kernel from ``make_fa2_tiled(d, BM, BN, TM, TN)``: any N, several tiles."""
    _require_or_fail(factory, "make_fa2_tiled")
    _check_params(factory, (8, 8, 8, 2, 2), "make_fa2_tiled")
    gpu = current().gpu
    cases = [(Problem(1, 2, 13, 8), TiledConfig(8, 8, 2, 2)),
             (Problem(1, 1, 37, 16), TiledConfig(16, 16, 2, 2)),
             (Problem(1, 1, 20, 8), TiledConfig(16, 8, 4, 2))]
    if hidden:
        cases += [(Problem(2, 1, 1, 8), TiledConfig(8, 8, 2, 2)),
                  (Problem(1, 1, 24, 16), TiledConfig(8, 16, 2, 4)),
                  (Problem(1, 2, 9, 4), TiledConfig(4, 4, 2, 2))]
        if gpu:
            cases += [(Problem(2, 3, 1000, 64), TiledConfig(64, 32, 4, 4)),
                      (Problem(1, 2, 257, 128), TiledConfig(32, 16, 4, 2)),
                      (Problem(1, 2, 130, 32), TiledConfig(32, 32, 4, 4))]
    for i, (p, cfg) in enumerate(cases):
        q, k, v = _qkv(p, seed=40 + i)
        what = f"fa2_tiled {p.describe()} with {cfg}"
        o = _run_kernel(lambda: launch_fa2_tiled(factory, q, k, v, cfg), what)
        _compare(o, p, q, k, v, what,
                 "check each thread's rows/columns mapping, the row max across the threads that "
                 "share a row, and the masking of keys >= N in the last tile.")
    canaries = [(Problem(1, 2, 11, 8), TiledConfig(8, 8, 2, 2))]
    for p, cfg in canaries:
        _canary(factory, p, "tiled", "fa2_tiled", cfg)
    if hidden:
        p, cfg = Problem(1, 1, 10, 8), TiledConfig(8, 8, 2, 2)
        _race(factory, p, "tiled", "fa2_tiled", cfg)
    print(f"PASSED fa2_tiled: {len(cases)} cases + {len(canaries)} canary check"
          + (" + race check" if hidden else ""))


# ---------------------------------------------------------------------- traffic model

def hbm_traffic(N: int, d: int, Bc: int, Br: int, order: str, *, B: int = 1, H: int = 1,
                itemsize: int = 4) -> dict:
    """Bytes each loop order moves between global memory (HBM) and the chip, with no cache.

    ``order='fa1'`` (flash.cu): per head, K and V are read once; for each of the Tc K/V tiles,
    every Q tile is read, the running (m, l) and O rows are read and written back; O, l, m are
    initialised in HBM first. ``order='fa2'``: Q is read once, each of the Tr query tiles reads
    all of K and V, O is written once, (m, l) never leave the chip.
    Returns reads, writes and total in bytes, and the per-tensor breakdown in elements.
    """
    Tc, Tr = math.ceil(N / Bc), math.ceil(N / Br)
    Nd = N * d
    if order == "fa1":
        parts = {"Q read": Tc * Nd, "K,V read": 2 * Nd, "O read": Tc * Nd, "O write": Tc * Nd,
                 "m,l read": Tc * 2 * N, "m,l write": Tc * 2 * N, "init O,m,l": Nd + 2 * N}
    elif order == "fa2":
        parts = {"Q read": Nd, "K,V read": Tr * 2 * Nd, "O read": 0, "O write": Nd,
                 "m,l read": 0, "m,l write": 0, "init O,m,l": 0}
    else:
        raise ValueError(f"order must be 'fa1' or 'fa2', got {order!r}")
    heads = B * H
    reads = sum(v for k, v in parts.items() if "read" in k) * heads * itemsize
    writes = sum(v for k, v in parts.items() if "read" not in k) * heads * itemsize
    return {"reads": reads, "writes": writes, "total": reads + writes,
            "parts": {k: v * heads for k, v in parts.items()}, "Tc": Tc, "Tr": Tr}


def traffic_table(N: int, d: int, Bc: int, Br: int, B: int = 1, H: int = 1) -> str:
    """A text table comparing the two orders (MB = 1e6 bytes)."""
    a = hbm_traffic(N, d, Bc, Br, "fa1", B=B, H=H)
    b = hbm_traffic(N, d, Bc, Br, "fa2", B=B, H=H)
    lines = [f"B={B}, H={H}, N={N}, d={d}, Bc={Bc}, Br={Br} (Tc={a['Tc']}, Tr={a['Tr']}), float32",
             f"{'':12}{'FA1 (flash.cu)':>16}{'FA2 order':>14}"]
    for key in a["parts"]:
        lines.append(f"{key:12}{a['parts'][key] * 4 / 1e6:13.1f} MB{b['parts'][key] * 4 / 1e6:11.1f} MB")
    for key in ("reads", "writes", "total"):
        lines.append(f"{key.upper():12}{a[key] / 1e6:13.1f} MB{b[key] / 1e6:11.1f} MB")
    lines.append(f"compulsory (read Q, K, V, write O once): {4 * 4 * N * d * B * H / 1e6:.1f} MB")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- figures

def draw_schedule(order: str = "fa1", N: int = 8, Bc: int = 2, Br: int = 2, steps: int = 6):
    """Which tile sits where at each step: one panel per step.

    Each panel shows the N x N score matrix (query rows down, keys across) with the (i, j)
    tile being computed, the Q rows and K/V rows in shared memory, and which rows of O, m, l
    are read from and written to HBM in that step.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    Tc, Tr = math.ceil(N / Bc), math.ceil(N / Br)
    if order == "fa1":
        seq = [(i, j) for j in range(Tc) for i in range(Tr)]
    elif order == "fa2":
        seq = [(i, j) for i in range(Tr) for j in range(Tc)]
    else:
        raise ValueError("order must be 'fa1' or 'fa2'")
    seq = seq[:steps]
    cols = min(len(seq), 3)
    rows = math.ceil(len(seq) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.9 * rows), squeeze=False)
    for ax, (step, (i, j)) in zip(axes.flat, enumerate(seq)):
        ax.set_xlim(-3.2, N + 0.3)
        ax.set_ylim(N + 2.2, -1.6)
        ax.set_aspect("equal")
        ax.axis("off")
        done = seq[:step]
        # the score matrix, tiles already visited in grey
        for (ii, jj) in done:
            ax.add_patch(Rectangle((jj * Bc, ii * Br), Bc, Br, color="0.85"))
        ax.add_patch(Rectangle((j * Bc, i * Br), Bc, Br, color="tab:orange", alpha=0.9))
        ax.add_patch(Rectangle((0, 0), N, N, fill=False, lw=1.2))
        for t in range(1, Tc):
            ax.plot([t * Bc] * 2, [0, N], color="0.6", lw=0.6)
        for t in range(1, Tr):
            ax.plot([0, N], [t * Br] * 2, color="0.6", lw=0.6)
        # K/V tile in SMEM (top bar), Q tile in SMEM (left bar)
        ax.add_patch(Rectangle((j * Bc, -1.3), Bc, 0.9, color="tab:blue"))
        ax.text(N / 2, -1.45, f"K_{j}, V_{j} in SMEM", ha="center", va="bottom", fontsize=8, color="tab:blue")
        ax.add_patch(Rectangle((-1.3, i * Br), 0.9, Br, color="tab:green"))
        ax.text(-1.45, i * Br + Br / 2, f"Q_{i}", ha="right", va="center", fontsize=8, color="tab:green")
        # O / m / l traffic
        if order == "fa1":
            ax.add_patch(Rectangle((-3.0, i * Br), 0.9, Br, color="tab:red"))
            ax.text(N / 2, N + 1.2, f"HBM: read and write O_{i}, m_{i}, l_{i}", ha="center",
                    fontsize=8, color="tab:red")
        else:
            ax.add_patch(Rectangle((-3.0, i * Br), 0.9, Br, color="tab:purple", alpha=0.5))
            last = j == Tc - 1
            ax.text(N / 2, N + 1.2, f"registers: m, l, acc of rows Q_{i}" +
                    (f"; write O_{i} once" if last else ""), ha="center", fontsize=8,
                    color="tab:purple")
        ax.set_title(f"step {step}: S tile (i={i}, j={j})", fontsize=9)
    for ax in list(axes.flat)[len(seq):]:
        ax.axis("off")
    name = "FA1 (flash.cu): outer j over K/V tiles, inner i over Q tiles" if order == "fa1" else \
        "FA2 order: one block per Q tile i (in the grid), loop j over K/V tiles"
    fig.suptitle(name, fontsize=10)
    fig.tight_layout()
    return fig


def draw_smem_layout(Bc: int = 32, Br: int = 32, d: int = 64, limit: int = DEFAULT_SMEM_LIMIT):
    """The dynamic shared-memory buffer of flash.cu for d and 2*d, against the 48 KiB budget."""
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7.5, 2.0))
    for row, dd in enumerate((d, 2 * d)):
        x = 0
        for name, n, color in (("Qi", Bc * dd, "tab:green"), ("Kj", Bc * dd, "tab:blue"),
                               ("Vj", Bc * dd, "tab:cyan"), ("S", Bc * Br, "tab:orange")):
            ax.barh(row, 4 * n / 1024, left=x, color=color, edgecolor="black")
            ax.text(x + 2 * n / 1024, row, name, ha="center", va="center", fontsize=8)
            x += 4 * n / 1024
        ax.text(x + 0.5, row, f"{x:.0f} KiB (d={dd})", va="center", fontsize=8)
    ax.axvline(limit / 1024, color="red", ls="--")
    ax.text(limit / 1024, 1.55, f"{limit // 1024} KiB per-block limit", color="red", fontsize=8, ha="center")
    ax.set_yticks([])
    ax.set_xlim(0, 64)
    ax.set_ylim(-0.6, 1.8)
    ax.set_xlabel("dynamic shared memory per block (KiB)")
    fig.tight_layout()
    return fig


def plot_ladder(rows: list[dict], N: int | None = None):
    """Bar chart of TFLOP/s per kernel (the ladder) from a bench CSV's rows, one group per N."""
    import matplotlib.pyplot as plt
    order = ["fa1_literal", "fa1_bounded", "fa2_rows", "fa2_tiled", "sdpa_efficient", "sdpa_math"]
    Ns = sorted({r["N_q"] for r in rows}) if N is None else [N]
    kernels = [k for k in order if any(r["kernel"] == k for r in rows)]
    fig, ax = plt.subplots(figsize=(7.2, 4.0))
    width = 0.8 / max(1, len(Ns))
    for gi, n in enumerate(Ns):
        ys = []
        for k in kernels:
            match = [r for r in rows if r["kernel"] == k and r["N_q"] == n and r["tflops"]]
            ys.append(match[0]["tflops"] if match else float("nan"))
        xs = [x + gi * width for x in range(len(kernels))]
        bars = ax.bar(xs, ys, width=width, label=f"N={n}")
        for b, y in zip(bars, ys):
            if y == y:
                ax.text(b.get_x() + b.get_width() / 2, y * 1.1, f"{y:.3g}", ha="center", fontsize=7)
    ax.set_yscale("log")
    ax.set_xticks([x + width * (len(Ns) - 1) / 2 for x in range(len(kernels))])
    ax.set_xticklabels(kernels, rotation=15)
    ax.set_ylabel("TFLOP/s (fp32, log scale)")
    ax.legend()
    ax.grid(True, axis="y", which="both", alpha=0.3)
    fig.tight_layout()
    return fig
