"""The grading guard's half that runs INSIDE the student's kernel (see ``guard.py``).

The worker's setup cell loads this file by path, before any student code has run, under a module
name chosen at random per notebook; it is never imported by the grader itself. It then
* ``snapshot()``: records the pristine state the checks rely on: ``builtins``, the ``sys``
  streams and hooks, the import system, ``sys.modules``, the attributes (and the code of the
  Python functions) of the third-party modules the notebook imports (torch, numpy, ``torch.Tensor``,
  ``torch.testing``, ``numpy.testing`` ...), and IPython's error display and display hooks;
* before every graded test cell, ``enter()``: puts all of that back, then loads the checks' package
  (the grader's own, from its installed files; never a module the student can name or reach
  through ``sys.modules``) afresh, and returns the objects the test cell's names stand for;
* after the test cell's last line, ``done(token)``: writes the cell's secret token to the
  pristine stdout. The worker awards the cell's points only if the token is in the output and the
  cell raised nothing, so an exception that the student's code hides from IPython still fails.

This resists rebinding any name, attribute or ``sys.modules`` entry, and patching ``__code__`` of
functions, before the test cell runs. It cannot stop code that walks the interpreter (frames,
``gc``, ``ctypes``) while the check calls it: ``scan.py`` flags such code for the instructor.
"""
import builtins
import importlib
import importlib.util
import os
import sys
import types

_STATE = {}
_MISSING = object()
# IPython shell methods a submission could override (on the instance or its class) to hide errors
_SHELL_METHODS = ("showtraceback", "_showtraceback", "showsyntaxerror", "showindentationerror",
                  "run_cell", "run_cell_async", "_run_cell", "run_code", "run_ast_nodes",
                  "should_run_async", "transform_cell", "transform_ast", "get_exception_only",
                  "excepthook", "set_custom_exc", "_get_exc_info")
_SHELL_LISTS = ("input_transformers_cleanup", "input_transformers_post", "ast_transformers")
_SHELL_OBJECTS = ("displayhook", "display_pub", "display_trap", "builtin_trap", "InteractiveTB",
                  "SyntaxTB", "custom_exceptions", "CustomTB")
_CACHES = (dict, list, set)
_LOADING = []                       # non-empty while a fresh load runs         # module data that libraries may legitimately update


def _functions(d):
    """{name: (code, defaults, kwdefaults)} of the plain Python functions in ``d``."""
    return {k: (v.__code__, v.__defaults__, v.__kwdefaults__) for k, v in d.items()
            if isinstance(v, types.FunctionType)}


def _with_functions(saved):
    return saved, _functions(saved)


def _behaviour(v):
    return callable(v) or isinstance(v, (property, staticmethod, classmethod,
                                         types.GetSetDescriptorType, types.MemberDescriptorType))


def _shell():
    try:
        from IPython import get_ipython
        return get_ipython()
    except Exception:
        return None


def snapshot(packages, fresh_root, fresh_prefix, modules=(), classes=()):
    """Record the pristine state (run by the setup cell, before any student code)."""
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception:
            pass
    mods = [sys.modules[n] for n in modules if n in sys.modules]
    cls = {}
    for spec in classes:                        # "torch.Tensor"
        mod, _, attr = spec.rpartition(".")
        c = getattr(sys.modules.get(mod), attr, None)
        if isinstance(c, type):
            cls[c] = None                       # every behaviour key
    shell = _shell()
    if shell is not None:
        for c in type(shell).__mro__:
            if c is not object:
                cls.setdefault(c, _SHELL_METHODS)
    cls.setdefault(type(sys.stdout), None)
    _STATE.update(
        builtins=(dict(vars(builtins)), _functions(vars(builtins))),
        sys={k: getattr(sys, k) for k in ("stdout", "stderr", "stdin", "displayhook", "excepthook",
                                          "meta_path", "path_hooks", "path")},
        sys_lists={k: list(getattr(sys, k)) for k in ("meta_path", "path_hooks", "path")},
        importer_cache=dict(sys.path_importer_cache),
        sys_modules=dict(sys.modules),
        modules={m: _with_functions({k: v for k, v in vars(m).items()
                                     if not isinstance(v, _CACHES)}) for m in mods},
        classes={c: (*_with_functions({k: v for k, v in vars(c).items() if
                                       (keys is None and _behaviour(v)) or (keys and k in keys)}),
                     keys) for c, keys in cls.items()},
        streams=(sys.stdout, sys.stderr),
        shell=shell, packages=tuple(packages), fresh_root=fresh_root,
        fresh_prefix=fresh_prefix, import_module=importlib.import_module)
    if shell is not None:
        _STATE["shell_objects"] = {k: getattr(shell, k) for k in _SHELL_OBJECTS
                                   if hasattr(shell, k)}
        _STATE["shell_lists"] = {k: list(getattr(shell, k)) for k in _SHELL_LISTS
                                 if hasattr(shell, k)}


def _restore_code(saved, functions):
    for k, (code, defaults, kwdefaults) in functions.items():
        f = saved[k]
        if f.__code__ is not code:
            f.__code__ = code
        if f.__defaults__ is not defaults:
            f.__defaults__ = defaults
        if f.__kwdefaults__ is not kwdefaults:
            f.__kwdefaults__ = kwdefaults


def _restore_namespace(d, saved, functions):
    for k, v in saved.items():
        if d.get(k, _MISSING) is not v:
            d[k] = v
    _restore_code(saved, functions)


def _restore_class(c, saved, functions, keys):
    """Put back the class's methods (``keys``: only these; None: all); drop an added one that
    shadows a base class's."""
    current = vars(c)
    for k, v in saved.items():
        if current.get(k, _MISSING) is not v:
            try:
                type.__setattr__(c, k, v)
            except Exception:
                pass
    for k in [k for k in current if k not in saved and _behaviour(current[k])
              and (keys is None or k in keys)]:
        if any(k in vars(b) for b in c.__mro__[1:]):     # shadows a base class's method
            try:
                type.__delattr__(c, k)
            except Exception:
                pass
    _restore_code(saved, functions)


def restore():
    """Put back everything ``snapshot`` recorded."""
    s = _STATE
    _restore_namespace(vars(builtins), *s["builtins"])
    for k, v in s["sys"].items():
        if getattr(sys, k) is not v:
            setattr(sys, k, v)
    for k, v in s["sys_lists"].items():
        lst = getattr(sys, k)
        if lst != v:
            lst[:] = v
    cache = s["importer_cache"]
    for k, v in list(sys.path_importer_cache.items()):
        if k in cache and cache[k] is not v:
            sys.path_importer_cache[k] = cache[k]
    for k, v in s["sys_modules"].items():
        if k != "__main__" and sys.modules.get(k) is not v:
            sys.modules[k] = v
    for m, (saved, fns) in s["modules"].items():
        _restore_namespace(vars(m), saved, fns)
    for c, (saved, fns, keys) in s["classes"].items():
        _restore_class(c, saved, fns, keys)
    for stream in s["streams"]:            # an instance attribute over a method: drop it
        d = vars(stream)
        for k in [k for k in d if _behaviour(getattr(type(stream), k, None))]:
            del d[k]
    shell = s["shell"]
    if shell is not None:
        d = vars(shell)
        for k in _SHELL_METHODS:
            d.pop(k, None)
        for k, v in s["shell_objects"].items():
            if getattr(shell, k, _MISSING) is not v:
                try:
                    setattr(shell, k, v)
                except Exception:
                    pass
        for k, v in s["shell_lists"].items():
            lst = getattr(shell, k)
            if lst != v:
                lst[:] = v


def _ours(k):
    return any(k == p or k.startswith(p + ".") for p in _STATE["packages"])


class _FreshLoader:
    """Wraps a loader of the checks' package during a fresh load: the module it executes gets
    its own builtins, whose ``__import__`` resolves the checks' package to the fresh modules.
    (A function keeps the builtins of the module it was defined in, so an import inside a check,
    run long after the load, still finds the fresh modules, never the notebook's copies.)"""

    def __init__(self, loader, builtins_dict):
        self._loader, self._builtins = loader, builtins_dict

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        module.__dict__["__builtins__"] = self._builtins
        self._loader.exec_module(module)

    def __getattr__(self, name):            # get_source, get_code, is_package ...
        return getattr(self._loader, name)


class _FreshFinder:
    """On ``sys.meta_path`` while a fresh load runs: finds the checks' modules as usual and
    wraps their loaders in ``_FreshLoader``."""

    def __init__(self, builtins_dict):
        self._builtins = builtins_dict

    def find_spec(self, name, path=None, target=None):
        if not _ours(name):
            return None
        for finder in _STATE["sys_lists"]["meta_path"]:
            find = getattr(finder, "find_spec", None)
            spec = find(name, path, target) if find else None
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _FreshLoader(spec.loader, self._builtins)
                return spec
        return None


def _fresh_builtins(registry):
    """Builtins for the fresh modules: pristine, with an ``__import__`` that hands out (and loads
    on first use) fresh modules of the checks' package from ``registry``."""
    pristine = _STATE["builtins"][0]
    plain_import = pristine["__import__"]
    d = dict(pristine)

    def fresh_import(name, globals=None, locals=None, fromlist=(), level=0):
        if _LOADING:                    # sys.modules is the fresh view already
            return plain_import(name, globals, locals, fromlist, level)
        package = (globals or {}).get("__package__") or ""
        absolute = importlib.util.resolve_name("." * level + name, package) if level else name
        if not _ours(absolute):
            return plain_import(name, globals, locals, fromlist, level)
        wanted = [absolute] + [f"{absolute}.{a}" for a in fromlist or () if a != "*"
                               and _is_module(f"{absolute}.{a}")]
        _load_fresh([m for m in wanted if m not in registry], registry, d)
        if fromlist:
            return registry[absolute]
        return registry[absolute.partition(".")[0]] if not level else registry[absolute]

    d["__import__"] = fresh_import
    return d


def _load_fresh(module_names, registry, builtins_dict):
    """Import ``module_names`` with ``sys.modules`` holding only ``registry``'s modules of the
    checks' package (what the student's code had, or can name, is put back after); add what was
    loaded to ``registry``."""
    if not module_names:
        return
    s = _STATE
    saved = {k: v for k, v in sys.modules.items() if _ours(k)}
    path, meta = list(sys.path), list(sys.meta_path)
    for k in saved:
        del sys.modules[k]
    sys.modules.update(registry)
    # the installed package first: never a flashbook.py the submission put in its work dir
    sys.path[:] = [s["fresh_root"]] + [p for p in s["sys_lists"]["path"]
                                       if p not in ("", ".") and p != s["fresh_root"]]
    sys.meta_path[:] = [_FreshFinder(builtins_dict)] + s["sys_lists"]["meta_path"]
    _LOADING.append(True)
    try:
        for name in module_names:
            s["import_module"](name)
        fresh = {k: v for k, v in sys.modules.items() if _ours(k)}
    finally:
        _LOADING.pop()
        for k in [k for k in sys.modules if _ours(k)]:
            del sys.modules[k]
        sys.modules.update(saved)
        sys.path[:], sys.meta_path[:] = path, meta
    for k, m in fresh.items():
        f = getattr(m, "__file__", None) or ""
        if not f.startswith(s["fresh_prefix"]):
            raise ImportError(f"the grader's check module {k} did not come from its installed "
                              f"files ({f!r})")
    registry.update(fresh)


def _fresh(module_names):
    """Load the checks' packages afresh from their installed files: new module objects that are
    not in ``sys.modules`` (what the student's code had, or can name, stays as it was). Imports
    that these modules run later, inside their functions, get fresh modules too."""
    registry = {}
    _load_fresh(module_names, registry, _fresh_builtins(registry))
    return registry


def _is_module(name):
    """Whether ``name`` is a module of the checks' packages (``from pkg import x`` also names
    attributes)."""
    base = os.path.join(_STATE["fresh_root"], *name.split("."))
    return os.path.isdir(base) or os.path.exists(base + ".py")


def enter(bindings):
    """Restore the pristine state; return {name: object} for the test cell.

    ``bindings``: {name: (module, attribute or None)} from the instructor's import statements;
    modules of the checks' packages are loaded afresh, others are the pristine modules.
    """
    restore()
    s = _STATE
    wanted = []
    for mod, attr in bindings.values():
        if _ours(mod):
            wanted += [mod] + ([f"{mod}.{attr}"] if attr and _is_module(f"{mod}.{attr}") else [])
    fresh = _fresh(list(dict.fromkeys(wanted))) if wanted else {}
    out = {}
    for name, (mod, attr) in bindings.items():
        if _ours(mod):
            m = fresh[mod]
            out[name] = (fresh.get(f"{mod}.{attr}") or getattr(m, attr)) if attr else m
        else:
            m = s["sys_modules"].get(mod) or sys.modules.get(mod) or s["import_module"](mod)
            if attr:
                sub = s["sys_modules"].get(f"{mod}.{attr}") or sys.modules.get(f"{mod}.{attr}")
                out[name] = sub if sub is not None else getattr(m, attr)
            else:
                out[name] = m
    return out


def done(token):
    """The test cell reached its end: say so (on the pristine stdout)."""
    restore()
    out = _STATE["sys"]["stdout"]
    out.write(f"\n{token}\n")
    out.flush()
