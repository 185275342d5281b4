"""Chapter 3: online softmax and the FlashAttention forward in Triton.

The student writes Triton kernels with fixed signatures; ``launch`` wraps them (validation,
tile configs per GPU), ``checks`` grades them, ``figures`` draws the chapter's pictures and
``benchmark`` times them on a GPU (``flashbook bench ch3``).
"""
from __future__ import annotations

import functools

from flashbook.contract import Chapter, Exercise

from . import benchmark
from .checks import attention_cases, check_attention_kernel, check_merge_kernel, \
    check_softmax_kernel, merge_cases, softmax_cases
from .figures import online_softmax_trace, plot_online_softmax, plot_tiles
from .launch import DTYPES, HEAD_DIMS, LOG2E, Config, attention_forward, merge_states, \
    pick_config, softmax_rows
from .variants import VARIANTS

__all__ = ["CHAPTER", "Config", "pick_config", "softmax_rows", "attention_forward", "merge_states",
           "check_softmax_kernel", "check_attention_kernel", "check_merge_kernel",
           "attention_cases", "softmax_cases", "merge_cases", "online_softmax_trace",
           "plot_online_softmax", "plot_tiles", "LOG2E", "HEAD_DIMS", "DTYPES"]


def quoted_figures(rows) -> list[str]:
    """The sentences of the chapter's closing section that quote the recorded H200 data."""
    by = {(r.kernel, r.B, r.N_q, r.d): r.tflops for r in rows}
    ref, cudnn = by[("ch3_two_tiles", 1, 16384, 128)], by[("sdpa_cudnn", 1, 16384, 128)]
    shapes = {(b, n, d) for _, b, n, d in by}
    vs_fa2 = sorted(by[("ch3_two_tiles", *s)] / by[("sdpa_flash", *s)] for s in shapes)
    return [f"{ref / cudnn:.2f}x cuDNN at `(1, 16, 16384, 128)` ({ref:.0f} against {cudnn:.0f}",
            f"by {vs_fa2[0]:.2f}x to {vs_fa2[-1]:.2f}x"]


CHAPTER = Chapter(
    id="ch3",
    title="Online softmax and the Triton FlashAttention forward",
    exercises=(
        Exercise("ch3_softmax_kernel_test", ("ch3_softmax_kernel",), ("softmax_kernel",),
                 check_softmax_kernel),
        Exercise("ch3_attn_test", ("ch3_attn_tile", "ch3_attn_kernel"), ("attn_fwd_kernel",),
                 check_attention_kernel),
        Exercise("ch3_merge_test", ("ch3_merge_kernel",), ("merge_kernel",), check_merge_kernel),
        Exercise("ch3_two_tiles_test", ("ch3_attn_tile", "ch3_two_tiles_kernel"),
                 ("attn_fwd_two_tiles",), functools.partial(check_attention_kernel, two_tiles=True)),
    ),
    variants=VARIANTS,
    benchmark=benchmark.run,
    graph_timer=benchmark.GRAPH_TIMER,
    quotes=quoted_figures,
)
