"""The engine of the pipeline model of programs (warp roles), barriers and shared units: the
event loop in simulated time, the barriers' phases and waits, the tensor cores shared by the
GEMMs in flight, the vector clocks that order every read and write of a slot, and the hazard
reports (overwrite, read before ready, phase overrun, deadlock, dataflow, protocol, runaway).
``Pipeline.run`` is its entry. It knows no chapter: a configuration is a pipeline
(``pipeline_model``) whose ``actions`` it runs, whose ``who``, ``noun``, ``action_help`` and
``deadlock_report`` word its messages, and whose ops (``Op``, run by ``pipeline_ops``) add
units and buffers with contents."""
from __future__ import annotations

import heapq
import inspect
import itertools
from typing import Callable

from .pipeline_ops import Ops
from .pipeline_types import (PARTS, Action, Arrive, Barrier, Gemm, Hazard, Load, Op, Read, Run,
                             Softmax, Span, Wait, Write, join_clocks)

__all__ = ["Engine", "join_clocks", "deadlock_text"]

_EPS = 1e-9


def deadlock_text(kind: str, stuck, who: Callable[[str], str], finished: dict,
                  advice: str) -> str:
    """The deadlock message: each stuck program's wait (``who`` names it) with its barrier's
    phase count, the programs that finished ({name: time}), then the rule of a wait and
    ``advice``."""
    lines = [f"every unfinished {kind} waits on a barrier and nothing is in flight:"]
    for p in stuck:
        a, since = p.blocked_on
        b = a.bar
        lines.append(f"  {who(p.name)} waits on {b.name} for parity {a.parity} since "
                     f"t={_t(since)} ({b.name} has completed {b.completed} phase(s), the "
                     f"current one has {b.pending} of {b.arrivals} arrival(s))")
    done = [f"{n} (t={_t(t)})" for n, t in finished.items()]
    if done:
        lines.append("  finished: " + ", ".join(done))
    lines.append("A wait passes only once its barrier has completed a phase of that parity "
                 "(on a fresh barrier parity 1 passes, parity 0 waits for the first phase)"
                 + advice)
    return "\n".join(lines)


def _t(x: float) -> str:
    return f"{x:g}"


def _who(name: str) -> str:
    return "the producer" if name == "producer" else name


def _cap(text: str) -> str:
    return text[:1].upper() + text[1:]


class _Prog:
    def __init__(self, name: str, gen, index: int):
        self.name, self.gen, self.index = name, gen, index
        self.vc = {name: 0}
        self.state = "ready"
        self.blocked_on = None          # (wait action, since)
        self.observed: dict = {}        # barrier -> completed phases it has seen
        self.waits: list = []           # (action index, barrier, completed seen, time)
        self.n_actions = 0
        self.last_write_index: dict = {}   # buffer -> action index of this program's last write
        self.qk = -1
        self.softmax = -1
        self.pv = -1


class Engine:
    def __init__(self, pipe, programs: dict):       # pipe: the pipeline.Pipeline it runs
        self.pipe, self.t = pipe, pipe.timing
        self.now = 0.0
        self.heap: list = []
        self.seq = itertools.count()
        self.programs = programs
        self.progs: dict[str, _Prog] = {}
        self.consumer_names = [f"consumer {i}" for i in range(pipe.consumers)]
        self.spans: list[Span] = []
        self.reads: list[Read] = []
        self.writes: list[Write] = []
        self.buffers: dict = {}                 # (part, slot) -> [Write, ...]
        self.finished: dict = {}
        self.n_actions = 0
        self.tc_jobs: list = []                 # [prog, remaining, action, start]
        self.tc_last = 0.0
        self.tc_version = 0
        self.done: dict = {}                    # what the ops did: {Spec.done: (start, end)}
        self.ops = Ops(self)

    # ------------------------------------------------------------------ event loop
    def at(self, time: float, fn: Callable, *args):
        heapq.heappush(self.heap, (time, next(self.seq), fn, args))

    def run(self) -> Run:
        error = None
        try:
            for i, (name, gen) in enumerate(self.programs.items()):
                if not inspect.isgenerator(gen):
                    raise Hazard("protocol", 0.0, f"the {name} program is {type(gen).__name__}, "
                                 "not a generator: its function must `yield` each action (yield "
                                 "pipe.wait(...), yield pipe.load(...), ...)")
                self.progs[name] = _Prog(name, gen, i)
            for p in self.progs.values():
                self.at(0.0, self.resume, p)
            while self.heap:
                time, _, fn, args = heapq.heappop(self.heap)
                self.now = time
                fn(*args)
            self.check_end()
        except Hazard as h:
            error = h
        finally:
            for p in self.progs.values():
                p.gen.close()
        return Run(self.pipe.stages, self.pipe.n_steps, self.pipe.consumers, self.t,
                   pingpong=False, spans=self.spans, reads=self.reads, writes=self.writes,
                   barriers=list(self.pipe._barriers), finished=dict(self.finished),
                   end=self.now, error=error, done=dict(self.done))

    def check_end(self):
        stuck = [p for p in self.progs.values() if p.state != "done"]
        if stuck:
            raise Hazard("deadlock", self.now, self.pipe.deadlock_report(stuck, self.finished))
        for a in self.pipe._created:
            if not a.yielded:
                raise Hazard("protocol", self.now,
                             f"{_who(a.creator or 'a program')} made the action {a} but never "
                             f"yielded it, so it did nothing: write `yield pipe."
                             f"{str(a).split('(')[0]}(...)`.")

    def resume(self, p: _Prog):
        """Run ``p`` until it blocks, starts a timed action or finishes."""
        pipe = self.pipe
        p.state = "ready"
        while True:
            self.n_actions += 1
            p.n_actions += 1
            if self.n_actions > pipe.max_actions:
                raise Hazard("runaway", self.now, f"more than {pipe.max_actions} actions: a "
                             f"{pipe.noun} loops without end? ({pipe.who(p.name)} was running)")
            self.pipe._current = p.name
            try:
                a = next(p.gen)
            except StopIteration:
                p.state = "done"
                self.finished[p.name] = self.now
                return
            finally:
                self.pipe._current = None
            if not isinstance(a, Action) or a.pipe is not pipe:
                raise Hazard("protocol", self.now, f"{_cap(pipe.who(p.name))} yielded {a!r}, "
                             f"not an action of its pipeline {pipe.action_help}")
            a.yielded = True
            if not isinstance(a, pipe.actions):
                raise Hazard("protocol", self.now, f"{_cap(pipe.who(p.name))} yielded {a}, "
                             f"{pipe.foreign_help}")
            pipe.in_order(p.name, a, self.now)      # a configuration's program-order rules
            if isinstance(a, Wait):
                if not self.do_wait(p, a):
                    return
            elif isinstance(a, Arrive):
                self.check_barrier(p, a.bar, a)
                p.vc[p.name] += 1
                self.arrive(a.bar, p.name, p.vc)
            elif isinstance(a, Load):
                self.do_load(p, a)
            elif isinstance(a, Gemm):
                self.do_gemm(p, a)
                return
            elif isinstance(a, Softmax):
                self.do_softmax(p, a)
                return
            elif not self.ops.perform(p, a):
                return

    @staticmethod
    def who(p: _Prog) -> str:
        return _cap(_who(p.name))

    def check_barrier(self, p, bar, a):
        if not isinstance(bar, Barrier) or bar not in self.pipe._barriers:
            verb = a.name if isinstance(a, Op) else type(a).__name__[1:].lower()
            raise Hazard("protocol", self.now, f"{self.who(p)}: {verb} needs a barrier made by "
                         f"pipe.barrier(...), got {bar!r}.")

    # ------------------------------------------------------------------ barriers
    def do_wait(self, p: _Prog, a: Wait) -> bool:
        self.check_barrier(p, a.bar, a)
        if a.parity not in (0, 1):
            raise Hazard("protocol", self.now, f"{self.who(p)}: wait({a.bar.name}, parity "
                         f"{a.parity!r}): a parity is 0 or 1.")
        a.bar.waiters.add(p.name)
        if a.bar.completed % 2 != a.parity:
            self.observe(p, a.bar)
            return True
        p.state, p.blocked_on = "blocked", (a, self.now)
        a.bar.blocked.append(p)
        return False

    def observe(self, p: _Prog, bar: Barrier):
        p.observed[bar] = bar.completed
        p.vc = join_clocks(p.vc, bar._cum[bar.completed])
        p.waits.append((p.n_actions, bar, bar.completed, self.now))

    def arrive(self, bar: Barrier, actor: str, vc: dict):
        bar._vc = join_clocks(bar._vc, vc)
        bar.arrivers.append((actor, self.now))
        bar.pending += 1
        if bar.pending < bar.arrivals:
            return
        c = bar.completed
        for name in sorted(bar.waiters, key=lambda n: self.progs[n].index):
            q = self.progs[name]
            if q.state == "done" or q in bar.blocked:
                continue
            seen = q.observed.get(bar, 0)
            if seen < c:
                raise Hazard("phase overrun", self.now, (
                    f"{bar.name} completed its phase {c} (arrivals: "
                    f"{', '.join(n for n, _ in bar.arrivers)}) while {q.name}, which waits on it, "
                    f"had seen only {seen} completed phase(s), not phase {c - 1}: with parity "
                    f"alone a waiter that is two phases behind cannot tell them apart. Usually the "
                    f"barrier expects too few arrivals (it completes once per arrival instead of "
                    f"once per round) or someone arrives too often."))
        bar.completed += 1
        bar._cum.append(join_clocks(bar._cum[-1], bar._vc))
        bar.phases.append((self.now, list(bar.arrivers)))
        bar._vc, bar.pending, bar.arrivers = {}, 0, []
        woken, bar.blocked = bar.blocked, []
        for q in woken:                                  # a completion flips the parity
            a, since = q.blocked_on
            q.blocked_on = None
            self.observe(q, bar)
            if self.now > since:
                self.spans.append(Span(q.name, "wait", since, self.now, note=bar.name))
            q.state = "woken"
            self.at(self.now, self.resume, q)

    # ------------------------------------------------------------------ TMA
    def do_load(self, p: _Prog, a: Load):
        self.check_barrier(p, a.bar, a)
        if not (isinstance(a.step, int) and 0 <= a.step < self.pipe.n_steps):
            raise Hazard("protocol", self.now, f"{self.who(p)}: load(step {a.step!r}): steps are "
                         f"0..{self.pipe.n_steps - 1}.")
        if not a.parts or any(x not in PARTS for x in a.parts):
            raise Hazard("protocol", self.now, f"{self.who(p)}: load parts must be from {PARTS}.")
        slot = self.pipe.slot(a.step)
        p.vc[p.name] += 1
        vc = dict(p.vc)
        for part in a.parts:
            buf = (part, slot)
            history = self.buffers.setdefault(buf, [])
            since = p.last_write_index.get(buf, 0)
            context = {"actor": p.name, "waits": [w for w in p.waits if w[0] > since],
                       "prev": history[-1] if history else None, "step": a.step}
            if history:
                self.check_overwrite(p, history[-1], a.step, context)
            w = Write(part, slot, a.step, len(history) + 1, self.now, self.now + self.t.tma,
                      a.bar, context)
            history.append(w)
            self.writes.append(w)
            p.last_write_index[buf] = p.n_actions
            vc[("w", part, slot)] = w.seq
        self.spans.append(Span("TMA", "load", self.now, self.now + self.t.tma, a.step,
                               note="".join(a.parts), lane=slot))
        self.at(self.now + self.t.tma, self.arrive, a.bar, "TMA", vc)

    def check_overwrite(self, p: _Prog, prev: Write, step: int, context: dict):
        what = (f"{self.who(p)}'s TMA of step {step} into slot {prev.slot} overwrites "
                f"{prev.part} of step {prev.step}")
        for c in self.consumer_names:
            reads = [r for r in prev.reads if r.actor == c]
            if not reads:
                raise Hazard("overwrite", self.now, f"{what} before {c} read it. "
                             + self.diagnose(context, c, prev, None))
            for r in reads:
                if p.vc.get(c, 0) < r.stamp:
                    gemm = "QK" if r.part == "K" else "PV"
                    still = (f" (and that GEMM is still running until t={_t(r.end)})"
                             if r.end > self.now + _EPS else "")
                    raise Hazard("overwrite", self.now, (
                        f"{what}, which {c}'s {gemm} GEMM read at t={_t(r.start)}{still}, but no "
                        f"barrier {_who(p.name)} waited on orders that read before this TMA. "
                        + self.diagnose(context, c, prev, r)))
        if prev.done > self.now + _EPS:
            raise Hazard("overwrite", self.now, f"{what} while the TMA of step {prev.step} into "
                         f"it is still in flight (it lands at t={_t(prev.done)}).")

    def diagnose(self, context: dict, victim: str, prev: Write, read: Read | None) -> str:
        """Why a write was not ordered after ``victim``'s reads of the slot's previous step:
        no wait at all, a wait whose phase included the victim's release made before its last
        read, a phase completed without the victim (too few arrivals), a wait that returned at
        once on a fresh barrier."""
        actor, waits = _cap(_who(context["actor"])), context["waits"]
        if not waits:
            return (f"{actor} did not wait on any barrier after it loaded step {prev.step} into "
                    f"this slot: before refilling a slot it must wait until every consumer has "
                    f"released it (wait on the slot's consumed barrier).")
        seen_phases = [(bar, bar.phases[seen - 1]) for _, bar, seen, _ in reversed(waits) if seen]
        for bar, (_, arrivers) in seen_phases:
            mine = [t for n, t in arrivers if n == victim]
            if mine:
                late = (f"its {'QK' if prev.part == 'K' else 'PV'} GEMM reads {prev.part} at "
                        f"t={_t(read.start)}" if read else f"it had not read {prev.part} yet")
                return (f"{_cap(victim)} released slot {prev.slot} (arrived on {bar.name} at "
                        f"t={_t(mine[-1])}) before its last read of it ({late}): arrive on the "
                        f"consumed barrier only after the last GEMM that reads the slot (PV "
                        f"reads V).")
        for bar, (t_done, arrivers) in seen_phases:
            others = [n for n, _ in arrivers if n in self.consumer_names]
            if others:
                if bar.arrivals < self.pipe.consumers:
                    return (f"{actor} waited on {bar.name}, whose phases complete after "
                            f"{bar.arrivals} arrival(s): every consumer must release the slot, "
                            f"so a consumed barrier needs one arrival per consumer "
                            f"({self.pipe.consumers}).")
                return (f"{actor} waited on {bar.name}, whose phase completed at t={_t(t_done)} "
                        f"with arrivals from {', '.join(others)} but not from {victim}.")
        fresh = [bar for _, bar, seen, _ in waits if not seen]
        if fresh:
            bar = fresh[-1]
            return (f"{actor}'s wait on {bar.name} returned at once: {bar.name} had completed no "
                    f"phase yet, and on a fresh barrier a wait for parity 1 passes immediately. "
                    f"Round r of a slot (r = step // stages) must wait for the phase the "
                    f"consumers complete in round r - 1.")
        names = ", ".join(sorted({bar.name for _, bar, _, _ in waits}))
        return (f"{actor} waited only on {names} since it loaded step {prev.step} into this "
                f"slot, and {victim} arrived on none of them: wait on the slot's consumed barrier.")

    # ------------------------------------------------------------------ reads, GEMMs
    def check_read(self, p: _Prog, a: Gemm) -> Read:
        part = "K" if a.name == "QK" else "V"
        slot = self.pipe.slot(a.step)
        history = self.buffers.get((part, slot), [])
        what = f"{_cap(p.name)}'s {a.name} GEMM reads {part} of step {a.step} from slot {slot}"
        hint = (f"wait on the slot's full barrier for parity pipe.phase({a.step}) = "
                f"{self.pipe.phase(a.step)} before the first GEMM that reads it.")
        mine = [w for w in history if w.step == a.step]
        newer = [w for w in history if w.step > a.step]
        if not mine:
            held = f"it still holds step {history[-1].step}" if history else "it is still empty"
            raise Hazard("read before ready", self.now, f"{what}, but {held}: the TMA of step "
                         f"{a.step} has not even been issued. Data not ready: {hint}")
        w = mine[-1]
        later = [x for x in newer if x.seq > w.seq]
        if later:
            x = later[0]
            raise Hazard("overwrite", self.now, (
                f"{what}, but {_who(x.context['actor'])}'s TMA of step {x.step} (issued at "
                f"t={_t(x.issue)}) has overwritten it. "
                + self.diagnose(x.context, p.name, w, Read(p.name, part, slot, a.step, self.now,
                                                           self.now, 0))))
        if w.done > self.now + _EPS:
            raise Hazard("read before ready", self.now, f"{what}, but its TMA (issued at "
                         f"t={_t(w.issue)}) lands only at t={_t(w.done)}. Data not ready: {hint}")
        if p.vc.get(("w", part, slot), 0) < w.seq:
            raise Hazard("read before ready", self.now, (
                f"{what}: the data had landed (t={_t(w.done)}), but {_who(p.name)} had not "
                f"waited on {w.bar.name}, the barrier that TMA arrives on, so nothing guarantees "
                f"it sees the data. Data not ready (as far as {_who(p.name)} knows): {hint}"))
        p.vc[p.name] += 1
        r = Read(p.name, part, slot, a.step, self.now, self.now, p.vc[p.name])
        w.reads.append(r)
        self.reads.append(r)
        return r

    def check_dataflow(self, p: _Prog, a):
        n = self.pipe.n_steps
        step = a.step
        if not (isinstance(step, int) and 0 <= step < n):
            raise Hazard("protocol", self.now, f"{self.who(p)}: {a}: steps are 0..{n - 1}.")
        if p.name not in self.consumer_names:
            raise Hazard("protocol", self.now,
                         f"{self.who(p)} issued {a}: only the consumers compute.")
        kind = a.name if isinstance(a, Gemm) else "softmax"
        last = {"QK": p.qk, "softmax": p.softmax, "PV": p.pv}[kind]
        need = {"QK": None, "softmax": ("QK", p.qk), "PV": ("softmax", p.softmax)}[kind]
        if step != last + 1:
            before = f"its previous {kind} was of step {last}" if last >= 0 else \
                f"it had issued no {kind} yet"
            raise Hazard("dataflow", self.now, f"{self.who(p)} issued {a}, but {before}: each "
                         f"warpgroup processes every step once, in order 0, 1, 2, ...")
        if need and need[1] < step:
            raise Hazard("dataflow", self.now, f"{self.who(p)} issued {a} before {need[0].lower()}"
                         f"({step}): {kind} of a step needs its {need[0]} result first.")

    def do_gemm(self, p: _Prog, a: Gemm):
        self.check_dataflow(p, a)
        read = self.check_read(p, a)
        if a.name == "QK":
            p.qk = a.step
        else:
            p.pv = a.step
        self.tc_update()
        work = self.t.qk if a.name == "QK" else self.t.pv
        self.tc_jobs.append([p, work, a, self.now, read])
        p.state = "busy"
        self.tc_schedule()

    def tc_update(self):
        n = len(self.tc_jobs)
        dt = self.now - self.tc_last
        if n and dt > 0:
            for j in self.tc_jobs:
                j[1] -= dt / n
            if n > 1:
                self.spans.append(Span("tensor core", "shared", self.tc_last, self.now,
                                       note=" + ".join(j[0].name for j in self.tc_jobs)))
        self.tc_last = self.now

    def tc_schedule(self):
        self.tc_version += 1
        if self.tc_jobs:
            n = len(self.tc_jobs)
            t = self.now + max(0.0, min(j[1] for j in self.tc_jobs)) * n
            self.at(t, self.tc_finish, self.tc_version)

    def tc_finish(self, version: int):
        if version != self.tc_version:
            return
        self.tc_update()
        done = [j for j in self.tc_jobs if j[1] <= _EPS]
        self.tc_jobs = [j for j in self.tc_jobs if j[1] > _EPS]
        for p, _, a, start, read in done:
            read.end = self.now
            lane = self.consumer_names.index(p.name)
            self.spans.append(Span("tensor core", a.name, start, self.now, a.step, lane=lane))
            self.spans.append(Span(p.name, a.name, start, self.now, a.step))
            self.at(self.now, self.resume, p)
        self.tc_schedule()

    def do_softmax(self, p: _Prog, a: Softmax):
        self.check_dataflow(p, a)
        p.softmax = a.step
        p.state = "busy"
        end = self.now + self.t.softmax
        self.spans.append(Span(p.name, "softmax", self.now, end, a.step))
        self.at(end, self.resume, p)


