"""flashbook.sweep's tables of ratios to cuDNN (the GPU measures; the tables are tested here)."""
from flashbook import sweep
from flashbook.results import Row


def _row(kernel, role, N, ms, causal=False, B=None):
    return Row(kernel=kernel, role=role, B=B or 32768 // N, H_q=16, H_kv=16, N_q=N, N_k=N,
               d=128, dtype="float16", causal=causal, ms=ms, tflops=None, gbps=None,
               pct_peak=None)


def test_ratios_are_the_baselines_time_over_ours_per_swept_length():
    rows = [_row("ch6_gluon_fa3", "reference", 512, 1.0), _row("sdpa_cudnn", "baseline", 512, 2.0),
            _row("sdpa_flash", "baseline", 512, 0.5),
            _row("ch6_gluon_fa3", "reference", 1024, 2.0),
            _row("sdpa_cudnn", "baseline", 1024, None), _row("sdpa_flash", "baseline", 1024, 3.0),
            _row("ch6_gluon_fa3", "reference", 512, 4.0, causal=True),
            _row("sdpa_cudnn", "baseline", 512, 1.0, causal=True)]
    text = sweep.ratio_tables(rows)
    assert "`ch6_gluon_fa3`, float16, d = 128, non-causal" in text
    assert "| vs | N=512 | N=1024 |" in text
    assert "| cuDNN | 2.00 | – |" in text           # not measured: a dash, not a ratio
    assert "| FA2 | 0.50 | 1.50 |" in text
    assert "| cuDNN | 0.25 |" in text              # the causal table is its own


def test_decode_tables_are_keyed_by_batch_and_context():
    rows = [Row(kernel=k, role=r, B=8, H_q=32, H_kv=8, N_q=1, N_k=32768, d=128,
                dtype="float16", causal=True, ms=ms, tflops=None, gbps=None, pct_peak=None)
            for k, r, ms in (("ch8_decode_split_kv", "reference", 0.25),
                             ("sdpa_cudnn", "baseline", 0.26), ("sdpa_flash", "baseline", 0.5))]
    text = sweep.ratio_tables(rows)
    assert "| vs | B=8, 32k |" in text and "| cuDNN | 1.04 |" in text and "| FA2 | 2.00 |" in text


def test_the_benchmarks_page_draws_a_recorded_sweep(tmp_path, monkeypatch):
    from flashbook import book, results
    rows = [_row("ch6_gluon_fa3", "reference", 512, 1.0), _row("sdpa_cudnn", "baseline", 512, 1.1)]
    results.write(rows, tmp_path, "h200", dict(gpu="NVIDIA H200", commit="abc1234",
                                               command="python -m flashbook.sweep"))
    monkeypatch.setattr(sweep, "DATA_DIR", tmp_path)
    page = "\n".join(book.sweep_section())
    assert "## Over a sweep of shapes: NVIDIA H200" in page and "`abc1234`" in page
    assert "| cuDNN | 1.10 |" in page
