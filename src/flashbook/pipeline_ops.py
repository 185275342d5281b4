"""How the pipeline engine runs an ``Op``, the action a configuration defines by its ``Spec``:
asynchronous copies that arrive on a barrier when they land, ops queued on an in-order unit
(one at a time, in issue order) with commits that arrive once the ops before them have finished,
work the issuing program runs itself, on a unit the programs queue for if it names one, and
marks (instant, no unit, no buffer: their place in the program order is what counts). Each
op's accesses to the configuration's buffers are checked when it starts (``pipeline_buffers``)
and its bars are drawn on the unit's row (and the issuer's, for work)."""
from __future__ import annotations

from .pipeline_buffers import Access, Buffers
from .pipeline_types import Hazard, Op, Span, join_clocks

__all__ = ["Ops"]


class _Queue:
    """An in-order unit: the ops issued to it, not started; the one running; what it has done,
    as a vector clock; the commits waiting for the ops before them."""

    def __init__(self):
        self.waiting: list = []        # [(spec, issue vc, issue time, issuer), ...]
        self.busy = None
        self.vc: dict = {}
        self.clock = self.issued = self.finished = 0
        self.commits: list = []        # [(bar, ops issued before it, committer, its vc)]


class Ops:
    """The ops of one run of ``engine`` (a ``pipeline_engine.Engine``)."""

    def __init__(self, engine):
        self.engine, self.pipe = engine, engine.pipe
        self.buffers = Buffers(self.pipe, engine)
        self.queues: dict[str, _Queue] = {}
        self.holder: dict = {}         # unit of work -> the program holding it
        self.line: dict = {}           # unit of work -> [(program, spec, since), ...]
        self.issued: dict = {}         # (name, *args) -> time, of every op but commits
        self.copies = 0

    def perform(self, p, a: Op) -> bool:
        """Start ``a`` for program ``p``; False when ``p`` is now busy with it."""
        e, pipe = self.engine, self.pipe
        who = pipe.who(p.name)
        owner = pipe.owner(a)
        if p.name != owner:
            raise Hazard("protocol", e.now, f"{who[:1].upper() + who[1:]} yielded {a}, which only "
                         f"{pipe.who(owner)} does {pipe.owner_rule}.")
        complaint = pipe.invalid(a)
        if complaint:
            raise Hazard("protocol", e.now, f"{who[:1].upper() + who[1:]}: {complaint}")
        spec = pipe.spec(a)
        if spec.how not in ("commit", "mark"):
            key = (a.name,) + a.args
            if key in self.issued:
                raise Hazard("protocol", e.now, f"{who[:1].upper() + who[1:]} issued {a} a "
                             f"second time (first at t={self.issued[key]:g}): every action of a "
                             "step happens once.")
            self.issued[key] = e.now
        if a.bar is not None:
            e.check_barrier(p, a.bar, a)
        getattr(self, spec.how)(p, a, spec)
        return spec.how != "work"

    def _accesses(self, spec, who, agent, key, stamp, vc, start):
        """Check the op's accesses as it starts; returns them with their buffers."""
        plan = []
        for name, mode, expect, new, need in spec.accesses:
            acc = Access(who, agent, key, stamp, mode, start, start + spec.duration,
                         label=spec.label, vc=vc)
            plan.append((self.buffers[name], acc, expect, new, need))
        if spec.require:
            name, content, text = spec.require
            found = self.buffers[name].content
            if found != content:
                raise Hazard("overwrite" if self.pipe.newer(found, content) else "dataflow",
                             start, text(found))
        for buf, acc, expect, _, _ in plan:
            self.buffers.access(buf, acc, expect)
        return plan

    def _complete(self, plan):
        for buf, acc, _, new, need in plan:
            self.buffers.complete(buf, acc, new, need)

    def _mark(self, spec, start):
        self.engine.done[spec.done] = (start, start + spec.duration)

    def mark(self, p, a: Op, spec):
        """An instruction that takes no time and touches no buffer (a fence, a wait for the
        program's own asynchronous ops): only its place in the program order counts, which the
        configuration's ``in_order`` checks. It may repeat."""

    # ------------------------------------------------------------------ copies
    def copy(self, p, a: Op, spec):
        e, now = self.engine, self.engine.now
        self.copies += 1
        key = (spec.unit, self.copies)
        p.vc[p.name] += 1
        vc = dict(p.vc)
        vc[key] = 1
        plan = self._accesses(spec, spec.who, spec.unit, key, 1, vc, now)
        e.spans.append(Span(spec.unit, spec.kind, now, now + spec.duration, spec.step,
                            note=spec.note, lane=spec.lane))
        self._mark(spec, now)

        def land():
            self._complete(plan)
            e.arrive(a.bar, spec.unit, vc)
        e.at(now + spec.duration, land)

    # ------------------------------------------------------------------ in-order units
    def issue(self, p, a: Op, spec):
        q = self.queues.setdefault(spec.unit, _Queue())
        p.vc[p.name] += 1
        q.issued += 1
        q.waiting.append((spec, dict(p.vc), self.engine.now, p.name))
        if q.busy is None:
            self._start(spec.unit, q)

    def commit(self, p, a: Op, spec):
        q = self.queues.setdefault(spec.unit, _Queue())
        p.vc[p.name] += 1
        vc = dict(p.vc)
        if q.finished == q.issued:
            self.engine.arrive(a.bar, p.name, join_clocks(vc, q.vc))
        else:
            q.commits.append((a.bar, q.issued, p.name, vc))

    def _start(self, unit: str, q: _Queue):
        e, now = self.engine, self.engine.now
        spec, issue_vc, issued_at, issuer = q.waiting.pop(0)
        q.clock += 1
        vc = join_clocks(issue_vc, q.vc)
        vc[unit] = q.clock
        who = f"{spec.who} (issued at t={issued_at:g})"
        plan = self._accesses(spec, who, unit, unit, q.clock, vc, now)
        q.busy = (plan, vc)
        e.spans.append(Span(unit, spec.kind, now, now + spec.duration, spec.step,
                            note=spec.note, lane=spec.lane))
        e.spans.append(Span(issuer, "issue", issued_at, issued_at, spec.step, note=spec.label,
                            lane=spec.lane))
        self._mark(spec, now)
        e.at(now + spec.duration, self._finish, unit, q)

    def _finish(self, unit: str, q: _Queue):
        plan, vc = q.busy
        self._complete(plan)
        q.vc, q.busy = vc, None
        q.finished += 1
        ready = [c for c in q.commits if c[1] <= q.finished]
        q.commits = [c for c in q.commits if c[1] > q.finished]
        for bar, _, committer, issuer_vc in ready:
            self.engine.arrive(bar, committer, join_clocks(issuer_vc, vc))
        if q.waiting:
            self._start(unit, q)

    # ------------------------------------------------------------------ work
    def work(self, p, a: Op, spec):
        """Start ``a`` now, unless its unit works for another program: then ``p`` queues for
        the unit and starts when it is free."""
        p.state = "busy"
        if spec.unit and self.holder.get(spec.unit) is not None:
            self.line.setdefault(spec.unit, []).append((p, spec, self.engine.now))
            return
        self._work(p, spec)

    def _free(self, unit: str):
        """The unit finished: the longest-waiting program's work starts now."""
        self.holder[unit] = None
        if self.line.get(unit):
            q, spec, since = self.line[unit].pop(0)
            self.engine.spans.append(Span(q.name, f"{spec.kind} wait", since, self.engine.now,
                                          spec.step, note=self.pipe.units[unit]))
            self._work(q, spec)

    def _work(self, p, spec):
        e, now = self.engine, self.engine.now
        p.vc[p.name] += 1
        plan = self._accesses(spec, spec.who, p.name, p.name, p.vc[p.name], dict(p.vc), now)
        p.state = "busy"
        e.spans.append(Span(p.name, spec.kind, now, now + spec.duration, spec.step))
        self._mark(spec, now)
        if spec.unit:
            self.holder[spec.unit] = p
            e.spans.append(Span(spec.unit, spec.kind, now, now + spec.duration, spec.step,
                                lane=spec.lane))

        def end():
            self._complete(plan)
            if spec.unit:
                self._free(spec.unit)
            e.resume(p)
        e.at(now + spec.duration, end)
