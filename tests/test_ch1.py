"""Chapter 1's own pieces: its checks judge wrong answers (located, with the right reason) and
leave torch as they found it, the traffic model, the benchmark's naive attention, and the
time/memory figure on the recorded H200 data. (The solution, stubs and known-wrong variants are
checked through the contract in tests/test_chapters.py.)"""
from __future__ import annotations

import dataclasses
import re

import matplotlib
import pytest
import torch
import torch.nn.functional as F

from flashbook import reference, results
from flashbook.chapters import ch1
from flashbook.check import CheckFailure

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _good_attention(q, k, v, scale=None, causal=False):
    return reference.attention(q, k, v, scale=scale, causal=causal, return_lse=True)


# ------------------------------------------------------------------------- attention

def test_check_attention_accepts_the_reference(capsys):
    ch1.check_attention(_good_attention, hidden=True)
    assert capsys.readouterr().out == ""          # hidden runs print nothing when they pass
    ch1.check_attention(_good_attention)
    assert capsys.readouterr().out == "PASSED attention: 14/14 cases\n"   # 7 shapes x 2 masks


def test_attention_cases_keep_the_chapter_shapes():
    visible = ch1.attention_cases(causal=False)
    assert [(c.B, c.H_q, c.N_q, c.n_k, c.d) for c in visible] == [
        (1, 2, 16, 16, 16), (1, 1, 1, 1, 8), (2, 3, 13, 13, 16), (1, 2, 8, 8, 16),
        (1, 2, 5, 9, 16), (1, 1, 7, 7, 32), (1, 1, 6, 3, 8)]
    assert visible[3].logit_boost == 300.0 and visible[5].scale == 0.5
    both = ch1.attention_cases(hidden=True, dtypes=(torch.float32, torch.float16))
    assert len(both) == 10 * 2 * 2
    # the visible cases include rows that see no key under the causal mask (N_q > N_k)
    assert any(c.causal and c.N_q > c.n_k for c in ch1.attention_cases(causal=True))


def test_check_attention_points_at_wrong_rows_and_heads():
    def tail_bug(q, k, v, scale=None, causal=False):
        o, lse = _good_attention(q, k, v, scale, causal)
        o = o.clone()
        o[:, 1, 10:] += 1.0
        return o, lse
    with pytest.raises(CheckFailure) as e:
        ch1.check_attention(tail_bug, causal=False)
    msg = str(e.value)
    assert "Wrong rows: 10-15" in msg and "(0, 1)" in msg and "(0, 0)" not in msg


def test_check_attention_reports_nan_and_a_stub():
    def nan_out(q, k, v, scale=None, causal=False):
        o, lse = _good_attention(q, k, v, scale, causal)
        return torch.full_like(o, float("nan")), lse
    with pytest.raises(CheckFailure, match="contains NaN"):
        ch1.check_attention(nan_out)

    def stub(*a, **k):
        raise NotImplementedError()
    with pytest.raises(CheckFailure, match="not implemented yet"):
        ch1.check_attention(stub)


@pytest.mark.parametrize("bad", ["shape", "dtype", "top_left", "no_lse"])
def test_check_attention_rejects_wrong_answers(bad):
    def wrong(q, k, v, scale=None, causal=False):
        o, lse = _good_attention(q, k, v, scale, causal)
        if bad == "shape":
            return o[..., :-1], lse
        if bad == "dtype":
            return o.double(), lse
        if bad == "top_left":
            s = (q.double() @ k.double().transpose(-1, -2)) * (scale or q.shape[-1] ** -0.5)
            if causal:
                s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
            return (reference.softmax(s) @ v.double()).to(q.dtype), torch.logsumexp(s, -1).float()
        return o
    messages = {"shape": "shape (1, 2, 16, 15) but expected (1, 2, 16, 16)",
                "dtype": "O has dtype torch.float64, expected torch.float32",
                "top_left": "aligned bottom-right", "no_lse": "expected a tuple (O, LSE)"}
    with pytest.raises(CheckFailure, match=re.escape(messages[bad])):
        ch1.check_attention(wrong, causal=True if bad == "top_left" else None)


# --------------------------------------------------------------------------- softmax

def _unguarded(x):
    e = torch.exp(x - x.amax(-1, keepdim=True))
    return e / e.sum(-1, keepdim=True)


def test_check_softmax_visible_cases_catch_unguarded_masked_rows():
    with pytest.raises(CheckFailure, match="a row of only -inf"):
        ch1.check_softmax(_unguarded)   # the visible cases have a fully masked row


def test_softmax_check_forbids_the_library_and_restores_it():
    originals = (torch.softmax, torch.log_softmax, torch.Tensor.softmax, F.softmax, F.log_softmax)

    def library(x):
        w = x.float() if x.dtype == torch.float16 else x
        return torch.nan_to_num(torch.softmax(w, dim=-1), nan=0.0).to(x.dtype)
    for hidden in (False, True):                # visible and hidden: forbidden
        with pytest.raises(CheckFailure, match="written by hand"):
            ch1.check_softmax(library, hidden=hidden)
    assert (torch.softmax, torch.log_softmax, torch.Tensor.softmax, F.softmax,
            F.log_softmax) == originals
    assert torch.allclose(torch.softmax(torch.zeros(2), 0), torch.full((2,), 0.5))


def test_check_softmax_rejects_a_changed_dtype():
    with pytest.raises(CheckFailure, match="expected the input's dtype torch.float16"):
        ch1.check_softmax(lambda x: reference.softmax(x.double()).to(
            torch.float32 if x.dtype == torch.float16 else x.dtype), hidden=True)


# --------------------------------------------------------------------- traffic model

def test_traffic_model_matches_the_chapter_table():
    """Q, K read, S written; S read, P written; P, V read, O written: 4Nd + 4N^2 elements."""
    B, H, N, d, e = 2, 3, 10, 4, 2
    assert ch1.expected_traffic(B, H, N, d, e) == (4 * B * H * N * N * d,
                                                   e * B * H * (4 * N * d + 4 * N * N))


def test_check_traffic_accepts_any_exact_form(capsys):
    ch1.check_traffic(lambda B, H, N, d, e: {"flops": 2 * 2 * B * H * N * N * d,
                                             "bytes": 4 * e * B * H * N * (d + N)}, hidden=True)
    assert capsys.readouterr().out == ""
    ch1.check_traffic(lambda B, H, N, d, e: {"flops": 2 * 2 * B * H * N * N * d,
                                             "bytes": 4 * e * B * H * N * (d + N)})
    assert "PASSED naive_traffic: 3/3 cases" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, message", [
    (lambda B, H, N, d, e: {"flops": 4 * B * H * N * N * d, "bytes": e * B * H * (4 * N * d + 2 * N * N)},
     "bytes = "),                                   # S and P counted once each
    (lambda B, H, N, d, e: {"flops": 4 * B * H * N * N * d, "bytes": B * H * (4 * N * d + 4 * N * N)},
     "bytes = "),                                   # elements, not bytes
    (lambda B, H, N, d, e: {"flops": 4 * N * N * d, "bytes": e * B * H * (4 * N * d + 4 * N * N)},
     "flops = "),                                   # one head only
    (lambda B, H, N, d, e: (4 * B * H * N * N * d, e * B * H * (4 * N * d + 4 * N * N)),
     "return a dict"),
])
def test_check_traffic_rejects_wrong_models(wrong, message):
    with pytest.raises(CheckFailure, match=message):
        ch1.check_traffic(wrong, hidden=True)


def test_check_traffic_reports_a_stub():
    def stub(B, H, N, d, e):
        raise NotImplementedError()
    with pytest.raises(CheckFailure, match="not implemented yet"):
        ch1.check_traffic(stub)


# ------------------------------------------------------------------- benchmark, figure

@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n_q, n_k", [(7, 7), (5, 9)])
def test_benchmark_naive_attention_matches_the_reference(causal, n_q, n_k):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, n_q, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, 2, n_k, 8, generator=g, dtype=torch.float64) for _ in range(2))
    got = ch1.benchmark.naive_attention(q, k, v, causal=causal)
    torch.testing.assert_close(got, reference.attention(q, k, v, causal=causal))


def test_benchmark_sweep_on_cpu_gives_rows():
    rows = ch1.benchmark.sweep([16, 32], B=1, H=1, d=8, dtype=torch.float32, device="cpu",
                               baselines=(None,))
    assert [(r.kernel, r.role, r.N_q) for r in rows] == [
        ("naive_torch", "reference", 16), ("sdpa", "baseline", 16),
        ("naive_torch", "reference", 32), ("sdpa", "baseline", 32)]
    assert all(isinstance(r, results.Row) and r.ms > 0 and r.peak_mib is not None for r in rows)


def test_benchmark_sweep_times_the_chapters_naive_attention_as_called():
    """The public row runs the solution's naive_attention (the function the chapter shows)."""
    calls = []

    def chapter_attention(q, k, v):
        calls.append(q.shape)
        return ch1.benchmark.naive_attention(q, k, v)
    rows = ch1.benchmark.sweep([16], B=1, H=1, d=8, dtype=torch.float32, device="cpu",
                               baselines=(None,), chapter_attention=chapter_attention)
    assert [(r.kernel, r.role) for r in rows] == [
        ("naive_torch", "reference"), ("naive_torch", "public"), ("sdpa", "baseline")]
    public = rows[1]
    assert calls and public.note == "naive_attention(q, k, v)" and public.ms > 0
    assert public.tflops == pytest.approx(rows[0].tflops * rows[0].ms / public.ms)


def test_contract_runs_the_chapter_benchmark():
    assert ch1.CHAPTER.benchmark is ch1.benchmark.run and not ch1.CHAPTER.graph_timer


def test_time_and_memory_figure_draws_the_recorded_h200_data():
    rows = results.recorded("ch1", "h200").rows
    fig = results.plot(rows, y=("ms", "peak_mib"), logx=True, logy=True, title="H200")
    try:
        assert [ax.get_ylabel() for ax in fig.axes] == ["time (ms)", "peak extra memory (MiB)"]
        # six lines of time (the chapter's naive_attention as called too), five of memory
        for ax, lines in zip(fig.axes, (6, 5)):
            assert len([ln for ln in ax.lines if ln.get_gid() != "not measured"]) == lines
            oom = sorted(ln.get_xdata()[0] for ln in ax.lines if ln.get_gid() == "not measured")
            # sdpa_math and naive_attention (float32 scores) at 32768, the fp16 model at 65536
            assert oom == [32768, 32768, 65536]
    finally:
        plt.close(fig)


def test_traffic_model_is_a_lower_bound_on_the_recorded_h200_times():
    """Section 5 sets the model's bytes / 4.8 TB/s beside the measured naive_torch times: the
    model must stay below every measurement, and the scale pass only adds bytes. The prose
    pastes the model's time at N = 512 (ch1_model_us_512, in microseconds)."""
    rows = results.recorded("ch1", "h200").rows
    table = ch1.traffic_vs_measured(rows)
    assert [n for n, *_ in table] == [512, 1024, 2048, 4096, 8192, 16384, 32768]
    for n, predicted, with_scale, measured in table:
        assert predicted < with_scale < measured, n
    n, predicted, _, _ = table[0]
    assert predicted == pytest.approx(2 * 16 * (4 * n * 64 + 4 * n * n) / 4.8e12 * 1e3)
    assert ch1.quoted_values(rows)["ch1_model_us_512"] == pytest.approx(predicted * 1e3)


def test_cpu_memory_panel_keeps_zero_points_on_a_linear_axis():
    """On CPU, SDPA's memory often measures 0: the chapter draws that panel on a linear axis,
    where a 0 is a visible point (a log axis drops it)."""
    rows = ch1.benchmark.sweep([16, 32], B=1, H=1, d=8, dtype=torch.float32, device="cpu",
                               baselines=(None,))
    rows = [dataclasses.replace(r, peak_mib=0.0) if r.kernel == "sdpa" else r for r in rows]
    fig, ax = plt.subplots()
    try:
        results.plot(rows, y="peak_mib", ax=ax, logx=True)
        sdpa = next(ln for ln in ax.lines if ln.get_label() == "sdpa")
        assert list(sdpa.get_ydata()) == [0.0, 0.0] and ax.get_yscale() == "linear"
    finally:
        plt.close(fig)
