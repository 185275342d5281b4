"""Chapter 6's benchmark on a CPU: its FLOP and byte counts, row construction, the guard that turns
any failure into a noted row, the students' kernel's lookup, and ``recorded.py`` on a small set
of rows.

The rows of ``fixture_rows`` are TEST FIXTURES with made-up numbers: they are not measurements
and must never be written to ``src/flashbook/data/bench``. The real data comes only from
``flashbook bench ch6`` on a GPU.
"""
import functools
import math

import matplotlib
import pytest
import torch

from flashbook import bench_setups, results
from flashbook.bench import Peak
from flashbook.bench_setups import case_columns
from flashbook.cases import AttnCase
from flashbook.chapters.ch6 import benchmark as b, benchmark_jax as bj
from flashbook.chapters.ch6 import recorded

matplotlib.use("Agg")

H200 = Peak("H200", 989.0, 67.0, 4800.0)


def _dense(B, H, N, d, dtype, causal):
    return AttnCase("fixture", B=B, H_q=H, N_q=N, d=d, dtype=dtype, causal=causal)


# ------------------------------------------------------------------------------ cases, rows

def test_cases_are_fp16_everywhere_and_bf16_at_the_headline_shape():
    cs = b.cases()
    assert len(cs) == 2 * len(b.SHAPES) + 2 * len(b.BF16_SHAPES)
    assert [c.causal for c in cs[:2]] == [False, True]
    assert {b.shape(c) for c in cs if c.dtype == torch.float16} == set(b.SHAPES)
    assert {b.shape(c) for c in cs if c.dtype == torch.bfloat16} == {(1, 16, 16384, 128)}


@pytest.mark.parametrize("causal", [False, True])
def test_flops_and_bytes_of_a_case(causal):
    cols = case_columns(_dense(1, 16, 16384, 128, torch.float16, causal))
    pairs = 16384 * 16384 / (2 if causal else 1)
    assert cols["flops"] == 4 * 16 * pairs * 128                # QK^T and PV, 2 FLOPs a MAC
    assert cols["nbytes"] == 2 * 4 * 16 * 16384 * 128           # read Q, K, V, write O in fp16
    assert case_columns(_dense(4, 16, 4096, 64, torch.bfloat16, causal))["flops"] == \
        4 * 4 * 16 * 4096 * 4096 * 64 / (2 if causal else 1)


def test_a_row_of_a_case_has_its_columns_and_rates(monkeypatch):
    monkeypatch.setattr(bench_setups, "timed_ms", lambda fn: (4.0, ""))
    monkeypatch.setattr(bench_setups, "gpu_peak", lambda: H200)
    c = _dense(1, 16, 16384, 128, torch.float16, False)
    r = b.measure("ch6_gluon_fa3", "reference", c, lambda: ((lambda: None), "cfg"))
    assert (r.B, r.H_q, r.H_kv, r.N_q, r.N_k, r.d, r.dtype, r.causal) == \
        (1, 16, 16, 16384, 16384, 128, "float16", False)
    assert r.tflops == pytest.approx(case_columns(c)["flops"] / 4e-3 / 1e12)
    assert r.pct_peak == pytest.approx(100 * r.tflops / 989.0)
    assert r.note == "cfg" and r.peak_mib is None


# ------------------------------------------------------------------------------ the guard

def _case(causal=False, dtype=torch.float16):
    return _dense(1, 2, 256, 64, dtype, causal)


def test_a_failing_setup_is_a_row_saying_where_a_bare_assert_failed():
    def setup():
        raise AssertionError        # what a bare ``assert x is not None`` raises (no message)
    r = b.measure("jax_pallas_fa3", "baseline", _case(), setup, note="block_q=64")
    assert r.ms is None and r.tflops is None
    assert r.note.startswith("block_q=64; not measured: AssertionError at test_ch6_benchmark.py:")
    assert "(raise AssertionError" in r.note


def test_the_check_flags_a_wrong_output():
    want = torch.zeros(1, 2, 4, 8)
    x = b.Inputs(*(want,) * 6, want={False: ("sdpa_cudnn", want)})
    check = x.check(False)
    assert check(want + 1e-3) == "max|O-sdpa_cudnn|=1.0e-03"
    assert check(want + 1.0).endswith(f" WRONG (> {b.TOLERANCE:g})")
    assert "WRONG" in check(torch.full_like(want, math.nan))
    assert "WRONG" in check(torch.zeros(1, 2, 4, 4))                      # bad shape
    assert x.check(True)(want) == ""                                      # no reference


# ------------------------------------------------------------------------------ JAX helpers

def test_jax_call_count_fills_the_target_within_limits():
    assert bj.jax_calls(3.0, 300, (10, 200)) == 100
    assert bj.jax_calls(100.0, 300, (10, 200)) == 10
    assert bj.jax_calls(0.01, 300, (10, 200)) == 200
    assert bj.jax_calls(0.0, 300, (10, 200)) == 200


def test_jax_block_kv_keeps_the_order_of_jax_benchmark():
    assert bj.jax_block_kv(16384) == [256, 128, 64]
    assert bj.jax_block_kv(4224) == [128, 64]                   # 4224 = 33 * 128
    assert bj.jax_block_kv(100) == []


@pytest.mark.parametrize("cupti_works", [True, False])
def test_jax_time_takes_the_cupti_median_else_the_blocking_call(monkeypatch, cupti_works):
    """JAX rows: CUPTI's per-call kernel times (median), do_bench of the blocking call as the
    cross-check, and that wall-clock time where CUPTI fails (here both are stubs: no GPU)."""
    pytest.importorskip("jax")
    import triton.testing
    from jax.experimental.mosaic.gpu import profiler

    def measure(f, iterations=1):
        if not cupti_works:
            raise RuntimeError("CUPTI profiling is not supported on this platform")
        return lambda *args: (f(*args), [3.0, 1.0, 2.0][:iterations])
    monkeypatch.setattr(profiler, "measure", measure)
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: (fn(), 1.5)[1])
    ms, note = bj.jax_time(functools.partial(lambda x: x + 1, 1.0))
    if cupti_works:
        assert ms == 2.0 and note.startswith("timed: CUPTI kernel time, median of 3 calls; ")
        assert "do_bench(block_until_ready) 1.5 ms" in note
    else:
        assert ms == 1.5 and "CUPTI failed: RuntimeError: CUPTI profiling" in note
    assert "jax 0." in note


def test_a_solution_without_its_consumer_is_a_pallas_row_saying_so():
    case = _case()
    r = b.measure("ch6_pallas_fa3", "variant", case, bj.pallas_setup(case, None, dict))
    assert r.ms is None and "no Exercise 4 consumer (fa3_consumer)" in r.note


def test_a_solution_that_does_not_load_is_a_row_saying_so(monkeypatch):
    from flashbook import sources

    def broken(chapter, *a, **kw):
        raise SyntaxError("invalid syntax (<cell ch3_attn_tile>, line 3)")
    monkeypatch.setattr(sources, "solution_namespace", broken)
    namespaces = {}
    case = _case()
    r = b.measure("ch3_two_tiles", "variant", case, b.ch3_setup(case, None, namespaces))
    assert r.note == ("not measured: RuntimeError: the ch3 solution did not load: SyntaxError: "
                      "invalid syntax (<cell ch3_attn_tile>, line 3)")


def test_sort_rows_follows_cases_then_kernels():
    cs = [_case(False), _case(True)]
    rows = [fixture_row(k, "baseline", c, None) for c in reversed(cs)
            for k in ("sdpa_flash", "jax_pallas_fa3", "ch6_gluon_fa3")]
    got = [(r.causal, r.kernel) for r in b.sort_rows(rows, cs)]
    assert got == [(False, "ch6_gluon_fa3"), (False, "jax_pallas_fa3"), (False, "sdpa_flash"),
                   (True, "ch6_gluon_fa3"), (True, "jax_pallas_fa3"), (True, "sdpa_flash")]


def test_run_on_cpu_never_crashes_and_gives_a_row_per_kernel_and_case(monkeypatch):
    """No GPU here: every GPU kernel fails, each into its own row (the Triton kernels of
    Chapters 3 and 4 are left out: the interpreter is slow)."""
    kernels = ["ch6_gluon_fa3", "ch6_pallas_fa3", "sdpa_cudnn"]
    rows = b.run(shapes=[(1, 2, 128, 64)], bf16_shapes=[], kernels=kernels, device="cpu")
    roles = [("ch6_gluon_fa3", "reference"), ("ch6_gluon_fa3", "public"),
             ("ch6_pallas_fa3", "variant"), ("sdpa_cudnn", "baseline")]
    assert [(r.kernel, r.role, r.causal) for r in rows] == [(k, role, c) for c in (False, True)
                                                            for k, role in roles]
    for r in rows:
        public = r.role == "public"     # the call as a reader makes it, named in its note
        assert r.ms is None and r.note.startswith(
            "attention_fa3(q, k, v, causal); not measured: " if public else "not measured: "), r


# ------------------------------------------------------------------------------ recorded.py

SHAPES = [(1, 16, 16384, 128), (4, 16, 4096, 128), (4, 16, 4096, 64)]


def fixture_row(kernel, role, case, ms, note=""):
    """TEST FIXTURE: a row of ``case`` taking ``ms`` (None: not measured) on an H200."""
    if ms is None:
        return results.Row(kernel, role, case.B, case.H_q, case.H_q, case.N_q, case.N_q, case.d,
                           str(case.dtype)[6:], case.causal, None, None, None, None, note=note)
    tflops = case_columns(case)["flops"] / (ms * 1e-3) / 1e12
    return results.Row(kernel, role, case.B, case.H_q, case.H_q, case.N_q, case.N_q, case.d,
                       str(case.dtype)[6:], case.causal, ms, tflops,
                       case_columns(case)["nbytes"] / (ms * 1e-3) / 1e9, 100 * tflops / 989.0,
                       note=note)


def fixture_rows():
    """TEST FIXTURE: made-up TFLOP/s (not measurements), shaped like a run's rows."""
    made_up = {"ch6_gluon_fa3": 600.0, "ch6_pallas_fa3": 400.0, "jax_pallas_fa3": 500.0,
               "ch3_two_tiles": 520.0, "ch4_two_tiles": 450.0, "sdpa_cudnn": 550.0,
               "sdpa_flash": 300.0}
    rows = []
    for case in b.cases(SHAPES, [SHAPES[0]]):
        for kernel, role, _ in b.KERNELS:
            if (kernel == "ch3_two_tiles" and case.causal) or \
                    (kernel == "ch4_two_tiles" and not case.causal):
                continue
            tflops = made_up[kernel] * (0.8 if case.causal else 1.0) * (
                0.5 if case.d == 64 else 1.0)
            ms = case_columns(case)["flops"] / (tflops * 1e12) * 1e3
            note = "max|O-sdpa_cudnn|=1.2e-04"
            if kernel == "jax_pallas_fa3" and case.dtype == torch.bfloat16:
                ms, note = None, "not measured: ValueError: bf16 unsupported (fixture)"
            if kernel == "jax_pallas_fa3" and b.shape(case) == SHAPES[2] and case.causal:
                note = "max|O-sdpa_cudnn|=3.0e+00 WRONG (> 0.02)"
            rows.append(fixture_row(kernel, role, case, ms, note))
    return rows


def test_recorded_figures_are_the_comparisons():
    got = recorded.quoted_values(fixture_rows())
    assert got["ch6_ours_1_16384_128_noncausal"] == pytest.approx(600)
    assert got["ch6_cudnn_noncausal"] == pytest.approx(550)
    assert got["ch6_vs_cudnn_causal"] == pytest.approx(480 / 440)
    assert got["ch6_vs_jax_1_16384_128_causal"] == pytest.approx(1.2)
    assert got["ch6_jax_4_4096_64_noncausal"] == pytest.approx(250)
    # JAX's output was wrong there: no speed of it is quoted
    assert "ch6_jax_4_4096_64_causal" not in got and "ch6_vs_jax_4_4096_64_causal" not in got
    assert len([k for k in got if k.startswith("ch6_vs_jax_")]) == 2 * len(SHAPES) - 1


def test_recorded_figures_move_with_the_data_and_survive_the_csv(tmp_path):
    rows = fixture_rows()
    path = results.write(rows, tmp_path, "fixture", {"note": "test fixture, not data"})
    back = results.read(path)
    assert recorded.quoted_values(back) == pytest.approx(recorded.quoted_values(rows))
    faster = [r if r.kernel != "sdpa_cudnn" else
              fixture_row(r.kernel, r.role, _dense(r.B, r.H_q, r.N_q, r.d, torch.float16,
                                                   r.causal), r.ms / 2)
              for r in rows if r.dtype == "float16"]
    assert recorded.quoted_values(faster)["ch6_vs_cudnn_noncausal"] == pytest.approx(600 / 1100)


def test_recorded_refuses_to_quote_without_the_headline_rows():
    rows = [r for r in fixture_rows() if r.kernel != "ch6_gluon_fa3"]
    with pytest.raises(ValueError, match="no measured ch6_gluon_fa3"):
        recorded.quoted_values(rows)


def test_recorded_summary_lists_ratios_and_failures():
    text = recorded.summary(fixture_rows())
    first = text.splitlines()[0]
    assert first.startswith("fp16 non-causal (1, 16, 16384, 128): ch6_gluon_fa3 600 (61% of peak)")
    assert "sdpa_cudnn 550 (ours 1.09x)" in first and "jax_pallas_fa3 500 (ours 1.20x)" in first
    assert "bf16 causal (1, 16, 16384, 128) jax_pallas_fa3: not measured: ValueError" in text
    assert "fp16 causal (4, 16, 4096, 64) jax_pallas_fa3: max|O-sdpa_cudnn|=3.0e+00 WRONG" in text


def test_recorded_plot_has_a_panel_per_dtype_and_mask():
    import matplotlib.pyplot as plt
    fig = recorded.plot_recorded(fixture_rows())
    axes = fig.get_axes()
    assert len(axes) == 4
    assert [a.get_title() for a in axes] == ["fp16, non-causal", "fp16, causal",
                                            "bf16, non-causal", "bf16, causal"]
    labels = [t.get_text() for t in axes[0].get_legend().get_texts()]
    assert labels[0] == "ours (Gluon FA3)" and "Triton two-tile (ch3/ch4)" in labels
    plt.close(fig)
