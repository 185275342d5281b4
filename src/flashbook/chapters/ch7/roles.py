"""The Blackwell design's five roles, simulated (Chapter 7, Exercise 4). They talk only through
mbarriers:

* the **load warp**: TMA copies of the two Q tiles, then K and V of step j into slot
  ``j % stages`` of the K ring and of the V ring;
* the **MMA warp** (one thread) issues every ``tcgen05`` MMA, ``S_t = Q_t K_j^T`` into tensor
  memory (TMEM) and ``O_t (+)= P_t V_j`` with P from TMEM, without waiting: the tensor core runs
  them **in issue order**, and ``commit(bar)`` arrives once every MMA issued before has finished;
* two **softmax** warpgroups, one per Q tile: S_t from TMEM, the row max (``rowmax``), ``P_t =
  exp2(S_t - m)`` **in place of S_t** (``exp``), at the end the row sum (``rowsum``). Both share
  the SM's exponential unit (MUFU), one tile's ``exp`` at a time (the Gantt's "exp wait");
* the **correction** warpgroup rescales O_t in TMEM between two PV MMAs (``rescale``), then
  normalises O_t into shared memory (``finish``); the **epilogue warp** stores it (``store``).

``role_pipeline`` configures the toolkit's engine (Chapter 6's) with buffers with contents in
shared memory (Q, K and V slots, O staging) and TMEM (S/P, O, row statistics): a hazard ends the
run naming the time, roles and buffer: *read before ready*, *overwrite*, *race* (overlapping
accesses, one a write), and Chapter 6's *deadlock*, *phase overrun*, *protocol*, *runaway*.
Time is in abstract units (``Timing``); issuing an MMA, a TMA copy or an arrival takes none.
"""
from __future__ import annotations

import types

from flashbook.pipeline_types import Barrier, Hazard, Run, Span

from .role_pipeline import ROLE_NAMES, TILES, RolePipeline, Timing

__all__ = ["Timing", "RolePipeline", "Run", "Hazard", "Barrier", "Span", "ROLE_NAMES",
           "fa4_model", "serial_model", "make_barriers", "load", "softmax", "epilogue",
           "simulate"]


def fa4_model(t: Timing) -> float:
    """Steady-state tensor-core utilisation of the two-tile schedule, when the K/V ring hides the
    TMA latency. Per key step the tensor core has ``2g`` of work. One tile's chain is
    ``QK_t(j) -> rowmax -> [exp, and the correction's rescale of O_t] -> PV_t(j) -> QK_t(j+1)``:
    S_t and P_t share TMEM columns, so the next QK of a tile waits for its PV. While one tile
    waits for its softmax the tensor core runs the other tile's PV and QK (g), so a period lasts
    ``max(2g, g + rowmax + max(exp, rescale))``; the correction warpgroup rescales both tiles,
    ``2 * rescale`` a period, and the SM's one exponential unit computes both tiles'
    exponentials, ``2 * exp`` a period. Utilisation = 2g / period."""
    g = t.g
    period = max(2 * g, g + t.rowmax + max(t.exp, t.rescale), 2 * t.rescale, 2 * t.exp)
    return min(1.0, 2 * g / period)


def serial_model(t: Timing) -> float:
    """One Q tile at a time (no second tile to fill the softmax): g / (g + rowmax + max(exp,
    rescale))."""
    return t.g / (t.g + t.rowmax + max(t.exp, t.rescale))


# ------------------------------------------------------------------ the chapter's given roles

def make_barriers(pipe: RolePipeline) -> types.SimpleNamespace:
    """The CTA's mbarriers (all expect one arrival a phase; ``[t]`` is per Q tile, ``[s]`` per
    ring slot):

    * ``q_full[t]``: Q tile t landed (TMA -> MMA warp);
    * ``k_full[s]``, ``v_full[s]``: the slot holds its next K (V) tile (TMA -> MMA warp);
    * ``k_free[s]``, ``v_free[s]``: both MMAs that read the slot have finished (MMA warp's
      commit -> load warp);
    * ``s_ready[t]``: QK_t has finished, S_t is in TMEM (MMA warp's commit -> softmax t);
    * ``p_ready[t]``: softmax t has written P_t into TMEM (softmax t -> MMA warp);
    * ``stats[t]``: softmax t has published this step's row max (softmax t -> correction);
    * ``o_done[t]``: PV_t has finished (MMA warp's commit -> correction);
    * ``o_ready[t]``: the correction has rescaled O_t (correction -> MMA warp);
    * ``l_ready[t]``: softmax t has published its row sum (softmax t -> correction);
    * ``epi_ready[t]``: the normalised O_t is in shared memory (correction -> epilogue warp).
    """
    def per_tile(name):
        return [pipe.barrier(f"{name}[{t}]") for t in TILES]

    def per_slot(name):
        return [pipe.barrier(f"{name}[{s}]") for s in range(pipe.stages)]
    return types.SimpleNamespace(
        q_full=per_tile("q_full"), k_full=per_slot("k_full"), k_free=per_slot("k_free"),
        v_full=per_slot("v_full"), v_free=per_slot("v_free"), s_ready=per_tile("s_ready"),
        p_ready=per_tile("p_ready"), stats=per_tile("stats"), o_done=per_tile("o_done"),
        o_ready=per_tile("o_ready"), l_ready=per_tile("l_ready"),
        epi_ready=per_tile("epi_ready"))


def load(pipe: RolePipeline, bars):
    """The load warp: both Q tiles, then K and V of every step, each into a slot only once the
    MMAs that read the slot's previous step have finished."""
    for t in TILES:
        yield pipe.load_q(t, bars.q_full[t])
    for j in range(pipe.n_steps):
        s, ph = pipe.slot(j), pipe.phase(j)
        yield pipe.wait(bars.k_free[s], ph ^ 1)           # round 0: parity 1 passes at once
        yield pipe.load_k(j, bars.k_full[s])
        yield pipe.wait(bars.v_free[s], ph ^ 1)
        yield pipe.load_v(j, bars.v_full[s])


def softmax(pipe: RolePipeline, t: int, bars):
    """Softmax warpgroup t: for every step, S_t from TMEM, the row max for the correction, P_t
    in place of S_t for the PV MMA; at the end the row sum."""
    for j in range(pipe.n_steps):
        yield pipe.wait(bars.s_ready[t], j % 2)           # QK_t(j) has finished
        yield pipe.rowmax(t, j)
        yield pipe.arrive(bars.stats[t])                   # the correction may use the max
        yield pipe.exp(t, j)
        yield pipe.arrive(bars.p_ready[t])                 # PV_t(j) may read P_t
    yield pipe.rowsum(t)
    yield pipe.arrive(bars.l_ready[t])


def epilogue(pipe: RolePipeline, bars):
    """The epilogue warp: TMA-stores each normalised O tile once the correction has written it."""
    for t in TILES:
        yield pipe.wait(bars.epi_ready[t], 0)
        yield pipe.store(t)


def simulate(mma, correction, *, stages: int, n_steps: int, timing: Timing | None = None,
             max_actions: int = 20000, roles: dict | None = None) -> Run:
    """Run the five roles: the chapter's load warp, softmax warpgroups and epilogue warp (or
    ``roles``' replacements, keyed by role name) with ``mma(pipe, bars)`` and
    ``correction(pipe, bars)``. Returns the Run; a hazard is ``run.error``, never raised."""
    pipe = RolePipeline(stages, n_steps, timing, max_actions)
    given = {"load warp": lambda: load(pipe, bars),
             "MMA warp": lambda: mma(pipe, bars),
             "softmax 0": lambda: softmax(pipe, 0, bars),
             "softmax 1": lambda: softmax(pipe, 1, bars),
             "correction": lambda: correction(pipe, bars),
             "epilogue warp": lambda: epilogue(pipe, bars)}
    for name, fn in (roles or {}).items():
        given[name] = (lambda fn=fn: fn(pipe, bars))
    try:
        bars = make_barriers(pipe)
        programs = {name: make() for name, make in given.items()}
        return pipe.run(programs)
    except Hazard as h:
        return Run(stages, n_steps, 0, pipe.timing, False, [], [], [], [], {}, 0.0, h)
