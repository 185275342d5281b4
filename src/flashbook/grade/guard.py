"""Checks out of the student's reach: the worker's half of the grading guard.

Every graded test cell runs in the same interpreter as the student's code, so anything a test
cell calls by a name the student can reach (``ch1.check_softmax``, ``sys.modules[...]``,
``torch.Tensor.any``, ``print``, IPython's error display) is the student's to rebind. The guard
(``kernel_guard.py`` runs inside the kernel) makes the grade independent of all of that:

1. A setup cell, put before the notebook's first cell (so before any student code), loads
   ``kernel_guard.py`` by path under a random module name and snapshots the pristine state:
   builtins, ``sys`` hooks and the import system, the notebook's third-party modules and
   ``torch.Tensor`` (attributes and the code of their Python functions), IPython's display.
2. Each graded test cell is rewritten: its (instructor's) source becomes the body of a function
   whose parameters are the names it uses that the instructor's import statements bind
   (``fb``, ``ch1``, ``torch`` ...). The function is called with ``enter(...)``, which restores
   the snapshot and loads the checks' package afresh from its installed files, as modules that
   are in no ``sys.modules`` and no namespace the student's code sees. The student's functions
   still find their own globals; the check they are handed to is one they never could name.
3. After the body's last line, ``done(token)`` prints a per-cell secret token (chosen here, at
   random). The cell earns points only if it raised nothing AND printed its token: an exception
   that the student's code hides from IPython (showtraceback, custom exception handlers ...)
   leaves no error output, but no token either.

The worker afterwards puts back the instructor's source, strips the token and removes the
setup cell, so the graded notebook reads as before. Code that walks the interpreter (frames,
``gc``, ``ctypes``, import hooks) can still reach anything in-process: ``scan.py`` flags it.
"""
from __future__ import annotations

import ast
import dataclasses
import secrets
import textwrap
from pathlib import Path

from . import cellmeta

KERNEL_FILE = Path(__file__).with_name("kernel_guard.py")
PACKAGE = __name__.split(".")[0]                    # the checks' package: loaded afresh
PACKAGE_DIR = Path(__file__).resolve().parents[1]   # .../flashbook
# third-party state the checks rely on (snapshotted when the notebook imports them)
SNAPSHOT_MODULES = {"torch": ("torch", "torch.nn.functional", "torch.testing", "torch.linalg",
                              "numpy", "numpy.testing"),
                    "numpy": ("numpy", "numpy.testing")}
SNAPSHOT_CLASSES = {"torch": ("torch.Tensor",)}
NOT_CONFIRMED = ("the test cell did not confirm that its checks ran to the end (no error was "
                 "shown, but the cell's completion token is missing): was the error display or "
                 "stdout changed?")


def imports(nb) -> dict[str, tuple[str, str | None]]:
    """{name: (module, attribute or None)} that the instructor's own (not solution) code cells
    bind with top-level import statements."""
    names: dict[str, tuple[str, str | None]] = {}
    for cell in nb.cells:
        if cell.cell_type != "code" or cellmeta.is_solution(cell):
            continue
        try:
            tree = ast.parse(cell.source)
        except SyntaxError:
            continue
        for node in tree.body:
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.asname:
                        names[a.asname] = (a.name, None)
                    else:
                        top = a.name.split(".")[0]
                        names[top] = (top, None)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                for a in node.names:
                    if a.name != "*":
                        names[a.asname or a.name] = (node.module, a.name)
    return names


def _used_names(tree) -> set[str]:
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}


_UNWRAPPABLE = (ast.Global, ast.Nonlocal, ast.Return, ast.Yield, ast.YieldFrom, ast.Await)


@dataclasses.dataclass
class Plan:
    """What the worker did to one notebook, to check and undo after running it."""
    module: str                               # the guard's random module name in the kernel
    tokens: dict[int, str]                    # cell index (without the setup cell) -> token
    sources: dict[int, str]                   # cell index -> the instructor's source


GPU_SHARE_ENV = "FLASHBOOK_GPU_MEMORY_SHARE"   # set by autograde when workers share a GPU

# Workers that share a GPU cap their kernel's CUDA memory to their share before student code runs.
_GPU_SHARE = f"""\
        import os as _os
        if _os.environ.get({GPU_SHARE_ENV!r}):
            import torch as _torch
            _torch.cuda.set_per_process_memory_fraction(float(_os.environ[{GPU_SHARE_ENV!r}]))
            del _torch
        del _os
"""


def setup_source(module: str, bindings: dict) -> str:
    """The setup cell: load the kernel guard by path, snapshot the pristine state."""
    tops = {m.split(".")[0] for m, _ in bindings.values()}
    if PACKAGE in tops:                       # the checks import torch and numpy
        tops |= {"torch", "numpy"}
    mods = sorted({m for t in tops for m in SNAPSHOT_MODULES.get(t, ())}
                  | {m for m, _ in bindings.values() if m.split(".")[0] in ("math",)})
    classes = sorted({c for t in tops for c in SNAPSHOT_CLASSES.get(t, ())})
    return textwrap.dedent(f"""\
        # flashbook grading guard: set up before any student code runs
        def _flashbook_guard_setup():
            import importlib.util, sys
            spec = importlib.util.spec_from_file_location({module!r}, {str(KERNEL_FILE)!r})
            m = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(m)
            sys.modules[{module!r}] = m
            m.snapshot({(PACKAGE,)!r}, {str(PACKAGE_DIR.parent)!r}, {str(PACKAGE_DIR)!r},
                       modules={tuple(mods)!r}, classes={tuple(classes)!r})
        _flashbook_guard_setup()
        del _flashbook_guard_setup
        """) + textwrap.dedent(_GPU_SHARE)


def guarded_source(source: str, module: str, token: str, bindings: dict) -> str:
    """The test cell ``source`` run against pristine objects, ending with its token."""
    enter = f"__import__('sys').modules[{module!r}]"
    try:
        tree = ast.parse(source)
    except SyntaxError:
        tree = None
    used = sorted(_used_names(tree) & set(bindings)) if tree else []
    args = {n: bindings[n] for n in used}
    fn = "_flashbook_test_" + "".join(ch for ch in token if ch.isalnum())[-8:]
    body = source
    wrappable = tree is not None and tree.body and \
        not any(isinstance(n, _UNWRAPPABLE) for n in ast.walk(tree)) and \
        not any(isinstance(n, ast.ImportFrom) and any(a.name == "*" for a in n.names)
                for n in ast.walk(tree))
    if wrappable:
        last = tree.body[-1]
        lines = source.splitlines()
        if isinstance(last, ast.Expr):         # keep the value: a number is partial credit
            i, col = last.lineno - 1, last.col_offset
            lines[i] = lines[i][:col] + "return " + lines[i][col:]
        body = "\n".join(lines)
        wrapped = f"def {fn}({', '.join(used)}):\n" + textwrap.indent(body, "    ") + "\n"
        try:               # the same statements (a multi-line string would differ): else fall back
            inner = ast.parse(wrapped).body[0].body
            same = ast.dump(ast.Module(inner[:-1] + [ast.Expr(inner[-1].value)]
                                       if isinstance(last, ast.Expr) else inner, []),
                            include_attributes=False) == ast.dump(tree, include_attributes=False)
        except SyntaxError:
            same = False
        if same:
            return (f"{wrapped}"
                    f"_flashbook_value = {fn}(**{enter}.enter({args!r}))\n"
                    f"del {fn}\n"
                    f"{enter}.done({token!r})\n"
                    f"_flashbook_value\n")
    # fallback (source that cannot live in a function): bind the names in the namespace
    return (f"globals().update({enter}.enter({args!r}))\n"
            f"{source}\n"
            f"{enter}.done({token!r})\n")


def apply(nb, source_nb) -> Plan:
    """Guard every graded test cell of ``nb`` (in place) and put the setup cell first."""
    import nbformat
    bindings = imports(source_nb)
    module = f"_flashbook_guard_{secrets.token_hex(8)}"
    tokens, sources = {}, {}
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code" and cellmeta.is_graded_test(cell) \
                and not cellmeta.is_solution(cell):
            token = f"flashbook-ok-{secrets.token_hex(16)}"
            tokens[i], sources[i] = token, cell.source
            cell.source = guarded_source(cell.source, module, token, bindings)
    nb.cells.insert(0, nbformat.v4.new_code_cell(setup_source(module, bindings)))
    return Plan(module, tokens, sources)


def setup_error(nb) -> str:
    """The setup cell's error, if it raised (the guard is then not in place)."""
    for out in nb.cells[0].get("outputs", []):
        if out.output_type == "error":
            return f"{out.get('ename', '')}: {out.get('evalue', '')}"
    return ""


def undo(nb, plan: Plan) -> dict[int, bool]:
    """Remove the setup cell, put back the instructor's sources, strip the tokens (in place).
    Returns {cell index: whether the cell printed its token}."""
    del nb.cells[0]
    confirmed = {}
    for i, token in plan.tokens.items():
        cell = nb.cells[i]
        cell.source = plan.sources[i]
        seen, outputs = False, []
        for out in cell.get("outputs", []):
            if out.output_type == "stream" and token in out.get("text", ""):
                seen = seen or out.get("name") == "stdout"
                out.text = out.text.replace(f"\n{token}\n", "").replace(token, "")
                if not out.text:
                    continue
            outputs.append(out)
        cell.outputs = outputs
        confirmed[i] = seen
    return confirmed
