"""The engine of Chapter 7's five-role simulator: Chapter 6's event loop, barriers, deadlock
and protocol checks (``flashbook.pipeline_engine.Engine``), with the five roles' actions
plugged in: the tensor core as an in-order queue with commits, the SM's exponential unit (MUFU)
as one resource both softmax warpgroups queue for, the TMA, timed work, and every access to a
buffer checked for the hazards ``roles`` describes (read before ready, overwrite, race).
``RolePipeline.run`` is its entry."""
from __future__ import annotations

from flashbook.pipeline_engine import Engine, deadlock_text, join_clocks
from flashbook.pipeline_types import Action, Arrive, Hazard, Span, Wait

from .role_actions import (ROLE_NAMES, TILES, Access, Buffer, Commit, MmaIssue, RoleAction,
                           TmaCopy, Work, access_label, content_text)
from .role_run import RoleRun

__all__ = ["RoleEngine"]


# --------------------------------------------------------------------------------- the engine

def _who_prog(name: str) -> str:
    return {"load warp": "the load warp", "MMA warp": "the MMA warp",
            "correction": "the correction warpgroup",
            "epilogue warp": "the epilogue warp"}.get(name, name)


def _cap(text: str) -> str:
    return text[:1].upper() + text[1:]


def _t(x: float) -> str:
    return f"{x:g}"


class RoleEngine:
    """Chapter 6's engine (event loop, barriers, deadlock and protocol checks), with this
    module's ``resume`` and deadlock report plugged in."""

    def __init__(self, pipe, programs: dict):       # pipe: the roles.RolePipeline it runs
        self.pipe, self.t = pipe, pipe.timing
        unknown = [n for n in programs if n not in ROLE_NAMES]
        if unknown:
            raise ValueError(f"unknown role(s) {unknown}; the roles are {ROLE_NAMES}")
        self.core = Engine(pipe.core, programs)
        self.core.resume = self.resume                  # the five roles' actions
        self.core.deadlock_report = self.deadlock_report
        n = pipe.n_steps
        self.bufs: dict = {}
        for t in TILES:
            self.bufs[f"Q{t}"] = Buffer(f"Q{t}", "SMEM")
            self.bufs[f"S{t}"] = Buffer(f"S{t}", "TMEM")
            self.bufs[f"O{t}"] = Buffer(f"O{t}", "TMEM")
            self.bufs[f"m{t}"] = Buffer(f"m{t}", "TMEM")
            self.bufs[f"l{t}"] = Buffer(f"l{t}", "TMEM")
            self.bufs[f"Ostage{t}"] = self.bufs[f"Q{t}"]     # O is staged in Q_t's tile
        for s in range(pipe.stages):
            self.bufs[f"K[{s}]"] = Buffer(f"K[{s}]", "SMEM")
            self.bufs[f"V[{s}]"] = Buffer(f"V[{s}]", "SMEM")
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
        # the SM's exponential unit: one exp (a tile's exponentials) at a time, first come first
        # served; the other softmax warpgroup's exp waits in the queue
        self.exp_busy = None               # the softmax program holding it
        self.exp_queue: list = []          # [(program, action, since), ...]

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
            if not isinstance(a, Action) or a.pipe is not self.pipe.core:
                raise Hazard("protocol", core.now, (
                    f"{_cap(_who_prog(p.name))} yielded {a!r}, not an action of its pipeline "
                    "(yield pipe.wait(...), pipe.arrive(...), pipe.commit(...), pipe.qk(...), "
                    "..."))
            a.yielded = True
            if isinstance(a, Wait):
                if not core.do_wait(p, a):
                    return
            elif isinstance(a, Arrive):
                core.check_barrier(p, a.bar, a)
                p.vc[p.name] += 1
                core.arrive(a.bar, p.name, p.vc)
            elif isinstance(a, RoleAction):
                self.check_owner(p, a)
                if isinstance(a, TmaCopy):
                    self.do_tma(p, a)
                elif isinstance(a, MmaIssue):
                    self.do_mma(p, a)
                elif isinstance(a, Commit):
                    self.do_commit(p, a)
                elif isinstance(a, Work):
                    self.do_work(p, a)
                    return
            else:
                raise Hazard("protocol", core.now, f"{_cap(_who_prog(p.name))} yielded {a}, "
                             "which is a Chapter 6 action: the Blackwell roles load with "
                             "pipe.load_q/load_k/load_v and issue MMAs with pipe.qk/pipe.pv.")

    def check_owner(self, p, a: RoleAction):
        owner = a.owner
        if p.name != owner:
            raise Hazard("protocol", self.core.now, (
                f"{_cap(_who_prog(p.name))} yielded {a}, which only {_who_prog(owner)} does "
                "(each role has its own actions: the load warp loads, the MMA warp issues MMAs "
                "and commits, softmax t works on tile t, the correction rescales and finishes, "
                "the epilogue warp stores)."))
        n = self.n
        tile = getattr(a, "tile", 0) if not isinstance(a, TmaCopy) else \
            (a.index if a.part == "Q" else 0)
        if tile not in TILES:
            raise Hazard("protocol", self.core.now, f"{_cap(_who_prog(p.name))}: {a}: the Q "
                         "tiles are 0 and 1.")
        step = a.step if isinstance(a, (MmaIssue, Work)) else \
            (a.index if isinstance(a, TmaCopy) and a.part != "Q" else None)
        if step is not None and not (isinstance(step, int) and 0 <= step < n):
            raise Hazard("protocol", self.core.now, f"{_cap(_who_prog(p.name))}: {a}: the key "
                         f"steps are 0..{n - 1}.")
        if isinstance(a, Work) and a.kind == "rescale" and step == 0:
            raise Hazard("protocol", self.core.now, f"{_cap(_who_prog(p.name))}: rescale"
                         f"({a.tile}, 0): step 0 has nothing to rescale (PV of step 0 "
                         "overwrites O); rescales are for steps 1..n_steps-1.")
        if isinstance(a, (MmaIssue, Work)) or (isinstance(a, TmaCopy)):
            key = (str(a).split("(")[0],) + ((a.part, a.index) if isinstance(a, TmaCopy) else
                                             (a.tile, a.step))
            if key in self.issued:
                raise Hazard("protocol", self.core.now, f"{_cap(_who_prog(p.name))} issued {a} "
                             f"a second time (first at t={_t(self.issued[key])}): every "
                             "action of a step happens once.")
            self.issued[key] = self.core.now
        if isinstance(a, (TmaCopy, Commit)):
            self.core.check_barrier(p, a.bar, a)

    # ---------------------------------------------------------------- buffer accesses
    def access(self, buf: Buffer, acc: Access, expect=None, new=None, need=()):
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

    def complete(self, buf: Buffer, acc: Access, new=None, need=()):
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
    def _buf_text(self, buf: Buffer) -> str:
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

    def _hint(self, buf: Buffer, acc: Access, expect, have) -> str:
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

    def content_text(self, buf: Buffer, acc: Access, expect) -> str:
        have = buf.content
        w = buf.write
        by = f" (written by {w.who} at t={_t(w.end)})" if w else ""
        return (f"{_cap(acc.who)} reads {self._buf_text(buf)} expecting "
                f"{content_text(expect)}, but it holds {content_text(have)}{by}."
                + self._hint(buf, acc, expect, have))

    def unordered_text(self, buf: Buffer, acc: Access, prior: Access, what: str) -> str:
        kind = "wrote" if "w" in prior.mode else "read"
        verb = "reads" if what == "read" else "writes"
        noun = "write" if kind == "wrote" else "read"
        return (f"{_cap(acc.who)} {verb} {self._buf_text(buf)}, which {prior.who} {kind} at "
                f"t={_t(prior.start)}, but no barrier orders that {noun} before this {what}: the "
                f"timing of this run hid it, another run's would not."
                + self._hint(buf, acc, buf.content, buf.content))

    def unread_text(self, buf: Buffer, acc: Access, new) -> str:
        missing = ", ".join(sorted(buf.need - {acc.label}))
        return (f"{_cap(acc.who)} overwrites {self._buf_text(buf)}, which holds "
                f"{content_text(buf.content)}, before {missing} read it."
                + self._hint(buf, acc, new, buf.content))

    def race_text(self, buf: Buffer, acc: Access, other: Access) -> str:
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
        finished = {_who_prog(n): t for n, t in self.core.finished.items()}
        return deadlock_text(
            "role", stuck, _who_prog, finished,
            ". Every phase someone waits for needs its arrival: an arrive by a role, a commit "
            "by the MMA warp (after the MMAs it covers), or a landed TMA copy.")

    # ---------------------------------------------------------------- TMA (load warp)
    def do_tma(self, p, a: TmaCopy):
        core, now = self.core, self.core.now
        if a.part == "Q":
            buf, content, need = self.bufs[f"Q{a.index}"], ("Q", a.index), ()
        else:
            s = self.pipe.slot(a.index)
            buf = self.bufs[f"{a.part}[{s}]"]
            content = (a.part, a.index)
            mma = "QK" if a.part == "K" else "PV"
            need = (access_label(mma, 0, a.index), access_label(mma, 1, a.index))
        self.tma_count += 1
        key = ("TMA", self.tma_count)
        p.vc[p.name] += 1
        vc = dict(p.vc)
        vc[key] = 1
        acc = Access(f"the TMA load of {content_text(content)}", "TMA", key, 1, "w", now,
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
    def do_mma(self, p, a: MmaIssue):
        p.vc[p.name] += 1
        self.issued_ops += 1
        self.tc_queue.append((a, dict(p.vc), self.core.now))
        if self.tc_busy is None:
            self.tc_start()

    def do_commit(self, p, a: Commit):
        p.vc[p.name] += 1
        vc = dict(p.vc)
        if self.finished_ops == self.issued_ops:
            self.core.arrive(a.bar, p.name, join_clocks(vc, self.tc_vc))
        else:
            self.commits.append((a.bar, self.issued_ops, vc))

    def tc_start(self):
        core, now = self.core, self.core.now
        a, issue_vc, issued_at = self.tc_queue.pop(0)
        self.tc_clock += 1
        vc = join_clocks(issue_vc, self.tc_vc)
        vc["tensor core"] = self.tc_clock
        dur = self.t.qk if a.kind == "QK" else self.t.pv
        t, j = a.tile, a.step
        who = f"the MMA warp's {a.label} (issued at t={_t(issued_at)})"

        def acc(mode):
            return Access(who, "tensor core", "tensor core", self.tc_clock, mode, now,
                           now + dur, label=a.label, vc=vc)
        plan = []
        if a.kind == "QK":
            plan.append((self.bufs[f"Q{t}"], acc("r"), ("Q", t), None, ()))
            plan.append((self.bufs[f"K[{self.pipe.slot(j)}]"], acc("r"), ("K", j), None, ()))
            plan.append((self.bufs[f"S{t}"], acc("w"), None, ("S", j), (access_label("rowmax", t, j),)))
        else:
            plan.append((self.bufs[f"S{t}"], acc("r"), ("P", j), None, ()))
            plan.append((self.bufs[f"V[{self.pipe.slot(j)}]"], acc("r"), ("V", j), None, ()))
            nxt = (access_label("rescale", t, j + 1),) if j + 1 < self.n else (access_label("finish", t),)
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
            self.core.arrive(bar, "MMA warp", join_clocks(issuer_vc, vc))
        if self.tc_queue:
            self.tc_start()

    # ---------------------------------------------------------------- timed work
    def do_work(self, p, a: Work):
        """Start ``a`` now, except an exp while the exponential unit works for the other
        softmax warpgroup: then ``p`` queues for the unit and starts when it is free."""
        p.state = "busy"
        if a.kind == "exp" and self.exp_busy is not None:
            self.exp_queue.append((p, a, self.core.now))
            return
        self.start_work(p, a)

    def exp_unit_free(self):
        """The exponential unit finished an exp: the longest-waiting softmax exp starts now."""
        self.exp_busy = None
        if self.exp_queue:
            q, a, since = self.exp_queue.pop(0)
            self.core.spans.append(Span(q.name, "exp wait", since, self.core.now, a.step,
                                        note="the exponential unit"))
            self.start_work(q, a)

    def start_work(self, p, a: Work):
        core, now = self.core, self.core.now
        t, j, n = a.tile, a.step, self.n
        dur = {"rowmax": self.t.rowmax, "exp": self.t.exp, "rowsum": self.t.rowsum,
               "rescale": self.t.rescale, "finish": self.t.finish, "store": self.t.store}[a.kind]
        p.vc[p.name] += 1
        stamp = p.vc[p.name]
        vc = dict(p.vc)
        label = access_label(a.kind, t, j)
        who = f"{_who_prog(p.name)}'s {a}"

        def acc(mode):
            return Access(who, p.name, p.name, stamp, mode, now, now + dur, label=label, vc=vc)
        B = self.bufs
        plan = []
        if a.kind == "rowmax":
            plan.append((B[f"S{t}"], acc("r"), ("S", j), None, ()))
            plan.append((B[f"m{t}"], acc("w"), None, ("m", j),
                         (access_label("rescale", t, j),) if j > 0 else ()))
        elif a.kind == "exp":
            plan.append((B[f"S{t}"], acc("w"), None, ("P", j), (access_label("PV", t, j),)))
        elif a.kind == "rowsum":
            plan.append((B[f"l{t}"], acc("w"), None, ("l",), (access_label("finish", t),)))
        elif a.kind == "rescale":
            plan.append((B[f"m{t}"], acc("r"), ("m", j), None, ()))
            plan.append((B[f"O{t}"], acc("rw"), ("O", j - 1), ("O~", j), (access_label("PV", t, j),)))
        elif a.kind == "finish":
            plan.append((B[f"l{t}"], acc("r"), ("l",), None, ()))
            plan.append((B[f"O{t}"], acc("r"), ("O", n - 1), None, ()))
            plan.append((B[f"Ostage{t}"], acc("w"), None, ("out", t), (access_label("store", t),)))
        else:                                              # store
            plan.append((B[f"Ostage{t}"], acc("r"), ("out", t), None, ()))
        if a.kind == "exp":
            # P is written in place of S: softmax must still hold S of this step (it read it in
            # rowmax), i.e. nobody overwrote S in between
            s_buf = B[f"S{t}"]
            if s_buf.content != ("S", j):
                raise Hazard("overwrite" if self.newer(s_buf.content, ("S", j)) else "dataflow",
                             now, f"Softmax {t}'s exp({t}, {j}) writes P in place of S of step "
                             f"{j}, but S_{t} holds {content_text(s_buf.content)}: softmax "
                             f"runs rowmax({t}, {j}) first, and nothing may overwrite S_{t} "
                             "before P is written.")
        for buf, x, expect, _, _ in plan:
            self.access(buf, x, expect)
        p.state = "busy"
        core.spans.append(Span(p.name, a.kind, now, now + dur, j if j is not None else None))
        self.done[(a.kind, t) + ((j,) if j is not None else ())] = (now, now + dur)
        if a.kind == "exp":
            self.exp_busy = p
            core.spans.append(Span("exp unit", "exp", now, now + dur, j, lane=t))

        def end():
            for buf, x, _, new, need in plan:
                self.complete(buf, x, new, need)
            if a.kind == "exp":
                self.exp_unit_free()
            self.core.resume(p)
        core.at(now + dur, end)


