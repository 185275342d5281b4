"""Chapter 6, Exercise 2's graded checks and its Gantt chart (``pipeline`` runs the schedules).

``check_ring_protocol`` (2a) runs the student's ``make_barriers`` and ``producer`` with the
check's own ``given_consumer``, so 2a is graded on its own; ``check_pingpong`` (2b) runs the
student's consumer too, then compares the steady-state tensor-core utilisation (fill and drain
left out) with the FA3 model: min(1, 2g/(g+s)) with two consumers taking turns, g/(g+s) with
one, and no two GEMMs sharing the tensor cores with ping-pong.
"""
from __future__ import annotations

from flashbook.check import CheckFailure, report, require_implemented

from .pipeline import Run, Timing, lockstep_model, pingpong_model, simulate, single_model

# (consumers, ping-pong): FA3's two consumers taking turns, the same two without a schedule (the
# ring alone must be right), and one consumer (FA2's single warpgroup)
MODES = ((2, True), (2, False), (1, False))
TOLERANCE = 0.02            # absolute, on a utilisation in [0, 1]
PINGPONG_STAGES, PINGPONG_STEPS = 3, 14


def _mode(consumers: int, pingpong: bool) -> str:
    if consumers == 1:
        return "one consumer"
    return "two consumers, " + ("ping-pong" if pingpong else "no ping-pong")


def ring_cases(hidden: bool = False) -> list[tuple[int, int, Timing]]:
    """(stages, n_steps, timing): visible 3 ring sizes x 3 lengths; hidden also 1..9 steps, and
    a TMA-bound and a GEMM-bound timing over fewer steps than, as many as and past the ring."""
    balanced = Timing(tma=3, qk=1, pv=1, softmax=2)
    if not hidden:
        return [(s, n, balanced) for s in (2, 3, 4) for n in (1, 4, 9)]
    skewed = (Timing(tma=9, qk=1, pv=1, softmax=1), Timing(tma=1, qk=2, pv=3, softmax=0.5))
    return [(s, n, balanced) for s in (2, 3, 4) for n in range(1, 10)] + \
        [(s, n, t) for t in skewed for s in (2, 3, 4) for n in (1, 2, 3, 5, 8)]


def pingpong_cases(hidden: bool = False) -> list[Timing]:
    """Timings whose TMA never limits a 3-stage ring: g = s, s > g and s < g."""
    cases = [Timing(tma=2, qk=1, pv=1, softmax=2),        # g = s: 100% against 50%
             Timing(tma=2, qk=1, pv=1, softmax=4),        # 67% against 33%
             Timing(tma=2, qk=2, pv=2, softmax=1)]        # 100% against 80%
    if hidden:
        cases += [Timing(tma=2, qk=1, pv=2, softmax=3), Timing(tma=3, qk=0.5, pv=1.5, softmax=6),
                  Timing(tma=1, qk=3, pv=1, softmax=4.5), Timing(tma=4, qk=1.5, pv=1.5, softmax=3)]
    return cases


def given_consumer(pipe, wg, full, consumed, turn=None):
    """2a's consumer: each step whole (QK, softmax, PV) before its slot is released; with
    ``turn`` the two take whole steps in turn, so one releases a slot a step before the other
    reads it (a consumed barrier that completes on one release refills it under the slower)."""
    for step in range(pipe.n_steps):
        slot = pipe.slot(step)
        yield pipe.wait(full[slot], pipe.phase(step))
        if turn is not None:
            yield pipe.wait(turn[wg], (step + wg + 1) % 2)
        yield pipe.qk(step)
        yield pipe.softmax(step)
        yield pipe.pv(step)
        yield pipe.arrive(consumed[slot])            # done with the slot: K and V read
        if turn is not None:
            yield pipe.arrive(turn[1 - wg])


def _complete(run: Run, what: str):
    """Every step loaded once (K and V), every consumer's QK, softmax and PV of it once."""
    for part in ("K", "V"):
        loads = [w.step for w in run.writes if w.part == part]
        if sorted(loads) != list(range(run.n_steps)):
            raise CheckFailure(f"{what}: the producer loaded {part} of steps {sorted(loads)}, "
                               f"not each of 0..{run.n_steps - 1} once.")
    for wg in range(run.consumers):
        who = f"consumer {wg}"
        for kind in ("QK", "softmax", "PV"):
            steps = sorted(s.step for s in run.spans if s.row == who and s.kind == kind)
            if steps != list(range(run.n_steps)):
                missing = sorted(set(range(run.n_steps)) - set(steps))
                raise CheckFailure(f"{what}: {who} finished without its {kind} of step(s) "
                                   f"{missing}: every consumer processes every step (QK, softmax, "
                                   f"PV), the last PV in a final GEMM block after the loop's "
                                   f"last step.")


def _protocol(make_barriers, producer, consumer, hidden: bool, whose: str) -> int:
    """Every ring case in every mode: no hazard, no deadlock, every step consumed. Returns the
    number of runs."""
    for stages, n_steps, timing in ring_cases(hidden):
        for consumers, pingpong in MODES:
            what = (f"ring protocol, stages={stages}, n_steps={n_steps}, "
                    f"{_mode(consumers, pingpong)}, timing ({timing.describe()}){whose}")
            run = simulate(make_barriers, producer, consumer, stages=stages, n_steps=n_steps,
                           consumers=consumers, pingpong=pingpong, timing=timing)
            if run.error is not None:
                hint = ""
                if run.error.kind == "deadlock" and consumers == 1:
                    hint = ("\n(With one consumer: does each consumed barrier expect "
                            "pipe.consumers arrivals?)")
                raise CheckFailure(f"{what}:\n{run.error}{hint}")
            _complete(run, what)
    return len(ring_cases(hidden)) * len(MODES)


def check_ring_protocol(make_barriers, producer, hidden: bool = False):
    """Exercise 2a: the ring's protocol is hazard- and deadlock-free for every case and mode,
    with the check's own consumers (``given_consumer``)."""
    require_implemented(make_barriers, "make_barriers")
    require_implemented(producer, "producer")
    n = _protocol(make_barriers, producer, given_consumer, hidden,
                  " (the check's own consumers: each takes whole steps, in turn)")
    report("pipeline ring protocol (no hazard, no deadlock, every step consumed once by every "
           "consumer)", n, hidden=hidden)


def steady_window(run: Run, skip: int = 3) -> tuple[float, float]:
    """From consumer 0's QK of step ``skip`` to its QK of step n_steps - skip: whole periods of
    the steady state."""
    starts = run.starts("consumer 0", "QK")
    a, b = skip, run.n_steps - skip
    if a not in starts or b not in starts or b <= a:
        raise CheckFailure(f"the run has no QK GEMMs of steps {a} and {b} on consumer 0 to "
                           f"measure the steady state between (n_steps={run.n_steps}).")
    return starts[a], starts[b]


def steady_utilisation(run: Run, skip: int = 3) -> float:
    return run.utilisation(*steady_window(run, skip))


def _pingpong_case(make_barriers, producer, consumer, t: Timing) -> tuple[float, float]:
    g, s = t.gemm, t.softmax
    what = f"ping-pong, g = qk + pv = {g:g}, s = {s:g} (timing {t.describe()})"
    kw = dict(stages=PINGPONG_STAGES, n_steps=PINGPONG_STEPS, timing=t)
    two = simulate(make_barriers, producer, consumer, consumers=2, pingpong=True, **kw)
    if two.error is not None:
        raise CheckFailure(f"{what}, two consumers:\n{two.error}")
    t0, t1 = steady_window(two)
    u, want = two.utilisation(t0, t1), pingpong_model(g, s)
    shared = two.shared()
    if shared or abs(u - want) > TOLERANCE:
        msg = (f"{what}: with two consumers the tensor cores were busy {u:.1%} of the steady "
               f"state (t={t0:g}..{t1:g}), but two warpgroups taking turns keep them busy "
               f"min(1, 2g/(g+s)) = {want:.1%}.")
        if shared:
            first = shared[0]
            msg += (f" The two consumers' GEMMs shared the tensor core (first at "
                    f"t={first.start:g}..{first.end:g}: {first.note}): they issue their GEMMs "
                    f"together, each runs at half speed, and then both run their softmax while "
                    f"the tensor cores idle; two warpgroups in lockstep reach only "
                    f"2g/(2g+s) = {lockstep_model(g, s):.1%}. Each consumer must wait for its "
                    f"turn before its GEMM block and pass the turn right after it.")
        else:
            msg += (" A turn is one GEMM block (the PV GEMM of step k-1, then the QK GEMM of "
                    "step k); pass the turn right after it, before the softmax, so the other "
                    "warpgroup's GEMMs run during this one's softmax.")
        raise CheckFailure(msg)
    one = simulate(make_barriers, producer, consumer, consumers=1, pingpong=False, **kw)
    if one.error is not None:
        raise CheckFailure(f"{what}, one consumer:\n{one.error}")
    u1, want1 = steady_utilisation(one), single_model(g, s)
    if abs(u1 - want1) > TOLERANCE:
        raise CheckFailure(f"{what}: one consumer kept the tensor cores busy {u1:.1%} of the "
                           f"steady state, but a single warpgroup alternating GEMM and softmax "
                           f"keeps them busy g/(g+s) = {want1:.1%}: does it wait for anything "
                           f"besides its data?")
    return u, u1


def check_pingpong(make_barriers, producer, consumer, hidden: bool = False):
    """Exercise 2b: the student's consumer keeps the ring protocol, and the steady-state
    utilisation follows the FA3 model (module docstring)."""
    require_implemented(make_barriers, "make_barriers")
    require_implemented(producer, "producer")
    require_implemented(consumer, "consumer")
    _protocol(make_barriers, producer, consumer, hidden, ", your consumer")
    cases = pingpong_cases(hidden)
    results = [_pingpong_case(make_barriers, producer, consumer, t) for t in cases]
    (u2, u1) = results[0]
    report("ping-pong tensor-core utilisation", len(cases),
           extra=f" (g = s: {u2:.0%} with two consumers taking turns, {u1:.0%} with one)",
           hidden=hidden)


# ------------------------------------------------------------------------------ the picture

_COLORS = {"QK": "#3a6ea5", "PV": "#2a9d8f", "softmax": "#f4a261", "wait": "#e3e3e3",
           "load": "#8e7cc3", "shared": "#d62828"}
_LEGEND = (("QK", "QK GEMM (reads K)"), ("PV", "PV GEMM (reads V)"), ("softmax", "softmax"),
           ("wait", "waiting on a barrier"), ("load", "TMA load (K and V)"),
           ("shared", "GEMMs sharing the tensor cores"))


def _rows(run: Run) -> list[str]:
    return ["producer", "TMA"] + [f"consumer {i}" for i in range(run.consumers)] + ["tensor core"]


def _title(run: Run) -> str:
    mode = _mode(run.consumers, run.pingpong)
    return (f"{mode}, {run.stages}-stage ring, {run.n_steps} steps: tensor cores busy "
            f"{run.utilisation():.0%} from the first GEMM to the last")


def _label(span, width: float, t_span: float) -> str:
    if span.step is None:
        return span.note if span.kind == "wait" and width > 0.08 * t_span else ""
    text = {"QK": f"QK{span.step}", "PV": f"PV{span.step}", "softmax": f"S{span.step}",
            "load": f"{span.step}"}.get(span.kind, "")
    return text if width > 0.018 * t_span * max(1, len(text) / 3) else ""


def plot_gantt(*runs: Run, titles=None, unit: str | None = None, t_max: float | None = None):
    """One panel per run: a row per warpgroup, the TMA unit (a lane per ring slot) and the
    tensor cores (a lane per consumer: shared GEMMs show as two bars at once); a hazard is
    marked where the run stopped. ``unit`` names the time axis's unit. Returns the figure."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if not runs:
        raise ValueError("plot_gantt needs at least one Run")
    titles = list(titles) if titles is not None else [None] * len(runs)
    heights = [len(_rows(r)) for r in runs]
    fig, axes = plt.subplots(len(runs), 1, figsize=(11, 0.5 * sum(heights) + 0.9 * len(runs) + 0.6),
                             sharex=True, squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    end = t_max if t_max is not None else max(r.end for r in runs) or 1.0
    if t_max is None and any(r.error is not None for r in runs):
        end *= 1.06                              # room for the hazard's label
    for ax, run, title in zip(axes[:, 0], runs, titles):
        rows = _rows(run)
        y_of = {row: len(rows) - 1 - i for i, row in enumerate(rows)}
        lanes = {"TMA": run.stages, "tensor core": run.consumers}
        for span in run.spans:
            if span.row not in y_of:
                continue
            n_lanes = lanes.get(span.row, 1)
            h, width = 0.8 / n_lanes, span.end - span.start
            if span.kind == "shared":             # both lanes, outlined
                ax.broken_barh([(span.start, width)], (y_of[span.row] - 0.4 - 0.05, 0.8 + 0.1),
                               facecolors="none", edgecolors=_COLORS["shared"], hatch="////",
                               linewidth=1.0, zorder=3)
                continue
            y0 = y_of[span.row] + 0.4 - h * (span.lane + 1)
            ax.broken_barh([(span.start, width)], (y0 + 0.03 * h, 0.94 * h),
                           facecolors=_COLORS[span.kind], edgecolors="white", linewidth=0.6,
                           hatch="..." if span.kind == "wait" else None, zorder=2)
            text = _label(span, width, end)
            if text:
                ax.text(span.start + width / 2, y0 + h / 2, text, ha="center", va="center",
                        fontsize=7 if n_lanes == 1 else 6, zorder=4,
                        color="black" if span.kind in ("softmax", "wait") else "white")
        for w in run.writes:                     # the producer's issue of each TMA
            if w.part == run.writes[0].part:
                ax.plot([w.issue], [y_of["producer"]], marker="v", color=_COLORS["load"],
                        markersize=5, zorder=4)
        if run.error is not None:
            ax.axvline(run.error.time, color=_COLORS["shared"], linestyle="--", linewidth=1.2,
                       zorder=5)
            ax.text(run.error.time, len(rows) - 0.45, f" {run.error.kind}", color=_COLORS["shared"],
                    fontsize=8, va="bottom", ha="left")
        labels = [f"TMA (slots 0-{run.stages - 1})" if r == "TMA" else
                  "tensor cores" if r == "tensor core" else r for r in rows]
        ax.set_yticks([y_of[r] for r in rows], labels)
        ax.set_ylim(-0.6, len(rows) - 0.4)
        ax.set_xlim(0, end)
        ax.grid(axis="x", color="#eeeeee", zorder=0)
        ax.set_axisbelow(True)
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
        ax.set_title(title if title is not None else _title(run), fontsize=10, loc="left")
    axes[-1, 0].set_xlabel(f"time ({unit})" if unit else "simulated time (time units)")
    handles = [Patch(facecolor=_COLORS[k] if k != "shared" else "none",
                     edgecolor=_COLORS["shared"] if k == "shared" else "white",
                     hatch="////" if k == "shared" else ("..." if k == "wait" else None), label=t)
               for k, t in _LEGEND]
    fig.legend(handles=handles, loc="lower center", ncol=3, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.09 if len(runs) == 1 else 0.06, 1, 1))
    return fig
