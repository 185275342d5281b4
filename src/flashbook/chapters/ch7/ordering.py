"""Blackwell's ordering rules (Chapter 7, Exercise 6; Section 8 states them): the tcgen05 waits
and fences, as a configuration of the five-role simulator (``roles``) on the toolkit's engine.

``OrderedRolePipeline`` checks the rules in program order (``in_order``) for the softmax
warpgroups, which the exercise writes at the instruction level: ``load_s`` (tcgen05.ld of S),
``wait_ld``, ``rowmax`` (a tcgen05.st of the row max), ``exp`` (a tcgen05.st of P into S's
columns), ``rowsum`` (a tcgen05.st of the row sum), ``wait_st``, ``fence_before``,
``fence_after``; the MMA warp's ``alloc`` hands over the TMEM address on ``tmem_ready``. The MMA
warp and the correction of Exercise 4 are written at the level of barriers; their fences follow
the same rules and are taken as given. A broken rule is a hazard of kind *ordering* whose
message names the role, the op, what is missing and what can go wrong on the hardware.
"""
from __future__ import annotations

import dataclasses

from flashbook.check import CheckFailure, report, require_implemented
from flashbook.pipeline_types import Arrive, Hazard, Op, Spec, Wait

from .roles import RolePipeline, Run, Timing, fa4_model, make_barriers, simulate
from .roles_checks import TOLERANCE, UTIL_STEPS, check_protocol, protocol_cases, ran, \
    steady_window

__all__ = ["OrderedRolePipeline", "simulate_ordered", "check_ordering", "MARKS", "STORES"]

MARKS = ("wait_ld", "wait_st", "fence_before", "fence_after")
STORES = {"rowmax": "the row max", "exp": "P", "rowsum": "the row sum"}   # op: what it stores
_PTX = {"wait_ld": "tcgen05.wait::ld", "wait_st": "tcgen05.wait::st"}
# barriers that hand tensor memory (or its address) from one role to another
_TMEM_BARRIERS = ("tmem_ready", "s_ready", "p_ready", "stats", "o_done", "o_ready", "l_ready")


@dataclasses.dataclass
class _State:
    """One ordered role's place in its program: its async TMEM ops not yet waited for, the
    tcgen05 instructions since its last before-fence, the TMEM barrier it waited on since its
    last after-fence, whether it has the TMEM address, and its last tcgen05.ld of S."""
    loads: list = dataclasses.field(default_factory=list)
    stores: list = dataclasses.field(default_factory=list)
    unfenced: list = dataclasses.field(default_factory=list)
    synced: str | None = None
    address: str = "none"          # "none", "waited" (on tmem_ready), "fenced"
    loaded: tuple | None = None    # (tile, step) of the last load_s


class OrderedRolePipeline(RolePipeline):
    """The five roles with the softmax warpgroups at the instruction level: the actions of
    ``RolePipeline``, the tcgen05 waits and fences, ``load_s`` and the MMA warp's ``alloc``;
    ``bars.tmem_ready`` besides Exercise 4's barriers."""
    ordered = ("softmax 0", "softmax 1")

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._order = {name: _State() for name in self.ordered}

    def make_barriers(self):
        bars = make_barriers(self)
        bars.tmem_ready = self.barrier("tmem_ready")   # the MMA warp's tcgen05.alloc is done
        return bars

    # ------------------------------------------------------------------ the actions
    def alloc(self):
        """MMA warp: ``tcgen05.alloc``, the TMEM address written into shared memory."""
        return self.op("alloc")

    def load_s(self, tile: int, step: int):
        """Softmax: ``tcgen05.ld`` of S_tile of ``step`` into registers (asynchronous)."""
        return self.op("load_s", tile, step)

    def wait_ld(self):
        """``tcgen05.wait::ld``: this role's tcgen05.ld have filled their registers."""
        return self.op("wait_ld")

    def wait_st(self):
        """``tcgen05.wait::st``: this role's tcgen05.st have landed in tensor memory."""
        return self.op("wait_st")

    def fence_before(self):
        """``tcgen05.fence::before_thread_sync``: this role's tcgen05 instructions so far are
        ordered before its next arrive."""
        return self.op("fence_before")

    def fence_after(self):
        """``tcgen05.fence::after_thread_sync``: this role's next tcgen05 instructions are
        ordered after the waits before it."""
        return self.op("fence_after")

    def owner(self, a) -> str:
        if a.name in MARKS:
            return a.creator or ""
        if a.name == "load_s":
            return f"softmax {a.args[0]}"
        return "MMA warp" if a.name == "alloc" else super().owner(a)

    def invalid(self, a) -> str | None:
        return None if a.name in MARKS + ("alloc",) else super().invalid(a)

    def spec(self, a):
        if a.name in MARKS + ("alloc", "load_s"):
            return Spec("mark")
        return super().spec(a)

    # ------------------------------------------------------------------ the rules
    def in_order(self, program: str, a, now: float) -> None:
        st = self._order.get(program)
        if st is None:
            return
        who = self.who(program)
        if isinstance(a, Wait):
            if a.bar.name.split("[")[0] in _TMEM_BARRIERS:
                st.synced = a.bar.name
                if a.bar.name == "tmem_ready":
                    st.address = "waited"
        elif isinstance(a, Arrive):
            self._check_arrive(st, who, a, now)
        elif isinstance(a, Op) and a.name in MARKS:
            self._mark(st, a.name)
        elif isinstance(a, Op) and (a.name == "load_s" or a.name in STORES):
            self._check_tcgen05(st, who, a, now)

    @staticmethod
    def _mark(st: _State, name: str):
        if name == "fence_after":
            st.synced = None
            if st.address == "waited":
                st.address = "fenced"
        elif name == "fence_before":
            st.unfenced = []
        else:
            (st.loads if name == "wait_ld" else st.stores).clear()
            st.unfenced.append(_PTX[name])

    def _check_tcgen05(self, st: _State, who: str, a, now: float):
        ptx = f"{a} ({'tcgen05.ld' if a.name == 'load_s' else 'with its tcgen05.st'})"
        if st.address != "fenced":
            step = ("it waited on tmem_ready but executed no tcgen05.fence::after_thread_sync "
                    "since" if st.address == "waited" else "it never waited on tmem_ready")
            raise Hazard("ordering", now, (
                f"{who.capitalize()} issues {ptx} before the allocation handshake: {step}. The "
                f"address of tensor memory is what the MMA warp's tcgen05.alloc wrote into "
                f"shared memory; the MMA warp then executes tcgen05.fence::before_thread_sync "
                f"and arrives on tmem_ready. Until {who} has waited on tmem_ready (parity 0) "
                f"and executed tcgen05.fence::after_thread_sync, it may read the address before "
                f"it was written and access a garbage address in tensor memory. Begin with "
                f"`yield pipe.wait(bars.tmem_ready, 0)` and `yield pipe.fence_after()`."))
        if st.synced is not None:
            raise Hazard("ordering", now, (
                f"{who.capitalize()} issues {ptx} after its wait on {st.synced} with no "
                f"tcgen05.fence::after_thread_sync in between (the consumer's half of the "
                f"hand-off). An mbarrier wait does not order the asynchronous tcgen05 "
                f"instructions after it: the hardware may start the tcgen05.ld before the wait "
                f"returns and read S before the QK MMA that {st.synced} announces has written "
                f"it (the previous step's P, some of the time). After the wait, "
                f"`yield pipe.fence_after()`, then the tcgen05 op."))
        tile, step = a.args[0], (a.args[1] if len(a.args) > 1 else None)
        if a.name == "rowmax":
            if st.loaded != (tile, step):
                raise Hazard("ordering", now, (
                    f"{who.capitalize()} computes rowmax({tile}, {step}) without a tcgen05.ld of "
                    f"S_{tile} of step {step}: the scores are in tensor memory, and a thread reads "
                    f"them only through tcgen05.ld. `yield pipe.load_s({tile}, {step})`, then "
                    f"`yield pipe.wait_ld()`, then the row max."))
            if st.loads:
                raise Hazard("ordering", now, (
                    f"{who.capitalize()} computes rowmax({tile}, {step}) from the registers its "
                    f"tcgen05.ld of S_{tile} ({st.loads[-1][1]}) fills, with no tcgen05.wait::ld "
                    f"in between: tcgen05.ld is asynchronous, and its destination registers are "
                    f"undefined until tcgen05.wait::ld (the max of stale registers, on a real "
                    f"GPU). `yield pipe.wait_ld()` after load_s."))
        if a.name == "load_s":
            st.loads.append((f"S_{tile}", a))
            st.loaded = (tile, step)
        else:
            st.stores.append((STORES[a.name], a))
        st.unfenced.append(ptx)

    @staticmethod
    def _check_arrive(st: _State, who: str, a, now: float):
        bar = a.bar.name
        if st.stores or st.loads:
            what, op = (st.stores or st.loads)[-1]
            pending = f"tcgen05.{'st' if st.stores else 'ld'} of {what} ({op})"
            wait = "tcgen05.wait::st" if st.stores else "tcgen05.wait::ld"
            harm = _HARM[what if st.stores else "S"].format(bar=bar)
            raise Hazard("ordering", now, (
                f"{who.capitalize()} arrives on {bar} before {wait}: its {pending} may still be in "
                f"flight. tcgen05.ld and tcgen05.st are asynchronous; the arrive tells another "
                f"role the data is ready, and {harm}. Before the arrive: "
                f"`yield pipe.{'wait_st' if st.stores else 'wait_ld'}()`, then "
                f"`yield pipe.fence_before()`."))
        if st.unfenced:
            raise Hazard("ordering", now, (
                f"{who.capitalize()} arrives on {bar} after {', '.join(st.unfenced[-3:])} with no "
                f"tcgen05.fence::before_thread_sync since (the producer's half of the "
                f"hand-off). The arrive is an ordinary memory operation, not ordered after the "
                f"tcgen05 instructions before it: the consumer may see {bar} complete before "
                f"they have taken effect. `yield pipe.fence_before()` right before the arrive "
                f"(after the wait_st / wait_ld)."))


_HARM = {"P": "the MMA warp, once it waited on {bar}, may read S's columns before P has landed "
              "in them and multiply scores, or half of P, by V",
         "the row max": "the correction, once it waited on {bar}, may read the row max before "
                        "it has landed and rescale O by a stale factor",
         "the row sum": "the correction, once it waited on {bar}, may divide O by a row sum "
                        "that has not landed",
         "S": "the MMA warp, once it waited on {bar}, may overwrite S with the next QK while "
              "the load still reads it"}


def with_alloc(mma):
    """The MMA warp of Exercise 4 after the allocation handshake's first half: tcgen05.alloc,
    tcgen05.fence::before_thread_sync, an arrive on tmem_ready."""
    def mma_warp(pipe, bars):
        yield pipe.alloc()
        yield pipe.fence_before()
        yield pipe.arrive(bars.tmem_ready)
        yield from mma(pipe, bars)
    return mma_warp


def simulate_ordered(softmax, mma, correction, *, stages: int, n_steps: int,
                     timing: Timing | None = None) -> Run:
    """The five roles with ``softmax(pipe, t, bars)`` for both softmax warpgroups, checked for
    the ordering rules, and Exercise 4's ``mma`` (after tcgen05.alloc) and ``correction``."""
    roles = {f"softmax {t}": (lambda pipe, bars, t=t: softmax(pipe, t, bars)) for t in (0, 1)}
    return simulate(with_alloc(mma), correction, stages=stages, n_steps=n_steps,
                    timing=timing, roles=roles, pipe_type=OrderedRolePipeline)


def check_ordering(softmax, mma, correction, hidden: bool = False):
    """Exercise 6: the softmax warpgroup with its tcgen05 waits and fences runs with your
    Exercise 4 roles without a hazard of any kind, completes every step, and keeps the tensor
    core as busy as Exercise 4's schedule (fences cost no time in the model)."""
    require_implemented(softmax, "softmax_ordered")
    require_implemented(mma, "mma (Exercise 4)")
    require_implemented(correction, "correction (Exercise 4)")
    alone = simulate(mma, correction, stages=2, n_steps=2)
    if alone.error is not None:
        raise CheckFailure("Exercise 6 runs your MMA warp and correction of Exercise 4, which "
                           f"fail on their own (pass Exercise 4 first):\n{alone.error}")
    cases = protocol_cases(hidden) if hidden else \
        [(s, n, t) for s, n, t in protocol_cases() if s == 2]
    check_protocol(lambda **kw: simulate_ordered(softmax, mma, correction, **kw), cases,
                   "ordered softmax")
    timings = [Timing()] + ([Timing(tma=2, exp=3.5), Timing(exp=1, rescale=2)] if hidden else [])
    for timing in timings:
        run = ran(simulate_ordered(softmax, mma, correction, stages=2, n_steps=UTIL_STEPS,
                                   timing=timing),
                  f"ordered softmax, utilisation run ({timing.describe()})")
        u, want = run.utilisation(*steady_window(run)), fa4_model(timing)
        if u < want - TOLERANCE:
            raise CheckFailure(
                f"ordered softmax ({timing.describe()}): the tensor core was busy {u:.1%} of "
                f"the steady state, below the model's {want:.1%} that Exercise 4's softmax "
                f"reaches: arrive on stats[t] right after the row max is stored (its wait_st "
                f"and fence_before), before the exp, so the correction can rescale meanwhile.")
    report("tcgen05 ordering of the softmax warpgroups (waits, fences, allocation handshake)",
           len(cases) + len(timings), hidden=hidden)
