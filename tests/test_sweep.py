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
                                               command="python -m flashbook.sweep",
                                               parts="forward,backward"))
    monkeypatch.setattr(sweep, "DATA_DIR", tmp_path)
    page = "\n".join(book.sweep_section())
    assert "## Over a sweep of shapes: NVIDIA H200" in page and "`abc1234`" in page
    assert "The parts this record holds: forward, backward." in page     # a run of some parts
    assert "| cuDNN | 1.10 |" in page


def test_gqa_rows_meet_their_own_baselines_and_flex_is_a_third_line():
    def row(kernel, role, ms, h_kv=16):
        return Row(kernel=kernel, role=role, B=8, H_q=16, H_kv=h_kv, N_q=4096, N_k=4096, d=128,
                   dtype="float16", causal=True, ms=ms, tflops=None, gbps=None, pct_peak=None)
    rows = [row("ch4_varlen", "reference", 1.0), row("sdpa_cudnn", "baseline", 0.9),
            row("flex_attention", "baseline", 1.5),
            row("ch5_gqa", "reference", 2.0, h_kv=4), row("sdpa_cudnn", "baseline", 3.0, h_kv=4)]
    text = sweep.ratio_tables(rows)
    varlen, gqa = text.split("`ch5_gqa`")
    assert "| cuDNN | 1.50 |" in gqa and "| Flex |" not in gqa       # its own (GQA) baseline
    assert "| cuDNN | 0.90 |" in varlen and "| Flex | 1.50 |" in varlen


def test_the_reading_gives_the_geomean_the_worst_point_and_where_fa2_wins():
    rows = [_row("ch6_gluon_fa3", "reference", 512, 2.0), _row("sdpa_cudnn", "baseline", 512, 1.0),
            _row("sdpa_flash", "baseline", 512, 1.0),
            _row("ch6_gluon_fa3", "reference", 1024, 1.0),
            _row("sdpa_cudnn", "baseline", 1024, 2.0), _row("sdpa_flash", "baseline", 1024, 3.0)]
    text = sweep.reading(rows)          # ratios to cuDNN 0.5 and 2.0: geometric mean 1.0
    assert text.startswith("- `ch6_gluon_fa3`: 1.00x cuDNN (geometric mean of 2 points)")
    assert "worst 0.50x at N=512, d=128, float16, non-causal" in text
    assert "1 points below 0.95x, 1 below 0.90x" in text
    assert "below FA2 at N=512, d=128, float16, non-causal" in text and "Why:" in text
