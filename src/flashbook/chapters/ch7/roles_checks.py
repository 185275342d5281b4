"""Chapter 7, Exercise 4's check (``check_roles_schedule``: the student's ``KV_STAGES``, ``mma``
and ``correction`` with the chapter's other roles) and the Gantt chart of a run.
"""
from __future__ import annotations

from flashbook.check import CheckFailure, report, require_implemented
from flashbook.planning import B200

from .roles import Run, Timing, fa4_model, serial_model, simulate

__all__ = ["check_roles_schedule", "protocol_cases", "utilisation_cases", "steady_window",
           "steady_utilisation", "plot_schedule", "complete", "ran", "check_protocol",
           "TOLERANCE", "SMEM_LIMIT"]

TOLERANCE = 0.02                      # absolute, on a utilisation in [0, 1]
UTIL_STEPS = 14                       # key steps of a utilisation run
SMEM_LIMIT = B200.smem_per_block      # dynamic shared memory one block may use on sm_100


def protocol_cases(hidden: bool = False) -> list[tuple[int, int, Timing]]:
    """(stages, n_steps, timing). Visible: rings of 2, 3 and 1 slots, 1, 2 and 5 steps, a timing
    whose rescale outlasts the exp (a PV issued too early then overlaps it) and a balanced one.
    Hidden: rings of 1-4 slots, 1-9 steps, and a TMA-bound and a softmax-bound timing besides."""
    base = [Timing(exp=1.0, rescale=2.0), Timing()]
    if not hidden:
        return [(s, n, t) for t in base for s in (2, 3, 1) for n in (1, 2, 5)]
    timings = base + [Timing(tma=9, exp=1.0), Timing(tma=1, qk=0.5, pv=1.5, rowmax=1, exp=4,
                                                     rescale=0.5)]
    return [(s, n, t) for t in timings for s in (2, 3, 1, 4) for n in range(1, 10)]


def utilisation_cases(hidden: bool = False) -> list[Timing]:
    """Timings whose TMA latency a 2-slot ring hides: g = s (100%), a long MMA (100%), a
    rescale longer than the exp (88.9%); hidden: two bound by the exponential unit the softmax
    warpgroups share (57.1%, 75%), one by the correction (80%), and long MMAs with a long
    softmax (100%)."""
    cases = [Timing(), Timing(tma=4, qk=2, pv=2, exp=1), Timing(exp=1, rescale=2)]
    if hidden:
        cases += [Timing(tma=2, exp=3.5), Timing(exp=0.5, rescale=2.5),
                  Timing(tma=5, qk=1.5, pv=1.5, rowmax=1, exp=2),
                  Timing(tma=6, qk=2, pv=1, exp=4)]
    return cases


def _ring_fits(stages) -> None:
    from . import planner                          # pure Python: no Triton needed
    if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
        raise CheckFailure(f"KV_STAGES must be a positive int (slots of the K ring and of the V "
                           f"ring), got {stages!r}.")
    config = planner.Config(STAGES=stages).for_inputs(128, "float16")
    need = planner.shared_memory(config)
    if need > SMEM_LIMIT:
        tile = planner.tile_bytes(config, "k")
        raise CheckFailure(
            f"KV_STAGES = {stages}: two Q tiles and {stages} K and {stages} V tiles of "
            f"{config.BLOCK_N} x 128 16-bit values ({tile:,} bytes each) need {need:,} bytes of "
            f"shared memory with the barriers, more than the {SMEM_LIMIT:,} a block may use on "
            f"a B200. Each slot costs {2 * tile:,} bytes (a K tile and a V tile): take the "
            f"fewest that keep the tensor core busy.")


def complete(run: Run, what: str):
    """Every load, MMA, softmax step, rescale, finish and store of the run happened once."""
    n = run.n_steps
    want = [("load_q", t) for t in (0, 1)]
    want += [(f"load_{p}", j) for j in range(n) for p in "kv"]
    for t in (0, 1):
        want += [(k, t, j) for j in range(n) for k in ("QK", "PV", "rowmax", "exp")]
        want += [("rescale", t, j) for j in range(1, n)]
        want += [("rowsum", t), ("finish", t), ("store", t)]
    missing = [w for w in want if w not in run.done]
    if missing:
        names = ", ".join(f"{w[0]}({', '.join(map(str, w[1:]))})" for w in missing[:6])
        raise CheckFailure(f"{what}: the run ended without {names}"
                           f"{' and more' if len(missing) > 6 else ''}: every step of both Q "
                           f"tiles needs its QK and PV MMAs, and the correction rescales O_t for "
                           f"steps 1..n-1 and finishes both tiles.")


def _diagnose_slow(run: Run, t0: float, t1: float, stages: int) -> str:
    """Why the tensor core idled: what the MMA warp waited on most in the steady state."""
    names = dict.fromkeys(s.note.split("[")[0] for s in run.spans
                          if s.row == "MMA warp" and s.kind == "wait")
    waits = {name: run.blocked_time("MMA warp", name, t0, t1) for name in names}
    if not waits or max(waits.values()) <= 1e-9:
        return ""
    worst = max(waits, key=waits.get)
    text = (f" In that window the MMA warp waited {waits[worst]:g} time units on {worst}"
            + "".join(f", {v:g} on {k}" for k, v in sorted(waits.items()) if k != worst and v > 0)
            + ".")
    if worst in ("k_full", "v_full"):
        text += (f" The ring is too short: with {stages} slot(s) the load of K (V) of step "
                 f"j + {stages} can start only after the MMAs that read step j have finished, "
                 f"and the TMA latency is no longer hidden behind the MMAs of the steps in "
                 f"between, so the MMAs serialise behind the loads.")
    elif worst == "p_ready":
        text += (" The MMA warp waits for a softmax while the other tile's MMAs could run: "
                 "issue in the order QK0(j), PV1(j-1), QK1(j), PV0(j), so that one tile's "
                 "softmax runs under the other tile's MMAs.")
    elif worst == "o_ready":
        text += (" It waits for the correction: does the correction wait for something it does "
                 "not need before its rescale (the next step's data, the other tile)?")
    return text


def ran(run: Run, what: str) -> Run:
    """``run``, unless it stopped at a hazard: then a CheckFailure that quotes it."""
    if run.error is not None:
        raise CheckFailure(f"{what}:\n{run.error}")
    return run


def check_protocol(simulate_roles, cases, label: str) -> int:
    """Every case's run has no hazard and is ``complete``; returns how many cases ran."""
    for stages, n_steps, timing in cases:
        what = f"{label}, {stages}-slot rings, n_steps={n_steps}, timing ({timing.describe()})"
        complete(ran(simulate_roles(stages=stages, n_steps=n_steps, timing=timing), what), what)
    return len(cases)


def steady_window(run: Run, skip: int = 3) -> tuple[float, float]:
    """From the tensor core's QK0(skip) to its QK0(n_steps - skip): whole periods of the steady
    state, the fill and the drain left out."""
    starts = run.starts("tensor core", "QK", lane=0)
    a, b = skip, run.n_steps - skip
    if a not in starts or b not in starts or b <= a:
        raise CheckFailure(f"the run has no QK0 MMAs of steps {a} and {b} to measure the steady "
                           f"state between (n_steps={run.n_steps}).")
    return starts[a], starts[b]


def steady_utilisation(run: Run, skip: int = 3) -> float:
    return run.utilisation(*steady_window(run, skip))


def check_roles_schedule(KV_STAGES, mma, correction, hidden: bool = False):
    """Exercise 4: the five-role schedule is hazard-free and deadlock-free for every ring size,
    length and timing, and with ``KV_STAGES`` slots keeps the tensor core busy as the model
    says it can."""
    require_implemented(mma, "mma"), require_implemented(correction, "correction")
    _ring_fits(KV_STAGES)
    n = check_protocol(lambda **kw: simulate(mma, correction, **kw), protocol_cases(hidden),
                       "five roles")
    shown = None
    for timing in utilisation_cases(hidden):
        what = (f"tensor-core utilisation with KV_STAGES = {KV_STAGES}, timing "
                f"({timing.describe()})")
        run = ran(simulate(mma, correction, stages=KV_STAGES, n_steps=UTIL_STEPS, timing=timing),
                  what)
        t0, t1 = steady_window(run)
        u, want = run.utilisation(t0, t1), fa4_model(timing)
        if u < want - TOLERANCE:
            raise CheckFailure(
                f"{what}: the tensor core was busy {u:.1%} of the steady state (t={t0:g}.."
                f"{t1:g}), below the model's {want:.1%} = 2g / max(2g, g + rowmax + max(exp, "
                f"rescale), 2 rescale, 2 exp) with g = qk + pv = {timing.g:g} (one Q tile alone "
                f"would reach {serial_model(timing):.1%})."
                + _diagnose_slow(run, t0, t1, KV_STAGES))
        shown = shown or (u, timing)
        n += 1
    u, timing = shown
    report("five-role Blackwell schedule (no hazard, no deadlock, tensor-core utilisation at "
           "the model's bound)", n, hidden=hidden,
           extra=f" (g = s: tensor core busy {u:.0%} with KV_STAGES = {KV_STAGES})")


# ------------------------------------------------------------------------------ the picture
_COLORS = {"QK": "#3a6ea5", "PV": "#2a9d8f", "rowmax": "#e9c46a", "exp": "#f4a261",
           "exp wait": "#fbe3cf",
           "rowsum": "#e9c46a", "rescale": "#b5838d", "finish": "#6d597a", "store": "#8e7cc3",
           "load": "#8e7cc3", "wait": "#e3e3e3", "hazard": "#d62828"}
_LEGEND = (("QK", "QK MMA (S = Q K^T into TMEM)"), ("PV", "PV MMA (O += P V, P from TMEM)"),
           ("rowmax", "softmax: row max"), ("exp", "softmax: exp2, P into TMEM"),
           ("rescale", "correction: rescale O in TMEM"), ("finish", "correction: O / l"),
           ("load", "TMA load / store"), ("wait", "waiting on a barrier"),
           ("exp wait", "softmax: waiting for the exp unit"))
_ROWS = ("load warp", "TMA", "MMA warp", "tensor core", "exp unit", "softmax 0", "softmax 1",
         "correction", "epilogue warp")


def plot_schedule(*runs: Run, titles=None, t_max: float | None = None):
    """One panel per run: a row per role, the TMA unit (lanes Q, K, V), the tensor core and the
    exp unit (lanes: tile 0, 1); ▲ marks each MMA issued, a dashed line a hazard's stop."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if not runs:
        raise ValueError("plot_schedule needs at least one Run")
    titles = list(titles) if titles is not None else [None] * len(runs)
    end = t_max if t_max is not None else max(r.end for r in runs) or 1.0
    fig, axes = plt.subplots(len(runs), 1, figsize=(11, 4.3 * len(runs) + 0.6), sharex=True,
                             squeeze=False)
    lanes = {"TMA": 3, "tensor core": 2, "exp unit": 2}
    for ax, run, title in zip(axes[:, 0], runs, titles):
        y_of = {row: len(_ROWS) - 1 - i for i, row in enumerate(_ROWS)}
        for span in run.spans:
            if span.row not in y_of:
                continue
            if span.kind == "issue":
                ax.plot([span.start], [y_of["MMA warp"] - 0.25 + 0.5 * span.lane], marker="^",
                        color=_COLORS["QK" if span.note.startswith("QK") else "PV"],
                        markersize=4, zorder=4)
                continue
            n_lanes = lanes.get(span.row, 1)
            h = 0.8 / n_lanes
            y0 = y_of[span.row] + 0.4 - h * (span.lane + 1)
            width = span.end - span.start
            ax.broken_barh([(span.start, width)], (y0 + 0.03 * h, 0.94 * h),
                           facecolors=_COLORS.get(span.kind, "#cccccc"), edgecolors="white",
                           linewidth=0.5,
                           hatch="..." if span.kind in ("wait", "exp wait") else None,
                           zorder=2)
            if span.kind in ("QK", "PV") and width > 0.02 * end and span.end <= end:
                ax.text(span.start + width / 2, y0 + h / 2, f"{span.kind}{span.lane}"
                        f"({span.step})", ha="center", va="center", fontsize=5.5,
                        color="white", zorder=4)
        if run.error is not None:
            ax.axvline(run.error.time, color=_COLORS["hazard"], linestyle="--", linewidth=1.2,
                       zorder=5)
            ax.text(run.error.time, len(_ROWS) - 0.45, f" {run.error.kind}",
                    color=_COLORS["hazard"], fontsize=8, va="bottom", ha="left")
        labels = [{"TMA": "TMA (Q, K, V)", "tensor core": "tensor core (tile 0, 1)",
                   "exp unit": "exp unit, MUFU (tile 0, 1)"}.get(r, r) for r in _ROWS]
        ax.set_yticks([y_of[r] for r in _ROWS], labels)
        ax.set_ylim(-0.6, len(_ROWS) - 0.4)
        ax.set_xlim(0, end)
        ax.grid(axis="x", color="#eeeeee", zorder=0)
        ax.set_axisbelow(True)
        ax.spines[["top", "right"]].set_visible(False)
        if title is None:
            title = (f"{run.stages}-slot K and V rings, {run.n_steps} steps: tensor core busy "
                     f"{run.utilisation():.0%} from the first MMA to the last")
        ax.set_title(title, fontsize=10, loc="left")
    axes[-1, 0].set_xlabel("simulated time (time units)")
    handles = [Patch(facecolor=_COLORS[k], edgecolor="white",
                     hatch="..." if k in ("wait", "exp wait") else None, label=text)
               for k, text in _LEGEND]
    fig.legend(handles=handles, loc="lower center", ncol=5, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.07 if len(runs) == 1 else 0.04, 1, 1))
    return fig
