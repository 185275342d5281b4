"""Chapter 7: the Blackwell design (FlashAttention-4 era). No Blackwell GPU is needed: ``design``
models the CuTe DSL example (roles, registers, scheduler, cycles per tile); Exercise 1 is
``tmem``, 2 ``lazy`` (in Chapter 3's Triton kernel), 3 ``exp2poly``, 4 ``roles`` and
``roles_checks``, 5 ``planner`` (of the Gluon kernel ``gluon_fa4``, compiled ahead of time), 6
``ordering`` (the tcgen05 waits and fences in the roles' simulator).
"""
from __future__ import annotations

from flashbook.contract import Chapter

from . import benchmark, design, exp2poly, lazy, recorded, tmem
from .design import ROLES, PIPELINES, plot_roles, plot_unit_cycles, register_table, \
    static_schedule, tile_coord, tile_cycles, best_emulated_fraction, work_tiles, \
    step_cycles, emulation_gain, exp_unit_table
from .exp2poly import BOUND, check_exp2_poly, check_exp2_poly_triton, fit_exp2, fit_error, \
    plot_exp2_error, run_exp2
from .lazy import check_lazy_attention, hw_exp2, launch_lazy, plot_lazy_trace, \
    simulate_rescales
from .tmem import SEED_MAP, check_tmem_plan, plot_tmem, problems as tmem_problems
from . import planner
from .roles import Timing, simulate
from .roles_checks import check_roles_schedule, plot_schedule, steady_utilisation
from .ordering import check_ordering, simulate_ordered

__all__ = ["CHAPTER", "design", "tmem", "lazy", "exp2poly", "ROLES", "PIPELINES", "plot_roles",
           "plot_unit_cycles", "register_table", "static_schedule", "tile_coord", "tile_cycles",
           "best_emulated_fraction", "work_tiles", "BOUND", "check_exp2_poly",
           "check_exp2_poly_triton", "fit_exp2", "fit_error", "plot_exp2_error", "run_exp2",
           "check_lazy_attention", "hw_exp2", "launch_lazy", "plot_lazy_trace",
           "simulate_rescales", "SEED_MAP", "check_tmem_plan", "plot_tmem", "tmem_problems",
           "planner", "check_roles_schedule", "plot_schedule", "steady_utilisation", "Timing",
           "simulate", "attention_fa4", "step_cycles", "emulation_gain", "exp_unit_table",
           "check_ordering", "simulate_ordered"]


def __getattr__(name):
    """``attention_fa4``, imported on first use: the Gluon kernel needs Triton's Gluon dialect
    (and a Blackwell GPU to run), which the rest of the chapter does not."""
    if name == "attention_fa4":
        from .gluon_fa4 import attention_fa4
        return attention_fa4
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

CHAPTER = Chapter(
    id="ch7",
    title="The Blackwell design (FlashAttention-4 era)",
    # Exercise 6 runs Exercise 4's mma and correction beside its softmax, but a bug in them
    # must be caught by Exercise 4's own check
    cells={"ch7_ordering_test": ("ch7_ordering",)},
    benchmark=benchmark.run,
    graph_timer=benchmark.GRAPH_TIMER,
    figures=recorded.quoted_values,
)
