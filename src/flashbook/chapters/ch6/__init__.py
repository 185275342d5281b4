"""Chapter 6: the Hopper design (FlashAttention-3).

Exercise 1's K/V ring (``ring``, graded by ``ring_checks``) and Exercise 4's FA3-shaped kernel
(``fa3_pallas``, ``fa3_checks``) are Pallas Mosaic GPU, graded in JAX's interpret mode in a child
process (``interpret``); Exercise 2 schedules one producer and two consumers on a model
(``pipeline``, ``pipeline_checks``); Exercise 3 plans the chapter's Gluon kernel (the toolkit's
``fa3_launch``, imported on demand: it needs Gluon and an sm_90 GPU) against ``planner`` (the
toolkit's ``fa3_planner``) and its compiled table (``planner_checks``). Exercises 5-7 are FP8:
block quantization, the incoherent-processing rotation and the online softmax's scales, graded
on a CPU (``fp8_checks``), feeding ``fp8``'s kernel and the toolkit's ``attention_fp8_gluon``."""
from __future__ import annotations

from flashbook import fa3_planner as planner
from flashbook.contract import Chapter
from flashbook.fa3_planner import Config

from . import benchmark, recorded
from .fa3_checks import check_fa3_consumer
from .fp8 import E4M3, attention_fp8
from .fp8_checks import check_block_quantization, check_fp8_tiles, check_rotation, outlier_inputs
from .pipeline import Timing, simulate
from .pipeline_checks import check_pingpong, check_ring_protocol, plot_gantt
from .planner_checks import H100_PROPS, H200_PROPS, MBARRIER_BYTES, PRODUCER_REGS, \
    REGISTERS_PER_SM, WARP_SPECIALIZE_BYTES, check_planner, choice_table
from .ring_checks import check_kv_ring

__all__ = ["CHAPTER", "planner", "check_kv_ring", "check_ring_protocol", "check_pingpong",
           "check_planner", "check_fa3_consumer", "plot_gantt", "Timing", "simulate", "Config",
           "H100_PROPS", "H200_PROPS", "MBARRIER_BYTES", "PRODUCER_REGS", "REGISTERS_PER_SM",
           "WARP_SPECIALIZE_BYTES", "choice_table", "attention_fa3", "E4M3", "attention_fp8",
           "attention_fp8_gluon", "check_block_quantization", "check_rotation",
           "check_fp8_tiles", "outlier_inputs"]


def __getattr__(name):  # the toolkit's Gluon launchers, imported on first use (they need Gluon)
    if name in ("attention_fa3", "attention_fp8_gluon"):
        from flashbook import fa3_fp8_launch, fa3_launch
        return getattr(fa3_launch if name == "attention_fa3" else fa3_fp8_launch, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

CHAPTER = Chapter(id="ch6", title="The Hopper design (FlashAttention-3)", benchmark=benchmark.run,
                  graph_timer=benchmark.GRAPH_TIMER, figures=recorded.quoted_values)
