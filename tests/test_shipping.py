"""flashbook.shipping: a function sent as source text comes back working, with its helpers,
constants and modules, and its errors point at its own lines."""
import json
import linecache
import subprocess
import sys
import traceback
from pathlib import Path

import pytest

from flashbook import shipping
from flashbook.compare import CheckFailure

# a notebook cell: its module is __main__ (nothing to import by name) and its source lives in
# linecache, as IPython keeps it
CELL = """\
import math
SCALE = 3.0
LIMIT = float("inf")

def _helper(x):
    return x * SCALE

def shipped_fn(x):
    if x < 0:
        raise ValueError("negative input")
    return math.sqrt(_helper(x)) if x < LIMIT else -1.0
"""
CELL_FILE = "<notebook-cell-7>"


def _cell_function():
    linecache.cache[CELL_FILE] = (len(CELL), None, CELL.splitlines(True), CELL_FILE)
    g = {"__name__": "__main__"}
    exec(compile(CELL, CELL_FILE, "exec"), g)
    return g["shipped_fn"]


def test_round_trip_through_json_rebuilds_helpers_constants_and_modules():
    shipped_fn = _cell_function()
    s = shipping.ship(shipped_fn, "f")
    assert [h.name for h in s.helpers] == ["_helper"]
    assert set(s.prelude) == {"import math as math", "LIMIT = float('inf')"}
    assert s.helpers[0].prelude == ("SCALE = 3.0",) and s.helpers[0].firstlineno == 5
    again = shipping.from_json(json.loads(json.dumps(shipping.to_json(s))))
    assert again == s
    assert [x.name for x in shipping.all_shipped([again])] == ["f", "_helper"]
    fn = shipping.rebuild([again])["f"]
    assert fn is not shipped_fn and fn(12.0) == shipped_fn(12.0) == 6.0


def test_rebuilt_function_fails_at_the_students_line():
    fn = shipping.rebuild([shipping.ship(_cell_function(), "f")])["f"]
    with pytest.raises(ValueError) as info:
        fn(-1.0)
    last = traceback.extract_tb(info.tb)[-1]
    assert last.filename == CELL_FILE and last.lineno == 10
    assert last.line == 'raise ValueError("negative input")'


def test_in_a_fresh_process_without_torch():
    """The child side imports only the standard library: a process that never imports torch
    rebuilds and runs the function."""
    job = json.dumps([shipping.to_json(shipping.ship(_cell_function(), "f"))])
    src = str(Path(shipping.__file__).resolve().parents[1])
    code = ("import json, sys, importlib.util\n"
            f"spec = importlib.util.spec_from_file_location('shipping', {shipping.__file__!r})\n"
            "m = importlib.util.module_from_spec(spec); sys.modules['shipping'] = m\n"
            "spec.loader.exec_module(m)\n"
            "fns = m.rebuild([m.from_json(d) for d in json.loads(sys.stdin.read())])\n"
            "print(fns['f'](3.0), 'torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], input=job, capture_output=True,
                         text=True, cwd=src, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["3.0", "False"]


def test_a_lambda_cannot_be_shipped():
    with pytest.raises(CheckFailure, match="defined with `def`"):
        shipping.ship(lambda x: x, "f")
