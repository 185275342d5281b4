"""Ahead-of-time compiles of the chapters' Gluon kernels, shared by Chapters 6 and 7: Gluon's
AST source class across the Triton versions the book runs (3.6 on GPU images, 3.9 in CI), the
compile of a Gluon attention kernel for a target GPU, the writer and reader of a stored table
of what compiling reported (``src/flashbook/data/ch*_compiled.json``, with its provenance),
which a chapter's checks read instead of compiling in a notebook, and what filling such a table
needs: the CUDA tools Triton bundles, ``cuobjdump``'s register and spill figures of a cubin,
what a PTX says a kernel needs, the shared provenance."""
from __future__ import annotations

import datetime
import functools
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterable


def gluon_ast_source():
    """``GluonASTSource``: exported by ``triton.experimental.gluon`` in triton 3.9, kept in its
    ``_runtime`` module in 3.6."""
    try:
        from triton.experimental.gluon import GluonASTSource
    except ImportError:
        from triton.experimental.gluon._runtime import GluonASTSource
    return GluonASTSource


def compile_attention(kernel, arch: int, dtype: str, head_dim: int, block_m: int, block_n: int,
                      layout: Callable, constexprs: dict, options: dict):
    """Compile a Gluon attention kernel ``(q_desc, k_desc, v_desc, o_desc, LSE, N_Q, N_K,
    qk_scale, **constexprs)`` for ``GPUTarget("cuda", arch, 32)`` without a GPU: q and o in TMA
    boxes of (1, block_m, d), k and v of (1, block_n, d), ``layout(rows)`` their shared layout;
    ``dtype`` "float16" or "bfloat16". Returns Triton's compiled kernel."""
    import triton
    from triton.backends.compiler import GPUTarget
    short = {"float16": "fp16", "bfloat16": "bf16"}[dtype]

    def desc(rows):
        return f"tensordesc<{short}[1,{rows},{head_dim}],{layout(rows)!r}>"
    signature = dict(q_desc=desc(block_m), k_desc=desc(block_n), v_desc=desc(block_n),
                     o_desc=desc(block_m), LSE="*fp32", N_Q="i32", N_K="i32", qk_scale="fp32")
    signature.update({n: "constexpr" for n in constexprs})
    source = gluon_ast_source()(fn=kernel, signature=signature, constexprs=constexprs)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)


def write_compiled_table(out: str | Path, module: str, argv: list[str] | None,
                         configs: Iterable[tuple], compile_entry: Callable[..., dict],
                         provenance: Callable[[str], dict]) -> None:
    """Compile every config (``compile_entry(*config)`` -> one row), printing each row and its
    time, and write ``{"provenance": ..., "configs": [...]}`` to ``out``, one config a line.
    ``module`` and ``argv`` make the exact command recorded in the provenance."""
    fusion = os.environ.get("TRITON_DEFAULT_FP_FUSION")
    command = ((f"TRITON_DEFAULT_FP_FUSION={fusion} " if fusion else "")
               + f"python -m {module} " + " ".join(sys.argv[1:] if argv is None else argv))
    rows = []
    for cfg in configs:
        t = time.time()
        rows.append(compile_entry(*cfg))
        print(json.dumps(rows[-1]), f"{time.time() - t:.1f} s", flush=True)
    prov = json.dumps(provenance(command.strip()), indent=1).replace("\n", "\n ")
    lines = ",\n  ".join(json.dumps(r) for r in rows)
    Path(out).write_text(f'{{\n "provenance": {prov},\n "configs": [\n  {lines}\n ]\n}}\n')
    print("wrote", out)


@functools.cache
def _read_json(path: str) -> dict:
    return json.loads(Path(path).read_text())


def read_compiled_table(path: str | Path) -> dict:
    """A stored table (``{"provenance": ..., "configs": [...]}``), read once per process."""
    return _read_json(str(path))


def triton_tool(name: str) -> str | None:
    """The path of a CUDA tool Triton bundles (``ptxas``, ``cuobjdump``, ...), else the one on
    PATH, else None."""
    import triton
    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    return path if os.path.exists(path) else shutil.which(name)


def cubin_resources(cubin: bytes, kernel: str) -> tuple[dict, str]:
    """What ``cuobjdump`` (bundled with Triton) reads in a compiled kernel's cubin: n_regs and
    stack (``-res-usage`` REG and STACK of function ``kernel``), spill_stores and spill_loads
    (STL and LDL instructions in the SASS); and the SASS text."""
    tool = triton_tool("cuobjdump")
    if tool is None:
        raise RuntimeError("cuobjdump not found (Triton bundles it in backends/nvidia/bin)")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        usage = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True,
                               check=True).stdout
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout
    finally:
        os.unlink(f.name)
    fields = dict(re.findall(r"(\w+):(\d+)", usage.split(f"Function {kernel}:", 1)[1]))
    return dict(n_regs=int(fields["REG"]), stack=int(fields["STACK"]),
                spill_stores=len(re.findall(r"\bSTL(\.\w+)*\b", sass)),
                spill_loads=len(re.findall(r"\bLDL(\.\w+)*\b", sass))), sass


def compile_provenance(command: str, kernel_file: str | Path,
                       ptxas_names: Iterable[str] = ("ptxas",)) -> dict:
    """The provenance every stored compile table shares: the Triton and ptxas versions, Python,
    the date, the exact command, the environment switches that change code generation, and the
    SHA-256 of the kernel's source file."""
    import triton
    ptxas = next((t for t in map(triton_tool, ptxas_names) if t), None)
    version = subprocess.run([ptxas, "--version"], capture_output=True, text=True).stdout \
        if ptxas else ""
    return dict(
        triton=triton.__version__,
        ptxas=(version.strip().splitlines() or [""])[-1],
        python=platform.python_version(),
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        command=command,
        env=dict(TRITON_DEFAULT_FP_FUSION=os.environ.get("TRITON_DEFAULT_FP_FUSION"),
                 TRITON_INTERPRET=os.environ.get("TRITON_INTERPRET")),
        kernel_source_sha256=hashlib.sha256(Path(kernel_file).read_bytes()).hexdigest())


# what the readers below return, as a compile table's provenance describes its fields
FIELDS = dict(
    shared="metadata.shared: bytes of dynamic shared memory a block needs",
    stack="cuobjdump -res-usage STACK: bytes of local memory per thread",
    spill_stores="STL instructions in the SASS (cuobjdump -sass)",
    spill_loads="LDL instructions in the SASS",
    tmem_alloc="the operand of each tcgen05.alloc in the PTX (columns)",
    reqntid="PTX .reqntid: threads per CTA",
    maxnreg="PTX .maxnreg: registers a thread at launch",
    setmaxnreg="the values of every setmaxnreg in the PTX (the roles' budgets and "
               "Triton's own: 256 while the CTA sets up, 80 for idle worker warps)",
    mma_ss="tcgen05.mma instructions with A and B in shared memory (S = Q K^T)",
    mma_ts="tcgen05.mma instructions with A in tensor memory (O += P V)",
    tma_loads="TMA loads (cp.async.bulk.tensor global -> shared) in the PTX",
    tma_stores="TMA stores (cp.async.bulk.tensor shared -> global) in the PTX")


def ptx_resources(ptx: str) -> dict:
    """What a Blackwell kernel's PTX says it needs: the operand of each ``tcgen05.alloc``
    (tensor-memory columns), ``.reqntid`` (threads), ``.maxnreg`` (registers a thread at
    launch), the ``setmaxnreg`` values, the MMAs (``mma_ss``: A and B in shared memory;
    ``mma_ts``: A in tensor memory) and the TMA loads and stores."""
    mma = re.findall(r"tcgen05\.mma\.cta_group::1\.kind::f16\s+\[[^\]]*\],\s*(\[?)", ptx)
    return dict(
        tmem_alloc=[int(x) for x in re.findall(r"tcgen05\.alloc\S*\s+\[[^\]]*\],\s*(\d+);", ptx)],
        reqntid=int(re.search(r"\.reqntid (\d+)", ptx).group(1)),
        maxnreg=int(re.search(r"\.maxnreg (\d+)", ptx).group(1)),
        setmaxnreg=sorted({int(x) for x in
                           re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+);", ptx)}),
        mma_ss=sum(1 for a in mma if not a), mma_ts=sum(1 for a in mma if a),
        tma_loads=len(re.findall(r"cp\.async\.bulk\.tensor\.\dd\.shared::\w+\.global", ptx)),
        tma_stores=len(re.findall(r"cp\.async\.bulk\.tensor\.\dd\.global\.shared::\w+", ptx)))


_SASS_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")


def sass_loops(sass: str, opcodes: Iterable[str] = ("SHFL.IDX", "SHFL.BFLY", "PRMT", "STS",
                                                    "BAR", "F2FP"),
               taken: bool = False) -> list[dict]:
    """The innermost loops of a SASS listing (``cuobjdump -sass``) that hold tensor-core MMAs
    (HGMMA, QGMMA): a loop is a backward ``BRA`` and the instructions from its target to it,
    innermost when no other backward branch lies inside (warp specialization's dispatch jumps
    make overlapping ranges that nest in nothing). For each, ``start`` and ``end``
    (addresses), ``n`` (instructions), ``mma`` and one count of the instructions whose opcode
    starts with each of ``opcodes``. ``taken``: count only the path on which every forward
    branch that lands inside the loop is taken (what an iteration issues when it skips its
    ``if`` blocks, e.g. an unmasked tile skipping the mask), and add ``skipped``, the
    instructions left out."""
    code = [(int(a, 16), op) for a, op, _ in _SASS_LINE.findall(sass)]
    branches = [(a, int(m.group(2), 16)) for a, op, rest in _SASS_LINE.findall(sass)
                if op == "BRA" and (m := re.match(r"\s*(0x)?([0-9a-f]+)", rest))
                for a in [int(a, 16)]]
    loops = [(target, a) for a, target in branches if target < a]

    def ops(lo, hi):
        return [op for a, op in code if lo <= a <= hi]
    inner = [(lo, hi) for lo, hi in set(loops) if not any(lo <= b < hi for _, b in loops)
             and any(op[1:4] == "GMM" for op in ops(lo, hi))]
    out = []
    for lo, hi in sorted(inner):
        jumps = [(a, t) for a, t in branches if taken and lo <= a < t <= hi]
        body = [op for a, op in code if lo <= a <= hi
                and not any(b < a < t for b, t in jumps)]
        row = dict(start=hex(lo), end=hex(hi), n=len(body),
                   mma=sum(op[1:4] == "GMM" for op in body))
        row.update({o: sum(op.startswith(o) for op in body) for o in opcodes})
        if taken:
            row["skipped"] = len(ops(lo, hi)) - len(body)
        out.append(row)
    return out
