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
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Iterable

__all__ = ["Timing", "Barrier", "Pipeline", "Hazard", "Span", "Read", "Write", "Run", "simulate",
           "pingpong_model", "single_model", "lockstep_model", "PARTS",
           # the actions, which Chapter 7's five-role simulator extends (the engine that runs
           # them is ``pipeline_engine``)
           "Action", "Wait", "Arrive", "Load", "Gemm", "Softmax"]

PARTS = ("K", "V")


@dataclasses.dataclass(frozen=True)
class Timing:
    """Durations in time units. ``g = qk + pv`` is one warpgroup's GEMM time per step."""
    tma: float = 3.0          # issue to arrival of one step's K and V
    qk: float = 1.0           # S = Q K^T, alone on the tensor cores
    pv: float = 1.0           # O += P V, alone on the tensor cores
    softmax: float = 2.0      # the online softmax of one step, on the warpgroup's CUDA cores

    @property
    def gemm(self) -> float:
        return self.qk + self.pv

    def describe(self) -> str:
        return f"tma {self.tma:g}, qk {self.qk:g}, pv {self.pv:g}, softmax {self.softmax:g}"


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


class Hazard(Exception):
    """A run stopped at a protocol error. ``kind``: overwrite, read before ready, phase overrun,
    deadlock, dataflow, protocol or runaway; ``time``: simulated time."""

    def __init__(self, kind: str, time: float, message: str):
        super().__init__(message)
        self.kind, self.time, self.message = kind, time, message

    def __str__(self):
        return f"HAZARD ({self.kind}) at t={self.time:g}: {self.message}"


class Barrier:
    """An mbarrier: ``arrivals`` per phase, ``completed`` phases so far. Make it with
    ``Pipeline.barrier``."""

    def __init__(self, name: str, arrivals: int):
        self.name, self.arrivals = name, arrivals
        self.completed = 0                 # phases completed; the current phase's parity is % 2
        self.pending = 0                   # arrivals in the current phase
        self.arrivers: list = []           # (actor, time) of the current phase
        self.phases: list = []             # per completed phase: (time, [(actor, time), ...])
        self._vc: dict = {}                # clock joined from the current phase's arrivals
        self._cum = [{}]                   # clock a waiter learns after n completed phases
        self.waiters: set = set()          # programs that ever waited on it
        self.blocked: list = []            # programs blocked on it now

    def __repr__(self):
        return f"Barrier({self.name!r}, arrivals={self.arrivals}, completed={self.completed})"


# ------------------------------------------------------------------------------------ actions

class Action:
    pipe = None
    yielded = False
    creator = None


@dataclasses.dataclass(eq=False)
class Wait(Action):
    bar: Barrier
    parity: int

    def __str__(self):
        return f"wait({self.bar.name}, parity {self.parity})"


@dataclasses.dataclass(eq=False)
class Arrive(Action):
    bar: Barrier

    def __str__(self):
        return f"arrive({self.bar.name})"


@dataclasses.dataclass(eq=False)
class Load(Action):
    step: int
    bar: Barrier
    parts: tuple

    def __str__(self):
        return f"load(step {self.step}, {self.bar.name})"


@dataclasses.dataclass(eq=False)
class Gemm(Action):
    name: str              # "QK" (reads K) or "PV" (reads V)
    step: int

    def __str__(self):
        return f"{self.name.lower()}({self.step})"


@dataclasses.dataclass(eq=False)
class Softmax(Action):
    step: int

    def __str__(self):
        return f"softmax({self.step})"


# -------------------------------------------------------------------------------- the trace

@dataclasses.dataclass(frozen=True)
class Span:
    """A bar of the Gantt chart. ``row``: "producer", "consumer i", "tensor core" or "TMA";
    ``kind``: QK, PV, softmax, wait, load or shared; ``lane``: the consumer (tensor core) or the
    slot (TMA) inside the row."""
    row: str
    kind: str
    start: float
    end: float
    step: int | None = None
    note: str = ""
    lane: int = 0


@dataclasses.dataclass
class Read:
    actor: str
    part: str
    slot: int
    step: int
    start: float
    end: float
    stamp: int             # the reader's own clock at the read: orders it against writes


@dataclasses.dataclass
class Write:
    part: str
    slot: int
    step: int
    seq: int               # n-th write into this buffer
    issue: float
    done: float
    bar: Barrier
    context: dict          # what the issuer had waited on since its previous write here
    reads: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Run:
    """What one simulation did: the trace, and ``error`` (a Hazard) if it stopped early."""
    stages: int
    n_steps: int
    consumers: int
    timing: Timing
    pingpong: bool
    spans: list
    reads: list
    writes: list
    barriers: list
    finished: dict         # program -> time it finished
    end: float
    error: Hazard | None = None

    def gemm_spans(self) -> list:
        return sorted((s for s in self.spans if s.row == "tensor core" and s.kind in ("QK", "PV")),
                      key=lambda s: (s.start, s.lane))

    def utilisation(self, t0: float | None = None, t1: float | None = None) -> float:
        """Fraction of [t0, t1] (default: first GEMM start to last GEMM end) in which the tensor
        cores ran at least one GEMM."""
        gemms = self.gemm_spans()
        if not gemms:
            return 0.0
        t0 = gemms[0].start if t0 is None else t0
        t1 = max(s.end for s in gemms) if t1 is None else t1
        busy, cur_a, cur_b = 0.0, None, None
        for s in gemms:
            a, b = max(s.start, t0), min(s.end, t1)
            if b <= a:
                continue
            if cur_b is None or a > cur_b:
                busy += 0 if cur_b is None else cur_b - cur_a
                cur_a, cur_b = a, b
            else:
                cur_b = max(cur_b, b)
        busy += 0 if cur_b is None else cur_b - cur_a
        return busy / (t1 - t0) if t1 > t0 else 0.0

    def shared(self) -> list:
        """The intervals in which two or more GEMMs shared the tensor cores."""
        return [s for s in self.spans if s.kind == "shared"]

    def blocked_time(self, row: str, barrier_prefix: str = "") -> float:
        """Time ``row`` spent waiting on barriers (whose names start with ``barrier_prefix``)."""
        return sum(s.end - s.start for s in self.spans
                   if s.row == row and s.kind == "wait" and s.note.startswith(barrier_prefix))

    def starts(self, row: str, kind: str) -> dict:
        """{step: start time} of ``row``'s actions of ``kind`` (QK, PV, softmax)."""
        return {s.step: s.start for s in self.spans if s.row == row and s.kind == kind}


# ---------------------------------------------------------------------------- the pipeline

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
        from .pipeline_engine import Engine          # it imports this module
        return Engine(self, programs).run()


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
