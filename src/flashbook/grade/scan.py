"""Flag tampering: a static scan of a submission's own code (outside the kernel, before it runs).

Looks for what an honest answer has no use for: the grading machinery (rebinding a module's
attributes such as ``ch1.check_softmax = ...`` or ``torch.Tensor.any = ...``, the names the
test cells use, ``sys.modules``, ``builtins``, ``importlib``, IPython's shell) and dynamic or
hidden code (``exec`` / ``eval`` / ``compile``, ``__import__``, ``ctypes``, ``gc``, frame and
code-object introspection, encoded blobs). Uses ``ast`` where the cell parses (IPython magics
blanked first), else regular expressions. A flag is for the instructor to review: the submission
is graded as usual (the guard, ``guard.py``, keeps the checks out of reach in any case).
"""
from __future__ import annotations

import ast
import re

from . import cellmeta
from .record import Flag

# modules an answer has no business importing or touching
_MODULES = {
    "importlib": "imports importlib (loads or reloads modules by hand)",
    "builtins": "uses the builtins module (can replace print, assert's exceptions ...)",
    "ctypes": "uses ctypes (raw memory access)",
    "gc": "uses gc (can find any object, e.g. the grader's)",
    "inspect": "uses inspect (frame and source introspection)",
    "linecache": "uses linecache (reads the source of other cells)",
    "IPython": "uses IPython's shell (error display, hooks, transformers)",
    "ipykernel": "uses ipykernel internals",
    "marshal": "uses marshal (hidden code objects)",
    "pickle": "uses pickle (hidden code)",
    "base64": "decodes base64 (hidden code)",
    "codecs": "uses codecs (hidden code)",
    "zlib": "decompresses data (hidden code)",
    "unittest": "uses unittest.mock (patching)",
}
_CALLS = {"exec": "calls exec() (runs code from a string)",
          "eval": "calls eval() (runs code from a string)",
          "compile": "calls compile() (builds code from a string)",
          "__import__": "calls __import__()",
          "setattr": "calls setattr() (can rebind module attributes)",
          "delattr": "calls delattr()",
          "globals": "calls globals() (reaches the notebook's namespace by hand)",
          "vars": "calls vars()",
          "get_ipython": "calls get_ipython() (the shell: error display, hooks)",
          "breakpoint": "calls breakpoint()"}
_SYS = {"modules": "touches sys.modules (the loaded modules, where the checks live)",
        "meta_path": "touches sys.meta_path (import hooks)",
        "path_hooks": "touches sys.path_hooks (import hooks)",
        "path_importer_cache": "touches sys.path_importer_cache",
        "_getframe": "uses sys._getframe (reads its callers' frames)",
        "settrace": "uses sys.settrace", "setprofile": "uses sys.setprofile",
        "excepthook": "touches sys.excepthook", "displayhook": "touches sys.displayhook",
        "stdout": None, "stderr": None}            # None: only assigning is flagged
_DUNDER = {"__code__", "__globals__", "__builtins__", "__closure__", "__subclasses__",
           "__bases__", "__mro__", "__defaults__", "__kwdefaults__", "__dict__", "__class__",
           "f_globals", "f_locals", "f_back", "f_builtins", "tb_frame", "gi_frame", "cr_frame",
           "co_consts", "__loader__", "__spec__"}
# names whose rebinding changes what a check (or its error reporting) does
_PROTECTED = {"print", "display", "AssertionError", "Exception", "BaseException", "isinstance",
              "issubclass", "getattr", "hasattr", "callable", "__import__", "globals", "exec",
              "eval", "compile", "__builtins__", "get_ipython", "__name__"}
_BLOB = re.compile(r"^[A-Za-z0-9+/=_\-\s]{160,}$")
_HEX = re.compile(r"^(?:\\x)?[0-9a-fA-F\s\\x]{160,}$")
_REGEX = [(re.compile(p), what) for p, what in (
    (r"\bsys\s*\.\s*modules\b", _SYS["modules"]),
    (r"\bsys\s*\.\s*_getframe\b", _SYS["_getframe"]),
    (r"\bsys\s*\.\s*meta_path\b", _SYS["meta_path"]),
    (r"\b__import__\b", _CALLS["__import__"]),
    (r"\bimportlib\b", _MODULES["importlib"]),
    (r"\bbuiltins\b", _MODULES["builtins"]),
    (r"\bget_ipython\b", _CALLS["get_ipython"]),
    (r"\b(?:exec|eval|compile)\s*\(", "calls exec/eval/compile (runs code from a string)"),
    (r"\bctypes\b", _MODULES["ctypes"]),
    (r"\b(?:set|del)attr\s*\(", _CALLS["setattr"]),
    (r"__(?:code|globals|closure|subclasses)__", "touches code objects / function internals"),
    (r"\bcheck_\w+\s*=", "assigns a name of a check function"),
)]


def _root(node):
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.value if not isinstance(node, ast.Call) else node.func
    return node.id if isinstance(node, ast.Name) else None


def _dotted(node) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def _module_flag(name: str, package: str) -> str | None:
    parts = name.split(".")
    if parts[0] in _MODULES:
        return _MODULES[parts[0]]
    if parts[0] == package and parts[1:2] == ["grade"]:
        return f"imports the grader ({name})"
    if parts[0] == package and parts[1:2] == ["kernels"]:
        return f"imports the book's solved kernels ({name}): answers to Chapters 3-4"
    return None


def scan_source(source: str, modules: set[str],
                package: str = "flashbook") -> list[tuple[int, str]]:
    """[(line, what)] found in one cell's ``source``; ``modules``: names bound to modules by the
    notebook's own imports (``ch1``, ``fb``, ``torch`` ...)."""
    clean = "\n".join("" if line.lstrip().startswith(("%", "!")) else line
                      for line in source.splitlines())
    try:
        tree = ast.parse(clean)
    except SyntaxError:
        return _scan_regex(source)
    found: list[tuple[int, str]] = []
    mods = set(modules) | {"sys"}
    for node in ast.walk(tree):            # names this cell binds to modules
        if isinstance(node, ast.Import):
            mods |= {a.asname or a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            mods |= {a.asname or a.name for a in node.names
                     if node.module.split(".")[0] in (package, "torch", "numpy", "triton",
                                                      "numba", "math")}

    def add(node, what):
        found.append((getattr(node, "lineno", 0), what))

    def target_flags(t, verb):
        if isinstance(t, (ast.Tuple, ast.List)):
            for e in t.elts:
                target_flags(e, verb)
        elif isinstance(t, ast.Starred):
            target_flags(t.value, verb)
        elif isinstance(t, ast.Attribute):
            root = _root(t)
            if root in mods:
                add(t, f"{verb} an attribute of a module: {_dotted(t)}")
            elif t.attr in _DUNDER:
                add(t, f"{verb} {t.attr}")
        elif isinstance(t, ast.Subscript):
            root = _root(t)
            if root in mods or root in ("__builtins__",):
                add(t, f"{verb} an item of {_dotted(t.value) or root}")
        elif isinstance(t, ast.Name) and (t.id in _PROTECTED or t.id in modules):
            add(t, f"{verb} {t.id!r}, which the checks or their error reports use")

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if (what := _module_flag(a.name, package)):
                    add(node, what)
        elif isinstance(node, ast.ImportFrom) and node.module:
            if (what := _module_flag(node.module, package)):
                add(node, what)
            elif node.module == "sys" and any(a.name in _SYS and _SYS[a.name] for a in node.names):
                add(node, "imports sys internals: " + ", ".join(a.name for a in node.names))
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                target_flags(t, "rebinds")
        elif isinstance(node, ast.Delete):
            for t in node.targets:
                target_flags(t, "deletes")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if node.name in _PROTECTED or node.name in modules:
                add(node, f"defines {node.name!r}, which the checks or their error reports use")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id in _CALLS:
            add(node, _CALLS[node.func.id])
        elif isinstance(node, ast.Attribute):
            if isinstance(node.value, ast.Name) and node.value.id == "sys" and \
                    _SYS.get(node.attr):
                add(node, _SYS[node.attr])
            elif node.attr in _DUNDER and node.attr not in ("__dict__", "__class__"):
                add(node, f"touches {node.attr} (function / frame internals)")
            elif isinstance(node.ctx, ast.Load) and node.attr == "__dict__" and \
                    _root(node) in mods:
                add(node, f"reads a module's namespace: {_dotted(node)}")
        elif isinstance(node, ast.Name) and node.id in ("__builtins__",):
            add(node, "touches __builtins__")
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and \
                node.id in ("exec", "eval", "compile", "__import__", "get_ipython"):
            add(node, f"refers to {node.id}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, (str, bytes)):
            text = node.value if isinstance(node.value, str) else node.value.decode("latin-1")
            if len(text) >= 160 and (_BLOB.match(text) or _HEX.match(text)) and \
                    len(set(text)) > 10:
                add(node, f"holds an encoded blob ({len(text)} characters)")
            elif isinstance(node.value, str) and any(
                    w in text for w in ("sys.modules", "_flashbook_guard", "kernel_guard")):
                add(node, "a string names the grading machinery")
    return sorted(set(found))


def _scan_regex(source: str) -> list[tuple[int, str]]:
    found = []
    for n, line in enumerate(source.splitlines(), 1):
        code = line.split("#", 1)[0]
        for pattern, what in _REGEX:
            if pattern.search(code):
                found.append((n, what))
        for word in re.findall(r"[A-Za-z0-9+/=]{160,}", code):
            found.append((n, f"holds an encoded blob ({len(word)} characters)"))
    return sorted(set(found))


def student_cells(nb, release):
    """(label, cell) for the code the student wrote: answer cells, and cells that are not the
    release's (added or edited); test and locked cells are the instructor's."""
    released = {c.source for c in release.cells if c.cell_type == "code"}
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        gid = cellmeta.grade_id(cell)
        if gid and not cellmeta.is_solution(cell):
            continue                       # replaced by the instructor's source
        if not gid and cell.source in released:
            continue
        yield gid or f"cell {i + 1}", cell


def scan(nb, release, modules: set[str], package: str = "flashbook") -> tuple[Flag, ...]:
    """Every flag of the (repaired) submission ``nb``."""
    flags = []
    for label, cell in student_cells(nb, release):
        for line, what in scan_source(cell.source, modules, package):
            flags.append(Flag(label, line, what))
    return tuple(flags)
