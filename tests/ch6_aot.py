"""Chapter 6's Gluon FA3 kernel compiled ahead of time for sm_90a, once per test process, in one
subprocess: the kernel cases ``tests/test_ch6.py`` reads (PTX, SASS, TTGIR, shared memory) and
the entries of the stored compile table that ``tests/test_ch6_planner.py`` recompiles
(``planner_checks.compile_entry``), and the persistent variant's cases. One subprocess pays the interpreter's start, the imports
and Triton's first compile once for all six kernels (about 17 s on two cores; two subprocesses
took about 18.5 s); the tests that read it are on one pytest-xdist worker
(``SHARES_THE_COMPILE``)."""
import functools
import tempfile
from pathlib import Path

import pytest

from aot_compile import compile_script

# (d, dtype, BLOCK_M, BLOCK_N, STAGES, OVERLAP, causal)
CASES = [(128, "float16", 64, 128, 2, True, False),     # the planner's pick for d=128
         (128, "bfloat16", 64, 128, 3, False, True),    # the largest ring that fits
         (64, "float16", 64, 128, 2, True, True)]       # d=64, two consumers
# three consumers (the planner's pick for d=64): (d, dtype, BLOCK_M, BLOCK_N, STAGES, causal)
THREE_CASES = [(64, "float16", 64, 128, 2, False)]
RING_CASES = [(128, "float16", 64, 128, 2, True, False), (64, "bfloat16", 64, 64, 3, False, True)]

# the persistent variant (Config(PERSISTENT=True, GROUP=group, CONSUMERS=consumers)), planner's
# default tiles: (d, dtype, causal, group, consumers)
PERSISTENT_CASES = [(128, "float16", True, 4, 2), (64, "bfloat16", False, 1, 2),
                    (64, "float16", True, 1, 3)]

# (d, dtype, BLOCK_M, BLOCK_N, STAGES): entries of data/ch6_compiled.json
REGENERATE = [(128, "float16", 64, 128, 3),      # the largest ring that fits: no spill
              (128, "float16", 128, 64, 2)]      # 128-row consumers: ptxas spills

SHARES_THE_COMPILE = pytest.mark.xdist_group("ch6-sm90")

# CASES (every case of CASES and RING_CASES once) and ENTRIES come first
SCRIPT = r'''
import os, re, subprocess, tempfile
from flashbook import fa3_launch as gluon_fa3, fa3_planner as planner
from flashbook.chapters.ch6 import planner_checks
from flashbook.aot import _SASS_LINE, cubin_resources, sass_loops


def pv_wait_order(sass):
    """Per main loop: where the wait for every wgmma (PV(j-1)'s, ``DEPBAR.LE gsb0, 0x0``) and
    the first exponential sit, and how many of the F2FP conversions to 16 bits write the
    registers PV reads as its A operand."""
    code = [(int(a, 16), op, rest) for a, op, rest in _SASS_LINE.findall(sass)]
    out = []
    for lp in sass_loops(sass, taken=True):
        lo, hi = int(lp["start"], 16), int(lp["end"], 16)
        body = [(op, rest) for a, op, rest in code if lo <= a <= hi]
        # an HGMMA's opcode group stops at its lowercase shape ("64x128x16"): search the rest
        a_regs = {int(m.group(1)) + i for op, rest in body if op.startswith("HGMMA")
                  and (m := re.search(r"\sR\d+,\s*R(\d+),", rest)) for i in range(4)}
        cvt = [int(m.group(1)) for op, rest in body
               if op.startswith("F2FP") and (m := re.match(r"\s*R(\d+)", rest))]
        first = lambda hit: next((i for i, (op, rest) in enumerate(body) if hit(op, rest)), -1)
        out.append(dict(wait=first(lambda op, rest: op == "WARPGROUP.DEPBAR.LE"
                                   and "gsb0, 0x0" in rest),
                        first_exp=first(lambda op, rest: op == "MUFU.EX2"),
                        cvt=len(cvt), cvt_into_a=sum(r in a_regs for r in cvt)))
    return out


bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
res = []
for d, dtype, bm, bn, stages, overlap, causal in CASES:
    c = planner.Config(BLOCK_M=bm, BLOCK_N=bn, STAGES=stages, OVERLAP=overlap).for_inputs(d, dtype)
    k = gluon_fa3.compile_for_sm90(c, causal)
    ptx = k.asm["ptx"]
    sass = ""
    tool = os.path.join(bin_dir, "cuobjdump")
    if os.path.exists(tool):
        with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
            f.write(k.asm["cubin"])
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True).stdout
        os.unlink(f.name)
    res.append(dict(case=[d, dtype, bm, bn, stages, overlap, causal], shared=k.metadata.shared,
                    planned=planner.shared_memory(c), target=ptx.split(".target", 1)[1].split()[0],
                    wgmma=ptx.count("wgmma.mma_async"), tma_load=ptx.count("cp.async.bulk.tensor") -
                    ptx.count("cp.async.bulk.tensor.3d.global.shared"),
                    tma_store=ptx.count("cp.async.bulk.tensor.3d.global.shared"),
                    setmaxnreg=sorted(set(int(x.split()[-1].rstrip(";")) for x in ptx.splitlines()
                                          if "setmaxnreg" in x)),
                    maxnreg=".maxnreg 168" in ptx, sass=bool(sass), hgmma=sass.count("HGMMA"),
                    depbar=sass.count("WARPGROUP.DEPBAR"),
                    local=sass.count("STL") + sass.count("LDL"), ttgir=k.asm["ttgir"],
                    pv_order=pv_wait_order(sass) if sass else []))
entries = [planner_checks.compile_entry(*e) for e in ENTRIES]
persistent = []
for d, dtype, causal, group, consumers in PERSISTENT:
    c = planner.Config(PERSISTENT=True, GROUP=group, CONSUMERS=consumers).for_inputs(d, dtype)
    k = gluon_fa3.compile_for_sm90(c, causal)
    usage = cubin_resources(k.asm["cubin"], "fa3_kernel")[0]
    persistent.append(dict(case=[d, dtype, causal, group, consumers], shared=k.metadata.shared,
                           planned=planner.shared_memory(c), ptx=k.asm["ptx"],
                           ttgir=k.asm["ttgir"], **usage))
three = []
for d, dtype, bm, bn, stages, causal in THREE:
    c = planner.Config(BLOCK_M=bm, BLOCK_N=bn, STAGES=stages, CONSUMERS=3).for_inputs(d, dtype)
    k = gluon_fa3.compile_for_sm90(c, causal)
    three.append(dict(case=[d, dtype, bm, bn, stages, causal], shared=k.metadata.shared,
                      planned=planner.shared_memory(c), ttgir=k.asm["ttgir"]))
print("RESULT" + json.dumps(dict(cases=res, entries=entries, persistent=persistent, three=three)))
'''


@functools.cache
def compiled() -> dict:
    """{"cases": {case: what compiling it gives}, "entries": [``compile_entry(*e)`` for each
    of REGENERATE], "persistent" and "three": {case: what compiling it gives} for
    PERSISTENT_CASES and THREE_CASES}."""
    cases = list(dict.fromkeys(CASES + RING_CASES))
    with tempfile.TemporaryDirectory(prefix="ch6-sm90-") as tmp:
        out = compile_script(f"CASES = {cases!r}\nENTRIES = {REGENERATE!r}\n"
                             f"PERSISTENT = {PERSISTENT_CASES!r}\nTHREE = {THREE_CASES!r}\n"
                             + SCRIPT, Path(tmp))
    return {"cases": {tuple(r["case"]): r for r in out["cases"]}, "entries": out["entries"],
            "persistent": {tuple(r["case"]): r for r in out["persistent"]},
            "three": {tuple(r["case"]): r for r in out["three"]}}
