"""The Blackwell design's five roles, simulated (Chapter 7, Exercise 4; the notebook's table says
what each role does). They talk only through mbarriers. The MMA warp's ``tcgen05`` MMAs return
at once, the tensor core runs them **in issue order**, and ``commit(bar)`` arrives once every MMA
issued before has finished; the two softmax warpgroups share the SM's exponential unit (MUFU),
one tile's ``exp`` at a time (the Gantt's "exp wait").

``RolePipeline`` configures the toolkit's engine (Chapter 6's): the actions, what each does
(``spec``: unit, duration, accesses to buffers in shared memory and TMEM) and the words of its
hazards: *read before ready*, *overwrite*, *race* (overlapping accesses, one a write), and
Chapter 6's *deadlock*, *phase overrun*, *protocol*, *runaway*. Time is in abstract units
(``Timing``); issuing an MMA, a TMA copy or an arrival takes none.
"""
from __future__ import annotations

import dataclasses
import types

from flashbook.pipeline_buffers import Buffer
from flashbook.pipeline_engine import deadlock_text
from flashbook.pipeline_model import BasePipeline
from flashbook.pipeline_types import Barrier, Hazard, Run, Spec, Span

from .planner_model import BARRIERS, PER_TILE_BARRIERS

__all__ = ["Timing", "RolePipeline", "Run", "Hazard", "Barrier", "Span", "ROLE_NAMES", "TILES",
           "fa4_model", "serial_model", "make_barriers", "load", "softmax", "epilogue",
           "simulate"]

ROLE_NAMES = ("load warp", "MMA warp", "softmax 0", "softmax 1", "correction", "epilogue warp")
TILES = (0, 1)
_MMA = ("qk", "pv")


@dataclasses.dataclass(frozen=True)
class Timing:
    """Durations in time units. ``g = qk + pv`` is one Q tile's MMA time per key step and
    ``s = rowmax + exp`` its softmax time."""
    tma: float = 3.0          # issue to arrival of one K or V tile (or a Q tile)
    qk: float = 1.0           # S = Q K^T of one Q tile, on the tensor core
    pv: float = 1.0           # O += P V of one Q tile, on the tensor core
    rowmax: float = 0.5       # softmax: read S from TMEM, row max, publish it
    exp: float = 1.5          # softmax: exp2 of one tile on the shared exp unit, P in place of S
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


_LABELS = {"QK": "QK{0}({1})", "PV": "PV{0}({1})", "rowmax": "softmax {0}'s rowmax({0}, {1})",
           "exp": "softmax {0}'s exp({0}, {1})", "rowsum": "softmax {0}'s rowsum({0})",
           "rescale": "the correction's rescale({0}, {1})",
           "finish": "the correction's finish({0})", "store": "the epilogue's store({0})"}
_CONTENTS = {"Q": "Q tile {}", "K": "K of step {}", "V": "V of step {}",
             "S": "the scores S of step {}", "P": "P of step {}", "m": "the row max of step {}",
             "l": "the row sum", "O": "O accumulated through step {}",
             "O~": "O rescaled for step {0} (waiting for PV of step {0})",
             "out": "the normalised O tile"}


def access_label(kind: str, tile: int, step: int | None = None) -> str:
    """An access's name, as the buffers' lists of awaited readers spell it."""
    return _LABELS[kind].format(tile, step)


class RolePipeline(BasePipeline):
    """What the role programs are given: the configuration (``stages``, ``n_steps``,
    ``timing``), ``barrier`` to make barriers, ``slot``/``phase`` of a key step, and the actions
    to ``yield`` (each role may yield only its own)."""
    noun = "role"
    names = ROLE_NAMES
    action_help = ("(yield pipe.wait(...), pipe.arrive(...), pipe.commit(...), pipe.qk(...), "
                   "...")
    owner_rule = ("(each role has its own actions: the load warp loads, the MMA warp issues MMAs "
                  "and commits, softmax t works on tile t, the correction rescales and "
                  "finishes, the epilogue warp stores)")
    units = {"exp unit": "the exponential unit"}
    timing_type = Timing

    # ------------------------------------------------------------------ the actions
    def load_q(self, tile: int, bar: Barrier):
        """Load warp: TMA of Q tile ``tile``; arrives on ``bar`` when it lands."""
        return self.op("load_q", tile, bar=bar)

    def load_k(self, step: int, bar: Barrier):
        """Load warp: TMA of K of ``step`` into slot ``slot(step)``; arrives on ``bar``."""
        return self.op("load_k", step, bar=bar)

    def load_v(self, step: int, bar: Barrier):
        """Load warp: TMA of V of ``step`` into slot ``slot(step)``; arrives on ``bar``."""
        return self.op("load_v", step, bar=bar)

    def qk(self, tile: int, step: int):
        """MMA warp: issue ``S_tile = Q_tile K_step^T`` (returns at once; runs in issue order)."""
        return self.op("qk", tile, step)

    def pv(self, tile: int, step: int):
        """MMA warp: issue ``O_tile (+)= P_tile V_step``, P from S_tile's columns (step 0
        overwrites O). Returns at once."""
        return self.op("pv", tile, step)

    def commit(self, bar: Barrier):
        """MMA warp: one arrival on ``bar`` once every MMA issued so far has finished."""
        return self.op("commit", bar=bar)

    def rowmax(self, tile: int, step: int):
        """Softmax: S_tile of ``step`` from TMEM, the new row max published."""
        return self.op("rowmax", tile, step)

    def exp(self, tile: int, step: int):
        """Softmax: ``P = exp2(S - m)`` in 16 bits, in place of S_tile (on the exp unit)."""
        return self.op("exp", tile, step)

    def rowsum(self, tile: int):
        """Softmax, after its last step: the row sum l published."""
        return self.op("rowsum", tile)

    def rescale(self, tile: int, step: int):
        """Correction: ``O_tile *= exp2(m_{step-1} - m_step)`` in TMEM; steps 1, 2, ..."""
        return self.op("rescale", tile, step)

    def finish(self, tile: int):
        """Correction, after the last PV: ``O_tile / l`` into the O staging tile (SMEM)."""
        return self.op("finish", tile)

    def store(self, tile: int):
        """Epilogue warp: TMA store of the normalised O tile."""
        return self.op("store", tile)

    def make_barriers(self) -> types.SimpleNamespace:
        """The barriers the role programs are given (``make_barriers``)."""
        return make_barriers(self)

    # ------------------------------------------------------------------ for the engine
    titles = {"load warp": "the load warp", "MMA warp": "the MMA warp",
              "correction": "the correction warpgroup", "epilogue warp": "the epilogue warp"}

    def deadlock_report(self, stuck, finished: dict) -> str:
        return deadlock_text(
            "role", stuck, self.who, {self.who(n): t for n, t in finished.items()},
            ". Every phase someone waits for needs its arrival: an arrive by a role, a commit "
            "by the MMA warp (after the MMAs it covers), or a landed TMA copy.")

    def owner(self, a) -> str:
        if a.name in ("rowmax", "exp", "rowsum"):
            return f"softmax {a.args[0]}"
        return {"rescale": "correction", "finish": "correction", "store": "epilogue warp"}.get(
            a.name, "load warp" if a.name.startswith("load_") else "MMA warp")

    def invalid(self, a) -> str | None:
        """What is wrong with an action its owner yielded: a tile, a step out of range."""
        tile = 0 if a.name in ("commit", "load_k", "load_v") else a.args[0]
        if tile not in TILES:
            return f"{a}: the Q tiles are 0 and 1."
        step = a.args[0] if a.name in ("load_k", "load_v") else \
            (a.args[1] if len(a.args) > 1 else None)
        if step is not None and not (isinstance(step, int) and 0 <= step < self.n_steps):
            return f"{a}: the key steps are 0..{self.n_steps - 1}."
        if a.name == "rescale" and step == 0:
            return (f"rescale({tile}, 0): step 0 has nothing to rescale (PV of step 0 "
                    "overwrites O); rescales are for steps 1..n_steps-1.")
        return None

    def buffers(self) -> dict:
        """The CTA's buffers: Q_t (SMEM, O's staging tile ``Ostage{t}`` at the end: the same
        buffer), S/P_t, O_t and the row statistics of tile t (TMEM), the K and V slots (SMEM)."""
        bufs = {f"{x}{t}": Buffer(f"{x}{t}", "SMEM" if x == "Q" else "TMEM")
                for t in TILES for x in "QSOml"}
        bufs.update({f"Ostage{t}": bufs[f"Q{t}"] for t in TILES})
        bufs.update({f"{x}[{s}]": Buffer(f"{x}[{s}]", "SMEM")
                     for s in range(self.stages) for x in "KV"})
        return bufs

    def spec(self, a) -> Spec:
        """What action ``a`` does: its unit, duration, accesses (buffer, mode, expected
        contents, new contents, the readers they await) and Gantt bars."""
        t, name, n = self.timing, a.name, self.n_steps
        if name == "commit":
            return Spec("commit", "tensor core")
        if name.startswith("load_"):                 # K and V await both tiles' MMAs
            part, i = name[-1].upper(), a.args[0]
            mma = "QK" if part == "K" else "PV"
            buf, need = (f"Q{i}", ()) if part == "Q" else \
                (f"{part}[{self.slot(i)}]", (access_label(mma, 0, i), access_label(mma, 1, i)))
            return Spec("copy", "TMA", t.tma, f"the TMA load of {self.content_text((part, i))}",
                        accesses=((buf, "w", None, (part, i), need),), kind="load",
                        step=None if part == "Q" else i, note=f"{part}{i}",
                        lane="QKV".index(part), done=(name, i))
        tile, j = a.args[0], (a.args[1] if len(a.args) > 1 else None)
        S, m, lsum, O = f"S{tile}", f"m{tile}", f"l{tile}", f"O{tile}"
        label = access_label(name.upper() if name in _MMA else name, tile, j)
        if name == "qk":
            accesses = ((f"Q{tile}", "r", ("Q", tile), None, ()),
                        (f"K[{self.slot(j)}]", "r", ("K", j), None, ()),
                        (S, "w", None, ("S", j), (access_label("rowmax", tile, j),)))
        elif name == "pv":
            nxt = (access_label("rescale", tile, j + 1),) if j + 1 < n else \
                (access_label("finish", tile),)
            accesses = ((S, "r", ("P", j), None, ()),
                        (f"V[{self.slot(j)}]", "r", ("V", j), None, ()),
                        (O, "w", None, ("O", 0), nxt) if j == 0 else
                        (O, "rw", ("O~", j), ("O", j), nxt))
        else:
            accesses = {
                "rowmax": ((S, "r", ("S", j), None, ()),
                           (m, "w", None, ("m", j),
                            (access_label("rescale", tile, j),) if j else ())),
                "exp": ((S, "w", None, ("P", j), (access_label("PV", tile, j),)),),
                "rowsum": ((lsum, "w", None, ("l",), (access_label("finish", tile),)),),
                "rescale": ((m, "r", ("m", j), None, ()),
                            (O, "rw", ("O", j - 1) if j else None, ("O~", j),
                             (access_label("PV", tile, j),))),
                "finish": ((lsum, "r", ("l",), None, ()), (O, "r", ("O", n - 1), None, ()),
                           (f"Ostage{tile}", "w", None, ("out", tile),
                            (access_label("store", tile),))),
                "store": ((f"Ostage{tile}", "r", ("out", tile), None, ()),)}[name]
        if name in _MMA:
            return Spec("issue", "tensor core", getattr(t, name), f"the MMA warp's {label}",
                        label, accesses, kind=name.upper(), step=j, lane=tile,
                        done=(name.upper(), tile, j))
        require = None
        if name == "exp":             # P is written in place of S: S of this step must be there
            require = (S, ("S", j), lambda found: (
                f"Softmax {tile}'s exp({tile}, {j}) writes P in place of S of step {j}, but "
                f"S_{tile} holds {self.content_text(found)}: softmax runs rowmax({tile}, {j}) "
                f"first, and nothing may overwrite S_{tile} before P is written."))
        return Spec("work", "exp unit" if name == "exp" else "", getattr(t, name),
                    f"{self.who(self.owner(a))}'s {a}", label, accesses, kind=name, step=j,
                    lane=tile, done=(name, tile) + (() if j is None else (j,)), require=require)

    # ------------------------------------------------------------------ the hazards' words
    @staticmethod
    def content_text(c) -> str:
        return "nothing yet" if c is None else _CONTENTS[c[0]].format(*c[1:])

    @staticmethod
    def newer(have, want) -> bool:
        """Whether contents ``have`` come later than ``want`` (an overwrite, not a read too
        early)."""
        if have is None or want is None:
            return False
        if have[0] in ("S", "P") and want[0] in ("S", "P"):
            return (have[1], have[0] == "P") > (want[1], want[0] == "P")
        if have[0] in ("O", "O~") and want[0] in ("O", "O~"):
            return (have[1], have[0] == "O") > (want[1], want[0] == "O")
        if len(have) > 1 and len(want) > 1 and have[0] == want[0]:
            return have[1] > want[1]
        return False

    @staticmethod
    def describe(buf: Buffer) -> str:
        name = buf.name
        if name[0] == "Q":
            return f"Q_{name[-1]}'s tile (SMEM; O's staging tile at the end)"
        if name[0] in "SO":
            return f"{name[0]}_{name[-1]} ({buf.memory})"
        if name[0] in "ml":
            return f"the row {'max' if name[0] == 'm' else 'sum'} of tile {name[-1]} ({buf.memory})"
        return f"{name[0]} slot {name[2:-1]} (SMEM)"

    @staticmethod
    def race_note(buf: Buffer, acc, other) -> str:
        if buf.name[0] == "O":
            labels = acc.label + " " + other.label
            if "rescale(" in labels:
                return " O rescaled while an MMA accumulates into it."
            if "finish(" in labels:
                return " O read for the output while an MMA still accumulates into it."
        return ""

    @staticmethod
    def hint(buf: Buffer, acc, expect, have) -> str:
        """What the role should have waited for, by buffer and accessor."""
        name, who, t = buf.name, acc.label, buf.name[-1]
        if name[0] == "S" and who.startswith("PV"):
            return (f" P read by the MMA before softmax {t} wrote it: before issuing "
                    f"PV{t}(j) the MMA warp waits on p_ready[{t}] for parity j % 2.")
        if name[0] == "S" and who.startswith("QK"):
            if have and have[0] == "S":
                return (f" S overwritten before softmax {t} read it: the MMA warp may issue "
                        f"QK{t}(j) only after PV{t}(j-1), which waits until softmax {t} has "
                        "written P (so S of step j-1 was read).")
            return (f" P_{t} overwritten before PV{t} read it: S and P share TMEM columns, "
                    f"so issue PV{t}(j-1) before QK{t}(j) (the tensor core runs MMAs in issue "
                    "order).")
        if name[0] == "S" and ("rowmax(" in who or "exp(" in who):
            return (f" Softmax {t} reads S_{t} once the MMA warp's commit on s_ready[{t}] says "
                    f"QK{t}(j) has finished.")
        if name[0] == "O":
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
            if who.startswith(("QK", "PV")):
                return (f" Before issuing an MMA that reads {part} of step j, the MMA warp "
                        f"waits on {part.lower()}_full[slot(j)] for parity phase(j).")
            return (f" Before refilling a {part} slot the load warp waits on "
                    f"{part.lower()}_free[slot] until both {'QK' if part == 'K' else 'PV'} "
                    f"MMAs that read it have finished; the MMA warp releases the slot with "
                    f"pipe.commit (it arrives when those MMAs finish), not pipe.arrive (it "
                    f"arrives at once).")
        if name[0] == "Q":
            if "store(" in who:
                return " The epilogue stores O once the correction signals epi_ready[t]."
            if "finish(" in who:
                return (" Q_t's tile becomes O's staging tile once no QK_t reads it: after the "
                        "last PV_t finished (o_done[t]), since every QK_t was issued before it.")
            return " The MMA warp waits on q_full[t] before the first QK of tile t."
        return ""


def fa4_model(t: Timing) -> float:
    """Steady-state tensor-core utilisation of the two-tile schedule when the K/V ring hides the
    TMA latency: 2g / period, the period ``max(2g, g + rowmax + max(exp, rescale), 2 rescale,
    2 exp)`` (a tile's next QK waits for its PV, as S and P share TMEM columns; the other tile's
    MMAs fill the wait; the correction and the one exponential unit serve both tiles)."""
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
    count = {name: len(TILES) if name in PER_TILE_BARRIERS else pipe.stages for name in BARRIERS}
    return types.SimpleNamespace(**{name: [pipe.barrier(f"{name}[{i}]") for i in range(n)]
                                    for name, n in count.items()})


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
             max_actions: int = 20000, roles: dict | None = None,
             pipe_type: type | None = None) -> Run:
    """Run the five roles: the chapter's load warp, softmax warpgroups and epilogue warp (or
    ``roles``' replacements, keyed by role name) with ``mma(pipe, bars)`` and
    ``correction(pipe, bars)``, on a ``pipe_type`` (``RolePipeline``, or a configuration of it
    with rules of its own: ``ordering``). Returns the Run; a hazard is ``run.error``, never
    raised."""
    pipe = (pipe_type or RolePipeline)(stages, n_steps, timing, max_actions)
    given = {"load warp": load, "MMA warp": mma, "softmax 0": lambda p, b: softmax(p, 0, b),
             "softmax 1": lambda p, b: softmax(p, 1, b), "correction": correction,
             "epilogue warp": epilogue, **(roles or {})}
    try:
        bars = pipe.make_barriers()
        programs = {name: fn(pipe, bars) for name, fn in given.items()}
        return pipe.run(programs)
    except Hazard as h:
        return Run(stages, n_steps, 0, pipe.timing, False, [], [], [], [], {}, 0.0, h)
