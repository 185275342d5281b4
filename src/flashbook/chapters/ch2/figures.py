"""Chapter 2's figures: the tile schedule of each loop order, flash.cu's shared-memory budget,
and (for now) the bar chart of the recorded ladder."""
from __future__ import annotations

import math

import matplotlib.pyplot as plt
from matplotlib.patches import Rectangle

from .launch import DEFAULT_SMEM_LIMIT


def draw_schedule(order: str = "fa1", N: int = 8, Bc: int = 2, Br: int = 2, steps: int = 6):
    """Which tile sits where at each step: one panel per step.

    Each panel shows the N x N score matrix (query rows down, keys across) with the (i, j)
    tile being computed, the Q rows and K/V rows in shared memory, and which rows of O, m, l
    are read from and written to HBM in that step.
    """
    Tc, Tr = math.ceil(N / Bc), math.ceil(N / Br)
    if order == "fa1":
        seq = [(i, j) for j in range(Tc) for i in range(Tr)]
    elif order == "fa2":
        seq = [(i, j) for i in range(Tr) for j in range(Tc)]
    else:
        raise ValueError("order must be 'fa1' or 'fa2'")
    seq = seq[:steps]
    cols = min(len(seq), 3)
    rows = math.ceil(len(seq) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.9 * rows), squeeze=False)
    for ax, (step, (i, j)) in zip(axes.flat, enumerate(seq)):
        ax.set_xlim(-3.2, N + 0.3)
        ax.set_ylim(N + 2.2, -1.6)
        ax.set_aspect("equal")
        ax.axis("off")
        done = seq[:step]
        # the score matrix, tiles already visited in grey
        for (ii, jj) in done:
            ax.add_patch(Rectangle((jj * Bc, ii * Br), Bc, Br, color="0.85"))
        ax.add_patch(Rectangle((j * Bc, i * Br), Bc, Br, color="tab:orange", alpha=0.9))
        ax.add_patch(Rectangle((0, 0), N, N, fill=False, lw=1.2))
        for t in range(1, Tc):
            ax.plot([t * Bc] * 2, [0, N], color="0.6", lw=0.6)
        for t in range(1, Tr):
            ax.plot([0, N], [t * Br] * 2, color="0.6", lw=0.6)
        # K/V tile in SMEM (top bar), Q tile in SMEM (left bar)
        ax.add_patch(Rectangle((j * Bc, -1.3), Bc, 0.9, color="tab:blue"))
        ax.text(N / 2, -1.45, f"K_{j}, V_{j} in SMEM", ha="center", va="bottom", fontsize=8, color="tab:blue")
        ax.add_patch(Rectangle((-1.3, i * Br), 0.9, Br, color="tab:green"))
        ax.text(-1.45, i * Br + Br / 2, f"Q_{i}", ha="right", va="center", fontsize=8, color="tab:green")
        # O / m / l traffic
        if order == "fa1":
            ax.add_patch(Rectangle((-3.0, i * Br), 0.9, Br, color="tab:red"))
            ax.text(N / 2, N + 1.2, f"HBM: read and write O_{i}, m_{i}, l_{i}", ha="center",
                    fontsize=8, color="tab:red")
        else:
            ax.add_patch(Rectangle((-3.0, i * Br), 0.9, Br, color="tab:purple", alpha=0.5))
            last = j == Tc - 1
            ax.text(N / 2, N + 1.2, f"registers: m, l, acc of rows Q_{i}" +
                    (f"; write O_{i} once" if last else ""), ha="center", fontsize=8,
                    color="tab:purple")
        ax.set_title(f"step {step}: S tile (i={i}, j={j})", fontsize=9)
    for ax in list(axes.flat)[len(seq):]:
        ax.axis("off")
    name = "FA1 (flash.cu): outer j over K/V tiles, inner i over Q tiles" if order == "fa1" else \
        "FA2 order: one block per Q tile i (in the grid), loop j over K/V tiles"
    fig.suptitle(name, fontsize=10)
    fig.tight_layout()
    return fig


def draw_smem_layout(Bc: int = 32, Br: int = 32, d: int = 64, limit: int = DEFAULT_SMEM_LIMIT):
    """The dynamic shared-memory buffer of flash.cu for d and 2*d, against the 48 KiB budget."""
    fig, ax = plt.subplots(figsize=(7.5, 2.0))
    for row, dd in enumerate((d, 2 * d)):
        x = 0
        for name, n, color in (("Qi", Bc * dd, "tab:green"), ("Kj", Bc * dd, "tab:blue"),
                               ("Vj", Bc * dd, "tab:cyan"), ("S", Bc * Br, "tab:orange")):
            ax.barh(row, 4 * n / 1024, left=x, color=color, edgecolor="black")
            ax.text(x + 2 * n / 1024, row, name, ha="center", va="center", fontsize=8)
            x += 4 * n / 1024
        ax.text(x + 0.5, row, f"{x:.0f} KiB (d={dd})", va="center", fontsize=8)
    ax.axvline(limit / 1024, color="red", ls="--")
    ax.text(limit / 1024, 1.55, f"{limit // 1024} KiB per-block limit", color="red", fontsize=8, ha="center")
    ax.set_yticks([])
    ax.set_xlim(0, 64)
    ax.set_ylim(-0.6, 1.8)
    ax.set_xlabel("dynamic shared memory per block (KiB)")
    fig.tight_layout()
    return fig
