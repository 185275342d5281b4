"""Chapter 4's figure helpers: tile classes checked against hand-worked masks, padding numbers
worked out by hand, the seeded length mix, and that each plot draws its panels. CPU only."""
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from flashbook.chapters.ch4 import figures  # noqa: E402

S, P, F = 0, 1, 2   # skipped, partial (masked), full


def classes(*args, **kwargs):
    t = figures.tile_classes(*args, **kwargs)
    assert t.dtype == torch.int8
    return t.tolist()


def loaded(*args, **kwargs):
    return int((figures.tile_classes(*args, **kwargs) > 0).sum())


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


# ------------------------------------------------------------------ tile_classes, by hand

def test_causal_square_tiles_of_one_is_the_lower_triangle():
    assert classes(4, 4, 1, 1, causal=True) == [[F, S, S, S],
                                                [F, F, S, S],
                                                [F, F, F, S],
                                                [F, F, F, F]]


def test_causal_bottom_right_2x5():
    # row 0 sits at key position 3: sees keys 0..3; row 1 sees 0..4
    assert classes(2, 5, 1, 1, causal=True) == [[F, F, F, F, S],
                                                [F, F, F, F, F]]


def test_causal_diagonal_tiles_are_partial():
    # 4 keys in tiles of 2: tile (0, 0) holds (0, 1), which row 0 may not see
    assert classes(4, 4, 2, 2, causal=True) == [[P, S],
                                                [F, P]]


def test_non_causal_is_all_full():
    assert classes(4, 4, 2, 2) == [[F, F], [F, F]]


def test_sliding_window_left_1_in_tiles_of_2():
    # window (1, 0): row i sees keys i-1 and i
    assert classes(6, 6, 2, 2, window=(1, 0)) == [[P, S, S],
                                                  [P, P, S],
                                                  [S, P, P]]


def test_window_right_side_is_bottom_right_aligned():
    # window (0, 1), 2 queries over 4 keys: row 0 sits at key 2 (sees 2, 3), row 1 at key 3
    assert classes(2, 4, 1, 1, window=(0, 1)) == [[S, S, F, F],
                                                  [S, S, S, F]]


def test_causal_with_a_left_window():
    # causal + window (1, -1): the right side becomes 0, so row i sees i-1 and i
    assert classes(3, 3, 1, 1, causal=True, window=(1, -1)) == [[F, S, S],
                                                                [F, F, S],
                                                                [S, F, F]]


def test_tail_key_tile_is_partial_only_because_of_seqlen_k():
    # non-causal, every real pair visible; the last tile holds key 4 and a lane past the end
    assert classes(4, 5, 2, 2) == [[F, F, P],
                                   [F, F, P]]


def test_rows_past_seqlen_q_do_not_make_a_tile_partial():
    # program 1 has one real row (2) and one row past the end; keys are a tile multiple
    assert classes(3, 4, 2, 2) == [[F, F],
                                   [F, F]]


def test_more_queries_than_keys_causal_first_rows_see_nothing():
    # 5 queries over 2 keys: row i sits at key i - 3, so rows 0..2 see no key
    assert classes(5, 2, 1, 1, causal=True) == [[S, S], [S, S], [S, S], [F, S], [F, F]]
    # in tiles of 2: rows 0-1 nothing; rows 2-3 only (3, 0); row 4 sees both keys
    assert classes(5, 2, 2, 2, causal=True) == [[S], [P], [F]]


def test_zero_length_sequences_give_empty_grids():
    assert tuple(figures.tile_classes(0, 5, 2, 2).shape) == (0, 3)
    assert tuple(figures.tile_classes(3, 0, 2, 2, causal=True).shape) == (2, 0)
    assert tuple(figures.tile_classes(0, 0, 4, 4).shape) == (0, 0)


# ------------------------------------------------------------------ tiles loaded

@pytest.mark.parametrize("N, B, n", [(256, 64, 4), (1024, 64, 16), (1000, 64, 16), (1000, 100, 10)])
def test_causal_loads_a_triangle_of_tiles(N, B, n):
    assert loaded(N, N, B, B, causal=True) == n * (n + 1) // 2


def test_causal_1024_in_64_tiles_is_120_full_and_16_partial():
    t = figures.tile_classes(1024, 1024, 64, 64, causal=True)
    assert int((t == F).sum()) == 120 and int((t == P).sum()) == 16 and int((t == S).sum()) == 120


def test_sliding_window_2048_loads_a_band_of_three_tiles():
    # window (256, 0), 128 tiles: program i loads K tiles i-2 (partial), i-1 (full), i (partial)
    t = figures.tile_classes(2048, 2048, 128, 128, window=(256, 0))
    assert int((t > 0).sum()) == 1 + 2 + 3 * 14
    assert t[5].tolist() == [S, S, S, P, F, P] + [S] * 10


# ------------------------------------------------------------------ padding

def test_padding_stats_by_hand():
    s = figures.padding_stats([3, 1, 4])
    assert s["sequences"] == 3 and s["max_len"] == 4
    assert s["total_tokens"] == 8 and s["padded_tokens"] == 12
    assert s["padding_ratio"] == pytest.approx(1.5)
    assert s["pairs_real"] == 9 + 1 + 16 and s["pairs_padded"] == 48
    assert s["pairs_ratio"] == pytest.approx(48 / 26)
    assert s["pairs_real_causal"] == 6 + 1 + 10 and s["pairs_padded_causal"] == 30
    assert s["pairs_ratio_causal"] == pytest.approx(30 / 17)


def test_lognormal_lengths_sum_exactly_and_repeat():
    for n in (1, 1000, 65536):
        assert sum(figures.lognormal_lengths(n)) == n
    assert figures.lognormal_lengths(0) == []
    a = figures.lognormal_lengths(65536, seed=3)
    assert a == figures.lognormal_lengths(65536, seed=3)
    assert a != figures.lognormal_lengths(65536, seed=4)
    assert all(isinstance(n, int) for n in a)


@pytest.mark.parametrize("seed", range(12))
def test_lognormal_lengths_are_clipped(seed):
    lens = figures.lognormal_lengths(20000, seed=seed, lo=300, hi=4000)
    assert sum(lens) == 20000
    assert min(lens) >= 300 and max(lens) <= 4000


def test_lognormal_lengths_refuse_impossible_splits():
    with pytest.raises(ValueError):
        figures.lognormal_lengths(250, lo=100, hi=100)
    with pytest.raises(ValueError):
        figures.lognormal_lengths(50, lo=100)


def test_default_mix_is_the_one_the_docstring_promises():
    lens = figures.lognormal_lengths(65536)
    assert (len(lens), max(lens)) == (29, 16384)
    assert figures.padding_stats(lens)["padding_ratio"] == pytest.approx(29 * 16384 / 65536)


# ------------------------------------------------------------------ plots

def test_plot_tile_visits_one_panel_per_case():
    cases = [("causal", 1024, 1024, True, None),
             dict(title="causal, 2x5", seqlen_q=2, seqlen_k=5, causal=True, block_m=1, block_n=1),
             dict(title="window", seqlen_q=2048, seqlen_k=2048, window=(256, 0),
                  block_m=128, block_n=128),
             dict(title="varlen", seqlen_q=[3, 5], block_m=2, block_n=2)]
    fig = figures.plot_tile_visits(cases)
    assert isinstance(fig, matplotlib.figure.Figure)
    axes = fig.get_axes()
    assert len(axes) == 4
    titles = [ax.get_title() for ax in axes]
    assert "136 of 256 tiles" in titles[0]
    assert "9 of 10 tiles" in titles[1]
    assert "45 of 256 tiles" in titles[2]
    assert "13 of 13 tiles" in titles[3]          # 2x2 + 3x3 tiles, all loaded (non-causal)
    assert axes[0].get_xlabel() == "key tile" and axes[0].get_ylabel() == "query tile (program)"
    assert fig.legends


def test_plot_varlen_tiles_counts_packed_and_padded():
    fig = figures.plot_varlen_tiles([3, 5], 2, 2)
    left, right = fig.get_axes()
    assert "13 tiles loaded" in left.get_title()      # 2x2 + 3x3
    assert "18 tiles loaded" in right.get_title()     # 2 sequences x 3x3
    fig = figures.plot_varlen_tiles([3, 5], 2, 2, causal=True)
    left, right = fig.get_axes()
    assert "9 tiles loaded" in left.get_title()       # 3 + 6
    assert "12 tiles loaded" in right.get_title()     # 2 x 6


def test_plot_padding_has_two_panels():
    fig = figures.plot_padding([3, 1, 4])
    assert isinstance(fig, matplotlib.figure.Figure)
    assert len(fig.get_axes()) == 2
    assert "1.5x" in fig.get_axes()[0].get_title()
