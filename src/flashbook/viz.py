"""Figures used across chapters (introduced in Chapter 1)."""
from __future__ import annotations

import matplotlib.pyplot as plt


def roofline(peak_tflops: float, hbm_gbps: float, points: dict[str, float], title: str = ""):
    """Log-log roofline: attainable TFLOP/s = min(peak, intensity * bandwidth).

    ``points`` maps a label to an arithmetic intensity (FLOP per byte); each is drawn on the roof.
    """
    import numpy as np
    ridge = peak_tflops * 1e12 / (hbm_gbps * 1e9)
    x = np.logspace(-1, 4, 200)
    roof = np.minimum(peak_tflops, x * hbm_gbps / 1e3)
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    ax.loglog(x, roof, color="black", lw=2)
    ax.axvline(ridge, color="grey", ls=":", lw=1)
    ax.text(ridge * 1.1, peak_tflops * 0.02, f"ridge: {ridge:.0f} FLOP/B", color="grey")
    for i, (label, ai) in enumerate(points.items()):
        y = min(peak_tflops, ai * hbm_gbps / 1e3)
        ax.plot([ai], [y], "o", ms=8, color=f"C{i}")
        ax.annotate(label, (ai, y), textcoords="offset points", xytext=(8, -14), color=f"C{i}")
    ax.set_xlabel("arithmetic intensity (FLOP per byte of HBM traffic)")
    ax.set_ylabel("attainable TFLOP/s")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    return fig


def plot_series(rows: list[dict], x: str, y: str, *, label="kernel", logx=True, logy=True,
                xlabel=None, ylabel=None, title=""):
    """One line per ``label`` value through rows (dicts or dataclasses); rows with y None skipped."""
    rows = [r if isinstance(r, dict) else vars(r) for r in rows]
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for i, name in enumerate(dict.fromkeys(r[label] for r in rows)):
        pts = sorted((r[x], r[y]) for r in rows if r[label] == name and r[y] is not None)
        if pts:
            ax.plot(*zip(*pts), "o-", label=name, color=f"C{i}")
    if logx:
        ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel or x)
    ax.set_ylabel(ylabel or y)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return fig
