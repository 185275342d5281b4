"""A discrete-event model of FlashAttention-3's warp-specialised pipeline (Chapter 6, Exercise 2).

One *producer* warpgroup streams the K/V tiles of ``n_steps`` key steps into a ring of ``stages``
shared-memory slots with TMA; ``consumers`` compute warpgroups (two in FA3, one Q tile each) read
every step: a QK GEMM reads K, a PV GEMM reads V, the softmax in between runs on the warpgroup's
own CUDA cores. Warpgroup programs are Python generators that ``yield`` actions made by the
``Pipeline`` they are given; the engine runs them in simulated time (abstract *time units*).

Why a model and not a GPU: the bugs of a barrier protocol are races. On a GPU they corrupt a
result once in a while or hang the kernel; here every one of them is reported, deterministically,
with the time, the warpgroups and the barrier involved.

Semantics (kept close to Hopper's ``mbarrier`` and ``wgmma``):

* A ``Barrier`` expects ``arrivals`` arrivals per phase; the last one completes the phase and the
  next phase begins. ``wait(bar, parity)`` returns once the most recent phase of that parity has
  completed, i.e. while ``completed % 2 != parity`` — so on a fresh barrier a wait for parity 1
  returns at once (a phase "-1" counts as done), the usual trick for a first round with nothing to
  wait for. Parity is all a waiter has: a barrier that completes twice before a waiter looks
  makes the waiter mistake one phase for another, which the engine reports (*phase overrun*).
* ``load(step, bar)`` is a TMA copy of K and V of ``step`` into slot ``step % stages``: the
  issuing warpgroup goes on at once, the data lands ``timing.tma`` later and the copy then counts
  as one arrival on ``bar`` (the transaction-count arrival of the real TMA).
* ``qk(step)`` and ``pv(step)`` are GEMMs on the SM's tensor cores, one resource shared by all
  warpgroups: GEMMs that run at the same time share it (each at 1/n of the speed, as the warp
  schedulers interleave their instructions), so two warpgroups that issue together also finish
  together. The issuing warpgroup waits for its GEMM (issue plus ``wgmma.wait``).
* ``softmax(step)`` runs on the warpgroup's own CUDA cores for ``timing.softmax``. Within a
  warpgroup the dataflow must hold: QK(k) before softmax(k) before PV(k), each step once, in order.

Hazards end the run with a ``Hazard`` that names the time, the warpgroups and the barrier:
*overwrite* (a TMA into a slot whose previous step some consumer has not finished reading, or
whose reads are not ordered before it by a barrier the producer waited on), *read before ready*
(a GEMM reads a slot whose TMA has not landed, or without having waited on the barrier that TMA
arrives on), *phase overrun* (above), *deadlock* (every unfinished warpgroup waits and nothing is
in flight), *dataflow*, *protocol* (something that is not an action, an action never yielded) and
*runaway* (more than ``max_actions`` actions). Reads and writes are ordered by vector clocks that
travel through barrier arrivals and waits, so a race is reported even when the timing of one run
happened to hide it.

The model's data types (the timing, barriers, actions, hazards and the trace) are the toolkit's
``flashbook.pipeline_types``, its ``Pipeline`` ``flashbook.pipeline_model`` and its event loop
``flashbook.pipeline_engine`` (Chapter 7's five roles run on the same engine); this module
re-exports them with the chapter's models and ``simulate``.
"""
from __future__ import annotations

from typing import Callable

from flashbook.pipeline_model import Pipeline
from flashbook.pipeline_types import (PARTS, Action, Arrive, Barrier, Gemm, Hazard, Load, Read,
                                      Run, Softmax, Span, Timing, Wait, Write)

__all__ = ["Timing", "Barrier", "Pipeline", "Hazard", "Span", "Read", "Write", "Run", "simulate",
           "pingpong_model", "single_model", "lockstep_model", "PARTS",
           # the actions, which Chapter 7's five-role simulator extends (the engine that runs
           # them is the toolkit's ``pipeline_engine``)
           "Action", "Wait", "Arrive", "Load", "Gemm", "Softmax"]


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


# ---------------------------------------------------------------------------- convenience

def simulate(make_barriers: Callable, producer: Callable, consumer: Callable, *, stages: int,
             n_steps: int, consumers: int = 2, pingpong: bool = True,
             timing: Timing | None = None, max_actions: int = 20000) -> Run:
    """Run a schedule written as three functions (the exercise's signatures):
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
