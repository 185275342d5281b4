"""Unit tests of the helper package: device, reference, check harness, bench, data."""
import math
import subprocess
import sys

import pytest
import torch

import flashbook
from flashbook import bench, benchmarks, check, reference


def test_setup_on_cpu_selects_simulators_and_small_sizes(capsys):
    backend = flashbook.setup()
    assert not backend.gpu and backend.device == "cpu"
    assert backend.sizes == flashbook.device.CPU_SIZES
    assert "backend: Triton interpreter + Numba CUDA simulator" in capsys.readouterr().out
    import os
    assert os.environ["TRITON_INTERPRET"] == "1" and os.environ["NUMBA_ENABLE_CUDASIM"] == "1"


def test_setup_warns_when_triton_was_imported_first():
    import os
    code = "import triton, flashbook; b = flashbook.setup(); print('restart', b.restart_needed)"
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "NUMBA_ENABLE_CUDASIM")}
    env["FLASHBOOK_FORCE_CPU"] = "1"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=300)
    assert "Restart the runtime" in proc.stdout and "restart True" in proc.stdout, proc.stderr


def test_banner_names_chapters_that_need_newer_gpus():
    b = flashbook.Backend(True, "Tesla T4", (7, 5), flashbook.device.GPU_SIZES)
    assert "sm_75" in b.banner() and "ch6 needs sm_90" in b.banner()
    assert b.supports("ch3") and not b.supports("ch6")
    h = flashbook.Backend(True, "NVIDIA H200", (9, 0), flashbook.device.GPU_SIZES)
    assert h.supports("ch6") and not h.supports("ch7")


def _sdpa64(q, k, v, causal, scale=None):
    # torch's math path in float64 is an independent implementation of the same definition.
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        mask = reference.causal_mask(q.shape[-2], k.shape[-2]) if causal else None
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                                scale=scale)


@pytest.mark.parametrize("nq,nk,causal", [(7, 7, False), (7, 7, True), (4, 9, True), (5, 13, False)])
def test_reference_attention_matches_torch_sdpa(nq, nk, causal):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, nq, 16, generator=g, dtype=torch.float64)
    k = torch.randn(2, 3, nk, 16, generator=g, dtype=torch.float64)
    v = torch.randn(2, 3, nk, 16, generator=g, dtype=torch.float64)
    torch.testing.assert_close(reference.attention(q, k, v, causal=causal), _sdpa64(q, k, v, causal))


def test_reference_lse_and_empty_rows():
    q = torch.randn(1, 1, 6, 8, dtype=torch.float64)
    k = torch.randn(1, 1, 3, 8, dtype=torch.float64)
    v = torch.randn(1, 1, 3, 8, dtype=torch.float64)
    o, lse = reference.attention(q, k, v, causal=True, return_lse=True)
    # bottom-right: with N_q=6 > N_k=3 the first 3 queries see no key
    assert torch.all(o[..., :3, :] == 0) and torch.all(torch.isneginf(lse[..., :3]))
    assert not torch.isnan(o).any()
    s = (q @ k.transpose(-1, -2)) / math.sqrt(8)
    expected = torch.logsumexp(s[..., 3:, :].masked_fill(
        ~reference.causal_mask(6, 3)[3:], float("-inf")), dim=-1)
    torch.testing.assert_close(lse[..., 3:].double(), expected, rtol=1e-6, atol=1e-6)


def test_causal_mask_is_bottom_right():
    m = reference.causal_mask(2, 4)
    assert m.tolist() == [[True, True, True, False], [True, True, True, True]]


def test_flops():
    assert reference.attention_flops(1, 1, 2, 3, 4) == 4 * 2 * 3 * 4
    assert reference.attention_flops(2, 2, 8, 8, 8, causal=True) == 4 * 2 * 2 * 32 * 8


def _good_attention(q, k, v, scale=None, causal=False):
    o, lse = reference.attention(q, k, v, scale=scale, causal=causal, return_lse=True)
    return o, lse


def test_check_attention_accepts_reference():
    check.check_attention(_good_attention, hidden=True, dtypes=(torch.float32, torch.float16))


def test_check_failure_points_at_wrong_rows_and_heads():
    def tail_bug(q, k, v, scale=None, causal=False):
        o, lse = _good_attention(q, k, v, scale, causal)
        o = o.clone()
        o[:, 1, 10:] += 1.0
        return o, lse
    with pytest.raises(check.CheckFailure) as e:
        check.check_attention(tail_bug, causal=False)
    msg = str(e.value)
    assert "Wrong rows: 10-15" in msg and "(0, 1)" in msg and "(0, 0)" not in msg


def test_check_reports_nan_and_missing_implementation():
    def nan_out(q, k, v, scale=None, causal=False):
        o, lse = _good_attention(q, k, v, scale, causal)
        return torch.full_like(o, float("nan")), lse
    with pytest.raises(check.CheckFailure, match="contains NaN"):
        check.check_attention(nan_out)

    def stub(*a, **k):
        raise NotImplementedError()
    with pytest.raises(check.CheckFailure, match="not implemented yet"):
        check.check_attention(stub)


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
    with pytest.raises(check.CheckFailure):
        check.check_attention(wrong, causal=True if bad == "top_left" else None)


def test_check_softmax_hidden_cases_catch_unguarded_masked_rows():
    def unguarded(x):
        e = torch.exp(x - x.amax(-1, keepdim=True))
        return e / e.sum(-1, keepdim=True)
    check.check_softmax(unguarded)   # visible cases have no fully masked row
    with pytest.raises(check.CheckFailure, match="NaN"):
        check.check_softmax(unguarded, hidden=True)


def test_gpu_peak_table():
    assert bench.gpu_peak("Tesla T4").tensor_tflops == 65.0
    assert bench.gpu_peak("NVIDIA H200").hbm_gbps == 4800.0
    assert bench.gpu_peak("NVIDIA A100-SXM4-80GB").name == "A100"
    assert bench.gpu_peak("NVIDIA A10G").name == "A10G"
    assert bench.gpu_peak("Some Future GPU") is None


def test_needs_gpu_explains_on_cpu(capsys):
    assert bench.needs_gpu("this benchmark") is False
    assert "needs a CUDA GPU" in capsys.readouterr().out


def test_measure_attention_on_cpu():
    q = torch.randn(1, 2, 64, 16)
    r = bench.measure_attention("sdpa", "baseline", lambda: bench.sdpa()(q, q, q), B=1, H=2,
                                N_q=64, N_k=64, d=16, dtype=torch.float32, memory=True)
    assert r.ms > 0 and r.tflops > 0 and r.pct_peak is None and r.peak_mib >= 0


def test_results_roundtrip(tmp_path):
    rows = [bench.Measurement("k", "reference", 1, 2, 2, 8, 8, 4, "float16", False, 1.5, 2.0,
                              3.0, 4.0, 5.0, ""),
            bench.Measurement("k", "reference", 1, 2, 2, 16, 16, 4, "float16", True, None, None,
                              None, None, None, "out of memory")]
    benchmarks.write_results(rows, tmp_path, "t4", "flashbook bench test")
    back = benchmarks.read_results(tmp_path / "t4.csv")
    assert back[0]["ms"] == 1.5 and back[1]["ms"] is None and back[1]["causal"] is True
    assert (tmp_path / "t4.json").read_text().count("flashbook bench test") == 1
    assert '"timer": "triton.testing.do_bench(' in (tmp_path / "t4.json").read_text()
    benchmarks.write_results(rows, tmp_path, "t4", "flashbook bench test", graph_timer=True)
    assert '"timer": "triton.testing.do_bench_cudagraph(' in (tmp_path / "t4.json").read_text()


def test_gpu_slug():
    assert benchmarks.gpu_slug("NVIDIA H200") == "h200"
    assert benchmarks.gpu_slug("Tesla T4") == "t4"
    assert benchmarks.gpu_slug("NVIDIA A100-SXM4-80GB") == "a100"


@pytest.mark.parametrize("chapter", sorted(benchmarks.CHAPTERS))
def test_recorded_gpu_data_has_provenance(chapter):
    rec = benchmarks.recorded(chapter)
    if rec is None:
        pytest.skip(f"no GPU data recorded for {chapter} yet")
    rows, meta = rec
    for key in ("gpu", "driver", "cuda", "torch", "triton", "date", "command", "compute_capability"):
        assert meta.get(key), f"{chapter}: provenance lacks {key}"
    assert meta["command"].startswith("flashbook bench " + chapter)
    assert rows and all(r["role"] in ("reference", "baseline", "variant") for r in rows)
    assert any(r["role"] == "reference" for r in rows)
