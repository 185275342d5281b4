"""Chapter 4's recorded H200 benchmark, read back: the rows of each section (dense causal, varlen,
sliding window), the comparisons the chapter states, the figures its prose quotes, and one
figure of all three.

Rows come from ``flashbook bench ch4`` (``benchmark.py`` documents them): varlen rows have a
note starting ``varlen`` (or ``uniform`` for the equal-length batch of the same tokens), window
rows a note starting ``window=``; public rows (the call as a reader makes it) are their own
section; everything else is a dense row.
"""
from __future__ import annotations

import re

import matplotlib.pyplot as plt

from flashbook import results

DENSE_KERNELS = ("ch4_two_tiles", "ch4_one_tile", "sdpa_cudnn", "flex_attention", "sdpa_flash")


def section(row) -> str:
    """dense, varlen or window; ``public`` for a row that times a call as a reader makes it
    (``benchmark.public``), kept out of the other sections' comparisons."""
    if row.role == "public":
        return "public"
    note = row.note or ""
    if note.startswith(("varlen", "uniform")):
        return "varlen"
    return "window" if note.startswith("window=") else "dense"


def window_of(row) -> int | None:
    """The left window of a window row (None: plain causal)."""
    m = re.match(r"window=\((-?\d+),", row.note or "")
    return None if m is None or m.group(1) == "-1" else int(m.group(1))


def dense(rows, kernel: str, B: int, N: int, causal: bool = True):
    return next((r for r in rows if section(r) == "dense" and r.kernel == kernel and r.B == B
                 and r.N_q == N and r.causal == causal), None)


def varlen(rows, kernel: str, causal: bool, uniform: bool = False):
    for r in rows:
        if section(r) == "varlen" and r.kernel == kernel and r.causal == causal and \
                (r.note or "").startswith("uniform") == uniform:
            return r
    return None


def windows(rows, kernel: str = "ch4_two_tiles") -> dict:
    """{left window or None: row} of the window section."""
    return {window_of(r): r for r in rows if section(r) == "window" and r.kernel == kernel}


def padding_ratio(rows) -> float:
    r = varlen(rows, "ch4_two_tiles", False)
    return float(re.search(r"padding ratio ([\d.]+)", r.note).group(1))


def longest(rows) -> int:
    r = varlen(rows, "ch4_two_tiles", False)
    return int(re.search(r"longest (\d+)", r.note).group(1))


def summary(rows) -> str:
    """The comparisons the chapter's targets are stated in, one line each."""
    lines = []
    for B, N in sorted({(r.B, r.N_q) for r in rows if section(r) == "dense"}):
        ours = dense(rows, "ch4_two_tiles", B, N)
        if ours is None or not ours.tflops:
            continue
        others = ", ".join(f"{k} {r.tflops:.0f} ({ours.tflops / r.tflops:.2f}x)"
                           for k in DENSE_KERNELS[1:] if (r := dense(rows, k, B, N)) and r.tflops)
        lines.append(f"causal (B={B}, H=16, N={N}, d=128): ours {ours.tflops:.0f} TFLOP/s; {others}")
    for causal in (False, True):
        ours, uni = varlen(rows, "ch4_two_tiles", causal), varlen(rows, "ch4_two_tiles", causal, True)
        if ours is None or not ours.tflops:
            continue
        others = ", ".join(f"{r.kernel} {r.tflops:.0f}" for r in rows if section(r) == "varlen"
                           and r.role == "baseline" and r.causal == causal and r.tflops)
        lines.append(f"varlen {'causal' if causal else 'non-causal'} ({ours.B} sequences, padding "
                     f"ratio {padding_ratio(rows):.1f}): ours {ours.tflops:.0f} TFLOP/s on real "
                     f"pairs = {ours.tflops / uni.tflops:.2f}x the uniform batch; {others}")
    win = windows(rows)
    if None in win:
        full = win[None].ms
        lines.append("sliding window at N=65536: " + ", ".join(
            f"left={w}: {r.ms:.2f} ms ({r.ms / full:.3f} of plain causal)"
            for w, r in sorted((w, r) for w, r in win.items() if w is not None)))
    return "\n".join(lines)


def plot_recorded(rows):
    """Three panels: dense causal TFLOP/s per kernel and shape; varlen TFLOP/s on real pairs
    (non-causal, causal); sliding-window time against the window (it should be a line)."""
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    ax = axes[0]
    shapes = sorted({(r.B, r.N_q) for r in rows if section(r) == "dense"}, reverse=True)
    width = 0.8 / len(DENSE_KERNELS)
    for i, k in enumerate(DENSE_KERNELS):
        vals = [getattr(dense(rows, k, B, N), "tflops", None) or 0 for B, N in shapes]
        ax.bar([x + i * width for x in range(len(shapes))], vals, width, label=k)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(shapes))],
                  [f"B={B}, N={N}" for B, N in shapes])
    ax.set_title("causal, H=16, d=128 (fp16)")
    ax.set_ylabel("TFLOP/s (visible pairs)")
    ax.legend(fontsize=7)
    ax = axes[1]
    names = ["ch4_two_tiles", "flex_attention", "sdpa_jagged", "sdpa_cudnn"]
    for i, causal in enumerate((False, True)):
        vals = []
        for k in names:
            r = next((r for r in rows if section(r) == "varlen" and r.causal == causal and
                      r.kernel == k and not (r.note or "").startswith("uniform")), None)
            vals.append(r.tflops if r and r.tflops else 0)
        ax.bar([x + i * 0.4 for x in range(len(names))], vals, 0.4,
               label="causal" if causal else "non-causal")
    ax.set_xticks([x + 0.2 for x in range(len(names))],
                  ["ours", "flex", "jagged SDPA", "padded SDPA"], fontsize=8)
    ax.set_title(f"varlen, 65536 tokens, padding ratio {padding_ratio(rows):.1f}")
    ax.set_ylabel("TFLOP/s on real pairs")
    ax.legend(fontsize=7)
    ax = axes[2]
    win = sorted((w, r.ms) for w, r in windows(rows).items() if w is not None)
    ax.plot([w for w, _ in win], [ms for _, ms in win], "o-", label="ours, window (left, 0)")
    if None in windows(rows):
        ax.axhline(windows(rows)[None].ms, color="C3", ls=":", label="ours, plain causal")
    ax.set_xlabel("window (keys)")
    ax.set_ylabel("ms")
    ax.set_ylim(bottom=0)
    ax.set_title("sliding window, N=65536, causal")
    ax.legend(fontsize=7)
    for a in axes:
        a.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def _sections(row) -> int:
    return int(re.search(r"sections=(\d+)", row.note).group(1))


def quoted_values(rows) -> dict:
    """The figures the chapter's closing section quotes (``flashbook.quoted``), by glue key."""
    # what a reader's call gets (attention_varlen as called, results.as_called) against the
    # baselines; the kernel's ablations (schedules, the uniform batch) as the benchmark times them
    kernels, rows = rows, results.as_called(rows)
    big, small = (1, 16384), (4, 4096)
    tf = {(k, B, N): dense(rows, k, B, N).tflops for k in DENSE_KERNELS for B, N in (big, small)}
    out = {"ch4_tflops": tf[("ch4_two_tiles", *big)], "ch4_cudnn_tflops": tf[("sdpa_cudnn", *big)]}
    for name, (B, N) in (("big", big), ("small", small)):
        for k in ("sdpa_cudnn", "flex_attention", "sdpa_flash"):
            out[f"ch4_vs_{k.removeprefix('sdpa_')}_{name}"] = tf[("ch4_two_tiles", B, N)] / \
                tf[(k, B, N)]
    ref = dense(kernels, "ch4_two_tiles", *big)
    out["ch4_tiles_first_tflops"], out["ch4_heads_first_tflops"] = (
        dense(kernels, f"ch4_two_tiles_{o}_first", *big).tflops for o in ("tiles", "heads"))
    out["ch4_sections_tflops"] = ref.tflops
    out["ch4_sections"] = {1: "one", 2: "two", 3: "three", 4: "four", 8: "eight"}.get(
        _sections(ref), str(_sections(ref)))
    nc = varlen(kernels, "ch4_two_tiles", False)
    out["ch4_varlen_heads_first_tflops"] = next(
        r for r in kernels if section(r) == "varlen" and not r.causal
        and r.kernel == "ch4_two_tiles_heads_first").tflops
    out["ch4_varlen_tflops"] = nc.tflops
    out["ch4_varlen_sequences"], out["ch4_varlen_longest"] = nc.B, longest(rows)
    out["ch4_padding_ratio"] = padding_ratio(rows)
    for c, label in ((False, "noncausal"), (True, "causal")):
        out[f"ch4_varlen_vs_uniform_{label}"] = varlen(kernels, "ch4_two_tiles", c).tflops / \
            varlen(kernels, "ch4_two_tiles", c, True).tflops
        out[f"ch4_flex_varlen_tflops_{label}"] = next(
            r for r in rows if section(r) == "varlen" and r.causal == c
            and r.kernel == "flex_attention").tflops
        padded = next(r for r in rows if section(r) == "varlen" and r.causal == c
                      and r.role == "baseline" and r.kernel.startswith("sdpa_")
                      and r.kernel != "sdpa_jagged")
        out[f"ch4_padded_tflops_{label}"] = padded.tflops
        out[f"ch4_vs_padded_{label}"] = padded.ms / varlen(rows, "ch4_two_tiles", c).ms
        if not c:
            computed, real = (float(x) for x in re.search(
                r"([\d.e+]+) pairs computed for ([\d.e+]+) real", padded.note).groups())
            out["ch4_padded_pairs_ratio"] = computed / real
    out["ch4_jagged_tflops"] = next(r for r in rows if r.kernel == "sdpa_jagged").tflops
    win = windows(rows)
    lefts = sorted(w for w in win if w is not None)
    for i, w in enumerate(lefts):
        out[f"ch4_window_{i}"], out[f"ch4_window_{i}_ms"] = w, win[w].ms
    out["ch4_causal_ms"] = win[None].ms
    out["ch4_window_1_share"] = win[lefts[1]].ms / win[None].ms
    return out
