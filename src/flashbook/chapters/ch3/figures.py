"""Chapter 3's pictures: the online softmax's running state, and the tiles one program visits."""
from __future__ import annotations

import math

import matplotlib.pyplot as plt
import torch
from matplotlib.patches import Rectangle


def online_softmax_trace(x, block: int):
    """The running (m, l) after each block of ``x`` (1-d), in float64, for plots and tables."""
    x = torch.as_tensor(x, dtype=torch.float64)
    m, l, rows = float("-inf"), 0.0, []
    for start in range(0, x.numel(), block):
        xb = x[start:start + block]
        m_new = max(m, float(xb.max()))
        alpha = math.exp(m - m_new) if m != float("-inf") else 0.0
        l = l * alpha + float(torch.exp(xb - m_new).sum())
        rows.append(dict(block=start // block, m=m_new, l=l, alpha=alpha))
        m = m_new
    return rows


def plot_online_softmax(x, blocks=(4, 8, 16)):
    """m and l/exp(-m) after each element as the blocks stream in: the curves end in the same
    place (the log-sum-exp) whatever the block size."""
    x = torch.as_tensor(x, dtype=torch.float64)
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
    for i, b in enumerate(blocks):
        tr = online_softmax_trace(x, b)
        ends = [min((r["block"] + 1) * b, x.numel()) for r in tr]
        axes[0].step(ends, [r["m"] for r in tr], where="post", label=f"block {b}", color=f"C{i}")
        axes[1].plot(ends, [r["m"] + math.log(r["l"]) for r in tr], "o-", ms=3,
                     label=f"block {b}", color=f"C{i}")
    axes[1].axhline(float(torch.logsumexp(x, 0)), color="black", ls=":", label="logsumexp(x)")
    axes[0].set_title("running max m")
    axes[1].set_title("running m + log(l)")
    for ax in axes:
        ax.set_xlabel("elements seen")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_tiles(N_q: int, N_k: int, block_m: int, block_n: int, program: int = 0):
    """Which tiles one program visits: its Q tile (row band) and every K/V tile. Only the tail
    tile (when ``N_k`` is not a multiple of ``block_n``) is masked; its lanes past ``N_k`` are
    hatched, as are the Q tile's rows past ``N_q`` if the program is the last one."""
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.add_patch(Rectangle((0, 0), N_k, N_q, fill=False, lw=1.5))
    r0 = program * block_m
    for j, c0 in enumerate(range(0, N_k, block_n)):
        tail = c0 + block_n > N_k
        ax.add_patch(Rectangle((c0, r0), min(block_n, N_k - c0), min(block_m, N_q - r0),
                               color="C3" if tail else "C0", alpha=0.35 + 0.4 * (j % 2)))
        if tail:
            ax.add_patch(Rectangle((N_k, r0), c0 + block_n - N_k, block_m, hatch="//",
                                   fill=False, ec="C3"))
    rows_past_end = r0 + block_m > N_q
    if rows_past_end:
        ax.add_patch(Rectangle((0, N_q), N_k, r0 + block_m - N_q, hatch="\\\\", fill=False, ec="grey"))
    ax.set_xlim(-1, N_k + block_n)
    ax.set_ylim(max(N_q, r0 + block_m) + 2, -1)
    ax.set_xlabel("key j (K/V tiles stream left to right)")
    ax.set_ylabel("query i")
    ax.set_title(f"program {program}: one {block_m}-row Q tile, {block_n}-key K/V tiles\n"
                 "red: the one masked tail tile; hatched: lanes past the end (masked)", fontsize=9)
    fig.tight_layout()
    return fig
