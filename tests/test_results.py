"""The results module: Row <-> CSV + provenance, the recorded GPU data, the one table formatter
and the one plot function (drawn on each chapter's recorded data), and `flashbook bench`'s
refusal to record without a GPU."""
from __future__ import annotations

import dataclasses
import json
import re

import matplotlib
import pytest

from flashbook import chapters, cli, results
from flashbook.results import Row

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

CHAPTERS = sorted(p.name for p in results.DATA_DIR.glob("ch*") if (p / "h200.csv").exists())


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def _rows():
    return [Row("k", "reference", 1, 2, 2, 8, 8, 4, "float16", False, 1.5, 2.0, 3.0, 4.0, 5.0, ""),
            Row("k", "variant", 1, 2, 1, 16, 32, 4, "float16", True, None, None, None, None,
                note='out of memory, "twice"; at N=16')]


# ------------------------------------------------------------------------ files

def test_write_then_read_gives_equal_rows(tmp_path):
    meta = {"command": "flashbook bench test", "gpu": "NVIDIA T4"}
    path = results.write(_rows(), tmp_path / "chX", "t4", meta)
    assert path == tmp_path / "chX" / "t4.csv"
    back = results.read(path)
    assert back == _rows()
    assert all(isinstance(r, Row) for r in back)
    assert back[1].causal is True and back[1].ms is None and isinstance(back[0].N_q, int)
    assert json.loads((tmp_path / "chX" / "t4.json").read_text()) == meta


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_recorded_rows_survive_a_rewrite(tmp_path, chapter):
    """The committed files keep 6 significant digits, as write does: nothing is lost."""
    rec = results.recorded(chapter)
    path = results.write(rec.rows, tmp_path, "h200", rec.provenance)
    assert results.read(path) == rec.rows
    assert path.read_text() == (results.DATA_DIR / chapter / "h200.csv").read_text()


def test_read_rejects_files_that_are_not_results(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("kernel,ms\nk,1.0\n")
    with pytest.raises(ValueError, match="not the results columns"):
        results.read(bad)
    path = results.write(_rows(), tmp_path, "t4", {})
    path.write_text(path.read_text().replace(",False,", ",no,"))
    with pytest.raises(ValueError, match="line 2, column causal"):
        results.read(path)


def test_write_takes_rows_only(tmp_path):
    with pytest.raises(ValueError, match="must be results.Row, got dict"):
        results.write([dataclasses.asdict(_rows()[0])], tmp_path, "t4", {})
    assert not list(tmp_path.iterdir())


def test_row_rejects_an_unknown_role():
    with pytest.raises(ValueError, match="role must be one of"):
        Row("k", "fastest", 1, 1, 1, 1, 1, 1, "float32", False, None, None, None, None)


def test_provenance_records_the_timer_and_the_command():
    p = results.provenance("flashbook bench ch9")
    assert p["command"] == "flashbook bench ch9" and p["torch"] and p["date"]
    assert p["timer"] == "triton.testing.do_bench(warmup=100, rep=300, return_mode='median')"
    assert results.provenance("x", graph_timer=True)["timer"].startswith(
        "triton.testing.do_bench_cudagraph(")


def test_gpu_slug():
    assert results.gpu_slug("NVIDIA H200") == "h200"
    assert results.gpu_slug("Tesla T4") == "t4"
    assert results.gpu_slug("NVIDIA A100-SXM4-80GB") == "a100"


# ------------------------------------------------------------------ recorded data

@pytest.mark.parametrize("chapter", CHAPTERS)
def test_recorded_data_are_rows_with_provenance(chapter):
    rec = results.recorded(chapter, "h200")
    rows, meta = rec                                   # a (rows, provenance) pair
    assert rows is rec.rows and meta is rec.provenance
    assert rows and all(isinstance(r, Row) for r in rows)
    assert any(r.role == "reference" for r in rows)
    for key in ("gpu", "driver", "cuda", "torch", "date", "command", "compute_capability"):
        assert meta.get(key), f"{chapter}: provenance lacks {key}"
    # `flashbook bench chN` or, run by a chapter's GPU script, a module of that chapter
    assert meta["command"].startswith(("flashbook bench " + chapter,
                                       f"python -m flashbook.chapters.{chapter}."))
    line = results.describe(meta)
    driver = meta['driver'].split("\n")[0]           # a line per GPU in multi-GPU records
    assert line.startswith(f"gpu {meta['gpu']}, driver {driver}") and meta["date"] in line


PROFILES = sorted((results.DATA_DIR.parent / "profiles").glob("*_ncu.txt"))


@pytest.mark.parametrize("path", PROFILES, ids=[p.stem for p in PROFILES])
def test_every_stored_profile_says_where_it_comes_from(path):
    """A stored Nsight Compute report (the chapters quote their figures) opens with what it
    profiled, the GPU, the versions, the date and the command, then holds ncu's own output for
    one kernel launch; the file names its GPU as the header does."""
    text = path.read_text()
    header = [line for line in text.splitlines() if line.startswith("#")]
    assert header[0].startswith("# Nsight Compute profile: ") and "(B, H, N, d)" in header[0]
    for key in ("# gpu: NVIDIA ", "# versions: torch ", "# date: 20", "# command"):
        assert any(line.startswith(key) for line in header), f"{path.name}: no {key!r}"
    versions = next(line for line in header if line.startswith("# versions:"))
    assert "triton" in versions and "ncu" in versions
    gpu = next(line for line in header if line.startswith("# gpu:"))
    named = re.search(r"_(h\d00)_", path.stem)              # ch9_ws_bwd_h100_causal_ncu -> h100
    assert named and named.group(1) in gpu.lower(), f"{path.name}: the name and {gpu!r} disagree"
    assert text.count("Section: GPU Speed Of Light Throughput") == 1   # one launch profiled
    assert "==ERROR==" not in text


def test_recorded_is_none_where_nothing_was_measured():
    assert results.recorded("ch1", "no-such-gpu") is None
    assert results.recorded("ch99") is None


def test_data_dir_is_inside_the_package():
    assert results.DATA_DIR.parts[-3:] == ("flashbook", "data", "bench")


# ------------------------------------------------------------------------ table

def test_table_format():
    assert results.table(_rows()).splitlines() == [
        "kernel                  N        ms   TFLOP/s  % peak       MiB  note",
        "---------------------------------------------------------------------",
        "k                       8     1.500      2.00     4.0       5.0  ",
        'k                      16         -         -       -         -  out of memory, "twice"; at N=16',
    ]


# ------------------------------------------------------------------------- plot

def _data_lines(ax):
    return [ln for ln in ax.lines if ln.get_gid() != "not measured"]


def _name(row):
    """A row's line or bar in a plot: a public row is the call as a reader makes it."""
    return row.kernel + (" (as called)" if row.role == "public" else "")


def test_plot_lines_two_panels_with_out_of_memory_markers():
    """Chapter 1's figure: ms and peak MiB against N, log axes, where each kernel ran out."""
    rows = results.recorded("ch1").rows
    fig = results.plot(rows, y=("ms", "peak_mib"), x="N_q", logx=True, logy=True, title="t")
    assert len(fig.axes) == 2
    for ax, col in zip(fig.axes, ("ms", "peak_mib")):
        # a public row has no memory measure: no line of its own in the memory panel
        kernels = list(dict.fromkeys(_name(r) for r in rows if getattr(r, col) is not None))
        lines = _data_lines(ax)
        assert [ln.get_label() for ln in lines] == kernels
        for ln, k in zip(lines, kernels):
            want = sorted((r.N_q, getattr(r, col)) for r in rows if _name(r) == k and r.ms)
            assert list(zip(ln.get_xdata(), ln.get_ydata())) == want
        markers = sorted(ln.get_xdata()[0] for ln in ax.lines if ln.get_gid() == "not measured")
        first_oom = {k: min(r.N_q for r in rows if _name(r) == k and r.ms is None
                            and "out of memory" in r.note)
                     for k in map(_name, rows) if any(_name(r) == k and r.ms is None for r in rows)}
        # sdpa_math, then naive_attention as called, then the fp16 naive_torch
        assert markers == sorted(first_oom.values()) and len(first_oom) == 3
        assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
        assert any("naive_torch: out of memory" in t.get_text() for t in ax.texts)
    assert fig._suptitle.get_text() == "t"


def test_plot_ladder_bars_per_kernel_grouped_by_n():
    """Chapter 2's ladder: TFLOP/s per kernel, one bar per N, log y, values written on top."""
    rows = results.recorded("ch2").rows
    fig = results.plot(rows, y="tflops", x="kernel", by="N_q", kind="bar", logy=True, values=True)
    (ax,) = fig.axes
    assert len(ax.patches) == len(rows) == 12
    kernels = [t.get_text() for t in ax.get_xticklabels()]
    assert kernels == list(dict.fromkeys(r.kernel for r in rows))
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["N=1024", "N=4096"]
    heights = sorted(p.get_height() for p in ax.patches)
    assert heights == sorted(r.tflops for r in rows)
    assert len([t for t in ax.texts if t.get_text()]) == 12 and ax.get_yscale() == "log"
    assert ax.get_ylabel() == "TFLOP/s (fp32)"


def test_plot_grouped_bars_per_shape():
    """Chapter 3's figure: one group per (B, H, N, d), one bar per kernel."""
    rows = results.recorded("ch3").rows
    fig = results.plot(rows, y="tflops", x=("B", "H_q", "N_q", "d"), kind="bar")
    (ax,) = fig.axes
    shapes = list(dict.fromkeys((r.B, r.H_q, r.N_q, r.d) for r in rows))
    kernels = list(dict.fromkeys(_name(r) for r in rows))     # attention_two_tiles as called too
    assert len(ax.patches) == len(shapes) * len(kernels) == len(rows)     # one bar per row
    assert [t.get_text() for t in ax.get_xticklabels()][0] == "B=1 H=16\nN=16384 d=128"
    assert [t.get_text() for t in ax.get_legend().get_texts()] == kernels
    assert ax.get_ylabel() == "TFLOP/s (fp16)" and ax.get_yscale() == "linear"


def test_plot_throughput_against_n_per_kernel_into_given_axes():
    rows = results.recorded("ch1").rows
    fig, ax = plt.subplots()
    assert results.plot(rows, y="gbps", ax=ax) is fig
    assert len(_data_lines(ax)) == 6 and ax.get_ylabel() == "GB/s (fp16)"   # and as called


def test_plot_rejects_bad_arguments():
    rows = results.recorded("ch1").rows
    with pytest.raises(ValueError, match="no rows"):
        results.plot([])
    with pytest.raises(ValueError, match="'TFLOPS' is not a column"):
        results.plot(rows, y="TFLOPS")
    with pytest.raises(ValueError, match="kind must be"):
        results.plot(rows, kind="pie")
    with pytest.raises(ValueError, match="one numeric column"):
        results.plot(rows, x=("B", "N_q"))
    fig, ax = plt.subplots()
    with pytest.raises(ValueError, match="2 panels"):
        results.plot(rows, y=("ms", "peak_mib"), ax=ax)


def test_plot_draws_into_the_axes_of_subplots():
    rows = results.recorded("ch1").rows
    fig, axes = plt.subplots(1, 2)          # a numpy array of Axes
    assert results.plot(rows, y=("ms", "peak_mib"), ax=axes) is fig
    assert [len(_data_lines(ax)) for ax in axes] == [6, 5]   # as called: no memory measure


# ----------------------------------------------------------------------- record

def test_record_refuses_without_a_gpu(tmp_path):
    """The suite runs in CPU mode (FLASHBOOK_FORCE_CPU=1): nothing may be recorded."""
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        results.record(chapters.contract("ch1"), tmp_path, "flashbook bench ch1")
    assert not list(tmp_path.iterdir())


def test_bench_rejects_an_unknown_chapter():
    with pytest.raises(ValueError, match="no chapter 'ch99'"):
        cli.main(["bench", "ch99"])


def test_describe_gives_one_driver_for_a_record_of_several_gpus():
    meta = {"gpu": "NVIDIA H200", "driver": "580.159.04\n580.159.04", "date": "2026-11-30"}
    assert results.describe(meta) == "gpu NVIDIA H200, driver 580.159.04, date 2026-11-30"


def test_a_public_row_is_the_same_problem_timed_as_called(monkeypatch):
    from flashbook import bench
    ref = Row(kernel="ch4_two_tiles", role="reference", B=1, H_q=16, H_kv=16, N_q=4096,
              N_k=4096, d=128, dtype="float16", causal=True, ms=2.0, tflops=300.0, gbps=100.0,
              pct_peak=30.0, peak_mib=12.0, note="sections=4")
    monkeypatch.setattr(bench, "time_ms", lambda fn, graph=False: fn() or 2.5)
    public = bench.public_row(ref, lambda: None, "attention_varlen(q, k, v, ...)")
    assert (public.role, public.kernel, public.N_q, public.causal) == ("public", ref.kernel,
                                                                       4096, True)
    assert public.ms == 2.5 and public.note == "attention_varlen(q, k, v, ...)"
    assert public.tflops == 240.0 and public.gbps == 80.0 and public.pct_peak == 24.0
    assert public.peak_mib is None                  # memory is the reference row's measure

    def refused():
        raise ValueError("attention_varlen: cu_seqlens_q must be int32")
    failed = bench.public_row(ref, refused, "attention_varlen(...)")
    assert failed.ms is None and failed.tflops is None and "cu_seqlens_q" in failed.note


def test_a_public_row_is_drawn_as_its_own_line():
    rows = [Row("k", role, 1, 2, 2, n, n, 4, "float16", False, 1.0, tf, 3.0, 4.0)
            for role, tf in (("reference", 2.0), ("public", 1.5)) for n in (8, 16)]
    fig = results.plot(rows)
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert labels == ["k", "k (as called)"]
    plt.close(fig)
    bars = results.plot(rows, x="kernel", by="N_q", kind="bar")
    ticks = [t.get_text() for t in bars.axes[0].get_xticklabels()]
    assert ticks == ["k", "k (as called)"]          # a bar of its own, not hidden behind k's
    plt.close(bars)


def test_as_called_quotes_the_public_figure_where_one_was_measured():
    def row(kernel, role, n, ms):
        return Row(kernel, role, 1, 2, 2, n, n, 4, "float16", False, ms, 1.0 / ms if ms else None,
                   None, None)
    rows = [row("k", "reference", 8, 1.0), row("k", "public", 8, 1.25),
            row("k", "reference", 16, 2.0), row("k", "public", 16, None),    # public failed
            row("k", "reference", 32, 4.0), row("sdpa", "baseline", 8, 0.5),
            row("k", "reference", 64, 8.0), row("k", "public", 64, 9.0),      # two problems
            row("k", "reference", 64, 3.0), row("k", "public", 64, 3.5)]      # alike: by order
    rows[0].note, rows[1].note = "sections=2", "attention(q, k, v)"
    called = results.as_called(rows)
    got = [(r.kernel, r.role, r.N_q, r.ms) for r in called]
    assert got == [("k", "reference", 8, 1.25), ("k", "reference", 16, 2.0),
                   ("k", "reference", 32, 4.0), ("sdpa", "baseline", 8, 0.5),
                   ("k", "reference", 64, 9.0), ("k", "reference", 64, 3.5)]
    assert called[0].tflops == 0.8 and called[0].note == "sections=2; as called: attention(q, k, v)"
    assert called[1].note == "" and rows[0].ms == 1.0          # the rows given are not changed
    assert results.companion(rows, 4) is None and results.companion(rows, 6) is rows[7]
