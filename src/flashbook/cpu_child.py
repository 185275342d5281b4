"""A check's CPU-mode part run from a GPU runtime, in a child process in CPU mode.

Some checks need the Triton interpreter: the out-of-bounds guard counts the tiles a kernel
loads (Chapter 4's skipping of masked tiles, Chapter 5's one load per K/V head), which a GPU
cannot tell. On a GPU runtime those checks run here: the student's functions are sent by
value (``flashbook.shipping``, their ``@triton.jit`` helpers included) to a child process that
starts in CPU mode (``FLASHBOOK_FORCE_CPU``), which calls the check's function on them and
reports what it returned, or the ``CheckFailure`` it raised, which the parent raises again.
So grading on a GPU drops no check.

Usage: ``on_cpu("flashbook.chapters.ch4.checks:count_masked_loads", {"kernel": kernel},
hidden=False)``: ``count_masked_loads(kernel, hidden=False)`` in the child; its return value
(a string) here.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

__all__ = ["on_cpu", "TIMEOUT_S"]

TIMEOUT_S = 600.0


def on_cpu(target: str, functions: dict, *, hidden: bool, timeout: float = TIMEOUT_S) -> str:
    """``target`` ("module:function") called in a CPU-mode child as ``function(*functions,
    hidden=hidden)`` with the functions rebuilt from their source; returns its string, raises
    its CheckFailure here (or a CheckFailure saying why the child gave no answer)."""
    from flashbook.compare import CheckFailure
    from flashbook import shipping
    job = Path(tempfile.mkdtemp(prefix="flashbook-cpu-"))
    try:
        (job / "functions.pkl").write_bytes(shipping.dumps(functions))
        (job / "job.json").write_text(json.dumps(dict(target=target, names=list(functions),
                                                      hidden=hidden)))
        src = str(Path(__file__).resolve().parents[1])
        env = dict(os.environ, FLASHBOOK_FORCE_CPU="1", TRITON_INTERPRET="1",
                   CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1",
                   PYTHONPATH=os.pathsep.join([src] + [p for p in os.environ.get(
                       "PYTHONPATH", "").split(os.pathsep) if p]))
        try:
            proc = subprocess.run([sys.executable, "-m", "flashbook.cpu_child", str(job)],
                                  stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                  env=env, cwd=job, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise CheckFailure(f"{target.split(':')[-1]}: the CPU-mode part of the check did not "
                               f"finish within {timeout:.0f} s.") from None
        result = job / "result.json"
        if not result.exists():
            raise CheckFailure(f"{target.split(':')[-1]}: the CPU-mode part of the check ended "
                               f"without an answer (exit code {proc.returncode}):\n"
                               f"{(proc.stdout + proc.stderr)[-1500:]}")
        answer = json.loads(result.read_text())
        if not answer["ok"]:
            raise CheckFailure(answer["message"])
        return answer["value"]
    finally:
        shutil.rmtree(job, ignore_errors=True)


def _child(job: Path) -> None:
    import importlib
    import flashbook
    from flashbook.compare import CheckFailure
    from flashbook import shipping
    spec = json.loads((job / "job.json").read_text())
    flashbook.setup(verbose=False)
    functions = shipping.loads((job / "functions.pkl").read_bytes())
    module, name = spec["target"].split(":")
    check = getattr(importlib.import_module(module), name)
    try:
        value = check(*(functions[n] for n in spec["names"]), hidden=spec["hidden"])
        answer = dict(ok=True, value=str(value))
    except CheckFailure as e:
        answer = dict(ok=False, message=str(e))
    (job / "result.json").write_text(json.dumps(answer))


if __name__ == "__main__":
    _child(Path(sys.argv[1]))
