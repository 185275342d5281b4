"""What a run of Chapter 7's five-role simulator (``roles``) is given and what it gives back: the
durations of its work (``Timing``) and the run itself (``RoleRun``: the Gantt bars, what ran,
the hazard that stopped it). ``roles`` re-exports both; its engine (``role_engine``) makes the
``RoleRun``.
"""
from __future__ import annotations

import dataclasses

from flashbook.pipeline_types import Hazard

__all__ = ["Timing", "RoleRun"]


@dataclasses.dataclass(frozen=True)
class Timing:
    """Durations in time units. ``g = qk + pv`` is one Q tile's MMA time per key step and
    ``s = rowmax + exp`` its softmax time."""
    tma: float = 3.0          # issue to arrival of one K or V tile (or a Q tile)
    qk: float = 1.0           # S = Q K^T of one Q tile, on the tensor core
    pv: float = 1.0           # O += P V of one Q tile, on the tensor core
    rowmax: float = 0.5       # softmax: read S from TMEM, row max, publish it
    exp: float = 1.5          # softmax: exp2 of one tile on the SM's exponential unit (one
    #                           tile at a time: the two softmax warpgroups share it), P to 16
    #                           bits, P stored in place of S
    rescale: float = 1.0      # correction: O *= exp2(m_old - m_new), O through registers
    rowsum: float = 0.25      # softmax, after its last step: publish the row sum
    finish: float = 1.0       # correction: O / l into shared memory
    store: float = 1.0        # epilogue: TMA store of one O tile

    @property
    def g(self) -> float:
        return self.qk + self.pv

    @property
    def s(self) -> float:
        return self.rowmax + self.exp

    def describe(self) -> str:
        return (f"tma {self.tma:g}, qk {self.qk:g}, pv {self.pv:g}, rowmax {self.rowmax:g}, "
                f"exp {self.exp:g}, rescale {self.rescale:g}")


@dataclasses.dataclass
class RoleRun:
    """What one simulation did. ``spans`` are the Gantt bars (rows: the roles, "TMA" and
    "tensor core"; the tensor core's bars have kind QK or PV and lane = the Q tile);
    ``error`` is the Hazard that stopped the run, or None."""
    stages: int
    n_steps: int
    timing: Timing
    spans: list
    barriers: list
    finished: dict
    end: float
    error: Hazard | None
    done: dict             # what ran: {("QK", t, j): (start, end), ("rescale", t, j): ..., ...}
    core: object           # Chapter 6's Run of the same spans (its utilisation measure)

    def utilisation(self, t0: float | None = None, t1: float | None = None) -> float:
        """Fraction of [t0, t1] (default: first MMA start to last MMA end) in which the
        tensor core ran an MMA."""
        return self.core.utilisation(t0, t1)

    def mma_spans(self) -> list:
        return self.core.gemm_spans()

    def starts(self, kind: str, tile: int) -> dict:
        """{step: start} of the tensor core's QK or PV MMAs of one tile."""
        return {s.step: s.start for s in self.spans
                if s.row == "tensor core" and s.kind == kind and s.lane == tile}

    def blocked_time(self, row: str, barrier_prefix: str = "", t0: float = 0.0,
                     t1: float = float("inf")) -> float:
        """Time ``row`` spent waiting in [t0, t1] on barriers whose names start with
        ``barrier_prefix``."""
        return sum(max(0.0, min(s.end, t1) - max(s.start, t0)) for s in self.spans
                   if s.row == row and s.kind == "wait" and s.note.startswith(barrier_prefix))
