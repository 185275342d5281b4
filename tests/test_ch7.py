"""Chapter 7's own tests: the TMEM rules on hand-made maps, the lazy rule's replay, the polynomial
fit and its shift invariance, the design model's arithmetic, the figures; and the lazy kernel
with both exponentials compiling ahead of time for sm_75 and sm_90. (The solution earning every
check and each known-wrong variant failing for its reason are the contract tests of
tests/test_chapters.py.)"""
import itertools
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from flashbook import sources  # noqa: E402
from flashbook.chapters import ch7  # noqa: E402
from flashbook.grade.cellmeta import grade_id, is_graded_test  # noqa: E402

from aot_compile import compile_script, too_big  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "solutions" / "ch7_blackwell.py"
NB = sources.read(SOURCE)
CELLS = [c for c in NB.cells if c.cell_type == "code" and not is_graded_test(c)
         and not sources.is_demo(c)]
BY_ID = sources.cells_by_id(NB)
_COUNT = itertools.count()


def namespace(replace=None) -> dict:
    """The notebook's definition cells run in order (``replace``: grade_id -> other source)."""
    ns = sources.fresh_module(f"test_ch7_{next(_COUNT)}").__dict__
    for i, cell in enumerate(CELLS):
        src = (replace or {}).get(grade_id(cell), cell.source)
        sources.exec_cell(src, sources.cell_name("ch7", 1000 * next(_COUNT) + i, src), ns)
    return ns


@pytest.fixture(scope="module")
def solution():
    return namespace()


# ------------------------------------------------------------------------------ TMEM

def test_seed_map_is_valid_and_the_solution_reproduces_it(solution):
    assert ch7.tmem_problems(ch7.SEED_MAP, 128) == []
    assert solution["plan_tmem"](128) == ch7.SEED_MAP


@pytest.mark.parametrize("edit, rule", [
    (dict(O0=(128, 128)), "overlap: S1"),
    (dict(P0=(2, 64)), "misaligned: P0"),
    (dict(P1=(32, 64)), "alias: P1"),                     # inside S0, not S1
    (dict(P0=(0, 64)), "overlap: P0 (columns 0-63) and stats0"),
    (dict(O1=(480, 128)), "overflow: O1"),
    (dict(S0=(0, 64)), "widths: S0"),
])
def test_tmem_rules_name_the_broken_rule(edit, rule):
    alloc, plan = ch7.SEED_MAP
    found = ch7.tmem_problems((alloc, plan | edit), 128)
    assert any(p.startswith(rule) for p in found), found


def test_tmem_allocation_must_be_the_smallest_power_of_two(solution):
    alloc, plan = solution["plan_tmem"](64, 64)
    assert alloc == 256 and ch7.tmem_problems((alloc, plan), 64, 64) == []
    assert ch7.tmem_problems((512, plan), 64, 64)[0].startswith("allocation: 512 columns, but 256")
    assert "not a power of two" in ch7.tmem_problems((384, plan), 64, 64)[0]


# ------------------------------------------------------------------------------ lazy

def test_the_lazy_rule_replayed_on_a_hand_made_row():
    # one row, keys in tiles of 2, scores (base 2 once scaled): maxima 1, 4, 9.5, 10, 30
    d = 1
    c = ch7.lazy.LOG2E                                   # scale 1: qk_scale = log2(e)
    k = torch.tensor([0, 1, 3, 4, 9.5, 2, 10, 0, 30, 0], dtype=torch.float32) / c
    q = torch.ones(1, 1, 1, d)
    counts, margin = ch7.simulate_rescales(q, k.view(1, 1, -1, 1), tau=8.0, scale=1.0,
                                           block_m=16, block_n=2)
    # padded rows score 0 (their max stays 0); the real row: 1 (move), 4, 9.5 (8.5 > 8: move),
    # 10, 30 (20.5 > 8: move)
    assert counts.tolist() == [[[3]]] and margin == pytest.approx(0.5)
    counts, _ = ch7.simulate_rescales(q, k.view(1, 1, -1, 1), tau=0.0, scale=1.0, block_m=16,
                                      block_n=2)
    assert counts.tolist() == [[[5]]]                    # eager: the max grows on every tile


def test_lazy_solution_with_tau_0_rescales_whenever_a_max_grows(solution):
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 1, 40, 16, generator=g) for _ in range(3))
    k[..., 0] += torch.linspace(0, 6, 40)                # maxima keep growing a little
    cfg = ch7.lazy.pick_config(16, torch.float32, None)
    o, lse, counts = solution["attention_lazy"](q, k, v, max_growth=1.0, config=cfg)
    want, _ = ch7.simulate_rescales(q, k, tau=0.0, block_m=cfg.BLOCK_M, block_n=cfg.BLOCK_N)
    assert torch.equal(counts, want)
    ref = ch7.lazy.attention(q.double(), k.double(), v.double())
    torch.testing.assert_close(o.double(), ref, atol=2e-5, rtol=1e-4)


def test_launch_refuses_a_threshold_that_overflows_float16(solution):
    q = torch.randn(1, 1, 16, 16, dtype=torch.float16)
    with pytest.raises(ValueError, match="65504"):
        solution["attention_lazy"](q, q, q, max_growth=2.0 ** 16)


# ------------------------------------------------------------------------------ exp2

def test_fit_errors_fall_by_about_25_a_degree_and_match_chebyshev():
    errs = [ch7.fit_error(k) for k in (2, 3, 4)]
    for k, e in zip((2, 3, 4), errs):
        cheb = math.log(2) ** (k + 1) / (math.factorial(k + 1) * 2 ** (2 * k + 1))
        assert 0.9 * cheb < e < 1.1 * cheb, (k, e, cheb)
    assert errs[1] < ch7.BOUND < errs[0]


def test_floor_reduction_with_its_own_fit_is_as_good_as_round():
    x = torch.cat([torch.linspace(-126.0, 0.0, 1 << 18), ch7.exp2poly.all_floats(-1.0, -0.5, 16)])
    for reduction, (lo, hi) in (("round", (-0.5, 0.5)), ("floor", (0.0, 1.0))):
        y = ch7.exp2poly.reference_exp2(x, ch7.fit_exp2(3, lo, hi), reduction)
        err = (y.double() / torch.exp2(x.double()) - 1).abs().max().item()
        assert err < 8e-5, (reduction, err)


def test_all_floats_enumerates_a_binade():
    x = ch7.exp2poly.all_floats(-1.0, -0.5)
    assert x.numel() == 2 ** 23 and x.min() == -1.0 and x.max() < -0.5
    assert ch7.exp2poly.all_floats(1.0, 2.0, 4).numel() == 2 ** 21


# ------------------------------------------------------------------------------ design

def test_register_split_and_roles():
    assert sum(t * r for _, t, r in ch7.design.register_split()) == 65536
    assert sorted(w for r in ch7.design.ROLES for w in r.warps) == list(range(16))
    c = ch7.tile_cycles(ch7.design.B200, 128)
    assert c["mma"] == c["exp"] == 1024
    assert ch7.tile_cycles(ch7.design.H100, 128)["mma"] == 2048
    r = ch7.best_emulated_fraction()
    c = ch7.tile_cycles(ch7.design.B200, 128, emulated=r)
    assert c["exp"] == pytest.approx(c["fma"])


def test_static_schedule_covers_every_tile_once():
    sched = ch7.static_schedule(23, 5)
    assert sorted(t for mine in sched for t in mine) == list(range(23))
    assert sched[1] == [1, 6, 11, 16, 21]
    assert ch7.tile_coord(5, 1024, 3) == (1, 1, 0)       # 4 query blocks per head


def test_figures_draw():
    figs = [ch7.plot_unit_cycles(), ch7.plot_roles(), ch7.plot_tmem(ch7.SEED_MAP),
            ch7.plot_lazy_trace(), ch7.plot_exp2_error()]
    assert all(f.axes for f in figs)
    plt.close("all")


# ------------------------------------------------------------------- compiled for GPUs

AOT_SCRIPT = r'''
from pathlib import Path
from flashbook.chapters.ch3 import pick_config
from flashbook.chapters.ch7 import lazy
from flashbook.grade.cellmeta import grade_id, is_graded_test
nb = sources.read(Path("solutions/ch7_blackwell.py"))
ns = sources.fresh_module("aot_ch7").__dict__
for i, c in enumerate(nb.cells):
    if c.cell_type == "code" and not is_graded_test(c) and not sources.is_demo(c):
        sources.exec_cell(c.source, sources.cell_name("ch7", i, c.source), ns)
ptr = dict(Q="*fp16", K="*fp16", V="*fp16", O="*fp16", LSE="*fp32", RESCALES="*i32",
           qk_scale="fp32", tau="fp32")
res = []
for cc in (75, 90):
    cfg = pick_config(128, torch.float16, (cc // 10, cc % 10))
    for name, exp2 in (("hw", lazy.hw_exp2), ("poly", ns["exp2_poly_tl"])):
        const = dict(UPDATE=ns["lazy_update"], EXP2=exp2, HEAD_DIM=128, BLOCK_M=cfg.BLOCK_M,
                     BLOCK_N=cfg.BLOCK_N, DOT_PRECISION="tf32")
        k = lazy.attn_fwd_lazy
        c = triton.compile(ASTSource(fn=k, signature=signature(k, ptr, const), constexprs=const),
                           target=GPUTarget("cuda", cc, 32),
                           options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
        ptx = c.asm["ptx"]
        res.append(dict(kernel=f"attn_fwd_lazy/{name}", cc=cc, shared=c.metadata.shared,
                        ex2=ptx.count("ex2.approx")))
print("RESULT" + json.dumps(res))
'''


@pytest.mark.slow
def test_lazy_kernel_compiles_for_t4_and_h100_with_both_exponentials(tmp_path):
    """To a cubin for the T4 (students' Colab GPU), to PTX for the H100: what is checked (the
    exponentials, the shared memory) is in the PTX, and the H200 runs the kernel for real."""
    res = compile_script(AOT_SCRIPT, tmp_path, ptx_only_for=(90,))
    assert len(res) == 4
    assert not too_big(res), f"configs that do not fit shared memory: {too_big(res)}"
    for r in res:      # the polynomial version keeps MUFU for nothing but LSE's log2
        assert (r["ex2"] > 0) == r["kernel"].endswith("hw"), r
