"""flashbook.shipping: a notebook's function sent by value comes back working in another
process, with its helpers, constants and modules, and its errors quote its own lines."""
import linecache
import subprocess
import sys
import threading

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


def _cell_function(**extra):
    linecache.cache[CELL_FILE] = (len(CELL), None, CELL.splitlines(True), CELL_FILE)
    g = {"__name__": "__main__", **extra}
    exec(compile(CELL, CELL_FILE, "exec"), g)
    return g["shipped_fn"]


def _in_another_process(code: str, data: bytes) -> list[str]:
    program = ("import sys, traceback\nfrom flashbook import shipping\n"
               "f = shipping.loads(sys.stdin.buffer.read())['f']\n" + code)
    out = subprocess.run([sys.executable, "-c", program], input=data, capture_output=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr.decode()
    return out.stdout.decode().splitlines()


def test_in_another_process_the_function_runs_and_fails_at_the_students_line():
    data = shipping.dumps({"f": _cell_function()})
    out = _in_another_process(
        "print(f(12.0))\n"
        "try:\n    f(-1.0)\nexcept ValueError as e:\n"
        "    last = traceback.extract_tb(e.__traceback__)[-1]\n"
        "    print(last.filename, last.lineno, last.line)\n", data)
    assert out == ["6.0", f'{CELL_FILE} 10 raise ValueError("negative input")']


def test_what_cannot_be_sent_is_a_check_failure():
    fn = _cell_function()
    fn.__globals__["SCALE"] = threading.Lock()
    with pytest.raises(CheckFailure, match="`f`: the check runs your code in a separate process"):
        shipping.dumps({"f": fn})
