"""Chapter 2's figures: the tile schedule of each loop order, flash.cu's shared-memory budget,
and (for now) the bar chart of the recorded ladder."""
from __future__ import annotations

import math

import matplotlib.pyplot as plt
from matplotlib.patches import Rectangle

from .launch import DEFAULT_SMEM_LIMIT


def draw_schedule(order: str = "fa1", N: int = 8, Bc: int = 2, Br: int = 2, steps: int = 6):
    """Which tile sits where at each step: one panel per step.

    Each panel shows the N x N score matrix (query rows down, keys across). ``"fa1"``: one
    block visits the (i, j) tiles one after another (inner loop over Q tiles i), with the Q rows
    and K/V rows in shared memory and the O, m, l rows it reads from and writes to HBM.
    ``"fa2"``: one block per Q tile, all running at the same time; panel t is time step t, in
    which every block i computes its tile (i, t) (a column of tiles in flight) with its m, l, acc
    in registers. At most ``steps`` panels (for FA2, at most Tc: one per K/V tile).
    """
    Tc, Tr = math.ceil(N / Bc), math.ceil(N / Br)
    if order == "fa1":
        seq = [[(i, j)] for j in range(Tc) for i in range(Tr)]
    elif order == "fa2":
        seq = [[(i, j) for i in range(Tr)] for j in range(Tc)]   # all Q tiles at once
    else:
        raise ValueError("order must be 'fa1' or 'fa2'")
    seq = seq[:steps]
    cols = len(seq) if len(seq) <= 4 else 3
    rows = math.ceil(len(seq) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.9 * rows), squeeze=False)
    for ax, (step, tiles) in zip(axes.flat, enumerate(seq)):
        ax.set_xlim(-3.2, N + (2.2 if order == "fa2" else 0.3))
        ax.set_ylim(N + 2.2, -2.2)
        ax.set_aspect("equal")
        ax.axis("off")
        # the score matrix: tiles already visited in grey, the ones being computed in orange
        for done in seq[:step]:
            for (ii, jj) in done:
                ax.add_patch(Rectangle((jj * Bc, ii * Br), Bc, Br, color="0.85"))
        for (i, j) in tiles:
            ax.add_patch(Rectangle((j * Bc, i * Br), Bc, Br, color="tab:orange", alpha=0.9))
        ax.add_patch(Rectangle((0, 0), N, N, fill=False, lw=1.2))
        for t in range(1, Tc):
            ax.plot([t * Bc] * 2, [0, N], color="0.6", lw=0.6)
        for t in range(1, Tr):
            ax.plot([0, N], [t * Br] * 2, color="0.6", lw=0.6)
        j = tiles[0][1]
        # K/V tile in SMEM (top bar); Q tile(s) in SMEM or registers (left bars)
        ax.add_patch(Rectangle((j * Bc, -1.3), Bc, 0.9, color="tab:blue"))
        for (i, _) in tiles:
            ax.add_patch(Rectangle((-1.3, i * Br), 0.9, Br, color="tab:green"))
            ax.text(-1.45, i * Br + Br / 2, f"Q_{i}", ha="right", va="center", fontsize=8,
                    color="tab:green")
        if order == "fa1":
            (i, _), = tiles
            ax.text(N / 2, -1.45, f"K_{j}, V_{j} in SMEM", ha="center", va="bottom", fontsize=8,
                    color="tab:blue")
            ax.add_patch(Rectangle((-3.0, i * Br), 0.9, Br, color="tab:red"))
            ax.text(N / 2, N + 1.2, f"HBM: read and write O_{i}, m_{i}, l_{i}", ha="center",
                    fontsize=8, color="tab:red")
            ax.set_title(f"step {step}: S tile (i={i}, j={j})", fontsize=9)
        else:
            ax.text(N / 2, -1.45, f"every block loads K_{j}, V_{j} into its SMEM", ha="center",
                    va="bottom", fontsize=8, color="tab:blue")
            for (i, _) in tiles:     # one program per Q tile: a lane each, side by side
                ax.add_patch(Rectangle((-3.0, i * Br), 0.9, Br, color="tab:purple", alpha=0.5))
                ax.add_patch(Rectangle((0, i * Br + 0.08), N, Br - 0.16, fill=False, lw=1.0,
                                       ls="--", ec=f"C{i % 10}"))
                ax.text(N + 0.2, i * Br + Br / 2, f"block {i}", va="center", fontsize=8,
                        color=f"C{i % 10}")
            last = j == Tc - 1
            ax.text(N / 2, N + 1.2, "registers: m, l, acc of every block's rows" +
                    ("; each writes its O once" if last else ""), ha="center", fontsize=8,
                    color="tab:purple")
            ax.set_title(f"time step {j}: {len(tiles)} blocks at once, tiles (0..{Tr - 1}, {j})",
                         fontsize=9)
    for ax in list(axes.flat)[len(seq):]:
        ax.axis("off")
    name = "FA1 (flash.cu): one block per head; outer j over K/V tiles, inner i over Q tiles" \
        if order == "fa1" else \
        "FA2 order: one block per Q tile i, all running in parallel; each loops j over K/V tiles"
    fig.suptitle(name, fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.93 if rows == 1 else 0.96))
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
