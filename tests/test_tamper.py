"""Grading that a submission cannot talk its way through (fast: no notebook kernel).

* the tampering scan (grade/scan.py) raises no flag on any chapter's solution cells, and flags
  each way of reaching the grading machinery that the end-to-end classes use;
* the guard's rewriting of test cells (grade/guard.py) keeps their statements and their value;
* the guard's kernel half (grade/kernel_guard.py), run in a plain Python process, hands the test
  cell pristine, freshly loaded checks after the student's code rebound the chapter module's
  checks, poisoned sys.modules, patched torch and replaced print.
The end-to-end cases are in test_grading.py (fixture class) and test_grading_ch1.py (Chapter 1).
"""
from __future__ import annotations

import ast
import base64
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import nbformat
import pytest

from flashbook import sources
from flashbook.grade import cellmeta, guard, scan
from flashbook.grade.record import Flag, NotebookResult

sys.path.insert(0, str(Path(__file__).parent))
from test_grading import SILENCER, STEAL  # noqa: E402
from test_grading_ch1 import DISPLAY, REBIND, SYS_MODULES, TORCH  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def chapter_notebooks():
    return [(s.name, sources.read(s.path)) for s in sources.sources(REPO)]


@pytest.mark.parametrize("name,nb", chapter_notebooks(), ids=lambda x: x if isinstance(x, str)
                         else "")
def test_solutions_raise_no_flag(name, nb):
    """Every answer cell of every chapter's solution: no flag (no false alarm on honest work)."""
    modules = set(guard.imports(nb))
    answers = {cellmeta.grade_id(c): c.source for c in nb.cells
               if cellmeta.grade_id(c) and cellmeta.is_solution(c)}
    assert answers, name
    for gid, src in answers.items():
        assert scan.scan_source(src, modules) == [], (name, gid)
    assert set(sources.cells_by_id(nb)) >= set(answers)


CH1_MODULES = {"fb", "math", "plt", "torch", "ch1"}


@pytest.mark.parametrize("code,what", [
    (REBIND, "rebinds an attribute of a module: ch1.check_softmax"),
    (SYS_MODULES, "touches sys.modules"),
    (SYS_MODULES, "touches __code__"),
    (TORCH, "rebinds an attribute of a module: torch.Tensor.any"),
    (TORCH, "rebinds an attribute of a module: numpy.testing.assert_allclose"),
    (DISPLAY, "calls get_ipython()"),
    (DISPLAY, "rebinds an attribute of a module: builtins.print"),
    (SILENCER, "calls get_ipython()"),
    (STEAL, "uses sys._getframe"),
    ("exec(open('x').read())", "calls exec()"),
    ("f = eval", "refers to eval"),
    ("x = eval('1')", "calls eval()"),
    ("import importlib; importlib.reload(ch1)", "imports importlib"),
    ("m = __import__('flashbook')", "calls __import__()"),
    ("import ctypes", "uses ctypes"),
    ("from flashbook.kernels import key_tiles", "imports the book's solved kernels"),
    ("setattr(ch1, 'check_softmax', None)", "calls setattr()"),
    ("from flashbook.chapters.ch1 import checks\nchecks.assert_close = print",
     "rebinds an attribute of a module: checks.assert_close"),
    ("print = lambda *a: None", "rebinds 'print'"),
    ("ch1 = None", "rebinds 'ch1'"),
    ("def softmax(x):\n    return x\nsoftmax.__globals__['ch1'] = 1", "__globals__"),
    ("blob = '" + base64.b64encode(bytes(range(256))).decode() + "'", "encoded blob"),
    ("code = bytes.fromhex('" + bytes(range(100)).hex() + "')", "encoded blob"),
    ("%time x = 1\nimport sys\nsys.modules['a'] = 1", "touches sys.modules"),   # magics
    ("def f(:\n    sys.modules['x'] = 1", "touches sys.modules"),              # regex fallback
])
def test_scan_flags_tampering(code, what):
    found = scan.scan_source(code, CH1_MODULES)
    assert any(what in w for _, w in found), found


def test_scan_reports_cell_and_line():
    rel = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("import flashbook as fb")])
    sub = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell("import flashbook as fb"),              # as released: skipped
        nbformat.v4.new_code_cell("x = 1\n\nfb.check = None"),           # added by the student
    ])
    flags = scan.scan(sub, rel, {"fb"})
    assert flags == (Flag("cell 2", 3, "rebinds an attribute of a module: fb.check"),)
    assert str(flags[0]) == "cell 2:3 rebinds an attribute of a module: fb.check"
    r = NotebookResult("nb", {}, flags=flags)
    assert NotebookResult.from_json(r.to_json()) == r


def test_guarded_source_keeps_statements_and_value():
    bindings = {"ch1": ("flashbook.chapters", "ch1"), "torch": ("torch", None)}
    src = "x = 2\nch1.check(f)\n### BEGIN HIDDEN TESTS\nch1.check(f, hidden=True)  # more\n" \
          "### END HIDDEN TESTS"
    out = guard.guarded_source(src, "_m", "tok-123456789", bindings)
    tree = ast.parse(out)
    fn = tree.body[0]
    assert isinstance(fn, ast.FunctionDef) and [a.arg for a in fn.args.args] == ["ch1"]
    assert isinstance(fn.body[-1], ast.Return)                      # the cell's value
    assert "ch1.check(f, hidden=True)  # more" in out               # hidden lines verbatim
    assert out.rstrip().endswith("_flashbook_value")
    assert "done('tok-123456789')" in out
    # a multi-line string would change inside a function: run in the namespace instead
    odd = 'assert f() == """a\nb"""'
    assert guard.guarded_source(odd, "_m", "tok-123456789", bindings).startswith("globals()")


def test_imports_are_the_instructors():
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell("import flashbook as fb\nimport triton.language as tl\n"
                                  "import math, torch.nn\nfrom flashbook import reference, oob\n"
                                  "from flashbook.chapters import ch3"),
        nbformat.v4.new_code_cell("import evil as ch3", metadata={"nbgrader": {
            "solution": True, "grade_id": "a", "grade": False, "locked": False}}),
    ])
    assert guard.imports(nb) == {
        "fb": ("flashbook", None), "tl": ("triton.language", None), "math": ("math", None),
        "torch": ("torch", None), "reference": ("flashbook", "reference"),
        "oob": ("flashbook", "oob"), "ch3": ("flashbook.chapters", "ch3")}


KERNEL = """
import importlib.util, os, sys
spec = importlib.util.spec_from_file_location("_g", {file!r})
g = importlib.util.module_from_spec(spec)
spec.loader.exec_module(g)
g.snapshot(("flashbook",), {root!r}, {pkg!r}, modules=("numpy", "numpy.testing", "torch",
           "torch.testing"), classes=("torch.Tensor",))
import builtins, io, torch
import flashbook as fb
fb.setup(verbose=False)
from flashbook.chapters import ch1
def softmax(x):                      # wrong
    return torch.zeros_like(x)
# the student's tampering
noop = lambda *a, **k: None
ch1.check_softmax = noop
sys.modules["flashbook.chapters.ch1"].checks.assert_close = noop
sys.modules["flashbook.check"].assert_close = noop
fb.check.run_student.__code__ = (lambda fn, *a, what, **k: fn(*a, **k)).__code__
torch.Tensor.any = lambda self, *a, **k: torch.tensor(False)
torch.testing.assert_close = noop
builtins.print = noop
sys.stdout = io.StringIO()
old = ch1
names = g.enter({{"ch1": ("flashbook.chapters", "ch1"), "torch": ("torch", None)}})
assert names["ch1"] is not old and names["torch"] is torch
assert names["ch1"].check_softmax is not noop
assert "flashbook.chapters.ch1" in sys.modules and sys.modules["flashbook.chapters.ch1"] is old
assert not bool(torch.ones(2).any() == False) and print is not noop
try:
    names["ch1"].check_softmax(softmax)
except AssertionError as e:
    sys.stdout.write("FAILED AS IT SHOULD " + type(e).__name__ + "\\n")
def softmax(x):                      # right
    w = x.double()
    m = w.amax(-1, keepdim=True)
    e = torch.exp(w - torch.where(torch.isfinite(m), m, torch.zeros_like(m)))
    t = e.sum(-1, keepdim=True)
    return torch.where(t > 0, e / t, torch.zeros_like(e)).to(x.dtype)
names["ch1"].check_softmax(softmax)
g.done("TOKEN-xyz")
"""


def test_kernel_guard_hands_out_pristine_checks():
    """The kernel half on its own (a plain Python process): after the student's code rebound
    ch1's checks, their helpers, sys.modules entries, torch.Tensor.any, print and stdout,
    ``enter`` gives the test cell fresh checks that fail a wrong answer and pass a right one."""
    pkg = Path(guard.__file__).resolve().parents[1]
    code = KERNEL.format(file=str(guard.KERNEL_FILE), root=str(pkg.parent), pkg=str(pkg))
    env = dict(os.environ, FLASHBOOK_FORCE_CPU="1")
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                       text=True, env=env, cwd=REPO)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "FAILED AS IT SHOULD CheckFailure" in p.stdout, p.stdout
    assert "PASSED softmax: 5/5 cases" in p.stdout and p.stdout.rstrip().endswith("TOKEN-xyz")
