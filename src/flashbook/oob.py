"""Out-of-bounds guard for Triton kernels in CPU mode (introduced in Chapter 3).

In the Triton interpreter a ``tl.load`` or ``tl.store`` whose address lies outside every
tensor is *not* detected: it reads garbage, silently overwrites other Python objects, or kills
the process (a segfault takes the notebook kernel, or the autograder, with it). This module
checks every address before the interpreter touches memory.

How it works:

* ``Guard`` patches the interpreter's builder (the object that executes ``tl.load``,
  ``tl.store`` and the atomics) while it is active. Every launch inside the guard registers the
  kernel's tensor arguments under their parameter names (``Q``, ``K``, ``Out`` ...).
* Each memory operation is checked lane by lane, on the lanes its mask leaves active: all of
  them must fall inside **one** registered tensor (a block of pointers comes from one base
  pointer; a lane that wanders into a neighbouring tensor is as wrong as one that hits no tensor).
* The first offending operation raises ``OutOfBoundsError`` *before* the access happens, with a
  message naming the source line, the program id, the tensor and the offending offsets.
  ``call`` turns that into a ``CheckFailure`` (an AssertionError: a failed graded cell, not a crash).

On a GPU the interpreter is not used and ``Guard`` does nothing; ``embed`` / ``canaries_intact``
(tensors placed inside larger buffers filled with a canary value) catch some errors there too.

Usage (any chapter)::

    from flashbook import oob
    out = oob.call(my_wrapper, q, k, v, what="attention forward")   # CheckFailure on OOB
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import inspect
import linecache
import os
import re
import sys
from typing import Callable

import numpy as np
import torch

from .compare import CheckFailure, format_ranges

__all__ = ["Guard", "OutOfBoundsError", "call", "interpreter_active", "embed", "canaries_intact",
           "counting_calls"]


class OutOfBoundsError(RuntimeError):
    """A load/store/atomic of a Triton kernel touched memory outside its tensors."""

    def __init__(self, message: str, op: str = "", tensor: str | None = None):
        super().__init__(message)
        self.op = op
        self.tensor = tensor


def interpreter_active() -> bool:
    """True when Triton runs kernels in its interpreter (CPU mode)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@dataclasses.dataclass(frozen=True)
class Region:
    name: str
    lo: int        # first byte
    hi: int        # one past the last byte
    base: int      # data_ptr() of the view (offsets are counted from here)
    itemsize: int
    shape: tuple
    dtype: str
    gaps: tuple = ()   # a view with holes (K and V halves of one KV tensor): its (size, stride)
                       # dimensions, outermost first, to tell its elements from the other's

    def holds(self, a: np.ndarray, itemsize: int) -> np.ndarray:
        """Which byte addresses ``a`` (of accesses of ``itemsize`` bytes) fall on this view's
        elements: inside its span and, for a view with holes, on an index it has."""
        inside = (a >= self.lo) & (a + itemsize <= self.hi)
        if not self.gaps:
            return inside
        off = (a - self.base).astype(np.int64)
        ok = inside & (off % self.itemsize == 0)
        off = off // self.itemsize
        for size, stride in self.gaps:
            idx = off // stride
            ok &= (idx >= 0) & (idx < size)
            off = off - idx * stride
        return ok & (off == 0)

    def describe(self) -> str:
        return f"`{self.name}` (shape {self.shape}, {self.dtype})"

    @property
    def numel(self) -> int:
        return (self.hi - self.lo) // self.itemsize

    def offsets(self, addresses):
        """Element offsets of byte addresses, counted from the view's start."""
        return (addresses - self.base) // self.itemsize


def region_of(name: str, t: torch.Tensor) -> Region | None:
    """The byte span [lo, hi) a (possibly strided) view can address; None for empty tensors."""
    if t.numel() == 0:
        return None
    item = t.element_size()
    lo_off = sum(st * (n - 1) for n, st in zip(t.shape, t.stride()) if st < 0)
    hi_off = sum(st * (n - 1) for n, st in zip(t.shape, t.stride()) if st > 0)
    base = t.data_ptr()
    dims = sorted(((n, st) for n, st in zip(t.shape, t.stride()) if n > 1), key=lambda x: -x[1])
    holes = hi_off + 1 - lo_off > t.numel() and lo_off == 0 and all(st > 0 for _, st in dims)
    return Region(name, base + lo_off * item, base + (hi_off + 1) * item, base, item,
                  tuple(t.shape), str(t.dtype).replace("torch.", ""),
                  tuple(dims) if holes else ())


def _kernel_frame():
    """(function name, line number, source line) of the kernel code that issued the access."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        import triton
        triton_dir = os.path.dirname(os.path.abspath(triton.__file__))
    except ImportError:  # pragma: no cover
        triton_dir = "\0"
    f = sys._getframe(2)
    while f is not None:
        fname = os.path.abspath(f.f_code.co_filename) if not f.f_code.co_filename.startswith("<") \
            else f.f_code.co_filename
        if not fname.startswith(triton_dir) and not fname.startswith(here) \
                and "numpy" not in fname:
            line = linecache.getline(f.f_code.co_filename, f.f_lineno).strip()
            return f.f_code.co_name, f.f_lineno, line
        f = f.f_back
    return "?", 0, ""


@contextlib.contextmanager
def counting_calls(kernel, helper: str, when: Callable[[dict], bool] = lambda arguments: True):
    """Count, per program id, the calls that ``kernel`` makes (itself or through other helpers)
    to the ``@triton.jit`` helper named ``helper`` in its module's globals, when
    ``when(arguments)`` holds (arguments by name, constexprs unwrapped): how a check sees that
    a kernel took the masked path for a tile (Chapter 4). Interpreter only; yields the Counter
    (empty when the interpreter is off or the kernel has no such helper)."""
    counts: collections.Counter = collections.Counter()
    namespace = getattr(kernel, "fn", kernel).__globals__
    original = namespace.get(helper)
    if original is None or not interpreter_active():
        yield counts
        return
    signature = inspect.signature(getattr(original, "fn", original))
    # the kernel's module, and those of the helpers it calls (a helper defined in an earlier
    # namespace looks the name up there)
    namespaces = {id(namespace): namespace}
    for value in list(namespace.values()):
        other = getattr(getattr(value, "fn", None), "__globals__", None)
        if isinstance(other, dict) and other.get(helper) is original:
            namespaces[id(other)] = other

    def counted(*args, **kwargs):
        from triton.runtime import interpreter as interp
        bound = signature.bind_partial(*args, **kwargs).arguments
        if when({k: getattr(v, "value", v) for k, v in bound.items()}):
            counts[tuple(getattr(interp.interpreter_builder, "grid_idx", None) or ())] += 1
        return original(*args, **kwargs)
    for ns in namespaces.values():
        ns[helper] = counted
    try:
        yield counts
    finally:
        for ns in namespaces.values():
            ns[helper] = original


class Guard:
    """Context manager: check every load/store/atomic of Triton kernels launched inside it.

    ``Guard(name=tensor, ...)`` registers extra tensors besides each launch's arguments (for
    kernels that receive raw addresses). ``guard.checked`` counts the operations checked.
    Does nothing (and checks nothing) when the interpreter is not active.

    ``guard.loads`` counts, per (program id, tensor name), the loads that had at least one
    active lane: how a check proves that a kernel skipped tiles it did not need (Chapter 4).
    """

    def __init__(self, **tensors: torch.Tensor):
        self.explicit = {n: t for n, t in tensors.items() if isinstance(t, torch.Tensor)}
        self.launch_regions: list[Region] = []
        self.checked = 0
        self.loads: collections.Counter = collections.Counter()
        self._saved: list = []
        self.active = False

    # --------------------------------------------------------------- registration
    def _regions(self) -> list[Region]:
        regs = list(self.launch_regions)
        for n, t in self.explicit.items():
            r = region_of(n, t)
            if r is not None:
                regs.append(r)
        return regs

    def _register_launch(self, names, args_hst, kwargs_hst):
        regs = []

        def add(name, a):
            if isinstance(a, torch.Tensor):
                r = region_of(name, a)
                if r is not None:
                    regs.append(r)
            elif isinstance(a, tuple):
                for i, x in enumerate(a):
                    add(f"{name}[{i}]", x)
            elif hasattr(a, "base") and isinstance(getattr(a, "base"), torch.Tensor):
                add(f"{name}.base", a.base)     # host-side TensorDescriptor

        for name, a in zip(names, args_hst):
            add(name, a)
        for name, a in kwargs_hst.items():
            add(name, a)
        self.launch_regions = regs

    # ------------------------------------------------------------------- checking
    def _check(self, op: str, ptrs, mask, builder):
        addr = np.asarray(ptrs.data).astype(np.uint64)
        active = np.ones(addr.shape, dtype=bool) if mask is None else \
            np.broadcast_to(np.asarray(mask.data).astype(bool), addr.shape)
        self.checked += 1
        if not active.any():
            return
        try:
            itemsize = int(ptrs.get_element_ty().primitive_bitwidth) // 8 or 1
        except Exception:  # pragma: no cover - exotic element types
            itemsize = 1
        regs = self._regions()
        a = addr.astype(np.int64 if addr.max() < 2**63 else np.float64)
        # which region holds each lane (-1: none)
        owner = np.full(addr.shape, -1, dtype=np.int64)
        for i, r in enumerate(regs):
            owner = np.where((owner < 0) & r.holds(a, itemsize), i, owner)
        lanes = owner[active]
        counts = np.bincount(lanes[lanes >= 0], minlength=len(regs)) if len(regs) else np.zeros(0)
        home = int(np.argmax(counts)) if counts.size and counts.max() > 0 else -1
        bad = active & (owner != home) if home >= 0 else active
        if not bad.any():
            if op == "load" and home >= 0:
                self.loads[tuple(getattr(builder, "grid_idx", None) or ()), regs[home].name] += 1
            return
        self._fail(op, a, bad, active, owner, regs, home, itemsize, builder)

    def _fail(self, op, a, bad, active, owner, regs, home, itemsize, builder):
        func, lineno, code = _kernel_frame()
        pid = tuple(getattr(builder, "grid_idx", None) or ())
        where = f"`{code}`" if code else f"a tl.{op}"
        loc = f"line {lineno} of `{func}`" if lineno else f"`{func}`"
        lines = [f"out-of-bounds {op}: {where} ({loc}), program id {pid}:"]
        n_bad, n_act = int(bad.sum()), int(active.sum())
        idx = np.argwhere(bad)
        if bad.ndim >= 1 and idx.size:
            axes = "; ".join(f"axis {ax}: {format_ranges(idx[:, ax])}" for ax in range(bad.ndim))
            block = f" at block positions [{axes}] of the {tuple(bad.shape)} block"
        else:
            block = ""
        tensor_name = None
        if home >= 0:
            r = regs[home]
            tensor_name = r.name
            lines.append(f"  {n_bad} of {n_act} active lanes{block} address memory outside "
                         f"{r.describe()}, which the other lanes of this {op} use.")
            lines.append(f"  Offending element offsets from `{r.name}`'s start: "
                         f"{format_ranges(r.offsets(a[bad]))} (valid: 0-{r.numel - 1}).")
            others = [regs[o].name for o in np.unique(owner[bad]) if o >= 0]
            if others:
                lines.append(f"  (Those lanes land inside {', '.join('`%s`' % n for n in others)}: "
                             "a neighbouring tensor, not this one.)")
        else:
            names = ", ".join(f"`{r.name}`" for r in regs) or "(none registered)"
            lines.append(f"  {n_bad} of {n_act} active lanes{block} address memory that belongs to "
                         f"none of the kernel's tensors ({names}).")
            first = a[bad].min()
            below = [r for r in regs if r.lo <= first]
            if below:
                r = max(below, key=lambda r: r.lo)
                tensor_name = r.name
                lines.append(f"  Nearest tensor below: {r.describe()}; as offsets from its start the "
                             f"lanes are {format_ranges(r.offsets(a[bad]))} (valid: 0-{r.numel - 1}).")
        lines.append(f"  Fix: give this tl.{op} a mask (e.g. `mask=offs < N`, with `other=0.0` for a "
                     "load) so lanes past the end of the tensor stay inactive. On a GPU this bug "
                     "reads garbage or crashes; in the interpreter it corrupts memory, so the "
                     "guard stopped the kernel before the access.")
        raise OutOfBoundsError("\n".join(lines), op=op, tensor=tensor_name)

    # ---------------------------------------------------------------- patching
    def __enter__(self):
        if not interpreter_active():
            return self
        try:
            from triton.runtime import interpreter as interp
            builder = interp.interpreter_builder
            executor = interp.GridExecutor
        except (ImportError, AttributeError):  # pragma: no cover - other triton layouts
            return self
        guard = self

        def wrap(name, op, ptr_i, mask_i):
            orig = getattr(builder, name, None)
            if orig is None:
                return

            def checked(*args, **kwargs):
                ptrs = args[ptr_i]
                mask = args[mask_i] if mask_i is not None and len(args) > mask_i else None
                guard._check(op, ptrs, mask, builder)
                return orig(*args, **kwargs)
            self._saved.append((builder, name, builder.__dict__.get(name)))
            setattr(builder, name, checked)

        # argument positions follow triton 3.x InterpreterBuilder signatures
        wrap("create_masked_load", "load", 0, 1)
        wrap("create_masked_store", "store", 0, 2)
        wrap("create_atomic_rmw", "atomic", 1, 3)
        wrap("create_atomic_cas", "atomic", 0, None)

        orig_init = getattr(executor, "_init_args_hst", None)
        if orig_init is not None:
            def init_args(ex_self, args_dev, kwargs):
                args_hst, kwargs_hst = orig_init(ex_self, args_dev, kwargs)
                guard._register_launch(getattr(ex_self, "arg_names", []), args_hst, kwargs_hst)
                return args_hst, kwargs_hst
            self._saved.append((executor, "_init_args_hst", executor.__dict__.get("_init_args_hst")))
            executor._init_args_hst = init_args
        self.active = True
        return self

    def __exit__(self, *exc):
        for obj, name, old in reversed(self._saved):
            if old is None:
                try:
                    delattr(obj, name)
                except AttributeError:  # pragma: no cover
                    pass
            else:
                setattr(obj, name, old)
        self._saved.clear()
        self.active = False
        return False


def find_oob(exc: BaseException | None) -> OutOfBoundsError | None:
    """The OutOfBoundsError behind ``exc`` (the interpreter re-wraps kernel exceptions)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, OutOfBoundsError):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


# On a GPU, Triton compiles a @triton.jit helper's stub (``raise NotImplementedError()``) and
# refuses it with this message, naming neither the exception nor (always) the stub.
_COMPILED_RAISE = "unsupported AST node type: Raise"


def _stub_behind(exc: BaseException | None) -> bool:
    """True if ``exc`` comes from a ``raise NotImplementedError()`` stub inside a kernel: raised
    (the interpreter) or refused by the compiler (a GPU)."""
    return stub_of(exc) is not None


def stub_of(exc: BaseException | None) -> str | None:
    """None unless ``exc`` comes from a stub inside a kernel; then the name of the jit function
    that holds it when the compiler's message shows it ("" when it does not)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        text = str(exc)[:4000]
        if isinstance(exc, NotImplementedError) or "NotImplementedError" in text or \
                _COMPILED_RAISE in text:
            names = re.findall(r"def (\w+)\(", text.split(_COMPILED_RAISE)[0])
            return names[-1] if names else ""
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def call(fn: Callable, *args, what: str = "kernel", **kwargs):
    """Run ``fn(*args, **kwargs)`` under a ``Guard``; report OOB accesses as a CheckFailure.

    ``NotImplementedError`` passes through (the check harness reports stubs itself); a
    ``ValueError`` from an input-validating wrapper too. Any other exception raised while a
    kernel runs becomes a CheckFailure naming it, so a broken kernel fails its check instead of
    taking the notebook down.
    """
    try:
        with Guard():
            return fn(*args, **kwargs)
    except (NotImplementedError, ValueError, CheckFailure):
        raise
    except Exception as e:  # noqa: BLE001 - anything a student kernel raises
        stub = stub_of(e)
        if stub is not None:
            raise NotImplementedError(f"{what}: a kernel still raises NotImplementedError"
                                      + (f" (in `{stub}`)" if stub else "")) from None
        oob = find_oob(e)
        if oob is not None:
            raise CheckFailure(f"{what}: {oob}") from None
        raise CheckFailure(f"{what}: the kernel raised {type(e).__name__}: "
                           f"{str(e)[:800]}") from None


# ------------------------------------------------------------------ canaries (GPU too)

def embed(t: torch.Tensor, pad: int = 64, fill: float = float("nan")) -> torch.Tensor:
    """A copy of ``t`` placed in the middle of a larger buffer whose other elements are ``fill``.

    An unmasked read past the end of the copy then reads ``fill`` (NaN poisons the output), and
    a write past its end changes the canaries (see ``canaries_intact``). Works on any device.
    """
    buf = torch.full((t.numel() + 2 * pad,), fill, dtype=t.dtype, device=t.device)
    view = buf[pad:pad + t.numel()].view(t.shape)
    view.copy_(t)
    view._flashbook_canary = (buf, pad, fill)   # keep the buffer alive, remember the layout
    return view


def canaries_intact(view: torch.Tensor) -> bool:
    """True when nothing wrote to the padding around a tensor made by ``embed``."""
    buf, pad, fill = view._flashbook_canary
    edge = torch.cat([buf[:pad], buf[pad + view.numel():]])
    if isinstance(fill, float) and fill != fill:
        return bool(torch.isnan(edge).all())
    return bool((edge == fill).all())
