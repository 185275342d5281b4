"""Chapter 7, Exercise 1: a tensor-memory (TMEM) column map for the Blackwell forward kernel, its
rules (``problems``), the check and a picture. A plan is ``(alloc_cols, {name: (first column,
width)})`` for ``NAMES``, in TMEM's 512 columns of 32 bits (a lane per row of a 128-row tile).
"""
from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.patches import Rectangle

from flashbook.check import CheckFailure, report, require_implemented, run_student
from flashbook.planning import TMEM_COLUMNS as COLUMNS, tmem_alloc

GRANULE = 32
NAMES = ("S0", "S1", "O0", "O1", "P0", "P1", "stats0", "stats1")
ALIASES = {"P0": "S0", "P1": "S1", "stats0": "S0", "stats1": "S1"}

# The example's fixed map (d <= 128; it always allocates all 512 columns).
SEED_MAP = (512, {"S0": (0, 128), "S1": (128, 128), "O0": (256, 128), "O1": (384, 128),
                  "P0": (32, 64), "P1": (160, 64), "stats0": (0, 2), "stats1": (128, 2)})


def widths(head_dim: int, block_n: int = 128, p_bits: int = 16) -> dict[str, int]:
    """The columns each buffer needs."""
    return {"S0": block_n, "S1": block_n, "O0": head_dim, "O1": head_dim,
            "P0": block_n * p_bits // 32, "P1": block_n * p_bits // 32, "stats0": 2, "stats1": 2}


def problems(plan, head_dim: int, block_n: int = 128, p_bits: int = 16) -> list[str]:
    """Every rule the plan breaks, as sentences ([] for a valid plan). The first word of each
    names the rule: shape, widths, misaligned, allocation, overflow, alias, overlap."""
    if not (isinstance(plan, tuple) and len(plan) == 2 and isinstance(plan[1], dict)):
        return [f"shape: return (alloc_cols, {{name: (column, width)}}), got {type(plan).__name__}"]
    alloc, cols = plan
    if set(cols) != set(NAMES):
        return [f"shape: the map must name exactly {', '.join(NAMES)}; got {sorted(cols)}"]
    cols = {n: tuple(int(x) for x in cols[n]) for n in NAMES}
    want = widths(head_dim, block_n, p_bits)
    out = [f"widths: {n} is {cols[n][1]} columns wide, it needs {want[n]}"
           for n in NAMES if cols[n][1] != want[n]]
    out += [f"misaligned: {n} starts at column {c}, not on a {GRANULE}-column boundary"
            for n, (c, _) in cols.items() if c % GRANULE]
    least = tmem_alloc(2 * block_n + 2 * head_dim)
    if not (isinstance(alloc, int) and alloc >= GRANULE and alloc & (alloc - 1) == 0):
        out.append(f"allocation: {alloc} columns is not a power of two >= {GRANULE} "
                   "(tcgen05.alloc hands out 32, 64, 128, 256 or 512)")
    elif alloc != least:
        out.append(f"allocation: {alloc} columns, but {least} is the "
                   "smallest power of two this shape needs (2 S + 2 O side by side): keep the "
                   "rest for another CTA on the SM")
    top = min(alloc, COLUMNS) if isinstance(alloc, int) else COLUMNS
    out += [f"overflow: {n} occupies columns {c}-{c + w - 1}, past the {top} columns "
            f"allocated" + (" (TMEM has 512)" if c + w > COLUMNS else "")
            for n, (c, w) in cols.items() if c < 0 or c + w > top]
    for n, host in ALIASES.items():
        c, w = cols[n]
        hc, hw = cols[host]
        if not (hc <= c and c + w <= hc + hw):
            out.append(f"alias: {n} (columns {c}-{c + w - 1}) must lie inside {host} (columns "
                       f"{hc}-{hc + hw - 1}): the softmax writes it over the scores it has read")
    for i, a in enumerate(NAMES):
        for b in NAMES[i + 1:]:
            if ALIASES.get(a) == b or ALIASES.get(b) == a:
                continue
            if cols[a][0] < sum(cols[b]) and cols[b][0] < sum(cols[a]):
                out.append(f"overlap: {a} (columns {cols[a][0]}-{sum(cols[a]) - 1}) and {b} "
                           f"(columns {cols[b][0]}-{sum(cols[b]) - 1}) share columns")
    return out


def _cases(hidden: bool):
    # (head_dim, block_n, p_bits, fits)
    cases = [(128, 128, 16, True), (64, 128, 16, True), (256, 128, 16, False),
             (32, 64, 8, True)]                     # the smallest allocation that holds it
    if hidden:
        cases += [(32, 128, 8, True), (64, 64, 16, True), (128, 64, 16, True),
                  (128, 128, 8, True), (256, 64, 16, False)]
    return cases


def check_tmem_plan(plan_tmem, hidden: bool = False):
    """Exercise 1: ``plan_tmem(head_dim, block_n, p_bits)`` returns a valid map for every shape
    that fits in 512 columns and raises a ValueError that mentions 512 for one that does not."""
    require_implemented(plan_tmem, "plan_tmem")
    n = 0
    for d, bn, bits, fits in _cases(hidden):
        what = f"plan_tmem(head_dim={d}, block_n={bn}, p_bits={bits})"
        if not fits:
            need = 2 * bn + 2 * d
            try:
                plan = run_student(plan_tmem, d, bn, bits, what=what, passthrough=(ValueError,))
            except ValueError as e:
                if "512" not in str(e):
                    raise CheckFailure(f"{what}: the ValueError should say the map needs more "
                                       f"than 512 columns; got: {e}") from None
                n += 1
                continue
            raise CheckFailure(f"{what}: two S tiles and two O accumulators need {need} "
                               f"columns, more than TMEM's 512; raise a ValueError saying so "
                               f"(got the plan {plan}).")
        plan = run_student(plan_tmem, d, bn, bits, what=what)
        found = problems(plan, d, bn, bits)
        if found:
            raise CheckFailure(f"{what}: the map breaks {len(found)} rule(s):\n  - "
                               + "\n  - ".join(found) + f"\n  Your map: {plan}")
        n += 1
    report("TMEM column map", n, hidden=hidden)


# -------------------------------------------------------------------------- picture
_COLORS = {"S": "#9ecae1", "O": "#fdae6b", "P": "#31a354", "stats": "#d62728"}


def plot_tmem(plan, title: str = "", head_dim: int | None = None):
    """Columns 0-511 left to right, in two tracks: the S and O buffers, and below them what
    aliases the S tiles (P and the row statistics). Every buffer spans all 128 lanes (one lane
    per query row); the allocation is outlined."""
    alloc, cols = plan
    fig, ax = plt.subplots(figsize=(10, 2.5))
    tracks = {False: (1.1, 0.8), True: (0.1, 0.8)}             # aliased -> (y, height)
    ax.add_patch(Rectangle((0, 0.0), COLUMNS, 2.0, fc="#f4f4f4", ec="0.7"))
    ax.add_patch(Rectangle((0, 0.0), alloc, 2.0, fc="none", ec="black", lw=2, ls="--"))
    for name, (c, w) in cols.items():
        kind = name.rstrip("01")
        y, h = tracks[name in ALIASES]
        ax.add_patch(Rectangle((c, y), w, h, fc=_COLORS[kind], ec="black", lw=0.8,
                               hatch="//" if name in ALIASES else None, alpha=0.85))
        label = name if kind != "stats" else f"m,l{name[-1]}"
        ax.text(c + w / 2 if w > 16 else c + w + 2, y + h / 2, label, fontsize=9,
                ha="center" if w > 16 else "left", va="center")
    ax.set_xlim(0, COLUMNS)
    ax.set_ylim(0, 2.0)
    ax.set_xticks(range(0, COLUMNS + 1, 32), [str(c) if c % 64 == 0 else "" for c in
                                              range(0, COLUMNS + 1, 32)])
    ax.set_yticks([0.5, 1.5], ["written over S", "buffers"])
    ax.set_xlabel("TMEM column (32 bits each; every buffer spans all 128 lanes, one per row)")
    ax.grid(axis="x", alpha=0.3)
    ax.set_title(title or f"TMEM map: {alloc} columns allocated (dashed)"
                 + (f", head dim {head_dim}" if head_dim else ""), fontsize=10)
    fig.tight_layout()
    return fig
