"""Chapter 2: the solution passes its checks, every known-wrong variant fails the check of its
exercise, stubs fail with "not implemented", the race checker and the canary catch what they
should, the wrappers reject bad inputs, and the recorded H200 data meets the chapter's targets."""
import csv
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from flashbook import notebooks
from flashbook.chapters import ch2
from flashbook.check import CheckFailure

sys.path.insert(0, str(Path(__file__).resolve().parent))
from known_wrong.ch2 import VARIANTS  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "src" / "flashbook" / "data" / "bench" / "ch2"


def _check(gid):
    return {
        "ch2_fa1_literal": lambda ns, h: ch2.check_fa1_literal(ns["fa1_literal_kernel"], hidden=h),
        "ch2_fa1_bounded": lambda ns, h: ch2.check_fa1_bounded(ns["fa1_bounded_kernel"], hidden=h),
        "ch2_launch_config": lambda ns, h: ch2.check_launch_config(ns["smem_bytes"], ns["launch_config"],
                                                                   hidden=h),
        "ch2_fa2_rows": lambda ns, h: ch2.check_fa2_rows(ns["make_fa2_rows"], hidden=h),
        "ch2_fa2_tiled": lambda ns, h: ch2.check_fa2_tiled(ns["make_fa2_tiled"], hidden=h),
    }[gid]


def namespace(replace: dict | None = None) -> dict:
    """The chapter's definition cells (no tests, no demos), optionally with cells replaced."""
    return notebooks.solution_namespace("ch2", ROOT, replace=replace)


@pytest.fixture(scope="module")
def solution():
    return namespace()


GIDS = ["ch2_fa1_literal", "ch2_fa1_bounded", "ch2_launch_config", "ch2_fa2_rows", "ch2_fa2_tiled"]


@pytest.mark.parametrize("gid", GIDS)
def test_solution_passes_visible_and_hidden_checks(solution, gid):
    _check(gid)(solution, False)
    _check(gid)(solution, True)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_known_wrong_variant_fails_its_check(name):
    v = VARIANTS[name]
    ns = namespace({v["grade_id"]: v["source"]})
    with pytest.raises(CheckFailure):
        _check(v["grade_id"])(ns, False)
        _check(v["grade_id"])(ns, True)


def test_every_exercise_has_variants():
    assert {v["grade_id"] for v in VARIANTS.values()} == set(GIDS)


def test_stubs_fail_as_not_implemented():
    stub = "    # YOUR CODE HERE\n    raise NotImplementedError()\n"
    nb = notebooks.read_source(notebooks.chapter("ch2", ROOT).source)
    replace = {}
    for cell in nb.cells:
        if notebooks.is_solution(cell):
            src, out, skipping = cell.source.splitlines(True), [], False
            for line in src:
                if "### BEGIN SOLUTION" in line:
                    skipping = True
                    out.append(line[: len(line) - len(line.lstrip())] + "# YOUR CODE HERE\n")
                    out.append(line[: len(line) - len(line.lstrip())] + "raise NotImplementedError()\n")
                elif "### END SOLUTION" in line:
                    skipping = False
                elif not skipping:
                    out.append(line)
            replace[notebooks.grade_meta(cell)["grade_id"]] = "".join(out)
    assert stub  # (format reference)
    ns = namespace(replace)
    for gid in GIDS:
        with pytest.raises(CheckFailure, match="not implemented"):
            _check(gid)(ns, False)


def test_canary_names_the_neighbouring_head(solution):
    with pytest.raises(CheckFailure) as e:
        ch2.check_fa1_bounded(solution["fa1_literal_kernel"])
    msg = str(e.value)
    assert "past the end" in msg or "NEXT head" in msg, msg
    # with a neighbour head behind the buffer the literal port reads/writes it: the canary says so
    p = ch2.Problem(1, 1, 13, 4, 8)
    with pytest.raises(CheckFailure, match="NEXT head"):
        ch2._canary(solution["fa1_literal_kernel"], p, "fa1", "literal")


# ------------------------------------------------------------------ the race checker

from numba import cuda, float32  # noqa: E402  (conftest switched on the simulator)


@cuda.jit
def _reverse_ok(a, n):
    s = cuda.shared.array(0, dtype=float32)
    t = cuda.threadIdx.x
    s[t] = a[t]
    cuda.syncthreads()
    v = s[n - 1 - t]
    cuda.syncthreads()
    a[t] = v


@cuda.jit
def _reverse_no_barrier(a, n):
    s = cuda.shared.array(0, dtype=float32)
    t = cuda.threadIdx.x
    s[t] = a[t]
    a[t] = s[n - 1 - t]


@cuda.jit
def _divergent_barrier(a, n):
    t = cuda.threadIdx.x
    if t < n // 2:
        cuda.syncthreads()
    a[t] = 1.0


def test_race_checker_passes_a_correct_kernel_and_computes():
    a = np.arange(8, dtype=np.float32)
    ch2.race_check(_reverse_ok, (1,), (8,), (a, 8), 32)
    assert a.tolist() == list(range(7, -1, -1))


def test_race_checker_finds_a_missing_barrier():
    with pytest.raises(ch2.RaceError, match="syncthreads"):
        ch2.race_check(_reverse_no_barrier, (1,), (8,), (np.arange(8, dtype=np.float32), 8), 32)


def test_race_checker_finds_a_divergent_barrier():
    with pytest.raises(ch2.RaceError, match="wait"):
        ch2.race_check(_divergent_barrier, (1,), (8,), (np.zeros(8, np.float32), 8), 0)


# ------------------------------------------------------------------ wrappers and models

@pytest.mark.parametrize("bad, what", [
    ((torch.zeros(1, 1, 4, 4, dtype=torch.float16),) * 3, "float32"),
    ((torch.zeros(1, 1, 4, 4).transpose(-1, -2),) * 3, "contiguous"),
    ((torch.zeros(1, 4, 4),) * 3, "4-d"),
    ((torch.zeros(1, 1, 4, 4), torch.zeros(1, 1, 5, 4), torch.zeros(1, 1, 4, 4)), "same shape"),
    ((torch.zeros(1, 1, 4, 200),) * 3, "head dimension"),
    ((np.zeros((1, 1, 4, 4), np.float32),) * 3, "torch.Tensor"),
])
def test_wrappers_reject_bad_inputs(solution, bad, what):
    with pytest.raises(ValueError, match=what):
        solution["fa1_attention"](*bad)
    with pytest.raises(ValueError, match=what):
        solution["fa2_rows"](*bad)


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


def test_tiled_configs_fit_48k():
    for d in (16, 32, 64, 128):
        for gpu in (False, True):
            ch2.tiled_config(d, gpu=gpu).validate(d)


def test_diagrams_draw():
    import matplotlib.pyplot as plt
    for order in ("fa1", "fa2"):
        fig = ch2.draw_schedule(order, N=8, Bc=2, Br=2, steps=6)
        assert len(fig.axes) == 6
        plt.close(fig)
    plt.close(ch2.draw_smem_layout())


# ------------------------------------------------------------------ recorded GPU data

def test_benchmark_takes_kernels_from_the_solution():
    src = (ROOT / "src" / "flashbook" / "benchmarks" / "ch2.py").read_text()
    assert "solution_namespace(\"ch2\")" in src and "cuda.jit" not in src


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
