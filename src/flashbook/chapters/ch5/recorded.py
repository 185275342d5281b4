"""Chapter 5's recorded H200 benchmark, read back: prefill (TFLOP/s) and decode (GB/s of K/V
read) against their baselines and the GPU's read ceiling, one figure of each, and the figures
the chapter quotes."""
from __future__ import annotations

import matplotlib.pyplot as plt

from flashbook import results
from flashbook.bench import PEAKS

from .figures import decode_intensity, prefill_intensity


def _row(rows, kernel, *, causal=None, decode=False, B=None, note="", group=4):
    for r in rows:
        if r.kernel == kernel and r.role != "public" and r.H_q == group * r.H_kv and \
                (causal is None or r.causal == causal) and (r.N_q == 1) == decode and \
                (B is None or r.B == B) and note in (r.note or "") and r.ms is not None:
            return r
    return None


def _name(r) -> str:
    """A row's key in the tables: its kernel, ``_public`` for the call as a reader makes it."""
    return r.kernel + ("_public" if r.role == "public" else "")


def prefill(rows, causal: bool, group: int = 4) -> dict:
    """{kernel: TFLOP/s} of the prefill rows of this group size (the expanded-K/V cuDNN row as
    sdpa_cudnn_expanded, a public row as <kernel>_public)."""
    out = {}
    for r in rows:
        if r.N_q > 1 and r.causal == causal and r.tflops and r.H_q == group * r.H_kv:
            name = _name(r) + ("_expanded" if "expanded" in (r.note or "") else "")
            out[name] = r.tflops
    return out


def decode(rows) -> dict:
    """{kernel (and page size): GB/s} of the batched decode rows and the ceilings."""
    out = {}
    for r in rows:
        if r.N_q == 1 and r.B > 1 and r.gbps:
            page = (r.note or "").split("page_size=")[1].split(";")[0] if "page_size=" in \
                (r.note or "") else ""
            out[_name(r) + (f"_{page}" if page else "")] = r.gbps
    return out


def summary(rows) -> str:
    lines = []
    for causal in (True, False):
        p = prefill(rows, causal)
        best = max(v for k, v in p.items() if not k.startswith("ch5"))
        lines.append(f"prefill {'causal' if causal else 'non-causal'}: " + ", ".join(
            f"{k} {v:.0f}" for k, v in p.items()) + f" TFLOP/s; two-tile M-fold "
            f"{p['ch5_two_tiles'] / best:.2f}x the fastest baseline")
    d = decode(rows)
    lines.append("decode (B=32, context 8192): " + ", ".join(f"{k} {v:.0f}" for k, v in d.items())
                 + " GB/s")
    return "\n".join(lines)


def plot_recorded(rows):
    fig, axes = plt.subplots(1, 2, figsize=(12, 3.8))
    ax = axes[0]
    for i, causal in enumerate((False, True)):
        p = prefill(rows, causal)
        ax.bar([x + 0.4 * i for x in range(len(p))], list(p.values()), 0.4,
               label="causal" if causal else "non-causal")
        ax.set_xticks([x + 0.2 for x in range(len(p))], list(p), rotation=30, ha="right",
                      fontsize=7)
    ax.set_ylabel("TFLOP/s")
    ax.set_title("prefill, (1, h_q=32, h_kv=8, N=16384, d=128)")
    ax.legend(fontsize=7)
    ax = axes[1]
    d = decode(rows)
    ax.barh(list(d), list(d.values()), color=["C0" if k.startswith("ch5") else "C7" for k in d])
    ax.set_xlabel("GB/s of K/V read (copy: read + written)")
    ax.set_title("decode, B=32, context 8192")
    for a in axes:
        a.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def quoted_values(rows) -> dict:
    """The figures the chapter quotes (``flashbook.quoted``), by glue key: the chapter's
    functions as a reader calls them (``results.as_called``); the paged kernels against the
    contiguous one as the benchmark launches both."""
    kernels = decode(rows)
    rows = results.as_called(rows)
    pc, pn = prefill(rows, True), prefill(rows, False)
    d = decode(rows)
    contiguous = d["ch5_decode"]
    return {
        "ch5_tflops_causal": pc["ch5_two_tiles"], "ch5_tflops_noncausal": pn["ch5_two_tiles"],
        "ch5_vs_best_causal": pc["ch5_two_tiles"] / max(
            v for k, v in pc.items() if not k.startswith("ch5")),
        "ch5_vs_best_noncausal": pn["ch5_two_tiles"] / max(
            v for k, v in pn.items() if not k.startswith("ch5")),
        "ch5_mfold_tflops_causal": pc["ch5_mfold"], "ch5_mfold_tflops_noncausal": pn["ch5_mfold"],
        "ch5_repeat_cost": pc["ch5_mfold"] / pc["ch5_per_head"],
        "ch5_flash_tflops": pc["sdpa_flash"], "ch5_flex_tflops": pc["flex_attention"],
        "ch5_decode_gbps": contiguous, "ch5_cudnn_gbps": d["sdpa_cudnn"],
        "ch5_decode_vs_cudnn": contiguous / d["sdpa_cudnn"],
        # the datasheet's TB/s is typed in the prose: a constant of the GPU, not a measurement
        "ch5_decode_pct_datasheet": 100 * contiguous / PEAKS["H200"][2],
        "ch5_decode_kernel_gbps": kernels["ch5_decode"], "ch5_hbm_read_gbps": d["hbm_read"],
        **{f"ch5_paged_{p}_gbps": d[f"ch5_decode_paged_{p}"] for p in (256, 64)},
        **{f"ch5_paged_{p}_vs_contiguous": kernels[f"ch5_decode_paged_{p}"] /
           kernels["ch5_decode"] for p in (256, 64)},
        "ch5_b1_gbps": _row(rows, "ch5_decode", decode=True, B=1).gbps,
        "ch5_b1_cudnn_gbps": _row(rows, "sdpa_cudnn", decode=True, B=1).gbps,
    }


def measured_points(rows) -> list:
    """(label, FLOP per byte of K/V, measured TFLOP/s) of the chapter's recorded decode (B=32)
    and non-causal prefill, for ``plot_roofline`` (cuDNN's lie on the same verticals)."""
    out = []
    r = _row(rows, "ch5_decode", decode=True, B=32)
    if r:
        out.append(("our decode", decode_intensity(r.H_q, r.H_kv, r.N_q, r.N_k, r.d), r.tflops))
    r = _row(rows, "ch5_two_tiles", causal=False, decode=False)
    if r:
        out.append(("our prefill", prefill_intensity(r.H_q, r.H_kv, r.N_q, r.d), r.tflops))
    return out
