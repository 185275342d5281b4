"""The ``Pipeline`` warp-role programs are given (Chapter 6's producer and consumers, Chapter
7's five roles): the configuration, the barriers it makes, the slot and phase of a step, and the
actions to ``yield``; ``run`` hands the programs to ``pipeline_engine``. The semantics are in
Chapter 6's ``pipeline`` module, which teaches them."""
from __future__ import annotations

from typing import Iterable

from .pipeline_engine import Engine
from .pipeline_types import PARTS, Action, Arrive, Barrier, Gemm, Load, Run, Softmax, Timing, Wait

__all__ = ["Pipeline"]


class Pipeline:
    """What the warpgroup programs are given: the configuration, ``barrier`` to make barriers,
    the slot and phase of a step, and the actions to ``yield``."""

    def __init__(self, stages: int, n_steps: int, consumers: int = 2,
                 timing: Timing | None = None, max_actions: int = 20000):
        if not (isinstance(stages, int) and stages >= 1):
            raise ValueError(f"stages must be a positive int, got {stages!r}")
        if not (isinstance(n_steps, int) and n_steps >= 0):
            raise ValueError(f"n_steps must be a non-negative int, got {n_steps!r}")
        if consumers not in (1, 2):
            raise ValueError(f"consumers must be 1 or 2, got {consumers!r}")
        self.stages, self.n_steps, self.consumers = stages, n_steps, consumers
        self.timing = timing or Timing()
        self.max_actions = max_actions
        self._barriers: list[Barrier] = []
        self._created: list[Action] = []
        self._current: str | None = None
        self._ran = False

    # ------------------------------------------------------------- for the programs
    def barrier(self, name: str, arrivals: int = 1) -> Barrier:
        """A new barrier whose phases complete after ``arrivals`` arrivals each."""
        if not (isinstance(arrivals, int) and arrivals >= 1):
            raise ValueError(f"barrier {name!r}: arrivals must be a positive int, got {arrivals!r}")
        bar = Barrier(str(name), arrivals)
        self._barriers.append(bar)
        return bar

    def slot(self, step: int) -> int:
        """The ring slot that holds ``step``."""
        return step % self.stages

    def phase(self, step: int) -> int:
        """The parity of the phase of ``full[slot(step)]`` that completes when ``step`` has
        landed: the slot's round (step // stages) modulo 2."""
        return (step // self.stages) % 2

    def wait(self, bar: Barrier, parity: int):
        """Block until the most recent phase of ``bar`` with this parity has completed."""
        return self._make(Wait(bar, parity))

    def arrive(self, bar: Barrier):
        """One arrival on ``bar`` (never blocks)."""
        return self._make(Arrive(bar))

    def load(self, step: int, bar: Barrier, parts: Iterable[str] = PARTS):
        """TMA copy of ``parts`` (K and V) of ``step`` into its slot; arrives on ``bar`` when it
        has landed, ``timing.tma`` later. The issuer does not wait."""
        return self._make(Load(step, bar, tuple(parts)))

    def qk(self, step: int):
        """S = Q K^T of ``step`` on the tensor cores: reads K from the step's slot."""
        return self._make(Gemm("QK", step))

    def pv(self, step: int):
        """O += P V of ``step`` on the tensor cores: reads V from the step's slot."""
        return self._make(Gemm("PV", step))

    def softmax(self, step: int):
        """The online softmax of ``step`` on this warpgroup's CUDA cores."""
        return self._make(Softmax(step))

    def _make(self, action: Action):
        action.pipe, action.creator = self, self._current
        self._created.append(action)
        return action

    # ------------------------------------------------------------------- running
    def run(self, programs: dict) -> Run:
        """Run ``{name: generator}`` (the producer is "producer", consumers "consumer 0", ...)
        to the end or to the first hazard. Never raises a Hazard: it is ``Run.error``."""
        if self._ran:
            raise RuntimeError("a Pipeline runs once; make a new one")
        self._ran = True
        return Engine(self, programs).run()
