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
