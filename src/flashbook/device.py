"""Device detection and the CPU fallback (introduced in Chapter 1).

``setup()`` is the first code cell of every chapter. It must run before triton or
numba are imported: with no GPU it sets ``TRITON_INTERPRET=1`` and
``NUMBA_ENABLE_CUDASIM=1``, which both libraries read once, at import time. It also prints
the versions of the packages the chapter needs next to the minimums (``versions``).
"""
from __future__ import annotations

import dataclasses
import os
import sys

from . import versions

_CPU_ENV = {"TRITON_INTERPRET": "1", "NUMBA_ENABLE_CUDASIM": "1"}
_MODULE_ENV = {"triton": "TRITON_INTERPRET", "numba": "NUMBA_ENABLE_CUDASIM"}   # read at import


@dataclasses.dataclass(frozen=True)
class Sizes:
    """Problem sizes a chapter uses by default on this backend."""
    B: int
    H: int
    N: int          # sequence length for correctness runs
    d: int          # head dimension
    bench_N: tuple  # sequence lengths swept by benchmark cells


CPU_SIZES = Sizes(B=1, H=2, N=64, d=16, bench_N=(128, 256, 512, 1024))
GPU_SIZES = Sizes(B=4, H=16, N=1024, d=64, bench_N=(512, 1024, 2048, 4096, 8192, 16384))


@dataclasses.dataclass(frozen=True)
class Backend:
    """What this runtime can do; returned by ``setup()``."""
    gpu: bool
    name: str                      # "Tesla T4" or "CPU"
    capability: tuple | None       # (7, 5) on a T4; None on CPU
    sizes: Sizes
    restart_needed: bool = False   # triton/numba were imported before setup() on a CPU runtime

    @property
    def device(self) -> str:
        return "cuda" if self.gpu else "cpu"

    @property
    def kind(self) -> str:
        return "CUDA" if self.gpu else "Triton interpreter + Numba CUDA simulator"

    def banner(self) -> str:
        cc = f" (sm_{self.capability[0]}{self.capability[1]})" if self.capability else ""
        return f"flashbook | device: {self.name}{cc} | backend: {self.kind}"


_current: Backend | None = None


def _detect_gpu():
    """(name, capability) of GPU 0, or None. Uses torch, which does not import triton."""
    if os.environ.get("FLASHBOOK_FORCE_CPU") == "1":
        return None
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a hard dependency
        return None
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0)


def _index_scalars_of_shape_one() -> None:
    """Triton 3.6's interpreter keeps a loaded scalar as a NumPy array of shape (1,) and turns
    it into a Python int with ``int(array)``, which NumPy 2.4 refuses ("only 0-dimensional
    arrays ..."): every ``range(lo, hi)`` over a loaded sequence length fails. Later Triton
    squeezes the array first; do the same on the interpreter's patched ``tl.tensor``."""
    from triton.runtime import interpreter
    patch = getattr(interpreter, "_patch_lang_tensor", None)
    if patch is None or getattr(patch, "flashbook_squeezes", False):
        return

    def patch_lang_tensor(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patch_lang_tensor.flashbook_squeezes = True
    interpreter._patch_lang_tensor = patch_lang_tensor


def _patch_language_once_per_launch() -> None:
    """Triton's interpreter patches ``triton.language`` for a launch (``GridExecutor``), and
    again at every call of a ``@triton.jit`` helper from the kernel: an ``inspect.getmembers``
    over the language modules, about 0.7 ms a call, a quarter of a CPU-mode check whose kernels
    call helpers in their loops. The launch has patched those modules already and restores them
    when it ends, so a helper whose language modules are all patched, and not yet restored,
    skips the second patching (which would find every builtin already replaced: the same state
    either way)."""
    from triton.runtime import interpreter
    import triton.language as tl
    patch = getattr(interpreter, "_patch_lang", None)
    scope_type = getattr(interpreter, "_LangPatchScope", None)
    if patch is None or scope_type is None or getattr(patch, "flashbook_once", False):
        return
    patched: set = set()        # ids of the language modules patched by scopes not yet restored

    def patch_lang(fn):
        langs = {id(v) for v in fn.__globals__.values() if v is tl or v is tl.core}
        if langs and langs <= patched:
            return scope_type()                         # nothing patched, nothing to restore
        scope = patch(fn)
        added = langs - patched
        patched.update(added)
        restore = scope.restore

        def restore_and_forget():
            restore()
            patched.difference_update(added)
        scope.restore = restore_and_forget
        return scope

    patch_lang.flashbook_once = True
    interpreter._patch_lang = patch_lang


def _no_overflow_asserts() -> None:
    """Triton's interpreter redoes every 32-bit integer add, subtract and multiply in int64 and
    compares it with the int32 range, for an overflow assert that it then drops unless
    ``debug`` is on (``semantic.device_assert``): work whose result is never read, over a third
    of a CPU-mode check's time (Chapter 5's two-tile check: 7.5 s -> 4.4 s). With ``debug`` off
    it is skipped, which changes no result (a GPU build without ``debug=True`` checks nothing
    either)."""
    import dataclasses
    from triton.runtime import interpreter
    builder = getattr(interpreter, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if options is not None and options.sanitize_overflow and not options.debug:
        builder.options = dataclasses.replace(options, sanitize_overflow=False)


def setup(verbose: bool = True, needs=versions.DEFAULT_NEEDS) -> Backend:
    """Detect the device, configure CPU mode if needed, print a one-line banner and a line of
    the installed versions of ``needs`` (package names of ``versions.MINIMUM``: what the chapter
    needs) against their minimums, with a warning for each that is missing or older.

    Set ``FLASHBOOK_FORCE_CPU=1`` to use CPU mode on a GPU machine (what CI does).
    """
    global _current
    import numpy as np
    if not hasattr(np, "row_stack"):   # numpy 2.5 removed it; numba-cuda 0.30 still calls it
        np.row_stack = np.vstack
    gpu = _detect_gpu()
    restart = False
    if gpu is None:
        # imported before CPU mode was on: the variable (its name, not its value) was not "1"
        stale = [m for m, var in _MODULE_ENV.items()
                 if m in sys.modules and os.environ.get(var) != _CPU_ENV[var]]
        os.environ.update(_CPU_ENV)
        _index_scalars_of_shape_one()
        _patch_language_once_per_launch()
        _no_overflow_asserts()
        restart = bool(stale)
        backend = Backend(False, "CPU", None, CPU_SIZES, restart)
    else:
        name, cc = gpu
        backend = Backend(True, name, tuple(cc), GPU_SIZES)
    _current = backend
    if verbose:
        print(backend.banner())
        line, warnings = versions.report(needs)
        print(line)
        for warning in warnings:
            print(warning)
        if restart:
            print(f"WARNING: {', '.join(stale)} was imported before flashbook.setup(), so it "
                  "cannot switch to CPU mode. Restart the runtime (Runtime > Restart session) "
                  "and run this cell first.")
    return backend


def current() -> Backend:
    """The backend chosen by the last ``setup()`` call (runs it quietly if needed)."""
    return _current if _current is not None else setup(verbose=False)
