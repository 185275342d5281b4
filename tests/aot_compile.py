"""Ahead-of-time compilation of a chapter's Triton kernels for GPUs this machine does not have
(the chapters' tests use it): a script runs in a fresh process with a fake GPU backend, so the
chapter's solution is compiled, not interpreted, and prints ``RESULT`` + JSON."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# the script's first lines: flashbook believes it runs on an sm_90 GPU and compiles for real
PREAMBLE = textwrap.dedent(r'''
    import itertools, json
    import flashbook, flashbook.device as dv
    fake = dv.Backend(True, "AOT", (9, 0), dv.GPU_SIZES)      # compile for GPUs, do not interpret
    flashbook.setup = lambda verbose=True: fake
    dv._current = fake
    import torch, triton
    from triton.compiler import ASTSource
    from triton.backends.compiler import GPUTarget
    from flashbook import sources


    def signature(kernel, pointers, constexprs):
        """Every argument: constexpr, a pointer type from ``pointers``, or i32."""
        return {n: "constexpr" if n in constexprs else pointers.get(n, "i32")
                for n in kernel.arg_names}
''')


# ptxas is the slowest stage (a third of a compile). For targets in ``ptx_only_for`` the script
# stops at the PTX, through Triton's own hook on the compile stages: what a test reads there (the
# PTX, the shared memory, which LLVM lowering sets) is complete; the cubin is empty.
PTX_ONLY = textwrap.dedent(r'''
    from triton import knobs


    def _stop_at_ptx(backend=None, stages=None, options=None, language=None, capability=None):
        if backend is None:             # asked for a cache key first
            return f"ptx-only{PTX_ONLY_FOR}", f"ptx-only{PTX_ONLY_FOR}"
        if backend.target.arch in PTX_ONLY_FOR:
            stages["cubin"] = lambda src, metadata: b""


    knobs.runtime.add_stages_inspection_hook = _stop_at_ptx
''')


def compile_script(body: str, tmp_path: Path, ptx_only_for: tuple = ()) -> list:
    """Run PREAMBLE + ``body`` (which prints "RESULT" + a JSON list) in a fresh interpreter
    without CPU mode; return the list. Fails the test with the script's stderr. Targets whose
    compute capability (e.g. 90) is in ``ptx_only_for`` are compiled to PTX, not to a cubin."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("TRITON_INTERPRET", "FLASHBOOK_FORCE_CPU")}
    env["PYTHONPATH"] = str(ROOT / "src")
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    script = tmp_path / "aot.py"
    only = f"PTX_ONLY_FOR = {tuple(ptx_only_for)!r}\n" + PTX_ONLY if ptx_only_for else ""
    script.write_text(PREAMBLE + only + textwrap.dedent(body))
    proc = subprocess.run([sys.executable, str(script)], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.split("RESULT", 1)[1])


def too_big(results: list) -> list:
    """The compiled kernels (rows with ``cc`` and ``shared``) that need more shared memory than
    one block of that GPU may use (``SHARED_MEMORY_PER_BLOCK``)."""
    from flashbook.chapters.ch3 import SHARED_MEMORY_PER_BLOCK
    return [r for r in results if r["shared"] > SHARED_MEMORY_PER_BLOCK[divmod(r["cc"], 10)]]
