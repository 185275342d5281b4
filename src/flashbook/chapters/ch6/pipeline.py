"""A discrete-event model of FlashAttention-3's warp-specialised pipeline (Chapter 6, Exercise 2).

One producer warpgroup streams the K/V tiles of ``n_steps`` key steps into a ring of ``stages``
SMEM slots with TMA; ``consumers`` warpgroups read every step. Programs are generators that
``yield`` the actions of the ``Pipeline`` they are given; the toolkit's engine
(``flashbook.pipeline_engine``, with ``pipeline_types`` and ``pipeline_model``) runs them in
abstract time units, with barriers that follow ``mbarrier`` (the notebook's Section 4). Each
barrier bug is a ``Hazard`` (overwrite, read before ready, phase overrun, deadlock, dataflow,
protocol, runaway), reported deterministically: reads and writes are ordered by vector clocks
carried through barriers, so a race shows even when one run's timing hid it.
"""
from __future__ import annotations

from typing import Callable

from flashbook.pipeline_model import Pipeline
from flashbook.pipeline_types import PARTS, Barrier, Hazard, Read, Run, Span, Timing, Write

__all__ = ["Timing", "Barrier", "Pipeline", "Hazard", "Span", "Read", "Write", "Run", "simulate",
           "pingpong_model", "single_model", "lockstep_model", "PARTS"]


def pingpong_model(g: float, s: float) -> float:
    """Tensor-core utilisation of two warpgroups taking turns: each turn is one GEMM block of g,
    so one period lasts max(2g, g + s) with the tensor cores busy 2g of it."""
    return min(1.0, 2 * g / (g + s))


def single_model(g: float, s: float) -> float:
    """One warpgroup alternating GEMM and softmax: the tensor cores idle during every softmax."""
    return g / (g + s)


def lockstep_model(g: float, s: float) -> float:
    """Two warpgroups without a schedule: they issue together, share the tensor cores (2g), then
    both run softmax (s) while the tensor cores idle."""
    return 2 * g / (2 * g + s)


def simulate(make_barriers: Callable, producer: Callable, consumer: Callable, *, stages: int,
             n_steps: int, consumers: int = 2, pingpong: bool = True,
             timing: Timing | None = None, max_actions: int = 20000) -> Run:
    """Run a schedule written as the exercise's three functions:
    ``make_barriers(pipe) -> (full, consumed, turn)``, ``producer(pipe, full, consumed)`` and
    ``consumer(pipe, wg, full, consumed, turn)``; ``turn`` is None without ping-pong (and with
    one consumer). Returns the Run; a hazard is ``run.error``, never raised."""
    pipe = Pipeline(stages, n_steps, consumers, timing, max_actions)
    pingpong = pingpong and consumers > 1
    try:
        bars = make_barriers(pipe)
        if not (isinstance(bars, tuple) and len(bars) == 3):
            raise Hazard("protocol", 0.0, "make_barriers(pipe) should return the tuple (full, "
                         f"consumed, turn), got {type(bars).__name__}")
        full, consumed, turn = bars
        programs = {"producer": producer(pipe, full, consumed)}
        for wg in range(consumers):
            programs[f"consumer {wg}"] = consumer(pipe, wg, full, consumed,
                                                  turn if pingpong else None)
        run = pipe.run(programs)
    except Hazard as h:
        run = Run(stages, n_steps, consumers, pipe.timing, pingpong, [], [], [], [], {}, 0.0, h)
    run.pingpong = pingpong
    return run
