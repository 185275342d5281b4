"""Chapter 7, Exercise 5 and the chapter's Gluon Blackwell kernel (``gluon_fa4``): the planner
(``planner``) against the kernel compiled ahead of time for sm_100a, the stored table
``src/flashbook/data/ch7_compiled.json`` and its provenance, the graded check with its
known-wrong answers, and the launcher's argument checks.

The kernel cannot run here (no GPU) nor on the lent H200 (sm_90): the slow test compiles it for
sm_100a in a subprocess (about 30 s on two cores) and checks that the stored table is still what
the compiler reports, and where Triton put the tensor-memory buffers."""
import json

import pytest
import torch

from flashbook import sources
from flashbook.check import CheckFailure
from flashbook.chapters.ch7 import planner
from flashbook.chapters.ch7.planner import Config
from flashbook.sources import exec_cell, fresh_module

from aot_compile import compile_script


def _resources_cell() -> str:
    """The solution cell, as the chapter's notebook has it."""
    return sources.cells_by_id(sources.read(sources.source("ch7").path))['ch7_resources']


RESOURCES_CELL = _resources_cell()

VARIANTS = [(v.name, *v.edits[0], v.expect) for v in sources.variants("ch7")
            if v.cell == 'ch7_resources']
CRASH = ("NameError", "SyntaxError", "IndentationError", "TypeError")
_names = iter(range(10**6))


def kernel_resources(cell: str = RESOURCES_CELL):
    ns = fresh_module("ch7_gluon_test").__dict__
    exec_cell(cell, f"<ch7 resources test cell {next(_names)}>", ns)
    return ns["kernel_resources"]


def cfg(d=128, dtype="float16", **kw) -> Config:
    return Config(**kw).for_inputs(d, dtype)


# ------------------------------------------------------------------------ the exercise's check
def test_reference_answer_passes_every_check(capsys):
    fn = kernel_resources()
    planner.check_resources(fn)
    planner.check_resources(fn, hidden=True)
    out = capsys.readouterr().out
    assert ("PASSED kernel resources against the compiled kernel: 7/7 cases (d=128 float16, "
            "BLOCK_N=128, STAGES=2: 197,132 bytes of shared memory, 512 TMEM columns)") in out
    assert len(planner.resource_cases(hidden=True)) == 45


def test_threads_and_registers_vary_over_the_cases():
    """Every output of the exercise takes more than one value over the visible cases, so a
    hard-coded one loses the points there (each such answer is a known-wrong variant)."""
    got = [planner.resources(c) for c in planner.resource_cases()]
    for key in ("tmem_columns", "threads", "launch_registers", "correction_registers"):
        assert len({g[key] for g in got}) > 1, key
    whatif = {c.describe(): planner.resources(c) for c in planner.resource_cases()[5:]}
    assert [(r["threads"], r["launch_registers"], r["correction_registers"])
            for r in whatif.values()] == [(512, 128, 96), (640, 96, 48)], whatif


@pytest.mark.parametrize("split, correction", [
    ({}, 104), (dict(SINGLE_WARP_REGS=32), 96), (dict(SOFTMAX_REGS=184), 120),
    (dict(CORRECTION_WARPS=8), 48), (dict(CORRECTION_WARPS=8, SOFTMAX_REGS=160,
                                          SINGLE_WARP_REGS=32), 80)])
def test_the_register_split_uses_every_register(split, correction):
    c = cfg(**split)
    budget = planner.register_budget(c)
    assert budget["correction"] == correction
    assert budget["launch"] * planner.threads(c) <= 65536 and budget["launch"] % 8 == 0
    assert 65536 - 8 * 32 * c.CORRECTION_WARPS < budget["total"] <= 65536
    assert planner.feasible(c)
    assert planner.compiled_entry(c) is None if split else planner.compiled_entry(c)


def test_splits_the_kernel_cannot_take_are_refused():
    assert not planner.feasible(cfg(CORRECTION_WARPS=6))
    assert not planner.feasible(cfg(SOFTMAX_REGS=190))
    assert any("fewer than setmaxnreg's 24" in r for r in
               planner.feasible(cfg(SOFTMAX_REGS=248, SINGLE_WARP_REGS=32)).reasons)


def test_the_planner_answers_the_exercise():
    planner.check_resources(planner.resources, hidden=True)


def test_stub_fails_as_not_implemented():
    head, rest = RESOURCES_CELL.split("    ### BEGIN SOLUTION\n")
    stub = head + "    # YOUR CODE HERE\n    raise NotImplementedError()\n" + \
        rest.split("    ### END SOLUTION", 1)[1].lstrip("\n")
    with pytest.raises(CheckFailure, match="kernel_resources: not implemented"):
        planner.check_resources(kernel_resources(stub))


@pytest.mark.parametrize("name, old, new, expect", VARIANTS, ids=[v[0] for v in VARIANTS])
def test_known_wrong_variant_fails_for_its_reason(name, old, new, expect):
    assert RESOURCES_CELL.count(old) == 1, f"{name}: the edit does not apply once"
    fn = kernel_resources(RESOURCES_CELL.replace(old, new))
    with pytest.raises(CheckFailure) as info:
        planner.check_resources(fn)
        planner.check_resources(fn, hidden=True)
    message = str(info.value)
    assert expect in message, message
    assert not any(c in message for c in CRASH), message


def test_answers_of_the_wrong_form_are_named():
    with pytest.raises(CheckFailure, match="should return a dict"):
        planner.check_resources(lambda c: 197132)
    with pytest.raises(CheckFailure, match="has no tmem_columns"):
        planner.check_resources(lambda c: dict(smem_buffers=[], threads=512))
    right = planner.resources
    with pytest.raises(CheckFailure, match="list of \\(name, bytes\\) pairs"):
        planner.check_resources(lambda c: dict(right(c), smem_buffers=197132))
    with pytest.raises(CheckFailure, match="correction_registers = 108.*rounded down"):
        planner.check_resources(lambda c: dict(right(c), correction_registers=108))
    with pytest.raises(CheckFailure, match="launch_registers = 136.*65,536 registers shared"):
        planner.check_resources(lambda c: dict(right(c), launch_registers=136))
    with pytest.raises(CheckFailure, match="4-byte elements"):
        planner.check_resources(lambda c: dict(right(c), smem_buffers=[
            (n, 2 * b if b >= 1024 else b) for n, b in right(c)["smem_buffers"]]))


# ---------------------------------------------------------------- the planner and the table
def _config(e) -> Config:
    return Config(BLOCK_N=e["BLOCK_N"], STAGES=e["STAGES"], CAUSAL=e["causal"]).for_inputs(
        e["d"], e["dtype"])


def test_the_planner_matches_every_compiled_config_exactly():
    table = planner.compiled_table()
    assert [(e["d"], e["dtype"], e["BLOCK_N"], e["STAGES"], e["causal"])
            for e in table["configs"]] == [tuple(c) for c in planner.TABLE_CONFIGS]
    for e in table["configs"]:
        c = _config(e)
        budget = planner.register_budget(c)
        assert e["shared"] == planner.shared_memory(c), c
        assert e["tmem_size"] == planner.tmem_columns(c) and e["tmem_alloc"] == [e["tmem_size"]]
        assert e["reqntid"] == planner.threads(c) == 32 * e["num_warps"] == 512
        assert e["maxnreg"] == e["n_regs"] == budget["launch"] == 128
        assert {budget["correction"], budget["softmax"], budget["single_warp"]} <= \
            set(e["setmaxnreg"])
        assert budget["total"] == 65536
        assert e["mma_ss"] > 0 and e["mma_ts"] > 0 and e["utcmma"] == e["mma_ss"] + e["mma_ts"]
        assert e["tma_loads"] > 0 and e["tma_stores"] > 0
        assert e["stack"] <= 32, f"ptxas spills more than a few scalars: {e}"


def test_the_table_carries_its_provenance():
    prov = planner.compiled_table()["provenance"]
    for key in ("what", "target", "triton", "ptxas", "python", "date", "command", "env",
                "kernel_source_sha256", "machine", "fields"):
        assert prov.get(key), key
    assert "sm_100a" in prov["target"] and "no GPU" in prov["machine"]
    assert prov["command"].endswith("python -m flashbook.chapters.ch7.planner --out "
                                    "src/flashbook/data/ch7_compiled.json")
    entry = planner.compiled_table()["configs"][0]
    assert set(entry) - {"d", "dtype", "BLOCK_M", "BLOCK_N", "STAGES", "causal"} <= \
        set(prov["fields"])


def test_the_chapter_config_and_its_limits():
    best = planner.best(128)
    assert (best.BLOCK_N, best.STAGES) == (128, 2) and planner.feasible(best)
    assert planner.shared_memory(best) == 197132
    layout = dict((n, (o, s)) for n, o, s in planner.shared_memory_layout(best))
    assert layout["q"] == (0, 65536) and layout["captures"] == (196608, 320)
    assert layout["warp_states"] == (197120, 12)
    too_deep = planner.feasible(cfg(STAGES=3))
    assert not too_deep and "shared memory 262,732 B > 232,448 B" in too_deep.reasons[0]
    assert planner.feasible(cfg(64, STAGES=6)) and not planner.feasible(cfg(64, STAGES=7))
    wide = planner.feasible(cfg(256))
    assert any("768 columns > 512" in r for r in wide.reasons)
    assert not planner.feasible(cfg(BLOCK_N=256)) and not planner.feasible(cfg(BLOCK_M=64))
    assert planner.shared_memory(cfg(128, CAUSAL=True)) == 197148      # the workers need N_Q
    with pytest.raises(ValueError, match="HEAD_DIM and DTYPE"):
        planner.shared_memory(Config())


@pytest.mark.parametrize("d, bn", [(128, 128), (64, 128), (128, 64), (64, 64)])
def test_the_tensor_memory_map(d, bn):
    c = cfg(d, BLOCK_N=bn)
    rows = {name: (first, width) for name, first, width, _ in planner.tmem_map(c)}
    allocs = [rows[n] for n in ("S0", "S1", "O0", "O1")]
    assert sum(w for _, w in allocs) == planner.tmem_columns_used(c) <= 512
    spans = sorted((a, a + w) for a, w in allocs)
    assert all(b <= c2 for (_, b), (c2, _) in zip(spans, spans[1:])), "allocations overlap"
    for t in (0, 1):
        s0, sw = rows[f"S{t}"]
        for inside in (f"P{t}", f"alpha{t}", f"m{t}, l{t}"):
            a, w = rows[inside]
            assert s0 <= a and a + w <= s0 + sw, inside
        assert rows[f"P{t}"][1] == bn // 2                     # 16-bit, two a column
        assert rows[f"alpha{t}"][0] == rows[f"P{t}"][0] + bn // 2   # after P, not inside it
    assert planner.tmem_columns(c) == max(32, 1 << (planner.tmem_columns_used(c) - 1).bit_length())


# ------------------------------------------------------------------------------- the kernel
@pytest.fixture(scope="module")
def fa4():
    from flashbook.chapters.ch7 import gluon_fa4
    return gluon_fa4


def test_the_shim_names_this_tritons_api(fa4):
    import triton
    if fa4.TRITON_VERSION >= (3, 9):
        assert fa4.SHIM == dict(tma_load="async_load", tma_store="async_store",
                                tmem_reg_layout="tensor_memory_descriptor_type.get_reg_layout",
                                tmem_reinterpret="reinterpret")
    assert triton.__version__.startswith(".".join(map(str, fa4.TRITON_VERSION)))
    args = fa4.kernel_args(planner.best(128))
    assert args["constexprs"]["SOFTMAX_REGS"] == 192 and args["options"] == {"num_warps": 4}
    args = fa4.kernel_args(cfg(SOFTMAX_REGS=184, SINGLE_WARP_REGS=32))
    assert (args["constexprs"]["SOFTMAX_REGS"], args["constexprs"]["SINGLE_WARP_REGS"]) == \
        (184, 32)
    with pytest.raises(ValueError, match="written for one warpgroup"):
        fa4.kernel_args(cfg(CORRECTION_WARPS=8))


def qkv(B=1, H=2, N=128, d=64, dtype=torch.float16, n_k=None):
    n_k = N if n_k is None else n_k
    return (torch.randn(B, H, N, d, dtype=dtype), torch.randn(B, H, n_k, d, dtype=dtype),
            torch.randn(B, H, n_k, d, dtype=dtype))


@pytest.mark.parametrize("make, kwargs, text", [
    (lambda: qkv(), {}, "runs only on a CUDA GPU of compute capability 10.0"),
    (lambda: qkv(dtype=torch.float32), {}, "torch.float16 or torch.bfloat16"),
    (lambda: tuple(t[0] for t in qkv()), {}, "must be 4-D"),
    (lambda: qkv(d=256), {}, "d=256 is not supported"),
    (lambda: (qkv()[0], qkv(N=64)[1], qkv()[2]), {}, "k and v must be"),
    (lambda: (qkv()[0].transpose(1, 2).contiguous().transpose(1, 2), *qkv()[1:]), {},
     "must be contiguous"),
    (lambda: qkv(), dict(softmax_scale=0.0), "softmax_scale"),
    (lambda: qkv(), dict(config=Config(STAGES=9)), "does not fit a B200"),
    (lambda: qkv(), dict(config=cfg(128)), "config is for d=128"),
    (lambda: qkv(), dict(config={"STAGES": 2}), "must be a"),
])
def test_launcher_names_the_problem(fa4, make, kwargs, text):
    q, k, v = make()
    with pytest.raises(ValueError, match=text):
        fa4.attention_fa4(q, k, v, **kwargs)


# ------------------------------------------------------------ slow: compile for sm_100a again
# the chapter's config, and one at d = 64 (tensor memory rounded up, causal, a 3-slot ring),
# compiled with Triton's IR dump on, to see where the TMEM buffers went
RECOMPILE = [planner.TABLE_CONFIGS[0], planner.TABLE_CONFIGS[3]]
# other register requests (Exercise 5's what-ifs): Triton's split is the planner's
SPLITS = [dict(SOFTMAX_REGS=184), dict(SINGLE_WARP_REGS=32)]
AOT = r'''
import os, re
from flashbook.chapters.ch7 import planner
log = os.path.join(os.environ["TRITON_CACHE_DIR"], "mlir.log")
fresh = []
for i, c in enumerate(RECOMPILE):
    if i == 1:                             # the IR after allocation, on stderr: into a file
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        saved = os.dup(2)
        os.dup2(fd, 2)
        os.environ["MLIR_ENABLE_DUMP"] = "1"
    try:
        fresh.append(planner.compile_entry(*c))
    finally:
        if i == 1:
            os.environ.pop("MLIR_ENABLE_DUMP")
            os.dup2(saved, 2)
            os.close(fd)
offsets = sorted(set(re.findall(r"tensor_memory_col_offset = (\d+) : i32, "
                                r"tensor_memory_row_offset = 0 : i32\} : \(\) -> "
                                r"!ttg.memdesc<2x128x(\d+)xf32", open(log).read())))
splits = [planner.compile_entry(64, "float16", 64, 2, False, **s) for s in SPLITS]
print("RESULT" + json.dumps(dict(fresh=fresh, offsets=offsets, splits=splits)))
'''


@pytest.mark.slow
def test_the_compiled_table_is_what_compiling_gives(tmp_path):
    """Recompile two stored configs for sm_100a (a subprocess with an empty Triton cache,
    about 30 s): the stored figures must be what the compiler reports now, or the table is stale
    (regenerate it with the command in its provenance). Also: S0/S1 start at column 0 and
    O0/O1 right after them, as planner.tmem_map says."""
    res = compile_script(f"RECOMPILE = {RECOMPILE!r}\nSPLITS = {SPLITS!r}\n" + AOT, tmp_path)
    prov = planner.compiled_table()["provenance"]
    import triton
    for new in res["fresh"]:
        old = planner.compiled_entry(_config(new))
        stale = (f"data/ch7_compiled.json is stale for {new}: stored {old}; regenerate with "
                 f"`{prov['command']}`")
        for field in ("shared", "tmem_size", "tmem_alloc", "num_warps", "reqntid", "maxnreg",
                      "setmaxnreg", "mma_ss", "mma_ts", "tma_loads", "tma_stores", "n_regs"):
            assert new[field] == old[field], stale
        if triton.__version__ == prov["triton"]:
            assert new["stack"] <= 32 and new["spill_stores"] <= 16, new
    for split, new in zip(SPLITS, res["splits"]):
        want = planner.register_budget(cfg(64, **split))
        assert {want["softmax"], want["correction"], want["single_warp"]} <= \
            set(new["setmaxnreg"]), (split, new["setmaxnreg"])
        assert new["maxnreg"] == want["launch"] and new["reqntid"] == 512
    d, dtype, bn, stages, causal = RECOMPILE[1]
    c = Config(BLOCK_N=bn, STAGES=stages, CAUSAL=causal).for_inputs(d, dtype)
    rows = {name: first for name, first, _, _ in planner.tmem_map(c)}
    assert [tuple(map(int, o)) for o in res["offsets"]] == [(rows["S0"], bn), (rows["O0"], d)], \
        res["offsets"]
    assert json.dumps(res)
