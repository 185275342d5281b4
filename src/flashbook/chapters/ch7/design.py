"""Chapter 7's model of the Blackwell forward kernel (CUTLASS's CuTe DSL example, FlashAttention-4's
structure): warp roles and registers, the pipelines between roles, the persistent scheduler, and
a cycle model of one tile and of one key step of two tiles (Section 2's rates: ``SM``). A model
for reasoning: no latencies, shared-memory traffic or overlap limits. Pure Python.
"""
from __future__ import annotations

import dataclasses
import math

import matplotlib.pyplot as plt
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

from flashbook.planning import REGISTERS_PER_SM


@dataclasses.dataclass(frozen=True)
class Role:
    name: str
    warps: tuple[int, ...]
    registers: int          # per thread, after setmaxnreg
    job: str


# The example's 16 warps (512 threads). setmaxnreg works per warpgroup (4 consecutive warps), so
# warps 12-15 share one count, and warp 15 exists only to complete that warpgroup.
ROLES = (
    Role("softmax0", (0, 1, 2, 3), 192, "S0 -> P0 for query tile 0: row max, exp2, P, row sum"),
    Role("softmax1", (4, 5, 6, 7), 192, "the same for query tile 1"),
    Role("correction", (8, 9, 10, 11), 96, "rescales O0/O1 in TMEM; final O / l and the LSE"),
    Role("mma", (12,), 32, "allocates TMEM; one thread issues every tcgen05.mma"),
    Role("load", (13,), 32, "TMA loads: Q0, K0, Q1, V0, K1, V1, ..."),
    Role("epilogue", (14,), 32, "TMA stores of O0/O1 from shared memory"),
    Role("empty", (15,), 32, "idle: completes the fourth warpgroup"),
)

# Producer -> consumer pipelines of the example (name, from, to, stages, what it says).
PIPELINES = (
    ("load_q", "load", "mma", 2, "Q0 / Q1 landed (TMA transaction bytes)"),
    ("load_kv", "load", "mma", 3, "a K or V tile landed (one ring for both)"),
    ("mma_s0", "mma", "softmax0", 1, "S0 ready / P0 written back (ownership of S0)"),
    ("mma_s1", "mma", "softmax1", 1, "S1 ready / P1 written back"),
    ("s0_corr", "softmax0", "correction", 1, "(old max, new max) of tile 0; finally (sum, max)"),
    ("s1_corr", "softmax1", "correction", 1, "the same for tile 1"),
    ("mma_corr", "mma", "correction", 2, "P V accumulated into O_i: O_i may be rescaled"),
    ("corr_epi", "correction", "epilogue", 2, "normalised O_i in shared memory"),
    ("s0_s1_sequence", "softmax0", "softmax1", 1, "take turns on the exponential unit"),
)


def register_split() -> list[tuple[str, int, int]]:
    """[(warpgroup, threads, registers per thread)]: the four warpgroups' setmaxnreg counts."""
    return [("softmax0 (warps 0-3)", 128, 192), ("softmax1 (warps 4-7)", 128, 192),
            ("correction (warps 8-11)", 128, 96),
            ("mma, load, epilogue, empty (warps 12-15)", 128, 32)]


def register_table() -> str:
    rows = ["| warpgroup | threads | registers / thread | registers |", "|---|---|---|---|"]
    rows += [f"| {name} | {threads} | {regs} | {threads * regs:,} |"
             for name, threads, regs in register_split()]
    used = sum(threads * regs for _, threads, regs in register_split())
    rows.append(f"| **total** | 512 | | **{used:,}** of {REGISTERS_PER_SM:,} |")
    return "\n".join(rows)


# ------------------------------------------------------------------ persistent scheduler
def work_tiles(seqlen_q: int, heads: int, batch: int, rows_per_cta: int = 256) -> int:
    """Work tiles of the example's scheduler: (ceil(seqlen_q / 256), heads, batch)."""
    return math.ceil(seqlen_q / rows_per_cta) * heads * batch


def tile_coord(index: int, seqlen_q: int, heads: int, rows_per_cta: int = 256):
    """(m_block, head, batch) of linear tile ``index``, the m_block varying fastest."""
    m_blocks = math.ceil(seqlen_q / rows_per_cta)
    return index % m_blocks, (index // m_blocks) % heads, index // (m_blocks * heads)


def static_schedule(num_tiles: int, sms: int) -> list[list[int]]:
    """The persistent static schedule: grid = min(sms, num_tiles) CTAs; CTA c takes tiles
    c, c + grid, c + 2 grid, ... Every warp role of a CTA walks this same list on its own."""
    grid = min(sms, num_tiles)
    return [list(range(c, num_tiles, grid)) for c in range(grid)]


# ----------------------------------------------------------------------- cycle model
# The model's numbers, all in one place. They are the chapter's stated assumptions (Sections 1
# and 2: per-SM throughputs from the CUDA guide's tables, and for the B300 the doubled
# exponential rate Section 2 states), not measurements: nothing here was timed on a GPU.
@dataclasses.dataclass(frozen=True)
class SM:
    name: str
    mma_flops: int      # dense 16-bit tensor-core FLOP per clock per SM
    mufu: int = 16      # exponentials per clock per SM (special-function unit, MUFU.EX2)
    fma: int = 128      # fp32 FMA (and other ALU) operations per clock per SM
    poly: bool = True   # whether FlashAttention-4 emulates a share of exp2 by the polynomial


H100 = SM("H100 (sm_90)", 4096)          # 989 TFLOP/s / 132 SMs / 1.83 GHz
B200 = SM("B200 (sm_100)", 8192)
# Blackwell Ultra: twice the exponentials per clock; the model keeps the B200's tensor-core
# rate, and FlashAttention-4 turns the polynomial off there
B300 = SM("B300 (sm_103)", 8192, mufu=32, poly=False)

# fp32 ALU operations per score besides the exponential: the scale-and-subtract FMA, the max,
# the sum, and half a conversion to 16 bits (two values are packed per instruction)
OTHER_OPS_PER_SCORE = 3.5
# a polynomial exp2 on the FMA units: the round-to-integer add, the subtraction of n, three
# Horner FMAs and the integer shift-add that builds 2^n
POLY_OPS = 6


def tile_cycles(sm: SM, head_dim: int, block_m: int = 128, block_n: int = 128,
                emulated: float = 0.0) -> dict[str, float]:
    """Clock cycles one SM needs for one (block_m x block_n) tile of scores, per unit:
    ``mma`` (Q K^T and P V: 4 block_m block_n d FLOPs), ``exp`` (the exponentials left on the
    special-function unit) and ``fma`` (the other per-score work plus the ``emulated``
    fraction of the exponentials as polynomials)."""
    scores = block_m * block_n
    return {"mma": 4 * block_m * block_n * head_dim / sm.mma_flops,
            "exp": scores * (1 - emulated) / sm.mufu,
            "fma": scores * (OTHER_OPS_PER_SCORE + POLY_OPS * emulated) / sm.fma}


def best_emulated_fraction(sm: SM = B200) -> float:
    """The fraction of exponentials to emulate so that MUFU and the FMA units finish together."""
    # (1 - r) / mufu = (other + poly r) / fma
    return (sm.fma / sm.mufu - OTHER_OPS_PER_SCORE) / (sm.fma / sm.mufu + POLY_OPS)


def step_cycles(sm: SM, head_dim: int, emulated: float = 0.0, tiles: int = 2,
                block_n: int = 128) -> dict[str, float]:
    """Cycles of one key step of a CTA with ``tiles`` Q tiles of 128 rows, per unit. The tiles'
    softmax warpgroups share the SM's one exponential unit (MUFU) and its FMA units, so their
    exp phases add up instead of overlapping; ``step`` is the slowest unit (perfect overlap
    otherwise), ``unshared_exp`` what the exponentials would take if each warpgroup had a
    unit of its own (the period would not add them)."""
    one = tile_cycles(sm, head_dim, block_n=block_n, emulated=emulated)
    out = {unit: tiles * c for unit, c in one.items()}
    out["step"] = max(out["mma"], out["exp"], out["fma"])
    out["unshared_exp"] = one["exp"]
    return out


def emulation_gain(sm: SM, head_dim: int) -> float:
    """How much shorter a key step gets when the best share of exponentials runs as the
    polynomial: the step without it over the step with it (1.0: no gain)."""
    r = max(0.0, best_emulated_fraction(sm))
    return step_cycles(sm, head_dim)["step"] / step_cycles(sm, head_dim, emulated=r)["step"]


def exp_unit_table(head_dims=(64, 128), sms=(B200, B300)) -> str:
    """A markdown table: per key step of two Q tiles, the cycles of the tensor cores and of the
    one exponential unit both softmax warpgroups share, with and without the polynomial."""
    rows = ["| GPU | d | tensor cores | exp unit (2 tiles) | FMA units | best share emulated | "
            "exp unit | FMA units | step gain | FlashAttention-4's polynomial |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for sm in sms:
        r = max(0.0, best_emulated_fraction(sm))
        for d in head_dims:
            a, b = step_cycles(sm, d), step_cycles(sm, d, emulated=r)
            rows.append(f"| {sm.name} | {d} | {a['mma']:,.0f} | {a['exp']:,.0f} | "
                        f"{a['fma']:,.0f} | {r:.0%} | {b['exp']:,.0f} | {b['fma']:,.0f} | "
                        f"{emulation_gain(sm, d):.2f}x | {'on' if sm.poly else 'off'} |")
    return "\n".join(rows)


def plot_unit_cycles(head_dims=(64, 128)):
    """Bars: cycles per 128x128 tile on each unit, H100 against B200, and the B200 with the best
    fraction of exponentials emulated on the FMA units."""
    r = best_emulated_fraction(B200)
    configs = [(H100, 0.0, "H100"), (B200, 0.0, "B200"), (B200, r, f"B200, {r:.0%} emulated")]
    fig, axes = plt.subplots(1, len(head_dims), figsize=(9.5, 3.6), sharey=True)
    for ax, d in zip(axes, head_dims):
        for i, (sm, frac, label) in enumerate(configs):
            cyc = tile_cycles(sm, d, emulated=frac)
            for j, unit in enumerate(("mma", "exp", "fma")):
                ax.bar(i + (j - 1) * 0.27, cyc[unit], width=0.25, color=f"C{j}",
                       label={"mma": "tensor cores (QK^T, PV)", "exp": "exp2 on MUFU",
                              "fma": "FMA units (scale, max, sum, cvt, poly)"}[unit]
                       if i == 0 else None)
        ax.set_xticks(range(len(configs)), [c[2] for c in configs], fontsize=8)
        ax.set_title(f"head dim {d}: clock cycles per 128x128 tile")
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel("cycles (model)")
    axes[0].legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    return fig


# -------------------------------------------------------------------------- roles
_BOXES = {  # role: (x, y) centre of its box (boxes are 1.7 x 0.84)
    "load": (0.8, 3.0), "mma": (3.5, 3.0), "softmax0": (6.3, 4.7), "softmax1": (6.3, 1.3),
    "correction": (9.1, 3.0), "epilogue": (11.7, 3.0),
}
# pipeline: (start point, end point, arc curvature, label position)
_ARROWS = {
    "load_q": ((1.65, 3.2), (2.65, 3.2), -0.3, (2.15, 3.62)),
    "load_kv": ((1.65, 2.8), (2.65, 2.8), 0.3, (2.15, 2.38)),
    "mma_s0": ((3.9, 3.42), (5.45, 4.6), -0.15, (4.25, 4.25)),
    "mma_s1": ((3.9, 2.58), (5.45, 1.4), 0.15, (4.25, 1.75)),
    "mma_corr": ((4.35, 3.0), (8.25, 3.0), 0.0, (7.35, 2.82)),
    "s0_s1_sequence": ((6.3, 4.28), (6.3, 1.72), 0.0, (5.55, 3.42)),
    "s0_corr": ((7.15, 4.6), (8.7, 3.42), -0.15, (8.35, 4.25)),
    "s1_corr": ((7.15, 1.4), (8.7, 2.58), 0.15, (8.35, 1.75)),
    "corr_epi": ((9.95, 3.0), (10.85, 3.0), 0.0, (10.4, 3.2)),
}


def plot_roles():
    """The warp roles as boxes (warps, registers) and the example's pipelines as arrows; the
    SM's one exponential unit sits between the two softmax warpgroups that share it."""
    fig, ax = plt.subplots(figsize=(11, 4.6))
    roles = {r.name: r for r in ROLES}
    for name, (x, y) in _BOXES.items():
        r = roles[name]
        warps = f"warp {r.warps[0]}" if len(r.warps) == 1 else f"warps {r.warps[0]}-{r.warps[-1]}"
        ax.add_patch(FancyBboxPatch((x - 0.85, y - 0.42), 1.7, 0.84, boxstyle="round,pad=0.05",
                                    fc="#e8eef7" if len(r.warps) == 4 else "#f3ece0", ec="0.3"))
        ax.text(x, y + 0.13, name, ha="center", va="center", fontsize=10, weight="bold")
        ax.text(x, y - 0.18, f"{warps}, {r.registers} regs", ha="center", va="center", fontsize=8)
    for name, src, dst, stages, _ in PIPELINES:
        start, end, rad, (lx, ly) = _ARROWS[name]
        ax.add_patch(FancyArrowPatch(start, end, connectionstyle=f"arc3,rad={rad}",
                                     arrowstyle="-|>", mutation_scale=12, color="0.25", lw=1.2))
        ax.text(lx, ly, f"{name} ({stages})", ha="center", va="center", fontsize=7.5,
                color="0.1", bbox=dict(fc="white", ec="none", pad=0.5, alpha=0.85))
    # the one exponential unit of the SM, which the two softmax warpgroups take turns on
    ax.add_patch(FancyBboxPatch((6.3 - 0.8, 2.2), 1.6, 0.36, boxstyle="round,pad=0.03",
                                fc="#fde8d7", ec="#c8773a", zorder=3))
    ax.text(6.3, 2.38, "exp unit (MUFU): 1 per SM", ha="center", va="center", fontsize=7.5,
            zorder=4)
    ax.text(12.6, 0.75, "warp 15: idle (completes the 4th warpgroup)\n"
            "registers: 2x128x192 + 128x96 + 128x32 = 65,536", ha="right", fontsize=8,
            color="0.3")
    ax.set_xlim(-0.2, 12.7)
    ax.set_ylim(0.5, 5.3)
    ax.axis("off")
    ax.set_title("The CuTe DSL example: the warp roles of one CTA and the pipelines between them "
                 "(stages in parentheses)", fontsize=10)
    fig.tight_layout()
    return fig
