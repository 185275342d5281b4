"""The pieces of the pipeline model that its engine (``pipeline_engine``) runs: the timing, a
ring's geometry (``Ring``, also the cases of Chapter 6's interpret-mode ring check), the
``Hazard`` a run stops at, the ``Barrier``, the actions a program yields (the warpgroups' own:
``Wait``, ``Arrive``, ``Load``, ``Gemm``, ``Softmax``; and ``Op``, an action a configuration
defines by its ``Spec``), and the trace of a run (``Span``, ``Read``, ``Write``, ``Run``).
"""
from __future__ import annotations

import dataclasses

__all__ = ["PARTS", "Timing", "Ring", "Hazard", "Barrier", "Action", "Wait", "Arrive", "Load",
           "Gemm", "Softmax", "Op", "Spec", "Span", "Read", "Write", "Run", "join_clocks"]

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


@dataclasses.dataclass(frozen=True)
class Ring:
    """A K/V ring's geometry: ``steps`` tiles streamed through ``stages`` shared-memory slots to
    ``consumers`` warpgroups (the arrivals each slot's release counts); ``why`` says what the
    case tests, and ``describe`` names it in a check's message."""
    stages: int
    steps: int
    consumers: int = 2
    why: str = ""

    def describe(self) -> str:
        return (f"'{self.stages} slots, {self.steps} tiles, {self.consumers} consumer"
                f"{'s' if self.consumers > 1 else ''}" + (f": {self.why}'" if self.why else "'"))


class Hazard(Exception):
    """A run stopped at a protocol error. ``kind``: overwrite, read before ready, phase overrun,
    deadlock, dataflow, protocol, runaway or a configuration's own (Chapter 7's ordering);
    ``time``: simulated time."""

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


@dataclasses.dataclass(eq=False)
class Op(Action):
    """An action of a configuration (``Pipeline.op``), shown as ``name(args, bar)``; what it
    does is the ``Spec`` the pipeline's ``spec`` gives it."""
    name: str
    args: tuple
    bar: Barrier | None = None

    def __str__(self):
        shown = self.args + ((self.bar.name,) if self.bar is not None else ())
        return f"{self.name}({', '.join(map(str, shown))})"


@dataclasses.dataclass
class Spec:
    """What an ``Op`` does. ``how``: "copy" (asynchronous, like a TMA: the issuer goes on, the
    copy arrives on the op's barrier when it lands), "issue" (queued on the in-order ``unit``,
    which runs its ops one at a time in issue order; the issuer goes on), "commit" (one arrival
    on the op's barrier once every op issued to ``unit`` so far has finished) or "work" (the
    issuer runs it; with a ``unit``, that unit is one resource the programs queue for, first
    come first served) or "mark" (no time, no unit, no buffer: a fence, whose place in the
    program order the configuration's ``in_order`` checks). ``accesses``: (buffer, mode "r"/"w"/"rw", the contents a read expects,
    the contents a write leaves, the labels of the readers those contents await), checked
    when the op starts (``pipeline_buffers``); ``require``: (buffer, contents, text(found)),
    the contents a buffer must still hold when the op starts."""
    how: str
    unit: str = ""
    duration: float = 0.0
    who: str = ""                  # the accessor, as hazard messages name it
    label: str = ""                # its name in the buffers' lists of awaited readers
    accesses: tuple = ()
    kind: str = ""                 # its bars' kind (row: the unit's, and the issuer's for work)
    step: int | None = None
    note: str = ""
    lane: int = 0
    done: tuple | None = None      # its key in ``Run.done``
    require: tuple | None = None


def join_clocks(a: dict, b: dict) -> dict:
    """The elementwise maximum of two vector clocks ({program: step})."""
    out = dict(a)
    for k, v in b.items():
        if out.get(k, 0) < v:
            out[k] = v
    return out


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
    """What one simulation did: the trace, ``error`` (a Hazard) if it stopped early, and what
    the ops of a configuration did (``done``: {``Spec.done``: (start, end)})."""
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
    done: dict = dataclasses.field(default_factory=dict)

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

    def blocked_time(self, row: str, barrier_prefix: str = "", t0: float = 0.0,
                     t1: float = float("inf")) -> float:
        """Time ``row`` spent waiting in [t0, t1] on barriers (whose names start with
        ``barrier_prefix``)."""
        return sum(max(0.0, min(s.end, t1) - max(s.start, t0)) for s in self.spans
                   if s.row == row and s.kind == "wait" and s.note.startswith(barrier_prefix))

    def starts(self, row: str, kind: str, lane: int | None = None) -> dict:
        """{step: start time} of ``row``'s actions of ``kind`` (QK, PV, softmax), of one
        ``lane`` if given."""
        return {s.step: s.start for s in self.spans
                if s.row == row and s.kind == kind and lane in (None, s.lane)}
