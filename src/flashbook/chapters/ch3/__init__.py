"""Chapter 3: online softmax and the FlashAttention forward in Triton.

The student writes Triton kernels with fixed signatures; ``launch`` wraps them (validation,
tile configs per GPU), ``checks`` grades them, ``figures`` draws the chapter's pictures and
``benchmark`` times them on a GPU (``flashbook bench ch3``).
"""
from __future__ import annotations

from flashbook import results
from flashbook.contract import Chapter

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


def quoted_values(rows) -> dict:
    """The figures the chapter's closing section quotes (``flashbook.quoted``), by glue key."""
    # the kernels' ablations compare reference rows (all timed one way); the speed a reader
    # gets, against cuDNN and FA2, is attention_two_tiles as called where that was recorded
    by = {(r.kernel, r.B, r.N_q, r.d): r for r in rows if r.role != "public"}
    tf = {key: r.tflops for key, r in by.items()}
    called = {(r.kernel, r.B, r.N_q, r.d): r.tflops for r in results.as_called(rows)}
    shapes = sorted({(b, n, d) for _, b, n, d in tf})
    vs_fa2 = sorted(called[("ch3_two_tiles", *s)] / tf[("sdpa_flash", *s)] for s in shapes)
    out = {"ch3_tflops": called[("ch3_two_tiles", 1, 16384, 128)],
           "ch3_cudnn_tflops": tf[("sdpa_cudnn", 1, 16384, 128)],
           "ch3_vs_fa2_min": vs_fa2[0], "ch3_vs_fa2_max": vs_fa2[-1]}
    for b, n, d in ((1, 16384, 128), (4, 4096, 128), (4, 4096, 64), (4, 1024, 64)):
        out[f"ch3_vs_cudnn_{b}_{n}_{d}"] = called[("ch3_two_tiles", b, n, d)] / \
            tf[("sdpa_cudnn", b, n, d)]
    ms = {(r.role, r.N_q): r.ms for r in rows if r.kernel == "ch3_two_tiles" and r.B == 4
          and r.d == 64}
    out["ch3_called_ms_1024"], out["ch3_graph_ms_1024"] = ms[("public", 1024)], \
        ms[("reference", 1024)]
    # the ablations: each pair of ratios (two shapes per head dimension), smaller first
    for name, top, bottom in (("interleaved_vs_ab", "ch3_two_tiles", "ch3_two_tiles_a_then_b"),
                              ("ab_vs_one_tile", "ch3_two_tiles_a_then_b", "ch3_one_tile")):
        for d in (128, 64):
            both = sorted(tf[(top, *s)] / tf[(bottom, *s)] for s in shapes if s[2] == d)
            out[f"ch3_{name}_d{d}_lo"], out[f"ch3_{name}_d{d}_hi"] = both

    def note(kernel: str, field: str) -> int:        # the note holds "...; regs=R spills=S"
        regs = by[(kernel, 1, 16384, 128)].note.split("; ")[1]
        return int(dict(x.split("=") for x in regs.split())[field])
    out["ch3_regs"], out["ch3_spills"] = note("ch3_two_tiles", "regs"), \
        note("ch3_two_tiles", "spills")
    out["ch3_regs_a_then_b"] = note("ch3_two_tiles_a_then_b", "regs")
    out["ch3_regs_one_tile"] = note("ch3_one_tile", "regs")
    return out


CHAPTER = Chapter(
    id="ch3",
    title="Online softmax and the Triton FlashAttention forward",
    benchmark=benchmark.run,
    graph_timer=benchmark.GRAPH_TIMER,
    figures=quoted_values,
)
