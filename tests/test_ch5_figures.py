"""Chapter 5's figure helpers: KV cache sizes, the model table, decode/prefill intensity and the
roofline's ridge against values worked out by hand, the M-fold row map and the paged-cache page
map by hand, and that each plot draws what it should. CPU only."""
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from flashbook.chapters.ch5 import figures  # noqa: E402

GiB = 1024 ** 3


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


# ------------------------------------------------------------------------ KV cache, by hand

def test_kv_cache_32_layers_8_kv_heads_d128_8192_tokens_fp16_is_one_gib():
    m = figures.Model("toy", layers=32, h_q=32, h_kv=8, head_dim=128, source="")
    # 2 (K, V) * 32 * 8 * 128 * 8192 * 2 bytes = 2^1 * 2^5 * 2^3 * 2^7 * 2^13 * 2^1 = 2^30
    assert figures.kv_cache_bytes(m, 8192) == 1073741824 == GiB
    assert figures.kv_cache_bytes(m, 8192, dtype_bytes=4) == 2 * GiB
    assert figures.kv_cache_bytes(m, 1) == 131072                       # 128 KiB per token


def test_kv_cache_of_named_models():
    assert figures.kv_cache_bytes("Llama-3.1-8B", 8192) == GiB
    assert figures.kv_cache_bytes("Llama-2-7B", 8192) == 4 * GiB          # 32 K/V heads, not 8
    assert figures.kv_cache_bytes("Llama-3.1-70B", 8192) == 2684354560    # 80/32 GiB
    assert figures.kv_cache_bytes("Qwen2.5-7B", 8192) == 469762048        # 2*28*4*128*8192*2
    assert figures.kv_cache_bytes("Falcon-7B", 8192) == 67108864          # 2*32*1*64*8192*2


def test_models_hold_the_verified_shapes():
    shapes = {m.name: (m.layers, m.h_q, m.h_kv, m.head_dim) for m in figures.MODELS}
    assert shapes == {"Llama-2-7B": (32, 32, 32, 128), "Llama-3.1-8B": (32, 32, 8, 128),
                      "Llama-3.1-70B": (80, 64, 8, 128), "Mistral-7B-v0.1": (32, 32, 8, 128),
                      "Qwen2.5-7B": (28, 28, 4, 128), "Falcon-7B": (32, 71, 1, 64)}
    assert all(m.source for m in figures.MODELS)


def test_kv_table_group_size_and_mha_ratio():
    rows = {r["model"]: r for r in figures.kv_table(tokens=8192, batch=32)}
    assert {k: r["G"] for k, r in rows.items()} == {
        "Llama-2-7B": 1, "Llama-3.1-8B": 4, "Llama-3.1-70B": 8, "Mistral-7B-v0.1": 4,
        "Qwen2.5-7B": 7, "Falcon-7B": 71}
    for r in rows.values():                                  # MHA caches G times the K/V heads
        assert r["mha_batch_gib"] == r["G"] * r["kv_batch_gib"]
    r = rows["Llama-3.1-70B"]
    assert (r["kv_seq_gib"], r["kv_batch_gib"], r["mha_batch_gib"]) == (2.5, 80.0, 640.0)
    r = rows["Qwen2.5-7B"]
    assert (r["kv_seq_gib"], r["kv_batch_gib"], r["mha_batch_gib"]) == (0.4375, 14.0, 98.0)
    r = rows["Falcon-7B"]
    assert (r["h_q"], r["h_kv"], r["kv_batch_gib"], r["mha_batch_gib"]) == (71, 1, 2.0, 142.0)


def test_kv_table_markdown():
    lines = figures.kv_table_markdown(tokens=8192, batch=32).splitlines()
    assert len(lines) == 2 + len(figures.MODELS)
    assert lines[0].startswith("| model | h_q | h_kv | G |") and "x 32" in lines[0]
    assert "| Llama-3.1-70B | 64 | 8 | 8 | 2.5 | 80 | 640 |" in lines
    assert "| Qwen2.5-7B | 28 | 4 | 7 | 0.4375 | 14 | 98 |" in lines
    assert "| Llama-2-7B | 32 | 32 | 1 | 4 | 128 | 128 |" in lines


# ------------------------------------------------------------------ intensity and roofline

def test_decode_intensity_by_hand():
    # MHA, one new token, fp16: 4*32*1*8192*128 = 134217728 FLOPs over 2*32*8192*128*2 bytes.
    assert figures.decode_intensity(32, 32, 1, 8192, 128) == 1.0
    assert figures.decode_intensity(32, 8, 1, 8192, 128) == 4.0              # G = 4
    assert figures.decode_intensity(32, 8, 4, 8192, 128) == 16.0             # G * n_new
    assert figures.decode_intensity(32, 32, 1, 8192, 128, dtype_bytes=4) == 0.5
    assert figures.decode_intensity(71, 1, 1, 4096, 64) == 71.0              # MQA
    assert figures.decode_intensity(32, 8, 1, 1, 128) == 4.0                 # context cancels
    assert figures.decode_intensity(32, 8, 1, 131072, 128) == 4.0


def test_prefill_intensity_by_hand():
    assert figures.prefill_intensity(32, 32, 16384, 128) == 16384.0
    assert figures.prefill_intensity(32, 8, 16384, 128) == 65536.0


def test_ridge_point_and_roof():
    assert figures.ridge_point(1000, 4000) == 250.0
    assert figures.ridge_point(989, 4800) == pytest.approx(206.0416666667)   # 989000 / 4800
    assert float(figures.attainable_tflops(1.0, 989, 4800)) == pytest.approx(4.8)
    assert float(figures.attainable_tflops(1e6, 989, 4800)) == 989.0
    assert figures.attainable_tflops([10.0, 250.0, 1e4], 1000, 4000).tolist() == [40, 1000, 1000]


def test_example_points():
    got = dict(figures.example_points(context=8192, n_prefill=16384))
    assert list(got.values()) == [1.0, 4.0, 16.0, 65536.0]


def test_plot_roofline():
    points = figures.example_points() + [("measured", 4.0, 12.0)]
    fig = figures.plot_roofline(989, 4800, points, gpu="H200")
    (ax,) = fig.axes
    assert ax.get_xscale() == ax.get_yscale() == "log"
    ridge = 989e3 / 4800
    vlines = [ln for ln in ax.get_lines() if list(ln.get_xdata()) == [ridge, ridge]]
    assert len(vlines) == 1                                       # the ridge, marked
    roof = max(ax.get_lines(), key=lambda ln: len(ln.get_xdata()))
    assert max(roof.get_ydata()) == 989
    assert [ln.get_marker() for ln in ax.get_lines()].count("o") == 4
    stars = [ln for ln in ax.get_lines() if ln.get_marker() == "*"]
    assert len(stars) == 1 and list(stars[0].get_ydata()) == [12.0]   # measured, off the roof
    assert "H200" in ax.get_title() and "989" in ax.get_title() and "4800" in ax.get_title()


# ------------------------------------------------------------------------------ M-fold

def test_mfold_rows_by_hand():
    assert figures.mfold_rows(4, 2, 16) == [0, 0, 1, 1, 2, 2, 3, 3] + [-1] * 8
    assert figures.mfold_rows(3, 1, 4) == [0, 1, 2, -1]
    assert figures.mfold_rows(8, 4, 16) == [h for h in range(8) for _ in range(4)]   # 2 tiles


def _kv_tiles(ax):
    return [p for p in ax.patches if p.get_facecolor()[:3] == pytest.approx((0.85,) * 3)]


def test_plot_mfold():
    fig = figures.plot_mfold(G=4, rows_per_head=2, block_m=16)
    left, right = fig.axes
    assert "loaded once for G=4" in left.get_title()
    assert "loaded G=4 times" in right.get_title()
    assert len(_kv_tiles(left)) == 1 and len(_kv_tiles(right)) == 4
    assert len(figures.plot_mfold(8, 4, 16).axes[0].patches) > 0
    with pytest.raises(ValueError):
        figures.plot_mfold(4, 32, 16)


# ---------------------------------------------------------------------------- paged cache

def test_page_map_by_hand():
    pm = figures.page_map([[2, 0, 5], [1, 3, -1]], [40, 17], 16)
    assert pm == [[(0, 2, 16), (1, 0, 16), (2, 5, 8)], [(0, 1, 16), (1, 3, 1)]]
    tensor = figures.page_map(torch.tensor([[4, 6, -1]]), torch.tensor([32]), 16)
    assert tensor == [[(0, 4, 16), (1, 6, 16)]]                   # full pages, the -1 unused
    with pytest.raises(ValueError):
        figures.page_map([[0]], [17], 16)                        # needs 2 pages, has 1
    with pytest.raises(ValueError):
        figures.page_map([[0, -1]], [17], 16)                    # a used page unmapped


def test_plot_paged_cache():
    fig = figures.plot_paged_cache([[2, 0, 5], [1, 3, -1]], [40, 17], 16, num_pages=8)
    (ax,) = fig.axes
    arrows = [t for t in ax.texts if getattr(t, "arrow_patch", None) is not None]
    assert len(arrows) == 5                                      # one per used logical page
    hatched = [p for p in ax.patches if p.get_hatch() == "///"]
    assert len(hatched) == 4              # 2 partial last pages, each in the pool and its row
    labels = {t.get_text() for t in ax.texts}
    assert {"p7", "L2->p5", "L1->p3", "seq 1: 17 tok"} <= labels
