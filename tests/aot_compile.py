"""Ahead-of-time compilation of a chapter's Triton kernels for GPUs this machine does not have
(the chapters' tests use it): a script runs in a fresh process with a fake GPU backend, so the
chapter's solution is compiled, not interpreted, and prints ``RESULT`` + JSON.

Compiling is a pure function of the script, the toolchain and the files the script reads, and
the slowest part of the suite (about a third of its CPU time). So each result is memoized in
``tests/aot_memo/`` (committed): one gzipped JSON per script and toolchain, with the SHA-256 of
every file of the repository the compile read (Python modules, solutions, data). A memo whose
files all still hash the same is the result; any other is compiled again and rewritten, so a
commit that changes a kernel carries its new memo. ``make aot-memo`` rebuilds the directory from
nothing (dropping memos of scripts that changed); ``FLASHBOOK_AOT_MEMO=off`` always compiles."""
import gzip
import hashlib
import json
import os
import subprocess
import sys
import textwrap
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MEMO_DIR = ROOT / "tests" / "aot_memo"
MEMO_MODE = os.environ.get("FLASHBOOK_AOT_MEMO", "on")        # on | off

# Run before every script: at exit it writes the files of the repository it opened for reading, as
# paths relative to the root (a module read from its bytecode cache counts as its source); a
# virtual environment inside the root is toolchain, which the memo's key names by version.
RECORD_READS = textwrap.dedent(r'''
    import atexit as _atexit, json as _json, os as _os, re as _re, sys as _sys
    _READ = set()


    def _note_read(event, args):
        if event == "open" and isinstance(args[0], str) and (args[1] or "r") in ("r", "rb", "rt"):
            _READ.add(_os.path.abspath(args[0]))


    def _write_reads():
        root, venv, out = _MEMO_ROOT + _os.sep, _sys.prefix + _os.sep, set()
        for path in _READ:
            path = _re.sub(r"__pycache__/([^/.]+)\.[^/]*\.pyc$", r"\1.py", path)
            if (path.startswith(root) and not path.startswith(venv) and ".egg-info" not in path
                    and _os.path.isfile(path)):
                out.add(path[len(root):])
        with open(_MEMO_READS, "w") as f:
            _json.dump(sorted(out), f)


    _sys.addaudithook(_note_read)
    _atexit.register(_write_reads)
''')

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
    without CPU mode; return the list, from its memo when that is current. Fails the test with
    the script's stderr. Targets whose compute capability (e.g. 90) is in ``ptx_only_for`` are
    compiled to PTX, not to a cubin."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("TRITON_INTERPRET", "FLASHBOOK_FORCE_CPU")}
    env["PYTHONPATH"] = str(ROOT / "src")
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    only = f"PTX_ONLY_FOR = {tuple(ptx_only_for)!r}\n" + PTX_ONLY if ptx_only_for else ""
    text = PREAMBLE + only + textwrap.dedent(body)
    memo = MEMO_DIR / f"{memo_key(text, env)}.json.gz"
    if MEMO_MODE != "off" and (result := read_memo(memo)) is not None:
        return result
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    reads = tmp_path / "aot-reads.json"
    script = tmp_path / "aot.py"
    script.write_text(f"_MEMO_ROOT, _MEMO_READS = {str(ROOT)!r}, {str(reads)!r}\n"
                      + RECORD_READS + text)
    proc = subprocess.run([sys.executable, str(script)], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.split("RESULT", 1)[1])
    if MEMO_MODE != "off":
        write_memo(memo, json.loads(reads.read_text()), result)
    return result


def memo_key(script: str, env: dict) -> str:
    """What else decides the compile: the toolchain and Triton's settings from the environment."""
    tools = [sys.version_info[:2], version("triton"), version("torch")]
    knobs = sorted((k, v) for k, v in env.items() if k.startswith("TRITON_"))
    return hashlib.sha256(json.dumps([script, tools, knobs]).encode()).hexdigest()[:24]


def file_sha(rel: str) -> str | None:
    path = ROOT / rel
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None


def read_memo(memo: Path):
    """The memoized result, or None when there is none or a file it read has changed."""
    if not memo.exists():
        return None
    entry = json.loads(gzip.decompress(memo.read_bytes()))
    current = all(file_sha(rel) == sha for rel, sha in entry["reads"].items())
    return entry["result"] if current else None


def write_memo(memo: Path, reads: list, result) -> None:
    """Write atomically (pytest-xdist's workers may share a memo); mtime 0 keeps gzip's bytes
    the same for the same entry."""
    entry = {"reads": {rel: file_sha(rel) for rel in reads}, "result": result}
    MEMO_DIR.mkdir(exist_ok=True)
    tmp = memo.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_bytes(gzip.compress(json.dumps(entry, sort_keys=True).encode(), mtime=0))
    os.replace(tmp, memo)


def too_big(results: list) -> list:
    """The compiled kernels (rows with ``cc`` and ``shared``) that need more shared memory than
    one block of that GPU may use (``SHARED_MEMORY_PER_BLOCK``)."""
    from flashbook.chapters.ch3 import SHARED_MEMORY_PER_BLOCK
    return [r for r in results if r["shared"] > SHARED_MEMORY_PER_BLOCK[divmod(r["cc"], 10)]]
