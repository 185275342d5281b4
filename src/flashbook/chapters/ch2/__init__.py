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
from flashbook.contract import Chapter, Exercise
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
           "traffic_table", "predicted_vs_measured", "prediction_table", "quoted_figures"]


def quoted_figures(rows) -> list[str]:
    """The sentences of the chapter that quote the recorded H200 data (and the traffic model
    applied to it): the distance to PyTorch at both N, the predicted against measured times."""
    rows = results.as_called(rows)       # fa2_tiled as a reader calls it, where recorded
    ms = {(r.kernel, r.N_q): r.ms for r in rows}
    gap = {n: ms[("fa2_tiled", n)] / ms[("sdpa_efficient", n)] for n in (1024, 4096)}
    slow = {n: ms[("fa1_literal", n)] / ms[("sdpa_efficient", n)] for n in (1024, 4096)}
    pred = {(p.kernel, p.N): p for p in predicted_vs_measured(rows)}
    fa1, rows4k = pred[("fa1_literal", 4096)], pred[("fa2_rows", 4096)]
    ratios = sorted(p.ratio for p in pred.values())
    fa2_ratios = sorted(p.ratio for p in pred.values() if p.kernel.startswith("fa2"))
    fa1_ratios = [p.ratio for p in pred.values() if p.kernel.startswith("fa1")]
    climb = {n: ms[("fa1_literal", n)] / ms[("fa2_tiled", n)] for n in (1024, 4096)}
    pct = {r.kernel: r.pct_peak for r in rows if r.N_q == 4096}
    quotes = [f"{slow[1024]:.0f}x (N = 1024) and {slow[4096]:.0f}x (N = 4096) slower",
              f"{gap[1024]:.1f}x slower at N = 1024 and {gap[4096]:.1f}x at N = 4096",
              f"{fa1.predicted_ms:.2f} ms predicted against {fa1.ms:.0f} ms measured",
              f"{rows4k.predicted_ms:.2f} ms predicted against {rows4k.ms:.2f} ms measured",
              f"{fa2_ratios[0]:.0f}x to {fa2_ratios[-1]:.0f}x for the two FA2 kernels",
              f"{ratios[0]:.0f}x to more than {math.floor(ratios[-1] / 1000) * 1000}x",
              f"more than {math.floor(min(fa1_ratios) / 1000) * 1000}x",
              f"about {round(climb[1024], -1):.0f}x (N = 1024) and {round(climb[4096], -2):.0f}x (N = 4096)",
              f"{pct['fa2_tiled']:.1f} % of the FMA peak"]
    return quotes

CHAPTER = Chapter(
    id="ch2",
    title="From flash.cu to Numba-CUDA",
    exercises=(
        Exercise("ch2_tile_copy_test", ("ch2_tile_copy",), ("tile_copy_kernel",), check_tile_copy),
        Exercise("ch2_fa1_literal_test", ("ch2_fa1_literal",), ("fa1_literal_kernel",),
                 check_fa1_literal),
        Exercise("ch2_fa1_bounded_test", ("ch2_fa1_bounded",), ("fa1_bounded_kernel",),
                 check_fa1_bounded),
        Exercise("ch2_launch_config_test", ("ch2_launch_config",), ("smem_bytes", "launch_config"),
                 check_launch_config),
        Exercise("ch2_fa2_rows_test", ("ch2_fa2_rows",), ("make_fa2_rows",), check_fa2_rows),
        Exercise("ch2_fa2_tiled_test", ("ch2_fa2_tiled",), ("make_fa2_tiled",), check_fa2_tiled),
    ),
    benchmark=benchmark.run,
    quotes=quoted_figures,
)
