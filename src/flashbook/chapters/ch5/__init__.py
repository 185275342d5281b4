"""Chapter 5: grouped-query attention: the M-fold prefill, decode against contiguous and paged
KV caches.

The student writes Triton kernels with fixed signatures (and, optionally, the prefill's
two-tile form) and the decode wrapper's argument checks; ``launch`` launches them, ``checks``
grades them (canary sequences, NaN past every cache length, counted K tile loads in CPU mode),
``figures`` draws the chapter's pictures and ``benchmark`` times the solution on a GPU
(``flashbook bench ch5``).
"""
from __future__ import annotations

from flashbook.contract import Chapter

from . import benchmark
from .checks import check_cache_rows, check_decode_kernel, check_gqa_prefill, \
    check_gqa_two_tiles, check_validate_decode, decode_cases, gqa_cases, validate_decode_cases
from .figures import MODELS, decode_intensity, example_points, kv_cache_bytes, kv_table, \
    kv_table_markdown, plot_mfold, plot_paged_cache, plot_roofline
from .launch import DTYPES, HEAD_DIMS, HEAD_DIMS_WHY, decode_block_m, decode_config, \
    launch_decode, launch_gqa, paged_cache, prefill_dtypes, validate_packed
from .recorded import measured_points, plot_recorded, quoted_values, summary

__all__ = ["CHAPTER", "launch_gqa", "launch_decode", "decode_block_m", "decode_config", "paged_cache",
           "validate_packed", "prefill_dtypes", "DTYPES", "HEAD_DIMS", "HEAD_DIMS_WHY",
           "check_gqa_prefill", "check_gqa_two_tiles", "check_cache_rows",
           "check_decode_kernel", "check_validate_decode", "gqa_cases", "decode_cases",
           "validate_decode_cases", "MODELS", "kv_cache_bytes", "kv_table", "kv_table_markdown",
           "decode_intensity", "example_points", "plot_roofline", "plot_mfold",
           "plot_paged_cache", "summary", "plot_recorded", "measured_points"]

CHAPTER = Chapter(
    id="ch5",
    title="Grouped-query attention",
    benchmark=benchmark.run,
    graph_timer=benchmark.GRAPH_TIMER,
    figures=quoted_values,
)
