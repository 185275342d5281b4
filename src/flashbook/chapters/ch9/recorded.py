"""Chapter 9's recorded H200 benchmark, read back: the backward and forward + backward of each
kernel against cuDNN's and FlashAttention-2's, one figure, and the figures the chapter
quotes (``CHAPTER.figures``).

Rows come from ``flashbook bench ch9`` (``benchmark.py`` documents them: ``ch9_bwd``,
``ch9_fwdbwd``, the variants ``ch9_bwd_atomic``, ``ch9_bwd_fused``, ``ch9_bwd_gluon`` and
``ch9_bwd_gluon_ws``, and SDPA's ``sdpa_cudnn_*`` and ``sdpa_flash_*``). Use with
``results.recorded("ch9")``, which is None until the data exists.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import matplotlib.pyplot as plt

from flashbook import results

from . import ws_recorded

# Nsight Compute's profile of the Gluon backward at the headline shape (its header says how)
PROFILE = Path(__file__).resolve().parents[2] / "data" / "profiles" / "ch9_gluon_bwd_h200_ncu.txt"
HEADLINE = (16384, 128, "float16")          # (N, d, dtype) of the backward sentences
CS336 = (16384, 64, "bfloat16")             # the leaderboard's forward + backward, causal
LABELS = {"ch9_bwd": "ours: two kernels", "ch9_bwd_fused": "ours: one kernel, TMA-reduced dQ",
          "ch9_bwd_atomic": "ours: one kernel, scalar atomics",
          "ch9_bwd_gluon": "ours: one kernel in Gluon (FA3's structure)",
          "ch9_bwd_gluon_ws": "ours: warp-specialized Gluon (FA3's roles)",
          "sdpa_cudnn_bwd": "cuDNN",
          "sdpa_flash_bwd": "FlashAttention-2 (SDPA)", "ch9_fwdbwd": "ours",
          "sdpa_cudnn_fwdbwd": "cuDNN", "sdpa_flash_fwdbwd": "FlashAttention-2 (SDPA)"}


def find(rows, kernel: str, case: tuple, causal: bool):
    """The row of ``kernel`` at ``case`` = (N, d, dtype), or None."""
    return next((r for r in rows if r.kernel == kernel and (r.N_q, r.d, r.dtype) == case
                 and r.causal == causal and r.tflops is not None and r.role != "public"),
                None)


def kind(row) -> str:
    """"fwdbwd" for forward + backward rows, "bwd" for the backward alone (variants included)."""
    return "fwdbwd" if row.kernel.endswith("_fwdbwd") else "bwd"


def _need(rows, kernel, case, causal):
    r = find(rows, kernel, case, causal)
    if r is None:
        raise ValueError(f"ch9: no measured {kernel} row at {case}, causal={causal}, to quote")
    return r


def summary(rows) -> str:
    """One line per case and kind (backward alone, forward + backward): each kernel's time and
    TFLOP/s, and ours against cuDNN and FlashAttention-2."""
    lines = []
    for case in dict.fromkeys((r.N_q, r.d, r.dtype) for r in rows):
        for causal in (False, True):
            for what in ("bwd", "fwdbwd"):
                here = [r for r in rows if (r.N_q, r.d, r.dtype) == case
                        and r.causal == causal and kind(r) == what]
                ours = find(here, f"ch9_{what}", case, causal)
                if not here or ours is None:
                    continue
                parts = [f"{r.kernel} {r.ms:.2f} ms ({r.tflops:.0f})" for r in here
                         if r.tflops is not None]
                for base in ("sdpa_cudnn", "sdpa_flash"):
                    b = find(here, f"{base}_{what}", case, causal)
                    if b is not None:
                        parts.append(f"ours/{base} {ours.tflops / b.tflops:.2f}x")
                N, d, dtype = case
                lines.append(f"N={N} d={d} {dtype} {'causal' if causal else 'non-causal'} "
                             f"{what}: " + ", ".join(parts))
    return "\n".join(lines)


def plot_recorded(rows):
    """TFLOP/s of the backward alone at the headline shape (every design, causal and not) and
    forward + backward at every case."""
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.2))
    bwd = [dataclasses.replace(r, kernel=LABELS.get(r.kernel, r.kernel))
           for r in rows if kind(r) == "bwd"]
    results.plot(bwd, "tflops", x=("causal",), by="kernel", kind="bar", ax=axes[0],
                 values=True, title="backward alone, (1, 16, 16384, 128) fp16")
    both = [dataclasses.replace(r, kernel=LABELS.get(r.kernel, r.kernel),
                                dtype="bf16" if r.dtype == "bfloat16" else "fp16")
            for r in rows if kind(r) == "fwdbwd"]
    results.plot(both, "tflops", x=("d", "dtype", "causal"), by="kernel", kind="bar",
                 ax=axes[1], values=True, title="forward + backward, N = 16384, 16 heads")
    for ax in axes:                 # room above the bars for a legend of two or three columns
        ax.set_ylim(0, ax.get_ylim()[1] * 1.35)
        ax.legend(loc="upper center", ncol=3 if ax is axes[1] else 2, fontsize=8)
    fig.tight_layout()
    return fig


_PROFILE_METRICS = {
    "tensor": r"Tensor is the highest-utilized pipeline \(([\d.]+)%\)",
    "shared": r"L1/TEX Cache Throughput\s+%\s+([\d.]+)",
    "no_eligible": r"No Eligible\s+%\s+([\d.]+)",
    "warps": r"Active Warps Per Scheduler\s+warp\s+([\d.]+)",
    "registers": r"Registers Per Thread\s+register/thread\s+([\d.]+)",
}


def profile_metrics(path=PROFILE) -> dict:
    """The figures Section 7 quotes from the stored Nsight Compute profile: the tensor pipe's
    and the L1/shared memory's utilisation (% of peak), the % of scheduler cycles with no warp
    eligible to issue, the warps per scheduler and the registers per thread."""
    return results.profile_figures(path, _PROFILE_METRICS, "ch9")


def quoted_values(rows) -> dict:
    """The figures Section 7 quotes (``flashbook.quoted``), by glue key: the backward against
    cuDNN's and FlashAttention-2's at the headline shape, causal and not; the one-kernel
    variants; the Gluon backward against cuDNN, and its profile (``PROFILE``: the keys
    ``ch9_profile_*``); the CS336 configuration's forward + backward in ms, the training step
    as a reader writes it where that was recorded (``results.as_called``). Raises ValueError
    when a row is missing."""
    rows = results.as_called(rows)
    out = {}
    for causal in (False, True):
        label = "causal" if causal else "noncausal"
        ours = _need(rows, "ch9_bwd", HEADLINE, causal)
        cudnn = _need(rows, "sdpa_cudnn_bwd", HEADLINE, causal)
        fa2 = _need(rows, "sdpa_flash_bwd", HEADLINE, causal)
        gluon = _need(rows, "ch9_bwd_gluon", HEADLINE, causal)
        out.update({f"ch9_bwd_tflops_{label}": ours.tflops,
                    f"ch9_cudnn_tflops_{label}": cudnn.tflops,
                    f"ch9_fa2_tflops_{label}": fa2.tflops,
                    f"ch9_bwd_vs_cudnn_{label}": ours.tflops / cudnn.tflops,
                    f"ch9_bwd_vs_fa2_{label}": ours.tflops / fa2.tflops,
                    f"ch9_gluon_tflops_{label}": gluon.tflops,
                    f"ch9_gluon_vs_cudnn_{label}": gluon.tflops / cudnn.tflops})
    for kernel, key in (("ch9_bwd_atomic", "atomic"), ("ch9_bwd_fused", "fused"),
                        ("ch9_bwd", "two_kernels")):
        out[f"ch9_{key}_ms"] = _need(rows, kernel, HEADLINE, False).ms
    out.update({f"ch9_profile_{k}": v for k, v in profile_metrics().items()})
    for kernel, key in (("ch9_fwdbwd", "fwdbwd"), ("sdpa_cudnn_fwdbwd", "cudnn_fwdbwd"),
                        ("sdpa_flash_fwdbwd", "fa2_fwdbwd")):
        out[f"ch9_{key}_ms"] = _need(rows, kernel, CS336, True).ms
    ws = ws_recorded.record()            # the warp-specialized backward's ablation (ch9_ws_*)
    return out | (ws_recorded.values(ws) if ws else {}) | ws_recorded.profile_values()
