"""Chapter 3: online softmax and the FlashAttention forward in Triton.

The student writes Triton kernels with fixed signatures; ``launch`` wraps them (validation,
tile configs per GPU), ``checks`` grades them, ``figures`` draws the chapter's pictures and
``benchmark`` times them on a GPU (``flashbook bench ch3``).
"""
from __future__ import annotations

import functools

from flashbook import results
from flashbook.contract import Chapter, Exercise

from . import benchmark
from .checks import attention_cases, check_attention_kernel, check_attn_tile_step, \
    check_merge_kernel, check_softmax_kernel, check_tile_load, merge_cases, softmax_cases, \
    tile_cases, tile_step_cases
from .figures import online_softmax_trace, plot_online_softmax, plot_tiles
from .launch import DTYPES, HEAD_DIMS, LOG2E, SHARED_MEMORY_PER_BLOCK, Config, \
    attention_forward, copy_tiles, merge_states, pick_config, softmax_rows

__all__ = ["CHAPTER", "Config", "pick_config", "softmax_rows", "copy_tiles", "attention_forward",
           "merge_states", "check_softmax_kernel", "check_tile_load", "check_attn_tile_step",
           "check_attention_kernel", "check_merge_kernel", "attention_cases", "softmax_cases",
           "tile_cases", "tile_step_cases", "merge_cases", "online_softmax_trace",
           "plot_online_softmax", "plot_tiles", "LOG2E", "HEAD_DIMS", "DTYPES",
           "SHARED_MEMORY_PER_BLOCK"]


def quoted_figures(rows) -> list[str]:
    """The sentences of the chapter's closing section that quote the recorded H200 data."""
    # the kernels' ablations compare reference rows (all timed one way); the speed a reader
    # gets, against cuDNN and FA2, is attention_two_tiles as called where that was recorded
    by = {(r.kernel, r.B, r.N_q, r.d): r for r in rows if r.role != "public"}
    tf = {key: r.tflops for key, r in by.items()}
    called = {(r.kernel, r.B, r.N_q, r.d): r.tflops for r in results.as_called(rows)}
    ref, cudnn = called[("ch3_two_tiles", 1, 16384, 128)], tf[("sdpa_cudnn", 1, 16384, 128)]
    shapes = sorted({(b, n, d) for _, b, n, d in tf})
    vs_fa2 = sorted(called[("ch3_two_tiles", *s)] / tf[("sdpa_flash", *s)] for s in shapes)

    def ratios(top: str, bottom: str, d: int) -> str:
        both = sorted(tf[(top, *s)] / tf[(bottom, *s)] for s in shapes if s[2] == d)
        return f"{both[0]:.2f}x and {both[1]:.2f}x at d = {d}"

    def regs(kernel: str) -> str:
        return by[(kernel, 1, 16384, 128)].note.split("; ")[1]      # "regs=R spills=S"
    def vs_cudnn(b, n, d):
        return f"{called[('ch3_two_tiles', b, n, d)] / tf[('sdpa_cudnn', b, n, d)]:.2f}x"
    ms = {(r.role, r.N_q): r.ms for r in rows if r.kernel == "ch3_two_tiles" and r.B == 4
          and r.d == 64}
    return [f"{ref / cudnn:.2f}x cuDNN at `(1, 16, 16384, 128)` ({ref:.0f} against {cudnn:.0f}",
            f"{vs_cudnn(4, 4096, 128)} at `(4, 16, 4096, 128)`, {vs_cudnn(4, 4096, 64)} at "
            f"`(4, 16, 4096, 64)` and {vs_cudnn(4, 1024, 64)} at `(4, 16, 1024, 64)`",
            f"by {vs_fa2[0]:.2f}x to {vs_fa2[-1]:.2f}x",
            f"{ms[('public', 1024)]:.3f} ms where its kernel replayed from a graph takes "
            f"{ms[('reference', 1024)]:.3f} ms",
            "A-then-B by " + ratios("ch3_two_tiles", "ch3_two_tiles_a_then_b", 128),
            "by " + ratios("ch3_two_tiles", "ch3_two_tiles_a_then_b", 64),
            "gives " + ratios("ch3_two_tiles_a_then_b", "ch3_one_tile", 128),
            "rows per program, " + ratios("ch3_two_tiles_a_then_b", "ch3_one_tile", 64)[:-len(" at d = 64")],
            "uses {} registers per thread and spills {}".format(
                *(x.split("=")[1] for x in regs("ch3_two_tiles").split())),
            "(the A-then-B order {} with no spills, the\n# one-tile kernel {})".format(
                regs("ch3_two_tiles_a_then_b").split()[0].split("=")[1],
                regs("ch3_one_tile").split()[0].split("=")[1])]


CHAPTER = Chapter(
    id="ch3",
    title="Online softmax and the Triton FlashAttention forward",
    exercises=(
        Exercise("ch3_softmax_kernel_test", ("ch3_softmax_kernel",), ("softmax_kernel",),
                 check_softmax_kernel),
        Exercise("ch3_tile_load_test", ("ch3_tile_load",), ("copy_tile_kernel",),
                 check_tile_load),
        # the loop body's two functions on one tile each: a bug there is named here first
        Exercise("ch3_attn_tile_test", ("ch3_attn_tile",), ("attn_scores", "attn_update"),
                 check_attn_tile_step),
        Exercise("ch3_attn_test", ("ch3_attn_tile", "ch3_attn_kernel"), ("attn_fwd_kernel",),
                 check_attention_kernel),
        Exercise("ch3_merge_test", ("ch3_merge_kernel",), ("merge_kernel",), check_merge_kernel),
        Exercise("ch3_two_tiles_test", ("ch3_attn_tile", "ch3_two_tiles_kernel"),
                 ("attn_fwd_two_tiles",), functools.partial(check_attention_kernel, two_tiles=True)),
    ),
    benchmark=benchmark.run,
    graph_timer=benchmark.GRAPH_TIMER,
    quotes=quoted_figures,
)
