"""What a kernel wrapper does at call time besides its argument checks (``cases``): its output
buffers (``output``, NaN-filled inside ``poisoned_outputs``), its grid arithmetic in plain ints
(``cdiv``, ``next_pow2``), and how it reads an index tensor (``cu_seqlens``, ``cache_seqlens``, a
block table) for its content checks without making a GPU's hot path wait (``host_values``, on
only where ``check_values`` is: the graded checks, CPU mode, or on request). ``cases``
re-exports all of it, the name the chapters and the students' validators use."""
from __future__ import annotations

import contextlib
import contextvars
import math
import os
import weakref

import torch

from .device import current


# ------------------------------------------------------------ launchers' output buffers

_POISON = contextvars.ContextVar("flashbook_poisoned_outputs", default=False)
# The switches below are also set in the environment while they are on: the grader runs each
# check from a fresh copy of flashbook's modules (grade/kernel_guard.py), while the student's
# wrappers call the launchers of the notebook's own copy. A context variable of one copy is
# invisible to the other; the process's environment is the one state both copies read.
POISON_ENV = "FLASHBOOK_POISON_OUTPUTS"
VALUES_ENV = "FLASHBOOK_CHECK_VALUES"
# Read on every launch: ``os.environ.get`` of an unset name costs about 1 µs (it encodes the name
# and raises a KeyError inside); the mapping under it (bytes names on POSIX, which is all the
# kernels run on) answers in a dict lookup and sees every change made through ``os.environ``.
if os.name == "posix" and isinstance(getattr(os.environ, "_data", None), dict):
    def _env(name: str) -> bytes | None:
        return os.environ._data.get(_ENV_KEYS[name])
else:                                            # pragma: no cover - not POSIX
    def _env(name: str) -> bytes | None:
        value = os.environ.get(name)
        return None if value is None else value.encode()
_ENV_KEYS = {POISON_ENV: POISON_ENV.encode(), VALUES_ENV: VALUES_ENV.encode()}


@contextlib.contextmanager
def _environment(name: str, value: str):
    """``os.environ[name] = value`` inside, the previous value (or none) after."""
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


@contextlib.contextmanager
def poisoned_outputs():
    """Inside, the launchers' output buffers (``output``) start as NaN, so an output row a
    kernel never writes shows as NaN instead of whatever the memory held (often the right
    answer of the previous call). The checks run every student launch inside."""
    token = _POISON.set(True)
    with _environment(POISON_ENV, "1"):
        try:
            yield
        finally:
            _POISON.reset(token)


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for a launcher's grid: plain Python (``triton.cdiv`` is a constexpr function,
    a few µs per call on the host)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1), for a launcher's tile sizes."""
    return 1 << (n - 1).bit_length() if n > 1 else 1


def poisoning() -> bool:
    """Whether ``poisoned_outputs`` is on (in this copy of flashbook's modules or another)."""
    return _POISON.get() or _env(POISON_ENV) == b"1"


def output(shape, *, dtype: torch.dtype, device) -> torch.Tensor:
    """A launcher's output buffer: ``torch.empty``, NaN-filled inside ``poisoned_outputs``."""
    t = torch.empty(shape, dtype=dtype, device=device)
    return t.fill_(math.nan) if _POISON.get() or _env(POISON_ENV) == b"1" else t


# ------------------------------------------------------------ index tensors read on the host

def capturing() -> bool:
    """True while this thread's current CUDA stream is capturing a CUDA graph (False without
    CUDA: a graph can only be captured once CUDA is initialised)."""
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


_READS: dict[int, tuple] = {}       # id(tensor) -> (weakref to it, its state, its values)
READ_CACHE_SIZE = 64                # tensors remembered (the oldest is forgotten first)


def _state(t: torch.Tensor):
    """What must be unchanged for ``t``'s values to be unchanged: every write through torch
    bumps ``_version``; ``set_``, a new view or a move change the rest. None for an inference
    tensor (``torch.inference_mode``), which has no version counter."""
    try:
        version = t._version
    except RuntimeError:
        return None
    return (version, t.data_ptr(), t.device, t.dtype, tuple(t.shape), t.stride())


_CHECK_VALUES = contextvars.ContextVar("flashbook_check_values", default=None)


@contextlib.contextmanager
def check_values(on: bool = True):
    """Inside, the wrappers check the *values* of their index tensors (``cu_seqlens``
    increasing and within the tensor, ``cache_seqlens`` within the cache, page-table entries
    in the pool) on a GPU too, at the cost of one host sync per new tensor; ``on=False`` skips
    them in CPU mode as well. The graded checks run student code inside ``check_values()``."""
    token = _CHECK_VALUES.set(bool(on))
    with _environment(VALUES_ENV, "1" if on else "0"):
        try:
            yield
        finally:
            _CHECK_VALUES.reset(token)


def values_checked() -> bool:
    """Whether ``host_values`` reads: inside ``check_values(on)``, ``on``; else with
    ``FLASHBOOK_CHECK_VALUES=1`` (or ``0``) in the environment, yes (no); else in CPU mode
    (reading costs no sync there), and not on a GPU, whose hot path must not wait for the
    device."""
    on = _CHECK_VALUES.get()
    if on is not None:
        return on
    env = _env(VALUES_ENV)
    if env in (b"0", b"1"):
        return env == b"1"
    return not current().gpu


def host_values(t: torch.Tensor):
    """The values of a small index tensor as nested tuples of Python numbers, for a wrapper's
    content checks (monotone offsets, lengths in range, page numbers in the pool), read so that
    the hot path never waits for the GPU:

    * where value checks are off (``values_checked()``: on a GPU outside the graded checks and
      ``check_values()``): ``None``, without reading; the caller skips its content checks;
    * while a CUDA graph is being captured: ``None``, without reading (a copy to the host is
      illegal during capture); the caller skips its content checks. The graph's warm-up call,
      made before the capture (``do_bench_cudagraph``, ``torch.cuda.graphs.make_graphed_callables``
      and the like do), checked the same tensors;
    * otherwise read (``tolist()``: one small copy, a sync for a GPU tensor) once per tensor
      state, and remembered: calling again with the same, unmodified tensor reads nothing.

    Why not check on the device (``torch._assert_async``)? A failed device assert is not a
    ValueError naming the argument: it kills the CUDA context. Why the cache is keyed by the
    tensor object itself (a weak reference) and its version, not by ``data_ptr`` alone: a freed
    tensor's memory is soon reused by another of the same shape, which must be read again.
    Writes torch cannot see (a kernel writing through the pointer, a shared NumPy view) are not
    noticed: index tensors written that way must be fresh tensors. An inference tensor has no
    version counter: it is read on every call outside capture. CPU tensors take the same path
    (reading them costs no sync), so the CPU tests exercise the GPU's.
    """
    return _read(t) if values_checked() else None


def _read(t: torch.Tensor):
    """``t``'s values, read once per tensor state (None while a CUDA graph is captured)."""
    if capturing():
        return None
    state = _state(t)
    key = id(t)
    hit = _READS.get(key)
    if state is not None and hit is not None and hit[0]() is t and hit[1] == state:
        return hit[2]
    values = _frozen(t.tolist())
    if state is not None:
        while len(_READS) >= READ_CACHE_SIZE:
            _READS.pop(next(iter(_READS)))
        _READS[key] = (weakref.ref(t, _forget(key)), state, values)
    return values


def _frozen(v):
    """tolist()'s nested lists as nested tuples: the remembered values cannot be changed."""
    return tuple(_frozen(x) for x in v) if isinstance(v, list) else v


def _forget(key: int):
    """The weak reference's callback: drop the entry when its tensor dies (if it is still
    that tensor's entry)."""
    def drop(ref):
        if _READS.get(key, (None,))[0] is ref:
            _READS.pop(key, None)
    return drop
