"""Chapter 2's own pieces: the wrappers reject bad inputs, launch_config refuses d=128 at 48 KiB,
the traffic model, the tile configs, the diagrams, the canary, the benchmark's source of kernels
and the recorded H200 data. (The solution passing its checks, stubs and known-wrong variants
failing them: tests/test_chapters.py, from ch2.CHAPTER. The race checker: tests/test_race.py.)"""
import csv
import inspect
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from flashbook import sources
from flashbook.cases import AttnCase
from flashbook.check import CheckFailure
from flashbook.chapters import ch2
from flashbook.chapters.ch2 import benchmark, probes
from flashbook.chapters.ch2.launch import Tiles

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "src" / "flashbook" / "data" / "bench" / "ch2"


@pytest.fixture(scope="module")
def solution():
    return sources.solution_namespace("ch2", ROOT)


# ------------------------------------------------------------------ wrappers and models

@pytest.mark.parametrize("bad, what", [
    ((torch.zeros(1, 1, 4, 4, dtype=torch.float16),) * 3, "this kernel takes torch.float32"),
    ((torch.zeros(1, 1, 4, 4).transpose(-1, -2),) * 3, "not contiguous"),
    ((torch.zeros(1, 4, 4),) * 3, "must have 4 dimensions"),
    ((torch.zeros(1, 1, 4, 4), torch.zeros(1, 1, 5, 4), torch.zeros(1, 1, 4, 4)), "same shape"),
    ((torch.zeros(1, 1, 4, 200),) * 3, "head dimension d=200"),
    ((torch.zeros(1, 1, 0, 4),) * 3, "empty input"),
    ((np.zeros((1, 1, 4, 4), np.float32),) * 3, "must be a torch.Tensor"),
])
@pytest.mark.parametrize("wrapper", ["fa1_attention", "fa2_rows", "fa2_tiled"])
def test_wrappers_reject_bad_inputs(solution, wrapper, bad, what):
    with pytest.raises(ValueError, match=re.escape(what)):
        solution[wrapper](*bad)


def test_validate_qkv_returns_the_shape():
    q = torch.zeros(2, 3, 5, 8)
    assert ch2.validate_qkv(q, q, q) == (2, 3, 5, 8)


def _stub_factory(d, Bc=32):
    raise NotImplementedError()


def test_launchers_refuse_a_stub_with_not_implemented():
    # the notebook's demos catch NotImplementedError; a stub must not reach the simulator
    q = torch.zeros(1, 1, 4, 4)
    with pytest.raises(NotImplementedError, match="stub"):
        ch2.launch_fa2_rows(_stub_factory, q, q, q, 4, 4)


def test_launch_config_refuses_d128_at_48k(solution):
    with pytest.raises(ValueError, match="53248"):
        solution["launch_config"](1, 8, 1024, 128)
    cfg = solution["launch_config"](1, 8, 1024, 128, max_smem=99 * 1024)
    assert cfg.smem == 53248 and cfg.grid == (1, 8)


def test_traffic_model():
    a = ch2.hbm_traffic(4096, 64, 32, 32, "fa1")
    b = ch2.hbm_traffic(4096, 64, 32, 32, "fa2")
    Nd = 4096 * 64
    assert a["parts"]["O write"] == 128 * Nd and b["parts"]["O write"] == Nd
    assert b["parts"]["m,l read"] == 0 and a["parts"]["m,l read"] == 128 * 2 * 4096
    assert b["total"] < a["total"]
    assert ch2.hbm_traffic(64, 16, 16, 16, "fa2")["total"] == 4 * (64 * 16 * 2 + 4 * 2 * 64 * 16)
    with pytest.raises(ValueError, match="order"):
        ch2.hbm_traffic(64, 16, 16, 16, "fa3")


def test_tile_copy_launcher(solution):
    x = torch.arange(13 * 3, dtype=torch.float32).reshape(13, 3)
    assert torch.equal(ch2.launch_tile_copy(solution["tile_copy_kernel"], x, 4), x)
    with pytest.raises(ValueError, match="float32"):
        ch2.launch_tile_copy(solution["tile_copy_kernel"], x.double(), 4)
    with pytest.raises(ValueError, match="1024 threads"):
        ch2.launch_tile_copy(solution["tile_copy_kernel"], x, 2048)


def _variant_of_cell(solution, name):
    """A known-wrong variant's cell, executed with the solution's globals (cuda, float32, ...)."""
    v = next(v for v in sources.variants("ch2") if v.name == name)
    src = v.apply(sources.cells_by_id(sources.read(sources.source("ch2", ROOT).path))[v.cell])
    ns = dict(solution)
    sources.exec_cell(src, f"<{name}>", ns)
    return ns


@pytest.mark.parametrize("name, message", [("copy_without_barrier", "shared-memory race"),
                                           ("copy_without_bounds_guard", "past the end"),
                                           ("copy_barrier_inside_the_guard", "syncthreads")])
def test_tile_copy_check_names_the_bug(solution, name, message):
    ch2.check_tile_copy(solution["tile_copy_kernel"])
    with pytest.raises(CheckFailure, match=message):
        ch2.check_tile_copy(_variant_of_cell(solution, name)["tile_copy_kernel"])


def test_traffic_model_against_the_recorded_times():
    from flashbook import results
    rows = results.recorded("ch2", "h200").rows
    pred = {(p.kernel, p.N): p for p in ch2.predicted_vs_measured(rows)}
    assert {k for k, _ in pred} == {"fa1_literal", "fa1_bounded", "fa2_rows", "fa2_tiled",
                                    "sdpa_efficient"}
    fa1 = pred[("fa1_literal", 4096)]
    assert fa1.bytes == ch2.hbm_traffic(4096, 64, 32, 32, "fa1", B=1, H=8)["total"]
    assert fa1.predicted_ms == pytest.approx(fa1.bytes / 4.8e12 * 1e3)       # H200: 4.8 TB/s
    assert fa1.ms == 3934.3 and fa1.ratio > 5000
    assert pred[("sdpa_efficient", 1024)].bytes == 16 * 1024 * 64 * 8         # compulsory only
    assert all(p.ratio > 1 for p in pred.values())    # nothing here runs at the HBM bound
    table = ch2.prediction_table(rows)
    assert "4.8 TB/s" in table and table.count("\n") == len(pred) + 1


def test_quoted_model_figures_are_the_traffic_model():
    """The figures the prose pastes from the model alone (``ch2_model_*``, which the contract
    test's perturbed timings cannot move) are the model's predictions (checked against the
    byte counts above), and the figures ``ch2.figures`` rounds down to thousands ("more than
    6000x") stay within a thousand below what they round."""
    from flashbook import results
    rows = results.recorded("ch2", "h200").rows
    fig = ch2.quoted_values(rows)
    pred = {(p.kernel, p.N): p for p in ch2.predicted_vs_measured(rows)}
    assert fig["ch2_model_fa1_ms"] == pred[("fa1_literal", 4096)].predicted_ms
    assert fig["ch2_model_fa2_rows_ms"] == pred[("fa2_rows", 4096)].predicted_ms
    fa1 = min(p.ratio for p in pred.values() if p.kernel.startswith("fa1"))
    for rounded, ratio in ((fig["ch2_vs_model_max_thousands"], max(p.ratio for p in pred.values())),
                           (fig["ch2_fa1_vs_model_thousands"], fa1)):
        assert rounded % 1000 == 0 and 0 <= ratio - rounded < 1000


def test_benchmarks_page_marks_fp32_on_tensor_cores():
    from flashbook import book
    page = book.benchmarks_page()
    ch2_part = page[page.index("## ch2"):page.index("## ch3")]
    marked = [line for line in ch2_part.splitlines() if " † |" in line]
    assert len(marked) == 2 and all(line.startswith("| `sdpa_efficient`") for line in marked)
    assert "3xTF32" in ch2_part
    assert not any(" † |" in line for line in ch2_part.splitlines() if "`fa2_tiled`" in line)


def test_tiled_configs_fit_48k():
    for d in (16, 32, 64, 128):
        for gpu in (False, True):
            ch2.tiled_config(d, gpu=gpu).validate(d)     # raises ValueError if it does not fit
    with pytest.raises(ValueError, match="shared memory"):
        ch2.TiledConfig(128, 64, 4, 4).validate(128)


def _orange(ax):
    from matplotlib.colors import to_rgba
    return [p for p in ax.patches if p.get_facecolor()[:3] == to_rgba("tab:orange")[:3]]


def test_diagrams_draw():
    import matplotlib.pyplot as plt
    fig = ch2.draw_schedule("fa1", N=8, Bc=2, Br=2, steps=6)
    assert len(fig.axes) == 6
    assert all(len(_orange(ax)) == 1 for ax in fig.axes)    # one block: one tile at a time
    plt.close(fig)
    # FA2: one panel per time step (at most Tc), every Q tile's block in flight in each
    fig = ch2.draw_schedule("fa2", N=8, Bc=2, Br=2, steps=6)
    assert len(fig.axes) == 4
    for j, ax in enumerate(fig.axes):
        tiles = sorted((p.get_y(), p.get_x()) for p in _orange(ax))
        assert tiles == [(2.0 * i, 2.0 * j) for i in range(4)], tiles
    plt.close(fig)
    fig = ch2.draw_smem_layout()
    assert len(fig.axes[0].patches) == 8        # Qi, Kj, Vj, S at d and at 2d
    plt.close(fig)


# ------------------------------------------------------------------------ the canary

def test_canary_names_the_neighbouring_head(solution):
    def launch(kernel):
        return lambda q, k, v, t, buffers=None: ch2.launch_fa1(kernel, q, k, v, t.Bc, buffers=buffers)

    case, tiles = AttnCase("tail of 5", B=1, H_q=1, N_q=13, d=4), Tiles(8)
    # one head: the simulator sees no index past the end, only the canary sees the damage
    with pytest.raises(CheckFailure, match="NEXT head"):
        probes.canary(launch(solution["fa1_literal_kernel"]), case, tiles, "literal", with_lm=True)
    probes.canary(launch(solution["fa1_bounded_kernel"]), case, tiles, "bounded", with_lm=True)


# ------------------------------------------------------------------ recorded GPU data

def test_benchmark_takes_kernels_from_the_solution(solution, monkeypatch):
    src = inspect.getsource(benchmark)
    assert "cuda.jit" not in src                     # no second copy of a kernel
    calls = []
    monkeypatch.setattr(sources, "solution_namespace", lambda cid: calls.append(cid) or solution)
    ns = benchmark.kernels_from_solution()
    assert calls == ["ch2"] and ns is solution
    used = set(re.findall(r'ns\["(\w+)"\]', src))
    # the four rungs, and the public call the chapter shows (its wrapper of make_fa2_tiled)
    assert used == {"fa1_literal_kernel", "fa1_bounded_kernel", "make_fa2_rows", "make_fa2_tiled",
                    "fa2_tiled"}
    assert used <= set(ns)


def test_recorded_h200_data_meets_the_targets():
    rows = list(csv.DictReader(open(DATA / "h200.csv")))
    prov = json.loads((DATA / "h200.json").read_text())
    assert prov["gpu"] == "NVIDIA H200" and prov["command"].startswith("flashbook bench ch2")
    for key in ("driver", "cuda", "torch", "numba_cuda", "date", "compute_capability"):
        assert prov.get(key), key
    roles = {r["kernel"]: r["role"] for r in rows}
    assert roles["fa1_literal"] == "variant" and roles["fa2_rows"] == "variant"
    assert roles["fa2_tiled"] == "reference" and roles["sdpa_efficient"] == "baseline"
    for r in rows:
        assert (r["B"], r["H_q"], r["d"], r["dtype"]) == ("1", "8", "64", "float32")
        err = float(r["note"].split("max_abs_err=")[1].split(";")[0])
        assert err <= 1e-5, r
    assert {int(r["N_q"]) for r in rows} == {1024, 4096}
    at = {r["kernel"]: float(r["ms"]) for r in rows if r["N_q"] == "4096"}
    assert at["fa1_literal"] / at["fa2_rows"] >= 300
    assert at["sdpa_efficient"] / at["fa2_tiled"] >= 0.3
