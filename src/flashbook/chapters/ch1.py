"""Chapter 1 helpers: the traffic-model check and the time/memory plots."""
from __future__ import annotations

import matplotlib.pyplot as plt

from ..check import CheckFailure, call_student

# (B, H, N, d, bytes per element): visible and hidden cases for the traffic model.
_TRAFFIC_CASES = [(1, 1, 4, 2, 4), (1, 16, 4096, 64, 2), (2, 8, 1000, 128, 4)]
_TRAFFIC_HIDDEN = [(3, 5, 7, 11, 2), (1, 1, 1, 1, 8), (4, 32, 16384, 128, 2)]


def _expected_traffic(B, H, N, d, e):
    """Independent statement of the model in the chapter text (three kernels, S and P in HBM)."""
    qk = e * B * H * (2 * N * d + N * N)          # read Q, K; write S
    sm = e * B * H * (2 * N * N)                  # read S; write P
    pv = e * B * H * (N * N + 2 * N * d)          # read P, V; write O
    return 4 * B * H * N * N * d, qk + sm + pv


def check_traffic(fn, hidden: bool = False):
    """Check ``fn(B, H, N, d, bytes_per_element) -> {"flops": ..., "bytes": ...}``."""
    cases = _TRAFFIC_CASES + (_TRAFFIC_HIDDEN if hidden else [])
    for B, H, N, d, e in cases:
        what = f"naive_traffic(B={B}, H={H}, N={N}, d={d}, bytes_per_element={e})"
        got = call_student(fn, B, H, N, d, e, what=what)
        if not isinstance(got, dict) or not {"flops", "bytes"} <= set(got):
            raise CheckFailure(f"{what}: return a dict with keys 'flops' and 'bytes', got {got!r}.")
        flops, nbytes = _expected_traffic(B, H, N, d, e)
        if got["flops"] != flops:
            raise CheckFailure(
                f"{what}: flops = {got['flops']:,} but the two matmuls do {flops:,}.\n  Hint: each "
                "of the N*N scores takes d multiply-adds (2d FLOPs), and so does each of the "
                "N*d outputs' N-term sum; count both, for every batch and head.")
        if got["bytes"] != nbytes:
            raise CheckFailure(
                f"{what}: bytes = {got['bytes']:,} but the three kernels move {nbytes:,}.\n  Hint: "
                "S and P are each written once and read once (N*N elements per head each way); "
                "Q, K, V are read once and O written once (N*d elements each).")
    print(f"PASSED naive_traffic: {len(cases)}/{len(cases)} cases")


def plot_time_and_memory(rows, title: str):
    """Two panels: time (ms) and peak extra memory (MiB) against N, one line per kernel."""
    rows = [r if isinstance(r, dict) else vars(r) for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, key, label in ((axes[0], "ms", "time (ms)"), (axes[1], "peak_mib", "peak extra memory (MiB)")):
        for i, name in enumerate(dict.fromkeys(r["kernel"] for r in rows)):
            pts = sorted((r["N_q"], r[key]) for r in rows if r["kernel"] == name and r[key])
            if pts:
                ax.plot(*zip(*pts), "o-", label=name, color=f"C{i}")
            oom = [r["N_q"] for r in rows if r["kernel"] == name and r["note"] == "out of memory"]
            if oom:
                ax.axvline(min(oom), color=f"C{i}", ls="--", lw=1)
                ax.text(min(oom), ax.get_ylim()[1] if ax.lines else 1, f" {name}: out of memory",
                        color=f"C{i}", rotation=90, va="top", fontsize=8)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length N")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig
