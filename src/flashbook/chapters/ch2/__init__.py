"""Chapter 2: from flash.cu to Numba-CUDA.

What lives here (and not in the chapter's notebook), one module per job:

* ``launch``: the launchers that validate torch tensors and turn them into the flat float32
  buffers the kernels read (``launch_fa1``, ``launch_fa2_rows``, ``launch_fa2_tiled``), the
  launch and tile configurations and their shared-memory sizes;
* ``checks``: the graded checks, one per exercise, and ``probes``: the neighbour-head canary
  and the race run (``flashbook.race``: the Numba simulator is not a race detector);
* ``traffic``: the HBM traffic model of the two loop orders;
* ``figures``: the tile schedules, the shared-memory budget, the recorded ladder;
* ``variants``: known-wrong answers; ``benchmark``: ``flashbook bench ch2``.

``CHAPTER`` is the chapter's contract (``flashbook.contract``).
"""
from __future__ import annotations

from flashbook.contract import Chapter, Exercise
from flashbook.race import race_check      # the prose points students to ch2.race_check

from . import benchmark
from .checks import (check_fa1_bounded, check_fa1_literal, check_fa2_rows, check_fa2_tiled,
                     check_launch_config)
from .figures import draw_schedule, draw_smem_layout
from .launch import (D_MAX, DEFAULT_SMEM_LIMIT, LaunchConfig, TiledConfig, as_flat, launch_fa1,
                     launch_fa2_rows, launch_fa2_tiled, tiled_config, validate_qkv)
from .probes import canary_buffers
from .traffic import hbm_traffic, traffic_table
from .variants import VARIANTS

# the names the chapter's notebook uses
__all__ = ["CHAPTER", "race_check", "check_fa1_literal", "check_fa1_bounded",
           "check_launch_config", "check_fa2_rows", "check_fa2_tiled", "draw_schedule",
           "draw_smem_layout", "D_MAX", "DEFAULT_SMEM_LIMIT", "LaunchConfig",
           "TiledConfig", "as_flat", "launch_fa1", "launch_fa2_rows", "launch_fa2_tiled",
           "tiled_config", "validate_qkv", "canary_buffers", "hbm_traffic", "traffic_table"]

CHAPTER = Chapter(
    id="ch2",
    title="From flash.cu to Numba-CUDA",
    exercises=(
        Exercise("ch2_fa1_literal_test", ("ch2_fa1_literal",), ("fa1_literal_kernel",),
                 check_fa1_literal),
        Exercise("ch2_fa1_bounded_test", ("ch2_fa1_bounded",), ("fa1_bounded_kernel",),
                 check_fa1_bounded),
        Exercise("ch2_launch_config_test", ("ch2_launch_config",), ("smem_bytes", "launch_config"),
                 check_launch_config),
        Exercise("ch2_fa2_rows_test", ("ch2_fa2_rows",), ("make_fa2_rows",), check_fa2_rows),
        Exercise("ch2_fa2_tiled_test", ("ch2_fa2_tiled",), ("make_fa2_tiled",), check_fa2_tiled),
    ),
    variants=VARIANTS,
    benchmark=benchmark.run,
)
