"""Chapter 2: from flash.cu to Numba-CUDA.

What lives here (and not in the chapter's notebook), one module per job:

* ``launch``: the launchers that validate torch tensors and turn them into the flat float32
  buffers the kernels read (``launch_fa1``, ``launch_fa2_rows``, ``launch_fa2_tiled``), the
  launch and tile configurations and their shared-memory sizes;
* ``checks``: the graded checks, one per exercise (the warm-up tile copy included), and ``probes``: the neighbour-head canary
  and the race run (``flashbook.race``: the Numba simulator is not a race detector);
* ``traffic``: the HBM traffic model of the two loop orders, and its prediction against the
  recorded times;
* ``figures``: the tile schedules, the shared-memory budget, the recorded ladder;
* ``benchmark``: ``flashbook bench ch2`` (known-wrong answers: ``solutions/variants/ch2.py``).

``CHAPTER`` is the chapter's contract (``flashbook.contract``).
"""
from __future__ import annotations

import math

from flashbook import results
from flashbook.contract import Chapter
from flashbook.race import race_check      # the prose points students to ch2.race_check

from . import benchmark
from .checks import (check_fa1_bounded, check_fa1_literal, check_fa2_rows, check_fa2_tiled,
                     check_launch_config, check_tile_copy)
from .figures import draw_schedule, draw_smem_layout
from .launch import (D_MAX, DEFAULT_SMEM_LIMIT, LaunchConfig, TiledConfig, as_flat, launch_fa1,
                     launch_fa2_rows, launch_fa2_tiled, launch_tile_copy, tiled_config,
                     validate_qkv)
from .probes import canary_buffers
from .traffic import hbm_traffic, predicted_vs_measured, prediction_table, traffic_table

# the names the chapter's notebook uses
__all__ = ["CHAPTER", "race_check", "check_tile_copy", "check_fa1_literal", "check_fa1_bounded",
           "check_launch_config", "check_fa2_rows", "check_fa2_tiled", "draw_schedule",
           "draw_smem_layout", "D_MAX", "DEFAULT_SMEM_LIMIT", "LaunchConfig",
           "TiledConfig", "as_flat", "launch_tile_copy", "launch_fa1", "launch_fa2_rows",
           "launch_fa2_tiled", "tiled_config", "validate_qkv", "canary_buffers", "hbm_traffic",
           "traffic_table", "predicted_vs_measured", "prediction_table"]


def quoted_values(rows) -> dict:
    """The figures the chapter quotes (``flashbook.quoted``), by glue key: the ladder against
    PyTorch at both N, and the traffic model's predictions (``chN_model_*``: the model's alone,
    bytes at the datasheet bandwidth) against the measured times. Where the prose rounds
    coarser than a format spec can ("more than 6000x", "about 540x"), the value is rounded
    here."""
    rows = results.as_called(rows)       # fa2_tiled as a reader calls it, where recorded
    ms = {(r.kernel, r.N_q): r.ms for r in rows}
    pred = {(p.kernel, p.N): p for p in predicted_vs_measured(rows)}
    ratios = sorted(p.ratio for p in pred.values())
    fa2_ratios = sorted(p.ratio for p in pred.values() if p.kernel.startswith("fa2"))
    fa1_ratios = [p.ratio for p in pred.values() if p.kernel.startswith("fa1")]
    fa1, fa2_rows = pred[("fa1_literal", 4096)], pred[("fa2_rows", 4096)]
    out = {"ch2_model_fa1_ms": fa1.predicted_ms, "ch2_fa1_ms": fa1.ms,
           "ch2_model_fa2_rows_ms": fa2_rows.predicted_ms, "ch2_fa2_rows_ms": fa2_rows.ms,
           "ch2_fa2_vs_model_min": fa2_ratios[0], "ch2_fa2_vs_model_max": fa2_ratios[-1],
           "ch2_vs_model_min": ratios[0],
           "ch2_vs_model_max_thousands": math.floor(ratios[-1] / 1000) * 1000,
           "ch2_fa1_vs_model_thousands": math.floor(min(fa1_ratios) / 1000) * 1000,
           "ch2_tiled_pct_peak": next(r.pct_peak for r in rows
                                      if r.kernel == "fa2_tiled" and r.N_q == 4096)}
    for n, digits in ((1024, -1), (4096, -2)):
        out[f"ch2_fa1_vs_sdpa_{n}"] = ms[("fa1_literal", n)] / ms[("sdpa_efficient", n)]
        out[f"ch2_tiled_vs_sdpa_{n}"] = ms[("fa2_tiled", n)] / ms[("sdpa_efficient", n)]
        # the climb from fa1_literal to fa2_tiled, to tens at N = 1024 and hundreds at 4096
        out[f"ch2_climb_{n}"] = round(ms[("fa1_literal", n)] / ms[("fa2_tiled", n)], digits)
    return out


CHAPTER = Chapter(
    id="ch2",
    title="From flash.cu to Numba-CUDA",
    benchmark=benchmark.run,
    figures=quoted_values,
)
