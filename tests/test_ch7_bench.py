"""Chapter 7's benchmark without a GPU: every trick setting of Chapter 3's kernel computes
attention in the interpreter (the probes as documented), every setting of both kernels compiles
for sm_90 ahead of time, and the Gluon kernel's cubic is Chapter 7's."""
import math

import pytest
import torch

from flashbook.tiles import pick_config
from flashbook.chapters.ch7 import benchmark as bench
from flashbook.chapters.ch7.exp2poly import fit_exp2
from flashbook.reference import attention

from aot_compile import compile_script


def test_gluon_cubic_is_the_chapter_fit():
    from flashbook.chapters.ch7.gluon_tricks import EXP2_CUBIC
    assert EXP2_CUBIC == pytest.approx(fit_exp2(3), rel=1e-7)


def test_gluon_hooks_of_each_setting():
    from flashbook.chapters.ch7 import gluon_tricks as gt
    assert gt.hooks() == {} and gt.hooks("poly") == {"EXP2": gt.exp2_poly}
    assert gt.TAU == bench.TAU and set(gt.hooks("hw", bench.TAU)) == {"MOVE_MAX", "RESCALE"}
    for bad in (dict(exp2="cubic"), dict(rescale_tau=4.0)):
        with pytest.raises(ValueError):
            gt.hooks(**bad)


def test_head0_reference_is_float64_attention():
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 3, 70, 16, generator=g) for _ in range(3))
    want = attention(q.double(), k.double(), v.double())[0, 0]
    torch.testing.assert_close(bench.head0_reference(q, k, v), want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("suffix", list(bench.TRICKS))
def test_trick_settings_in_chapter3_kernel(suffix):
    """N = 100 with 32-key tiles: full tiles and a masked tail; the threshold is crossed on the
    first tile only (random logits), so lazy rows stay exact to fp16 rounding."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 100, 64, generator=g).half() for _ in range(3))
    want = bench.head0_reference(q, k, v)
    ns = bench.triton_namespace(*bench.TRICKS[suffix])
    o = bench.launch_two_tiles(ns["attn_fwd_two_tiles"], q, k, v,
                               pick_config(64, torch.float16, None, two_tiles=True))
    err = bench.error(o, want)
    if suffix == "_no_exp":
        assert err > 0.05, "the probe without exponentials must not compute attention"
    else:
        assert err < 2e-3, f"{suffix}: max |O - O_ref| = {err:.1e}"
    assert math.isfinite(err)


def test_lazy_rows_time_the_chapters_attention_lazy_as_called(monkeypatch):
    """The chapter's entry point, once with its config and once as a reader calls it; the
    recorded summary sets the two side by side."""
    from flashbook import sources
    from flashbook.chapters.ch7 import recorded
    def measure(name, role, setup, note="", **kw):       # 2 ms, 100 TFLOP/s: made up
        _, checked = setup()
        return bench.Row(name, role, kw["B"], kw["H_q"], kw["H_q"], kw["N_q"], kw["N_q"],
                         kw["d"], "float16", False, 2.0, 100.0, None, None,
                         note=f"{note}; {checked}")
    monkeypatch.setattr(bench, "measure", measure)
    import flashbook.bench as fbench
    calls = []
    monkeypatch.setattr(fbench, "time_ms", lambda fn, graph=False: calls.append(fn()) or 2.5)
    attention_lazy = sources.solution_namespace("ch7")["attention_lazy"]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 64, 32, generator=g).half() for _ in range(3))
    want = bench.head0_reference(q, k, v)
    kw = bench.columns(1, 2, 64, 32, torch.float16)
    rows = bench.lazy_rows(attention_lazy, q, k, v, want, None, **kw)
    assert [(r.kernel, r.role) for r in rows] == [("ch7_attention_lazy", "reference"),
                                                   ("ch7_attention_lazy", "public")]
    o, lse, counts = calls[0]                     # the public call ran the real wrapper
    torch.testing.assert_close(o[0, 0].double(), want, atol=2e-3, rtol=0)
    assert rows[1].note == "attention_lazy(q, k, v)" and rows[1].tflops == 80.0
    assert float(rows[0].note.split("err=")[1]) < 2e-3
    line = recorded.lazy_as_called(rows, recorded.case(rows[0]))
    assert line.endswith("80 TFLOP/s, 0.80x its launch replayed from a CUDA graph")
    bf16 = [t.bfloat16() for t in (q, k, v)]
    assert bench.lazy_rows(attention_lazy, *bf16, want, None, **kw) == []   # fp16 only


AOT = r'''
from flashbook.chapters.ch7 import benchmark as bench
from flashbook import fa3_launch as gluon_fa3, fa3_planner as planner
from flashbook.chapters.ch7.gluon_tricks import hooks
from flashbook.tiles import pick_config
GLUON = ("", "_lazy_poly", "_exp_x2")     # the Gluon code paths: as shipped, both tricks, a probe
res = []
for suffix, (exp2, tau) in bench.TRICKS.items():
    k = bench.triton_namespace(exp2, tau)["attn_fwd_two_tiles"]
    for dtype, t in ((torch.float16, "fp16"), (torch.bfloat16, "bf16"))[:2 if not suffix else 1]:
        cfg = pick_config(128, dtype, (9, 0), two_tiles=True)
        const = dict(HEAD_DIM=128, BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, DOT_PRECISION="tf32")
        s = signature(k, dict(Q="*" + t, K="*" + t, V="*" + t, O="*" + t, LSE="*fp32",
                              qk_scale="fp32"), const)
        c = triton.compile(ASTSource(fn=k, signature=s, constexprs=const),
                           target=GPUTarget("cuda", 90, 32),
                           options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
        ptx = c.asm["ptx"]
        res.append(dict(kernel="ch3" + suffix, dtype=t, ex2=ptx.count("ex2.approx"),
                        shared=c.metadata.shared))
    if suffix in GLUON:
        c = gluon_fa3.compile_for_sm90(planner.best(128).for_inputs(128, "float16"), False,
                                       hooks(exp2, tau))
        res.append(dict(kernel="gluon" + suffix, dtype="fp16",
                        ex2=c.asm["ptx"].count("ex2.approx"), shared=c.metadata.shared))
print("RESULT" + json.dumps(res))
'''


@pytest.mark.slow
def test_every_setting_compiles_for_sm90(tmp_path):
    """The GPU run must not be where a setting first fails to compile; the PTX shows what each
    setting does to the special-function unit's exponentials. Compiled to PTX (all this test
    reads): the shipped Gluon kernel's cubin is built in tests/test_ch7_gluon.py."""
    res = {(r["kernel"], r["dtype"]): r for r in compile_script(AOT, tmp_path, ptx_only_for=(90,))}
    assert len(res) == len(bench.TRICKS) + 1 + 3          # bf16 for Chapter 3's kernel as is
    assert res["ch3", "bf16"]["shared"] == res["ch3", "fp16"]["shared"]
    gluon = {s: res["gluon" + s, "fp16"]["ex2"] for s in ("", "_lazy_poly", "_exp_x2")}
    assert gluon["_exp_x2"] > 1.8 * gluon[""] and gluon["_lazy_poly"] < 0.2 * gluon[""]
    ex2 = {s: res["ch3" + s, "fp16"]["ex2"] for s in bench.TRICKS}
    base = ex2[""]
    assert ex2["_exp_x2"] > 1.8 * base               # two exponentials per score
    assert ex2["_poly"] < 0.2 * base                 # only alpha's (one per row) stay
    assert ex2["_no_exp"] < 0.2 * base
    assert 0.4 * base < ex2["_poly_half"] < 0.7 * base
