"""Chapter 8's recorded GPU data, read back: the one-GPU decode benchmark (``h200.csv``, from
``flashbook bench ch8``) and the ring on several GPUs (``h200x<P>.csv`` and its ``.json``, whose
``timeline`` holds rank 0's compute and exposed wait per ring step, from ``ring_bench``); their
summaries, figures, and the figures the chapter quotes (``CHAPTER.figures``).
"""
from __future__ import annotations

import re

import matplotlib.pyplot as plt

from flashbook import results

SPLIT, NO_SPLIT = "ch8_split_kv", "ch5_decode"
RING, ONE_GPU, CP = "ch8_ring", "ch5_two_tiles", "context_parallel"
HEADLINE_N = 131072                     # the ring's target: scaling efficiency at this N, causal


def decode_rows(rows):
    """{kernel: GB/s} of the decode run: the reference split-KV row, the no-split kernel and
    the baselines (the split-count and tile sweeps are variants of the same kernel name)."""
    out = {}
    for r in rows:
        if r.gbps and (r.kernel != SPLIT or r.role == "reference"):
            out.setdefault(r.kernel, r.gbps)
    return out


def efficiency(row) -> float | None:
    m = re.search(r"scaling efficiency ([\d.]+) %", row.note or "")
    return float(m.group(1)) if m else None


def ring_rows(rows, causal: bool):
    return sorted((r for r in rows if r.kernel == RING and r.causal == causal and r.ms),
                  key=lambda r: r.N_q)


def find(rows, kernel: str, N: int, causal: bool):
    return next((r for r in rows if r.kernel == kernel and r.N_q == N and r.causal == causal),
                None)


def world_size(provenance: dict) -> int:
    return int(provenance.get("world_size", 0))


def summary(decode, ring) -> str:
    lines = []
    if decode:
        g = decode_rows(decode.rows)
        lines.append("decode, batch 1, context 131072 (GB/s of K and V read): " + ", ".join(
            f"{k} {v:.0f}" for k, v in sorted(g.items(), key=lambda kv: -kv[1])))
    if ring:
        P = world_size(ring.provenance)
        for causal in (True, False):
            for r in ring_rows(ring.rows, causal):
                one = find(ring.rows, ONE_GPU, r.N_q, causal)
                cp = find(ring.rows, CP, r.N_q, causal)
                lines.append(
                    f"ring on {P} GPUs, N={r.N_q} {'causal' if causal else 'non-causal'}: "
                    f"{r.ms:.1f} ms, one GPU {one.ms:.1f} ms, efficiency {efficiency(r):.1f} %"
                    + (f", context_parallel {cp.ms:.1f} ms" if cp is not None and cp.ms else ""))
    return "\n".join(lines)


def _label(r) -> str:
    if r.kernel != SPLIT:
        return r.kernel
    if r.role == "public":
        return "split-KV, as called"
    if r.role == "reference":
        return "split-KV (chosen)"
    m = re.search(r"= (\(\d+, \d+, \d+\))", r.note or "")
    splits = (r.note or "").split(";")[0].replace("num_splits=", "")
    return f"split-KV {splits} splits" + (f", tiles {m.group(1)}" if m else "")


def plot_decode(decode):
    """GB/s of every decode row: split-KV's sweep of split counts, the no-split kernel, the
    baselines and the read ceiling."""
    rows = [r for r in decode.rows if r.gbps]
    labels = [_label(r) for r in rows]
    fig, ax = plt.subplots(figsize=(11, 4.2))
    colors = ["C0" if r.kernel == SPLIT else "C3" if r.kernel == NO_SPLIT else "C7"
              for r in rows]
    ax.bar(range(len(rows)), [r.gbps for r in rows], color=colors)
    read = decode_rows(decode.rows).get("hbm_read")
    if read:
        ax.axhline(read, color="black", linestyle="--", linewidth=0.8, label="hbm_read")
        ax.legend(fontsize=8)
    ax.set_xticks(range(len(rows)), labels, rotation=35, ha="right", fontsize=7)
    ax.set_ylabel("GB/s of K and V read")
    ax.set_title("Batch-1 decode, context 131072, h_q=32, h_kv=8, d=128, fp16", fontsize=10)
    fig.tight_layout()
    return fig


def plot_ring(ring):
    """Left: scaling efficiency against N, causal and not. Right: rank 0's ring steps at
    ``HEADLINE_N`` causal: compute, and the wait for the next K/V block that was not hidden,
    beside what one hop takes alone."""
    P = world_size(ring.provenance)
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4))
    for causal in (True, False):
        rs = ring_rows(ring.rows, causal)
        ax.plot([r.N_q for r in rs], [efficiency(r) for r in rs], "o-",
                label="causal (zig-zag)" if causal else "non-causal")
    ax.axhline(85, color="gray", linestyle=":", linewidth=0.8, label="85 %")
    ax.set_xscale("log", base=2)
    ax.set_ylim(0, 110)
    ax.set_xlabel("sequence length N")
    ax.set_ylabel(f"scaling efficiency on {P} GPUs (%)")
    ax.legend(fontsize=8)
    steps = ring.provenance.get("timeline", {}).get(f"N={HEADLINE_N},causal=True", [])
    if steps:
        xs = [s["step"] for s in steps]
        bx.bar(xs, [s["compute_ms"] for s in steps], label="compute (attention + merge)")
        bx.bar(xs, [s["wait_ms"] for s in steps], bottom=[s["compute_ms"] for s in steps],
               color="C3", label="exposed wait for K/V")
        hop = _hop_ms(ring.rows)
        if hop:
            bx.axhline(hop, color="black", linestyle="--", linewidth=0.8,
                       label=f"one K/V hop alone ({hop:.2f} ms)")
        bx.set_xticks(xs, [f"step {x}" for x in xs])
        bx.set_ylabel("ms")
        bx.set_title(f"rank 0's ring steps, N = {HEADLINE_N}, causal", fontsize=10)
        bx.legend(fontsize=8)
    fig.tight_layout()
    return fig


def _hop_ms(rows) -> float | None:
    r = find(rows, RING, HEADLINE_N, True)
    m = re.search(r"one hop alone ([\d.]+) ms", (r.note if r else "") or "")
    return float(m.group(1)) if m else None


def quoted_values(decode_rows_) -> dict:
    """The figures Section 7 quotes (``flashbook.quoted``), by glue key (the contract passes
    the one-GPU rows; the ring's are read here): split-KV against cuDNN, the read ceiling and
    the no-split kernel; the ring's efficiency and its 1-GPU and context_parallel times at
    N = ``HEADLINE_N``."""
    g = decode_rows(results.as_called(decode_rows_))     # decode_split_kv as called
    kernels = decode_rows(decode_rows_)                  # its kernels, from a CUDA graph
    need = (SPLIT, "sdpa_cudnn", "hbm_read", NO_SPLIT)
    if any(k not in g for k in need):
        raise ValueError(f"ch8: the decode data lacks one of {need}")
    out = {"ch8_split_gbps": g[SPLIT], "ch8_cudnn_gbps": g["sdpa_cudnn"],
           "ch8_hbm_read_gbps": g["hbm_read"], "ch8_split_vs_cudnn": g[SPLIT] / g["sdpa_cudnn"],
           "ch8_split_pct_hbm_read": 100 * g[SPLIT] / g["hbm_read"],
           "ch8_split_kernels_gbps": kernels[SPLIT],
           "ch8_split_kernels_vs_cudnn": kernels[SPLIT] / g["sdpa_cudnn"],
           "ch8_no_split_gbps": g[NO_SPLIT]}
    ring = results.recorded("ch8", "h200x2")
    if ring is None:
        raise ValueError("ch8: no recorded two-GPU ring data (h200x2)")
    r = find(ring.rows, RING, HEADLINE_N, True)
    one, cp = find(ring.rows, ONE_GPU, HEADLINE_N, True), find(ring.rows, CP, HEADLINE_N, True)
    out.update(ch8_ring_ms=r.ms, ch8_one_gpu_ms=one.ms, ch8_ring_efficiency=efficiency(r))
    if cp is not None and cp.ms:
        out["ch8_context_parallel_ms"] = cp.ms
    return out
