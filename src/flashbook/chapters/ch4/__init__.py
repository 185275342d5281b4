"""Chapter 4: varlen (packed) batches, causal and sliding-window masks, block skipping.

The student writes Triton kernels with fixed signatures and the public wrapper's argument
checks, and, optionally, the masked kernel's two-tile form; ``launch`` launches the kernels on a
packed batch, ``checks`` grades them (with canary sequences and, in CPU mode, counted tile
loads; ``two_tiles`` the optional exercise), ``figures`` draws the chapter's pictures and
``benchmark`` times the solution on a GPU (``flashbook bench ch4``).
"""
from __future__ import annotations

from flashbook.contract import Chapter

from . import benchmark
from .checks import check_mask_helpers, check_masked_kernel, check_varlen_kernel, \
    expected_loads, mask_cases
from .validate_checks import check_validate_varlen, validate_cases
from .figures import lognormal_lengths, padding_stats, plot_padding, plot_tile_visits, \
    plot_varlen_tiles, tile_classes
from .launch import DTYPES, HEAD_DIMS, HEAD_DIMS_WHY, Config, heads_per_section, launch_varlen, pick_config, \
    pick_kernel, window_bounds
from .recorded import plot_recorded, quoted_values, summary
from .two_tiles import check_two_tile_kernel

__all__ = ["CHAPTER", "Config", "pick_config", "pick_kernel", "launch_varlen", "window_bounds",
           "heads_per_section", "summary", "plot_recorded", "DTYPES",
           "HEAD_DIMS", "HEAD_DIMS_WHY", "check_varlen_kernel", "check_mask_helpers", "check_masked_kernel",
           "check_validate_varlen", "check_two_tile_kernel", "expected_loads", "mask_cases", "validate_cases",
           "lognormal_lengths", "padding_stats", "plot_padding", "plot_tile_visits",
           "plot_varlen_tiles", "tile_classes"]


CHAPTER = Chapter(
    id="ch4",
    title="Varlen and causal masking",
    benchmark=benchmark.run,
    graph_timer=benchmark.GRAPH_TIMER,
    figures=quoted_values,
)
