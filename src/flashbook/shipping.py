"""A student's functions sent to another process: ``cloudpickle``, by value (a notebook's
function cannot be imported by name in another process), with the notebook's cell sources.

The Pallas interpret-mode jobs (``pallas_interpret``), Chapter 8's ring of gloo workers and
``cpu_child`` run the student's code in a child process, and must still name the student's own
lines: the child's tracebacks, ``inspect.getsource`` (Triton compiles a kernel from it) and the
messages read them from ``linecache``, where IPython (and the tests) keep a cell's source under
its file name. So ``dumps`` sends those in-memory entries along, and ``loads`` puts them back
before it rebuilds the functions. A ``@triton.jit`` function is sent as the Python function it
wraps and jitted again in the child (its compile caches and locks do not pickle), so it is
compiled, or interpreted in CPU mode, as the child's Triton decides.
"""
from __future__ import annotations

import io
import linecache
import marshal
import pickle
import sys
import types

import cloudpickle

__all__ = ["dumps", "loads"]

_JIT_OPTIONS = ("do_not_specialize", "do_not_specialize_on_alignment", "debug", "noinline")


def _jit(fn, options: dict):
    import triton
    return triton.jit(fn, **options)


class _Pickler(cloudpickle.Pickler):
    def reducer_override(self, obj):
        if type(obj).__name__ in ("JITFunction", "InterpretedFunction") and \
                callable(getattr(obj, "fn", None)):
            options = {k: getattr(obj, k) for k in _JIT_OPTIONS if getattr(obj, k, None)}
            return _jit, (obj.fn, options)
        if isinstance(obj, types.CodeType):
            # cloudpickle (3.1) names every code object's file "<dynamic-code>"; marshal keeps
            # the student's file and lines (the child runs this same Python)
            return marshal.loads, (marshal.dumps(obj),)
        return super().reducer_override(obj)


def dumps(functions: dict) -> bytes:
    """{name: function} as bytes for ``loads``, with the in-memory sources in ``linecache``
    (no file behind them: notebook cells)."""
    cells = {k: v for k, v in linecache.cache.items() if len(v) == 4 and v[1] is None}
    # by value whatever module they come from: one made in memory (``sources.fresh_module``)
    # or a test's cannot be imported by name there
    made = {m for m in (sys.modules.get(getattr(f, "__module__", "")) for f in functions.values())
            if m is not None and m.__name__ != "__main__"}
    buffer = io.BytesIO()
    try:
        for m in made:
            cloudpickle.register_pickle_by_value(m)
        _Pickler(buffer).dump(functions)
    except (pickle.PicklingError, TypeError, AttributeError) as e:
        from flashbook.compare import CheckFailure
        raise CheckFailure(f"{', '.join(f'`{n}`' for n in functions)}: the check runs your code "
                           f"in a separate process, and something it uses cannot be sent there "
                           f"({type(e).__name__}: {e}). Pass such objects in as arguments, or "
                           f"create them inside the function.") from None
    finally:
        for m in made:
            cloudpickle.unregister_pickle_by_value(m)
    return pickle.dumps((cells, buffer.getvalue()))


def loads(data: bytes) -> dict:
    """The functions ``dumps`` sent, their sources in this process's ``linecache`` first."""
    cells, functions = pickle.loads(data)
    linecache.cache.update(cells)
    return pickle.loads(functions)
