"""Functions sent to another process as source text.

A notebook's function cannot be pickled by reference (its module is ``__main__``), and a check
that runs it in a child process (Chapter 6's Pallas interpreter harness, Chapter 8's ring of
gloo workers) must still report errors at the student's own lines. So the parent ships
(``ship``) the function's source, the file and line it starts at, and what it uses from its
globals: modules as import statements, constants by value, importable callables by name, helper
functions by their own source. The child rebuilds them (``rebuild``) in one fresh module, with
the source in ``linecache`` so tracebacks quote it.

Only the standard library is imported here: children import this module without torch and
without the package's ``__init__``.
"""
from __future__ import annotations

import ast
import dataclasses
import inspect
import linecache
import math
import sys
import textwrap
import types
from typing import Callable, Iterable, Sequence

__all__ = ["Shipped", "ship", "to_json", "from_json", "all_shipped", "student_globals", "load",
           "rebuild", "STUDENT_MODULE"]

STUDENT_MODULE = "__flashbook_student__"      # the module the child rebuilds functions in


@dataclasses.dataclass(frozen=True)
class Shipped:
    """One function as the child rebuilds it: its source, where it came from (so that line
    numbers in reports are the student's), and what it needs from its globals."""
    name: str            # the name the receiver gets it as
    defines: str         # the name its ``def`` binds
    source: str
    filename: str
    firstlineno: int
    prelude: tuple[str, ...]   # import statements and constants, run before it
    helpers: tuple["Shipped", ...] = ()

    def line(self, lineno: int) -> str | None:
        i = lineno - self.firstlineno
        lines = self.source.splitlines()
        return lines[i].strip() if 0 <= i < len(lines) else None


def _fail(message: str):
    from flashbook.compare import CheckFailure     # the parent only: it imports torch
    raise CheckFailure(message)


def _code_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_names(const)
    return names


def _value_source(value) -> str | None:
    """An expression that rebuilds ``value`` in another process: Python literals, non-finite
    floats, NumPy scalars and (small) arrays; None for anything else."""
    if isinstance(value, float) and not math.isfinite(value):
        return f"float({str(value)!r})"
    if type(value).__module__ == "numpy":
        import numpy
        if isinstance(value, numpy.generic):
            return f"__import__('numpy').{value.dtype.name}({value.item()!r})"
        if isinstance(value, numpy.ndarray) and value.size <= 65536 and value.dtype.kind in "biuf":
            return f"__import__('numpy').asarray({value.tolist()!r}, dtype={str(value.dtype)!r})"
        return None
    try:
        text = repr(value)
        return text if ast.literal_eval(text) == value else None
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return None


def _importable(obj) -> str | None:
    """'from mod import qualname' when ``obj`` can be imported by name in another process."""
    mod, qual = getattr(obj, "__module__", None), getattr(obj, "__qualname__", "")
    if not mod or "<" in qual or mod == "__main__":
        return None
    m = sys.modules.get(mod)
    if m is None or getattr(m, "__spec__", None) is None or mod.startswith(STUDENT_MODULE):
        return None
    if "." in qual or getattr(m, qual, None) is not obj:
        return None
    return f"from {mod} import {qual}"


def _is_jit(obj) -> bool:
    """A ``@triton.jit`` function, compiled or interpreted (told by its type's name: this
    module imports no triton)."""
    return type(obj).__name__ in ("JITFunction", "InterpretedFunction") and \
        callable(getattr(obj, "fn", None))


def ship(fn: Callable, name: str, _seen: set | None = None) -> Shipped:
    """The source of ``fn`` and what it uses from its globals, for the child to rebuild.
    A ``@triton.jit`` function ships with its decorator (the child imports triton for it) and
    its jit helpers. Raises CheckFailure when there is no source text to ship."""
    _seen = set() if _seen is None else _seen
    jit = _is_jit(fn)
    if jit:
        _seen.add(id(fn))
        fn = fn.fn                                    # the Python function it compiles
    fn = inspect.unwrap(fn)
    code = getattr(fn, "__code__", None)
    if code is None or fn.__name__ == "<lambda>":
        _fail(f"`{name}` must be a function defined with `def` (the check runs it from its "
              f"source text in a separate process), got {type(fn).__name__}.")
    try:
        source = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError):
        _fail(f"`{name}`: its source text cannot be read (inspect.getsource failed). Define it "
              "in a notebook cell or a .py file: the check runs it from its source in a "
              "separate process.")
    globs = dict(fn.__globals__)
    if fn.__closure__:
        for var, cell in zip(code.co_freevars, fn.__closure__):
            try:
                globs[var] = cell.cell_contents
            except ValueError:
                pass
    prelude, helpers = (["import triton"] if jit else []), []
    _seen.add(id(fn))
    for g in sorted(_code_names(code) | set(code.co_freevars)):
        if g not in globs or g == fn.__name__:
            continue
        value = globs[g]
        if isinstance(value, types.ModuleType):
            prelude.append(f"import {value.__name__} as {g}")
        elif (expr := _value_source(value)) is not None:
            prelude.append(f"{g} = {expr}")
        elif callable(value) and (imp := _importable(value)):
            prelude.append(f"{imp} as {g}")
        elif (isinstance(value, types.FunctionType) or _is_jit(value)) and \
                id(value) not in _seen:
            helpers.append(ship(value, g, _seen))
        # anything else (other objects): not shipped; using it fails in the child with a
        # NameError, which the caller's report explains
    return Shipped(name=name, defines=fn.__name__, source=source, filename=code.co_filename,
                   firstlineno=code.co_firstlineno, prelude=tuple(prelude),
                   helpers=tuple(helpers))


def to_json(s: Shipped) -> dict:
    d = dataclasses.asdict(s)
    d["helpers"] = [to_json(h) for h in s.helpers]
    return d


def from_json(d: dict) -> Shipped:
    return Shipped(**{**d, "prelude": tuple(d["prelude"]),
                      "helpers": tuple(from_json(h) for h in d["helpers"])})


def all_shipped(shipped: Sequence[Shipped]):
    """Every shipped function, helpers included (depth first)."""
    for s in shipped:
        yield s
        yield from all_shipped(s.helpers)


# ------------------------------------------------------------------------- the child side

def student_globals(defaults: Iterable[str] = ()) -> dict:
    """The globals of a fresh ``STUDENT_MODULE`` (registered in ``sys.modules``, so pickling
    and ``inspect`` find it), after running the statements ``defaults``."""
    module = types.ModuleType(STUDENT_MODULE)
    sys.modules[STUDENT_MODULE] = module
    g = module.__dict__
    for stmt in defaults:
        exec(stmt, g)
    return g


def load(s: Shipped, g: dict):
    """Define ``s`` in the globals ``g`` (its helpers and prelude first) at its own file and
    line numbers; returns the function."""
    for h in s.helpers:
        load(h, g)
    for stmt in s.prelude:
        exec(stmt, g)
    # one file (a notebook cell) may hold several shipped functions: each fills in its own
    # lines of the cached text (Triton reads a kernel's source lazily, at its first compile)
    lines = list(linecache.cache.get(s.filename, (0, None, [], s.filename))[2])
    body = s.source.splitlines(True)
    lines += ["\n"] * max(0, s.firstlineno - 1 + len(body) - len(lines))
    lines[s.firstlineno - 1:s.firstlineno - 1 + len(body)] = body
    linecache.cache[s.filename] = (0, None, lines, s.filename)
    exec(compile("\n" * (s.firstlineno - 1) + s.source, s.filename, "exec"), g)
    g[s.name] = g[s.defines]          # a helper may be known by another name
    return g[s.defines]


def rebuild(shipped: Sequence[Shipped], defaults: Iterable[str] = ()) -> dict:
    """{name: function} of every shipped function, rebuilt in one fresh module."""
    g = student_globals(defaults)
    return {s.name: load(s, g) for s in shipped}
