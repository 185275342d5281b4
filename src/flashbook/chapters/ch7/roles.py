"""The Blackwell design's five roles, simulated (Chapter 7, Exercise 4).

FlashAttention-4 (and the chapter's seed, a CuTe DSL kernel for sm_100) splits a CTA into roles
that talk only through mbarriers:

* the **load warp** issues TMA copies: the CTA's two Q tiles once, then K and V of key step
  0, 1, 2, ... into two rings of ``stages`` shared-memory slots (step ``j`` goes to slot
  ``j % stages`` of the K ring and of the V ring);
* the **MMA warp** (one thread) issues every ``tcgen05`` MMA: ``S_t = Q_t K_j^T`` into tensor
  memory (TMEM) and ``O_t (+)= P_t V_j`` with P read from TMEM. Issuing does not wait: the
  tensor core runs the MMAs one after the other, **in issue order**, and ``commit(bar)`` arrives
  on ``bar`` once every MMA issued before it has finished (``tcgen05.commit``);
* two **softmax** warpgroups, one per Q tile ``t``: read S_t from TMEM, publish the row max
  (``rowmax``), then write ``P_t = exp2(S_t - m)`` **in place of S_t** (``exp``; P aliases S's
  columns), and at the end the row sum (``rowsum``);
* the **correction** warpgroup rescales O_t in TMEM by ``exp2(m_old - m_new)`` between two PV
  MMAs (``rescale``) and, after the last one, normalises O_t into shared memory (``finish``);
* the **epilogue warp** TMA-stores each normalised O tile (``store``).

The model is built on Chapter 6's engine (``flashbook.chapters.ch6.pipeline``), by composition: a
``RolePipeline`` owns a Chapter 6 ``Pipeline`` for its barriers and a Chapter 6 engine for the
event loop, the mbarrier semantics (parity waits, phase overrun, vector clocks through arrivals
and waits), deadlock detection and the protocol errors. This module adds the actions of the
five roles, the tensor core as an in-order queue with commits, and **buffers with contents**:
shared memory (Q, the K and V slots, the O staging tiles) and tensor memory (S/P, O, the row
statistics). Every access says what it expects to find; a hazard ends the run with a message
that names the time, the roles and the buffer:

* *read before ready*: a read finds old contents (P read by a PV MMA before softmax wrote it),
  or the writer's write is not ordered before it by any barrier the reader waited on;
* *overwrite*: a write destroys contents a role still had to read (S overwritten before
  softmax read it; a K slot refilled before both QK MMAs read it), or is not ordered after
  those reads;
* *race*: two accesses to one buffer overlap in time and one writes (O rescaled while a PV MMA
  accumulates into it);
* and Chapter 6's *deadlock*, *phase overrun*, *protocol* and *runaway*.

Time is in abstract units (``Timing``). Issuing an MMA, a TMA copy or an arrival takes no time.
"""
from __future__ import annotations

import dataclasses
import types

from ..ch6 import pipeline as _ch6
from ..ch6.pipeline import Barrier, Hazard, Span

__all__ = ["Timing", "RolePipeline", "RoleRun", "Hazard", "Barrier", "Span", "ROLE_NAMES",
           "fa4_model", "serial_model", "make_barriers", "load", "softmax", "epilogue",
           "simulate"]

ROLE_NAMES = ("load warp", "MMA warp", "softmax 0", "softmax 1", "correction", "epilogue warp")
TILES = (0, 1)
_EPS = 1e-9


@dataclasses.dataclass(frozen=True)
class Timing:
    """Durations in time units. ``g = qk + pv`` is one Q tile's MMA time per key step and
    ``s = rowmax + exp`` its softmax time."""
    tma: float = 3.0          # issue to arrival of one K or V tile (or a Q tile)
    qk: float = 1.0           # S = Q K^T of one Q tile, on the tensor core
    pv: float = 1.0           # O += P V of one Q tile, on the tensor core
    rowmax: float = 0.5       # softmax: read S from TMEM, row max, publish it
    exp: float = 1.5          # softmax: exp2, P to 16 bits, P stored in place of S
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


def fa4_model(t: Timing) -> float:
    """Steady-state tensor-core utilisation of the two-tile schedule, when the K/V ring hides the
    TMA latency. Per key step the tensor core has ``2g`` of work. One tile's chain is
    ``QK_t(j) -> rowmax -> [exp, and the correction's rescale of O_t] -> PV_t(j) -> QK_t(j+1)``:
    S_t and P_t share TMEM columns, so the next QK of a tile waits for its PV. While one tile
    waits for its softmax the tensor core runs the other tile's PV and QK (g), so a period lasts
    ``max(2g, g + rowmax + max(exp, rescale))``; the correction warpgroup rescales both tiles,
    ``2 * rescale`` a period. Utilisation = 2g / period."""
    g = t.g
    period = max(2 * g, g + t.rowmax + max(t.exp, t.rescale), 2 * t.rescale)
    return min(1.0, 2 * g / period)


def serial_model(t: Timing) -> float:
    """One Q tile at a time (no second tile to fill the softmax): g / (g + rowmax + max(exp,
    rescale))."""
    return t.g / (t.g + t.rowmax + max(t.exp, t.rescale))


# ------------------------------------------------------------------------------------ actions

class _RoleAction(_ch6.Action):
    """An action of one of the five roles (a Chapter 6 action, so the engine's bookkeeping of
    made-but-never-yielded actions covers it)."""
    owner = ""


@dataclasses.dataclass(eq=False)
class _Tma(_RoleAction):
    part: str              # "Q", "K" or "V"
    index: int             # the tile (Q) or the key step (K, V)
    bar: Barrier
    owner = "load warp"

    def __str__(self):
        return f"load_{self.part.lower()}({self.index}, {self.bar.name})"


@dataclasses.dataclass(eq=False)
class _Mma(_RoleAction):
    kind: str              # "QK" or "PV"
    tile: int
    step: int
    owner = "MMA warp"

    def __str__(self):
        return f"{self.kind.lower()}({self.tile}, {self.step})"

    @property
    def label(self) -> str:
        return f"{self.kind}{self.tile}({self.step})"


@dataclasses.dataclass(eq=False)
class _Commit(_RoleAction):
    bar: Barrier
    owner = "MMA warp"

    def __str__(self):
        return f"commit({self.bar.name})"


@dataclasses.dataclass(eq=False)
class _Work(_RoleAction):
    kind: str              # rowmax, exp, rowsum, rescale, finish, store
    tile: int
    step: int | None = None

    def __str__(self):
        return f"{self.kind}({self.tile}" + ("" if self.step is None else f", {self.step}") + ")"

    @property
    def owner(self):
        if self.kind in ("rowmax", "exp", "rowsum"):
            return f"softmax {self.tile}"
        return "correction" if self.kind in ("rescale", "finish") else "epilogue warp"


# -------------------------------------------------------------------------- buffers, contents

def _label(kind: str, tile: int, step: int | None = None) -> str:
    """An access's name, as the buffers' lists of awaited readers spell it."""
    if kind in ("QK", "PV"):
        return f"{kind}{tile}({step})"
    if kind in ("rowmax", "exp"):
        return f"softmax {tile}'s {kind}({tile}, {step})"
    if kind == "rowsum":
        return f"softmax {tile}'s rowsum({tile})"
    if kind == "rescale":
        return f"the correction's rescale({tile}, {step})"
    if kind == "finish":
        return f"the correction's finish({tile})"
    return f"the epilogue's store({tile})"


def _content_text(c) -> str:
    if c is None:
        return "nothing yet"
    kind = c[0]
    return {"Q": lambda: f"Q tile {c[1]}",
            "K": lambda: f"K of step {c[1]}",
            "V": lambda: f"V of step {c[1]}",
            "S": lambda: f"the scores S of step {c[1]}",
            "P": lambda: f"P of step {c[1]}",
            "m": lambda: f"the row max of step {c[1]}",
            "l": lambda: "the row sum",
            "O": lambda: f"O accumulated through step {c[1]}",
            "O~": lambda: f"O rescaled for step {c[1]} (waiting for PV of step {c[1]})",
            "out": lambda: "the normalised O tile"}[kind]()


@dataclasses.dataclass
class _Access:
    who: str               # "the MMA warp's PV1(3)", "softmax 0's rowmax(2)", ...
    agent: str             # the row it runs on: "tensor core", "TMA", "softmax 0", ...
    key: object            # its vector-clock component
    stamp: int             # its clock there
    mode: str              # "r", "w" or "rw"
    start: float
    end: float
    label: str = ""        # the reader's name in _Buf.need ("QK0(3)", "rowmax 0(3)", ...)
    vc: dict = dataclasses.field(default_factory=dict)   # what the accessor knows (its clock)


@dataclasses.dataclass
class _Buf:
    name: str
    memory: str            # "SMEM" or "TMEM"
    content: tuple | None = None
    write: _Access | None = None           # the access that wrote ``content``
    reads: list = dataclasses.field(default_factory=list)    # reads of ``content``
    need: set = dataclasses.field(default_factory=set)       # readers ``content`` still awaits
    inflight: list = dataclasses.field(default_factory=list)  # accesses in progress


# ------------------------------------------------------------------------------- the pipeline

class RolePipeline:
    """What the role programs are given: the configuration (``stages``, ``n_steps``,
    ``timing``), ``barrier`` to make barriers, ``slot``/``phase`` of a key step, and the actions
    to ``yield`` (each role may yield only its own)."""

    def __init__(self, stages: int, n_steps: int, timing: Timing | None = None,
                 max_actions: int = 20000):
        self.timing = timing or Timing()
        t = self.timing
        # Chapter 6's pipeline holds the barriers, the made actions and the configuration
        self.core = _ch6.Pipeline(stages, n_steps, consumers=2,
                                  timing=_ch6.Timing(tma=t.tma, qk=t.qk, pv=t.pv,
                                                     softmax=t.rowmax + t.exp),
                                  max_actions=max_actions)
        self.stages, self.n_steps = stages, n_steps

    # ------------------------------------------------------------ for every role
    def barrier(self, name: str, arrivals: int = 1) -> Barrier:
        """A new mbarrier whose phases complete after ``arrivals`` arrivals each."""
        return self.core.barrier(name, arrivals)

    def wait(self, bar: Barrier, parity: int):
        """Block until the most recent phase of ``bar`` with this parity has completed (on a
        fresh barrier parity 1 passes at once)."""
        return self.core.wait(bar, parity)

    def arrive(self, bar: Barrier):
        """One arrival on ``bar``, now (never blocks)."""
        return self.core.arrive(bar)

    def slot(self, step: int) -> int:
        """The slot of the K ring (and of the V ring) that holds key step ``step``."""
        return self.core.slot(step)

    def phase(self, step: int) -> int:
        """The parity of the phase of the slot's barriers that belongs to ``step``:
        ``(step // stages) % 2``."""
        return self.core.phase(step)

    # ------------------------------------------------------------------ load warp
    def load_q(self, tile: int, bar: Barrier):
        """TMA: Q tile ``tile`` into its shared-memory buffer; arrives on ``bar`` when it lands."""
        return self.core._make(_Tma("Q", tile, bar))

    def load_k(self, step: int, bar: Barrier):
        """TMA: K of ``step`` into K slot ``slot(step)``; arrives on ``bar`` when it lands."""
        return self.core._make(_Tma("K", step, bar))

    def load_v(self, step: int, bar: Barrier):
        """TMA: V of ``step`` into V slot ``slot(step)``; arrives on ``bar`` when it lands."""
        return self.core._make(_Tma("V", step, bar))

    # ------------------------------------------------------------------ MMA warp
    def qk(self, tile: int, step: int):
        """Issue ``S_tile = Q_tile K_step^T`` (reads Q and the K slot, writes S_tile in TMEM).
        Returns at once; the tensor core runs it after every MMA issued before it."""
        return self.core._make(_Mma("QK", tile, step))

    def pv(self, tile: int, step: int):
        """Issue ``O_tile (+)= P_tile V_step`` (reads P from S_tile's TMEM columns and the V slot;
        step 0 overwrites O_tile, later steps accumulate into it). Returns at once."""
        return self.core._make(_Mma("PV", tile, step))

    def commit(self, bar: Barrier):
        """``tcgen05.commit``: one arrival on ``bar`` once every MMA issued so far has finished
        (at once if none is pending). Never blocks."""
        return self.core._make(_Commit(bar))

    # ------------------------------------------------------------------ softmax t
    def rowmax(self, tile: int, step: int):
        """Read S_tile (scores of ``step``) from TMEM, compute the new row max and publish it
        for the correction (``timing.rowmax``)."""
        return self.core._make(_Work("rowmax", tile, step))

    def exp(self, tile: int, step: int):
        """``P = exp2(S - m)`` in 16 bits, stored in place of S_tile (``timing.exp``)."""
        return self.core._make(_Work("exp", tile, step))

    def rowsum(self, tile: int):
        """After the last step: publish the row sum l for the correction's final division."""
        return self.core._make(_Work("rowsum", tile))

    # ------------------------------------------------------------------ correction
    def rescale(self, tile: int, step: int):
        """``O_tile *= exp2(m_{step-1} - m_step)`` in TMEM (reads the row max softmax ``tile``
        published for ``step``; O through registers, ``timing.rescale``). Steps 1, 2, ..."""
        return self.core._make(_Work("rescale", tile, step))

    def finish(self, tile: int):
        """After the last PV: ``O_tile / l`` to the O staging tile in shared memory."""
        return self.core._make(_Work("finish", tile))

    # ------------------------------------------------------------------ epilogue warp
    def store(self, tile: int):
        """TMA store of the normalised O tile ``tile`` (waits until it is done)."""
        return self.core._make(_Work("store", tile))

    # ------------------------------------------------------------------ running
    def run(self, programs: dict) -> "RoleRun":
        """Run ``{role: generator}`` (names from ``ROLE_NAMES``) to the end or to the first hazard.
        Never raises a Hazard: it is ``RoleRun.error``."""
        if self.core._ran:
            raise RuntimeError("a RolePipeline runs once; make a new one")
        self.core._ran = True
        return _RoleEngine(self, programs).run()


# ------------------------------------------------------------------------------- the trace

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


# --------------------------------------------------------------------------------- the engine

def _who_prog(name: str) -> str:
    return {"load warp": "the load warp", "MMA warp": "the MMA warp",
            "correction": "the correction warpgroup",
            "epilogue warp": "the epilogue warp"}.get(name, name)


def _cap(text: str) -> str:
    return text[:1].upper() + text[1:]


def _t(x: float) -> str:
    return f"{x:g}"


class _RoleEngine:
    """Chapter 6's engine (event loop, barriers, deadlock and protocol checks), with this
    module's ``resume`` and deadlock report plugged in."""

    def __init__(self, pipe: RolePipeline, programs: dict):
        self.pipe, self.t = pipe, pipe.timing
        unknown = [n for n in programs if n not in ROLE_NAMES]
        if unknown:
            raise ValueError(f"unknown role(s) {unknown}; the roles are {ROLE_NAMES}")
        self.core = _ch6.Engine(pipe.core, programs)
        self.core.resume = self.resume                  # this module's actions
        self.core.deadlock_report = self.deadlock_report
        n = pipe.n_steps
        self.bufs: dict = {}
        for t in TILES:
            self.bufs[f"Q{t}"] = _Buf(f"Q{t}", "SMEM")
            self.bufs[f"S{t}"] = _Buf(f"S{t}", "TMEM")
            self.bufs[f"O{t}"] = _Buf(f"O{t}", "TMEM")
            self.bufs[f"m{t}"] = _Buf(f"m{t}", "TMEM")
            self.bufs[f"l{t}"] = _Buf(f"l{t}", "TMEM")
            self.bufs[f"Ostage{t}"] = self.bufs[f"Q{t}"]     # O is staged in Q_t's tile
        for s in range(pipe.stages):
            self.bufs[f"K[{s}]"] = _Buf(f"K[{s}]", "SMEM")
            self.bufs[f"V[{s}]"] = _Buf(f"V[{s}]", "SMEM")
        self.n = n
        self.tc_queue: list = []           # [(action, issue vc, issue time), ...] not started
        self.tc_busy = None                # the op running: (action, accesses, start)
        self.tc_vc: dict = {}              # what the tensor core has done, as a clock
        self.tc_clock = 0
        self.commits: list = []            # [(bar, after_op_count, vc of the MMA warp)]
        self.issued_ops = 0
        self.finished_ops = 0
        self.tma_count = 0
        self.done: dict = {}
        self.issued: dict = {}

    # ----------------------------------------------------------------- running
    def run(self) -> RoleRun:
        run = self.core.run()
        return RoleRun(self.pipe.stages, self.pipe.n_steps, self.t, run.spans, run.barriers,
                       run.finished, run.end, run.error, dict(self.done), run)

    def resume(self, p):
        """Run program ``p`` until it blocks, starts a timed action or finishes (Chapter 6's
        loop, with the five roles' actions)."""
        core = self.core
        p.state = "ready"
        while True:
            core.n_actions += 1
            p.n_actions += 1
            if core.n_actions > self.pipe.core.max_actions:
                raise Hazard("runaway", core.now, f"more than {self.pipe.core.max_actions} "
                             f"actions: a role loops without end? ({_who_prog(p.name)} was "
                             "running)")
            self.pipe.core._current = p.name
            try:
                a = next(p.gen)
            except StopIteration:
                p.state = "done"
                core.finished[p.name] = core.now
                return
            finally:
                self.pipe.core._current = None
            if not isinstance(a, _ch6.Action) or a.pipe is not self.pipe.core:
                raise Hazard("protocol", core.now, (
                    f"{_cap(_who_prog(p.name))} yielded {a!r}, not an action of its pipeline "
                    "(yield pipe.wait(...), pipe.arrive(...), pipe.commit(...), pipe.qk(...), "
                    "..."))
            a.yielded = True
            if isinstance(a, _ch6.Wait):
                if not core.do_wait(p, a):
                    return
            elif isinstance(a, _ch6.Arrive):
                core.check_barrier(p, a.bar, a)
                p.vc[p.name] += 1
                core.arrive(a.bar, p.name, p.vc)
            elif isinstance(a, _RoleAction):
                self.check_owner(p, a)
                if isinstance(a, _Tma):
                    self.do_tma(p, a)
                elif isinstance(a, _Mma):
                    self.do_mma(p, a)
                elif isinstance(a, _Commit):
                    self.do_commit(p, a)
                elif isinstance(a, _Work):
                    self.do_work(p, a)
                    return
            else:
                raise Hazard("protocol", core.now, f"{_cap(_who_prog(p.name))} yielded {a}, "
                             "which is a Chapter 6 action: the Blackwell roles load with "
                             "pipe.load_q/load_k/load_v and issue MMAs with pipe.qk/pipe.pv.")

    def check_owner(self, p, a: _RoleAction):
        owner = a.owner
        if p.name != owner:
            raise Hazard("protocol", self.core.now, (
                f"{_cap(_who_prog(p.name))} yielded {a}, which only {_who_prog(owner)} does "
                "(each role has its own actions: the load warp loads, the MMA warp issues MMAs "
                "and commits, softmax t works on tile t, the correction rescales and finishes, "
                "the epilogue warp stores)."))
        n = self.n
        tile = getattr(a, "tile", 0) if not isinstance(a, _Tma) else \
            (a.index if a.part == "Q" else 0)
        if tile not in TILES:
            raise Hazard("protocol", self.core.now, f"{_cap(_who_prog(p.name))}: {a}: the Q "
                         "tiles are 0 and 1.")
        step = a.step if isinstance(a, (_Mma, _Work)) else \
            (a.index if isinstance(a, _Tma) and a.part != "Q" else None)
        if step is not None and not (isinstance(step, int) and 0 <= step < n):
            raise Hazard("protocol", self.core.now, f"{_cap(_who_prog(p.name))}: {a}: the key "
                         f"steps are 0..{n - 1}.")
        if isinstance(a, _Work) and a.kind == "rescale" and step == 0:
            raise Hazard("protocol", self.core.now, f"{_cap(_who_prog(p.name))}: rescale"
                         f"({a.tile}, 0): step 0 has nothing to rescale (PV of step 0 "
                         "overwrites O); rescales are for steps 1..n_steps-1.")
        if isinstance(a, (_Mma, _Work)) or (isinstance(a, _Tma)):
            key = (str(a).split("(")[0],) + ((a.part, a.index) if isinstance(a, _Tma) else
                                             (a.tile, a.step))
            if key in self.issued:
                raise Hazard("protocol", self.core.now, f"{_cap(_who_prog(p.name))} issued {a} "
                             f"a second time (first at t={_t(self.issued[key])}): every "
                             "action of a step happens once.")
            self.issued[key] = self.core.now
        if isinstance(a, (_Tma, _Commit)):
            self.core.check_barrier(p, a.bar, a)

    # ---------------------------------------------------------------- buffer accesses
    def access(self, buf: _Buf, acc: _Access, expect=None, new=None, need=()):
        """Check an access when it starts: overlap with accesses in progress, the contents it
        expects, and the barrier order against the last write and the reads since."""
        now = self.core.now
        for other in buf.inflight:
            if other.key != acc.key and ("w" in acc.mode or "w" in other.mode):
                raise Hazard("race", now, self.race_text(buf, acc, other))
        vc = acc.vc
        if "r" in acc.mode:
            if buf.content != expect:
                kind = "overwrite" if self.newer(buf.content, expect) else "read before ready"
                raise Hazard(kind, now, self.content_text(buf, acc, expect))
            w = buf.write
            if w is not None and vc.get(w.key, 0) < w.stamp:
                raise Hazard("read before ready", now, self.unordered_text(buf, acc, w, "read"))
        if "w" in acc.mode:
            if buf.need - {acc.label}:
                raise Hazard("overwrite", now, self.unread_text(buf, acc, None))
            for prior in ([buf.write] if buf.write else []) + buf.reads:
                if prior.key != acc.key and vc.get(prior.key, 0) < prior.stamp:
                    raise Hazard("overwrite", now, self.unordered_text(buf, acc, prior, "write"))
        if "r" in acc.mode:
            buf.reads.append(acc)
            buf.need.discard(acc.label)
        buf.inflight.append(acc)

    def complete(self, buf: _Buf, acc: _Access, new=None, need=()):
        buf.inflight.remove(acc)
        if "w" in acc.mode:
            buf.content, buf.write, buf.reads, buf.need = new, acc, [], set(need)

    @staticmethod
    def newer(have, want) -> bool:
        order = {"S": 0, "P": 1}
        if have is None or want is None:
            return False
        if have[0] in ("S", "P") and want[0] in ("S", "P"):
            return (have[1], order[have[0]]) > (want[1], order[want[0]])
        if have[0] in ("O", "O~") and want[0] in ("O", "O~"):
            return (have[1], have[0] == "O") > (want[1], want[0] == "O")
        if len(have) > 1 and len(want) > 1 and have[0] == want[0]:
            return have[1] > want[1]
        return False

    # ---------------------------------------------------------------- messages
    def _buf_text(self, buf: _Buf) -> str:
        name = buf.name
        if name[0] == "Q":
            return f"Q_{name[-1]}'s tile (SMEM; O's staging tile at the end)"
        if name[0] in "SOml" and name[-1] in "01" and not name.startswith("Ostage"):
            what = {"S": "S", "O": "O", "m": "the row max", "l": "the row sum", "Q": "Q"}[name[0]]
            if name[0] in "SO":
                what = f"{what}_{name[-1]}"
            else:
                what = f"{what} of tile {name[-1]}"
            return f"{what} ({buf.memory})"
        if name.startswith("Ostage"):
            return f"the O staging tile {name[-1]} (SMEM)"
        return f"{name[0]} slot {name[2:-1]} (SMEM)"

    def _hint(self, buf: _Buf, acc: _Access, expect, have) -> str:
        name, who = buf.name, acc.label
        if name[0] == "S" and who.startswith("PV"):
            t = name[-1]
            return (f" P read by the MMA before softmax {t} wrote it: before issuing "
                    f"PV{t}(j) the MMA warp waits on p_ready[{t}] for parity j % 2.")
        if name[0] == "S" and who.startswith("QK"):
            t = name[-1]
            if have and have[0] == "S":
                return (f" S overwritten before softmax {t} read it: the MMA warp may issue "
                        f"QK{t}(j) only after PV{t}(j-1), which waits until softmax {t} has "
                        "written P (so S of step j-1 was read).")
            return (f" P_{t} overwritten before PV{t} read it: S and P share TMEM columns, "
                    f"so issue PV{t}(j-1) before QK{t}(j) (the tensor core runs MMAs in issue "
                    "order).")
        if name[0] == "S" and ("rowmax(" in who or "exp(" in who):
            t = name[-1]
            return (f" Softmax {t} reads S_{t} once the MMA warp's commit on s_ready[{t}] says "
                    f"QK{t}(j) has finished.")
        if name[0] == "O" and not name.startswith("Ostage"):
            t = name[-1]
            if who.startswith("PV"):
                return (f" The PV MMA accumulated into O_{t} before the correction rescaled "
                        f"it: before issuing PV{t}(j), j > 0, the MMA warp waits on "
                        f"o_ready[{t}] (parity (j - 1) % 2).")
            if "rescale(" in who:
                return (f" The correction may rescale O_{t} only when no MMA accumulates into "
                        f"it: after PV{t}(j-1) finished (wait on o_done[{t}], which the MMA "
                        f"warp commits after each PV{t}) and before PV{t}(j) is issued.")
            if "finish(" in who:
                return (f" The correction reads O_{t} for the output only after the last "
                        f"PV{t} finished: wait on o_done[{t}] for its last phase.")
        if name[0] == "m":
            return (" The correction reads the row max of step j after softmax published it "
                    "(stats[t]) and before softmax overwrites it with step j+1's.")
        if name[0] == "l":
            return " The correction reads the row sum after softmax published it (l_ready[t])."
        if name[0] in "KV" and name[1] == "[":
            part = name[0]
            mma = "QK" if part == "K" else "PV"
            if who.startswith(("QK", "PV")):
                return (f" Before issuing an MMA that reads {part} of step j, the MMA warp "
                        f"waits on {part.lower()}_full[slot(j)] for parity phase(j).")
            return (f" Before refilling a {part} slot the load warp waits on "
                    f"{part.lower()}_free[slot] until both {mma} MMAs that read it have "
                    f"finished; the MMA warp releases the slot with pipe.commit (it arrives "
                    f"when those MMAs finish), not pipe.arrive (it arrives at once).")
        if name[0] == "Q":
            if "store(" in who:
                return " The epilogue stores O once the correction signals epi_ready[t]."
            if "finish(" in who:
                return (" Q_t's tile becomes O's staging tile once no QK_t reads it: after the "
                        "last PV_t finished (o_done[t]), since every QK_t was issued before it.")
            return " The MMA warp waits on q_full[t] before the first QK of tile t."
        return ""

    def content_text(self, buf: _Buf, acc: _Access, expect) -> str:
        have = buf.content
        w = buf.write
        by = f" (written by {w.who} at t={_t(w.end)})" if w else ""
        return (f"{_cap(acc.who)} reads {self._buf_text(buf)} expecting "
                f"{_content_text(expect)}, but it holds {_content_text(have)}{by}."
                + self._hint(buf, acc, expect, have))

    def unordered_text(self, buf: _Buf, acc: _Access, prior: _Access, what: str) -> str:
        kind = "wrote" if "w" in prior.mode else "read"
        verb = "reads" if what == "read" else "writes"
        noun = "write" if kind == "wrote" else "read"
        return (f"{_cap(acc.who)} {verb} {self._buf_text(buf)}, which {prior.who} {kind} at "
                f"t={_t(prior.start)}, but no barrier orders that {noun} before this {what}: the "
                f"timing of this run hid it, another run's would not."
                + self._hint(buf, acc, buf.content, buf.content))

    def unread_text(self, buf: _Buf, acc: _Access, new) -> str:
        missing = ", ".join(sorted(buf.need - {acc.label}))
        return (f"{_cap(acc.who)} overwrites {self._buf_text(buf)}, which holds "
                f"{_content_text(buf.content)}, before {missing} read it."
                + self._hint(buf, acc, new, buf.content))

    def race_text(self, buf: _Buf, acc: _Access, other: _Access) -> str:
        a_verb = {"r": "reads", "w": "writes", "rw": "updates"}[acc.mode]
        o_verb = {"r": "reading", "w": "writing", "rw": "updating"}[other.mode]
        text = (f"{_cap(acc.who)} {a_verb} {self._buf_text(buf)} at t={_t(self.core.now)} "
                f"while {other.who} is still {o_verb} it (t={_t(other.start)}.."
                f"{_t(other.end)}).")
        if buf.name[0] == "O" and not buf.name.startswith("Ostage"):
            labels = acc.label + " " + other.label
            if "rescale(" in labels:
                text += " O rescaled while an MMA accumulates into it."
            elif "finish(" in labels:
                text += " O read for the output while an MMA still accumulates into it."
        return text + self._hint(buf, acc, buf.content, buf.content)

    def deadlock_report(self, stuck) -> str:
        lines = ["every unfinished role waits on a barrier and nothing is in flight:"]
        for p in stuck:
            a, since = p.blocked_on
            b = a.bar
            lines.append(f"  {_who_prog(p.name)} waits on {b.name} for parity {a.parity} since "
                         f"t={_t(since)} ({b.name} has completed {b.completed} phase(s), the "
                         f"current one has {b.pending} of {b.arrivals} arrival(s))")
        done = [f"{_who_prog(n)} (t={_t(t)})" for n, t in self.core.finished.items()]
        if done:
            lines.append("  finished: " + ", ".join(done))
        lines.append("A wait passes only once its barrier has completed a phase of that parity "
                     "(on a fresh barrier parity 1 passes, parity 0 waits for the first phase). "
                     "Every phase someone waits for needs its arrival: an arrive by a role, a "
                     "commit by the MMA warp (after the MMAs it covers), or a landed TMA copy.")
        return "\n".join(lines)

    # ---------------------------------------------------------------- TMA (load warp)
    def do_tma(self, p, a: _Tma):
        core, now = self.core, self.core.now
        if a.part == "Q":
            buf, content, need = self.bufs[f"Q{a.index}"], ("Q", a.index), ()
        else:
            s = self.pipe.slot(a.index)
            buf = self.bufs[f"{a.part}[{s}]"]
            content = (a.part, a.index)
            mma = "QK" if a.part == "K" else "PV"
            need = (_label(mma, 0, a.index), _label(mma, 1, a.index))
        self.tma_count += 1
        key = ("TMA", self.tma_count)
        p.vc[p.name] += 1
        vc = dict(p.vc)
        vc[key] = 1
        acc = _Access(f"the TMA load of {_content_text(content)}", "TMA", key, 1, "w", now,
                      now + self.t.tma, vc=vc)
        self.access(buf, acc)
        core.spans.append(Span("TMA", "load", now, now + self.t.tma,
                               None if a.part == "Q" else a.index,
                               note=f"{a.part}{a.index}" if a.part != "Q" else f"Q{a.index}",
                               lane=0 if a.part == "Q" else (1 if a.part == "K" else 2)))
        self.done[("load_" + a.part.lower(), a.index)] = (now, now + self.t.tma)

        def land():
            self.complete(buf, acc, content, need)
            core.arrive(a.bar, "TMA", vc)
        core.at(now + self.t.tma, land)

    # ---------------------------------------------------------------- MMAs (MMA warp)
    def do_mma(self, p, a: _Mma):
        p.vc[p.name] += 1
        self.issued_ops += 1
        self.tc_queue.append((a, dict(p.vc), self.core.now))
        if self.tc_busy is None:
            self.tc_start()

    def do_commit(self, p, a: _Commit):
        p.vc[p.name] += 1
        vc = dict(p.vc)
        if self.finished_ops == self.issued_ops:
            self.core.arrive(a.bar, p.name, _ch6.join_clocks(vc, self.tc_vc))
        else:
            self.commits.append((a.bar, self.issued_ops, vc))

    def tc_start(self):
        core, now = self.core, self.core.now
        a, issue_vc, issued_at = self.tc_queue.pop(0)
        self.tc_clock += 1
        vc = _ch6.join_clocks(issue_vc, self.tc_vc)
        vc["tensor core"] = self.tc_clock
        dur = self.t.qk if a.kind == "QK" else self.t.pv
        t, j = a.tile, a.step
        who = f"the MMA warp's {a.label} (issued at t={_t(issued_at)})"

        def acc(mode):
            return _Access(who, "tensor core", "tensor core", self.tc_clock, mode, now,
                           now + dur, label=a.label, vc=vc)
        plan = []
        if a.kind == "QK":
            plan.append((self.bufs[f"Q{t}"], acc("r"), ("Q", t), None, ()))
            plan.append((self.bufs[f"K[{self.pipe.slot(j)}]"], acc("r"), ("K", j), None, ()))
            plan.append((self.bufs[f"S{t}"], acc("w"), None, ("S", j), (_label("rowmax", t, j),)))
        else:
            plan.append((self.bufs[f"S{t}"], acc("r"), ("P", j), None, ()))
            plan.append((self.bufs[f"V[{self.pipe.slot(j)}]"], acc("r"), ("V", j), None, ()))
            nxt = (_label("rescale", t, j + 1),) if j + 1 < self.n else (_label("finish", t),)
            if j == 0:
                plan.append((self.bufs[f"O{t}"], acc("w"), None, ("O", 0), nxt))
            else:
                plan.append((self.bufs[f"O{t}"], acc("rw"), ("O~", j), ("O", j), nxt))
        for buf, x, expect, _, _ in plan:
            self.access(buf, x, expect)
        self.tc_busy = (a, plan, now, vc)
        core.spans.append(Span("tensor core", a.kind, now, now + dur, j, lane=t))
        core.spans.append(Span("MMA warp", "issue", issued_at, issued_at, j,
                               note=a.label, lane=t))
        self.done[(a.kind, t, j)] = (now, now + dur)
        core.at(now + dur, self.tc_finish)

    def tc_finish(self):
        a, plan, start, vc = self.tc_busy
        for buf, x, _, new, need in plan:
            self.complete(buf, x, new, need)
        self.tc_vc = vc
        self.tc_busy = None
        self.finished_ops += 1
        ready = [c for c in self.commits if c[1] <= self.finished_ops]
        self.commits = [c for c in self.commits if c[1] > self.finished_ops]
        for bar, _, issuer_vc in ready:
            self.core.arrive(bar, "MMA warp", _ch6.join_clocks(issuer_vc, vc))
        if self.tc_queue:
            self.tc_start()

    # ---------------------------------------------------------------- timed work
    def do_work(self, p, a: _Work):
        core, now = self.core, self.core.now
        t, j, n = a.tile, a.step, self.n
        dur = {"rowmax": self.t.rowmax, "exp": self.t.exp, "rowsum": self.t.rowsum,
               "rescale": self.t.rescale, "finish": self.t.finish, "store": self.t.store}[a.kind]
        p.vc[p.name] += 1
        stamp = p.vc[p.name]
        vc = dict(p.vc)
        label = _label(a.kind, t, j)
        who = f"{_who_prog(p.name)}'s {a}"

        def acc(mode):
            return _Access(who, p.name, p.name, stamp, mode, now, now + dur, label=label, vc=vc)
        B = self.bufs
        plan = []
        if a.kind == "rowmax":
            plan.append((B[f"S{t}"], acc("r"), ("S", j), None, ()))
            plan.append((B[f"m{t}"], acc("w"), None, ("m", j),
                         (_label("rescale", t, j),) if j > 0 else ()))
        elif a.kind == "exp":
            plan.append((B[f"S{t}"], acc("w"), None, ("P", j), (_label("PV", t, j),)))
        elif a.kind == "rowsum":
            plan.append((B[f"l{t}"], acc("w"), None, ("l",), (_label("finish", t),)))
        elif a.kind == "rescale":
            plan.append((B[f"m{t}"], acc("r"), ("m", j), None, ()))
            plan.append((B[f"O{t}"], acc("rw"), ("O", j - 1), ("O~", j), (_label("PV", t, j),)))
        elif a.kind == "finish":
            plan.append((B[f"l{t}"], acc("r"), ("l",), None, ()))
            plan.append((B[f"O{t}"], acc("r"), ("O", n - 1), None, ()))
            plan.append((B[f"Ostage{t}"], acc("w"), None, ("out", t), (_label("store", t),)))
        else:                                              # store
            plan.append((B[f"Ostage{t}"], acc("r"), ("out", t), None, ()))
        if a.kind == "exp":
            # P is written in place of S: softmax must still hold S of this step (it read it in
            # rowmax), i.e. nobody overwrote S in between
            s_buf = B[f"S{t}"]
            if s_buf.content != ("S", j):
                raise Hazard("overwrite" if self.newer(s_buf.content, ("S", j)) else "dataflow",
                             now, f"Softmax {t}'s exp({t}, {j}) writes P in place of S of step "
                             f"{j}, but S_{t} holds {_content_text(s_buf.content)}: softmax "
                             f"runs rowmax({t}, {j}) first, and nothing may overwrite S_{t} "
                             "before P is written.")
        for buf, x, expect, _, _ in plan:
            self.access(buf, x, expect)
        p.state = "busy"
        core.spans.append(Span(p.name, a.kind, now, now + dur, j if j is not None else None))
        self.done[(a.kind, t) + ((j,) if j is not None else ())] = (now, now + dur)

        def end():
            for buf, x, _, new, need in plan:
                self.complete(buf, x, new, need)
            self.core.resume(p)
        core.at(now + dur, end)


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
             max_actions: int = 20000, roles: dict | None = None) -> RoleRun:
    """Run the five roles: the chapter's load warp, softmax warpgroups and epilogue warp (or
    ``roles``' replacements, keyed by role name) with ``mma(pipe, bars)`` and
    ``correction(pipe, bars)``. Returns the RoleRun; a hazard is ``run.error``, never raised."""
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
        return RoleRun(stages, n_steps, pipe.timing, [], [], {}, 0.0, h, {}, None)
