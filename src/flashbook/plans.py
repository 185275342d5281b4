"""Remembered launches: what a kernel wrapper works out from its inputs' host metadata, kept for
the next call with the same metadata, and the kernel launched again without Triton's per-call
argument binding.

A wrapper's checks, tile choice, grid and scalar kernel arguments depend only on its inputs'
shapes, strides, dtypes and devices and on its Python arguments. ``key`` builds a tuple of those
(about 0.3 µs per tensor); the wrapper looks its plan up in a ``Plans`` table and, on a miss, runs
its checks (which raise a ValueError naming the problem: nothing is remembered then) and stores
the plan. A repeated call costs the key, one dict lookup, its output buffers and the launch.

``Launch`` is one kernel launch of a plan. Its first call is ``kernel[grid](...)``, Triton's
ordinary launch (which compiles); it keeps the compiled kernel's own launcher
(``CompiledKernel[grid]``: the C launcher, the current stream, Triton's launch hooks), and every
later call goes straight to it with the tensors and the remembered arguments. That skips what
``JITFunction.run`` repeats on each call (binding ~25 arguments, specializing each on its type,
value and alignment, hashing the specialization: 15-20 µs of an H200 host's time), which is
valid because everything it would compute is fixed by the plan's key: the integers come from the
shapes and strides, the tensors' alignment (Triton specializes pointers on 16-byte alignment) is
in ``key``, and the kernel object itself is too. In the CPU interpreter ``kernel[grid]`` returns
no compiled kernel and every call takes the ordinary path.

What the fast path does not repeat: Triton's check that the globals a kernel read at compile
time are unchanged (rebinding a global a compiled kernel uses, then calling the same kernel object
again, is not noticed; redefining the kernel makes a new object and a new plan), and its reading
of ``TRITON_DEBUG`` per call.
"""
from __future__ import annotations

import contextlib
import inspect

import torch

from .launcher import capturing, output, poisoning, values_checked


def tensor_key(t: torch.Tensor) -> tuple:
    """What a plan depends on in one tensor: shape, strides, dtype, device (``get_device()``: -1
    on the CPU, else the GPU's index) and 16-byte alignment."""
    return t.shape, t.stride(), t.dtype, t.get_device(), not t.data_ptr() & 15


def contiguous_strides(shape) -> tuple[int, ...]:
    """The strides of a new row-major tensor of ``shape`` (``torch.empty``'s output buffers)."""
    strides, step = [], 1
    for n in reversed(tuple(shape)):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


_TENSOR = torch.Tensor


def key(*parts) -> tuple:
    """A plan key: tensors by ``tensor_key``, anything else as itself (ints, floats, bools, None,
    tuples, frozen configs, kernels). A key with an unhashable part (a list, a NumPy array ...)
    finds no plan and is not remembered (``Plans``): the wrapper runs its checks every time,
    which say what is wrong. Built in one comprehension and hashed once, by the table's lookup:
    on a GPU's host it is the largest part of a repeated call's cost."""
    return tuple([tensor_key(p) if isinstance(p, _TENSOR) else p for p in parts])


class Plans(dict):
    """A wrapper's plans by key, at most ``size`` of them (the table is emptied when full: a
    notebook that keeps redefining its kernels must not hold every old one)."""

    def __init__(self, size: int = 256):
        super().__init__()
        self.size = size

    def get(self, k, default=None):
        """The plan of key ``k``, or ``default`` (also for a key that cannot be hashed)."""
        try:
            return super().get(k, default)
        except TypeError:
            return default

    def remember(self, k, plan):
        """Keep ``plan`` under ``k`` (not when ``k`` cannot be hashed) and return it."""
        if k is not None:
            if len(self) >= self.size:
                self.clear()
            try:
                self[k] = plan
            except TypeError:
                pass
        return plan


_RECORDING: list | None = None


@contextlib.contextmanager
def recorded_launches():
    """Inside, every ``Launch`` made is also appended to the yielded list as ``(launch,
    tensors)``: what ``flashbook.overhead`` replays to time a call's launches alone. Nested,
    the outer list gets the inner one's launches too."""
    global _RECORDING
    before, _RECORDING = _RECORDING, []
    inner = _RECORDING
    try:
        yield inner
    finally:
        _RECORDING = before
        if before is not None:
            before.extend(inner)


def triton_launch(launch: "Launch", tensors) -> None:
    """``launch`` made the ordinary way, ``kernel[grid](...)``: Triton binds and specializes
    every argument again (what a hand-written launch costs)."""
    launch.kernel[launch.grid](*tensors, *launch.args, **launch.kwargs)


def direct_launch(launch: "Launch", tensors) -> None:
    """``launch`` through the compiled kernel's launcher it keeps (Triton's way when it has
    none: the CPU interpreter)."""
    if launch.runner is not None:
        launch.runner(*tensors, *launch.tail)
    else:
        triton_launch(launch, tensors)


class Launch:
    """One launch of ``kernel`` on ``grid`` with per-call tensors first and then ``args`` and
    ``kwargs`` (launch options such as ``num_warps`` included), fixed by the plan's key.
    ``launch(*tensors)`` launches it; see the module docstring for the path it takes."""

    __slots__ = ("kernel", "grid", "args", "kwargs", "runner", "tail")

    def __init__(self, kernel, grid, args=(), kwargs=None):
        self.kernel, self.grid, self.args = kernel, tuple(grid), tuple(args)
        self.kwargs = dict(kwargs or {})
        self.runner = self.tail = None

    def __call__(self, *tensors):
        if _RECORDING is not None:
            _RECORDING.append((self, tensors))
        if self.runner is not None:
            self.runner(*tensors, *self.tail)
            return
        compiled = self.kernel[self.grid](*tensors, *self.args, **self.kwargs)
        self._keep(compiled, tensors)

    def _keep(self, compiled, tensors):
        """Keep the compiled kernel's launcher and the arguments after the tensors, in the
        kernel's parameter order with defaults filled in (what ``JITFunction.run`` passes)."""
        if compiled is None or not hasattr(compiled, "packed_metadata"):
            return                                  # the interpreter: no compiled kernel
        names = getattr(self.kernel, "arg_names", None)
        signature = getattr(self.kernel, "signature", None)
        if names is None or signature is None:
            return
        bound = signature.bind(*tensors, *self.args,
                               **{n: v for n, v in self.kwargs.items() if n in names})
        bound.apply_defaults()
        values = list(bound.arguments.values())
        if len(values) != len(names) or any(v is inspect.Parameter.empty for v in values):
            return
        grid = self.grid + (1,) * (3 - len(self.grid))
        self.tail = tuple(values[len(tensors):])
        self.runner = compiled[grid]


_PASSED = Plans(1024)


def validate_once(validate, *args) -> None:
    """``validate(*args)``, a wrapper's argument checks, run once per metadata: skipped when
    arguments with the same ``key`` passed before, unless values are being checked
    (``cases.values_checked()``: CPU mode, the graded checks, ``flashbook.check_values()``),
    where it always runs, since it then reads the index tensors' values, which the key does not
    hold. A check that raises is not remembered."""
    passed_key = key(validate, *args)
    if _PASSED.get(passed_key) and not values_checked():
        return
    validate(*args)
    _PASSED.remember(passed_key, True)


def current_stream(device: torch.device) -> int:
    """The handle of ``device``'s current CUDA stream (0 for a CPU tensor): the raw lookup
    Triton's launcher makes, not ``torch.cuda.current_stream()``, which builds a Stream object."""
    if device.type != "cuda":
        return 0
    index = device.index if device.index is not None else torch.cuda.current_device()
    try:
        return torch._C._cuda_getCurrentRawStream(index)
    except AttributeError:                       # a torch without the raw lookup
        return torch.cuda.current_stream(index).cuda_stream


class Workspace:
    """Scratch buffers (``shapes``, one ``dtype``) that one call's kernels write and then read,
    in stream order: kept per (device, stream) and reused by the next call on that stream, which
    its kernels reach only after the previous call's. Fresh buffers instead while a CUDA graph is
    captured (the graph must own what it reads; a kept buffer may be freed) and inside
    ``poisoned_outputs`` (the checks' NaN-filled buffers: a kernel that leaves part of the
    scratch unwritten must not read the previous call's values there)."""

    def __init__(self, shapes, dtype: torch.dtype):
        self.shapes, self.dtype = tuple(tuple(s) for s in shapes), dtype
        self.kept: dict = {}

    def get(self, device: torch.device) -> tuple:
        if poisoning() or capturing():
            return tuple(output(s, dtype=self.dtype, device=device) for s in self.shapes)
        where = (device, current_stream(device))
        buffers = self.kept.get(where)
        if buffers is None:
            buffers = self.kept[where] = tuple(torch.empty(s, dtype=self.dtype, device=device)
                                               for s in self.shapes)
        return buffers
