"""What the programs of the pipeline model are given. ``BasePipeline``, every configuration's:
the barriers it makes, the slot and phase of a step, ``wait`` and ``arrive``, ``op`` to make a
configuration's own actions, the words of the engine's messages, and ``run``, which hands the
programs to ``pipeline_engine``. ``Pipeline``, the configuration of a producer and consumer
warpgroups that run their own GEMMs and softmax (Hopper's): ``load``, ``qk``, ``pv`` and
``softmax``. A configuration with units and buffers of its own subclasses ``BasePipeline`` and
describes its ops (``spec``, ``owner``, ``invalid``, ``buffers`` and the buffer words that
``pipeline_buffers`` uses)."""
from __future__ import annotations

from typing import Iterable

from .pipeline_engine import Engine, deadlock_text
from .pipeline_types import (PARTS, Action, Arrive, Barrier, Gemm, Load, Op, Run, Softmax,
                             Timing, Wait)

__all__ = ["BasePipeline", "Pipeline"]


class BasePipeline:
    """What every configuration's programs are given: ``barrier`` to make barriers, the slot
    and phase of a step, ``wait`` and ``arrive``. A subclass sets ``actions`` (the action types
    its programs may yield) and the words of the engine's messages."""
    actions: tuple = (Wait, Arrive, Op)
    noun = "program"               # "a program loops without end?"
    action_help = "(yield pipe.wait(...) or pipe.arrive(...))."
    foreign_help = "which this pipeline does not run."
    names: tuple | None = None     # the programs' names, if fixed
    consumers = 0

    timing_type = Timing           # the durations' type, made with its defaults if none is given

    def __init__(self, stages: int, n_steps: int, timing=None, max_actions: int = 20000):
        if not (isinstance(stages, int) and stages >= 1):
            raise ValueError(f"stages must be a positive int, got {stages!r}")
        if not (isinstance(n_steps, int) and n_steps >= 0):
            raise ValueError(f"n_steps must be a non-negative int, got {n_steps!r}")
        self.stages, self.n_steps = stages, n_steps
        self.timing = timing or self.timing_type()
        self.max_actions = max_actions
        self._barriers: list[Barrier] = []
        self._created: list[Action] = []
        self._current: str | None = None
        self._ran = False

    titles: dict = {}              # program -> how the messages name it, if not by its name

    def who(self, name: str) -> str:
        """A program as the messages name it."""
        return self.titles.get(name, name)

    def deadlock_report(self, stuck, finished: dict) -> str:
        return deadlock_text(self.noun, stuck, self.who, finished, ".")

    def in_order(self, program: str, action, now: float) -> None:
        """Called with every action a program yields, in its program order, before it runs (a
        wait that came before it has passed): a configuration whose rules are about program
        order (Chapter 7's tcgen05 waits and fences) raises its ``Hazard`` here."""

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
        """Block until the most recent phase of ``bar`` with this parity has completed (on a
        fresh barrier parity 1 passes at once)."""
        return self._make(Wait(bar, parity))

    def arrive(self, bar: Barrier):
        """One arrival on ``bar``, now (never blocks)."""
        return self._make(Arrive(bar))

    def op(self, name: str, *args, bar: Barrier | None = None):
        """An action of this configuration, ``name(*args)``; ``spec`` says what it does."""
        return self._make(Op(name, args, bar))

    def _make(self, action: Action):
        action.pipe, action.creator = self, self._current
        self._created.append(action)
        return action

    # ------------------------------------------------------------------- running
    def run(self, programs: dict) -> Run:
        """Run ``{name: generator}`` to the end or to the first hazard. Never raises a Hazard:
        it is ``Run.error``."""
        if self._ran:
            raise RuntimeError(f"a {type(self).__name__} runs once; make a new one")
        self._ran = True
        unknown = [n for n in programs if self.names is not None and n not in self.names]
        if unknown:
            raise ValueError(f"unknown {self.noun}(s) {unknown}; the {self.noun}s are "
                             f"{self.names}")
        return Engine(self, programs).run()


class Pipeline(BasePipeline):
    """What the warpgroup programs are given: the configuration, ``barrier`` to make barriers,
    the slot and phase of a step, and the actions to ``yield``."""
    actions = (Wait, Arrive, Load, Gemm, Softmax)
    action_help = ("(yield pipe.wait(...), pipe.arrive(...), pipe.load(...), pipe.qk(...), "
                   "pipe.pv(...) or pipe.softmax(...)).")

    def __init__(self, stages: int, n_steps: int, consumers: int = 2,
                 timing: Timing | None = None, max_actions: int = 20000):
        super().__init__(stages, n_steps, timing, max_actions)
        if consumers not in (1, 2):
            raise ValueError(f"consumers must be 1 or 2, got {consumers!r}")
        self.consumers = consumers

    titles = {"producer": "the producer"}

    def deadlock_report(self, stuck, finished: dict) -> str:
        return deadlock_text(
            "warpgroup", stuck, self.who, finished,
            ": count the arrivals each barrier gets against the phases waited for; with "
            "ping-pong, both warpgroups take and pass the same number of turns.")

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
