"""Chapter 6's recorded H200 benchmark (``benchmark``), read back: a summary, a figure and the
figures the chapter quotes. A row whose O was flagged far from cuDNN's (``WRONG`` in its note)
is never quoted as a speed. Use with ``results.recorded("ch6")`` (None until the data exists).
"""
from __future__ import annotations

import dataclasses

import matplotlib.pyplot as plt

from flashbook import fa3_ablation, results

from . import fp8_recorded
from .benchmark import JAX_FA3, OURS, PALLAS
HEADLINE = (1, 16, 16384, 128)           # (B, H, N, d) of the sentences against cuDNN
# The kernels in the plots' and summaries' order; Chapters 3 and 4's two-tile kernel share a bar.
LABELS = {OURS: "ours (Gluon FA3)", PALLAS: "students' Pallas FA3",
          JAX_FA3: "JAX's Pallas FA3", "ch3_two_tiles": "Triton two-tile (ch3/ch4)",
          "ch4_two_tiles": "Triton two-tile (ch3/ch4)", "sdpa_cudnn": "cuDNN SDPA",
          "sdpa_flash": "FlashAttention-2 (SDPA)"}
ORDER = list(LABELS)
_SHORT = {"float16": "fp16", "bfloat16": "bf16"}


def shape(row) -> tuple:
    return (row.B, row.H_q, row.N_q, row.d)


def measured(row) -> bool:
    """A row with a speed that may be quoted: timed, and its O agreed with cuDNN's."""
    return row is not None and row.tflops is not None and "WRONG" not in (row.note or "")


def find(rows, kernel: str, shape_: tuple, causal: bool, dtype: str = "float16"):
    """The row of one kernel on one case (not its public row), or None."""
    return next((r for r in rows if r.kernel == kernel and shape(r) == tuple(shape_)
                 and r.causal == causal and r.dtype == dtype and r.role != "public"), None)


def shapes(rows, dtype: str = "float16") -> list[tuple]:
    """The (B, H, N, d) of the rows of ``dtype``, in the order measured."""
    return list(dict.fromkeys(shape(r) for r in rows if r.dtype == dtype))


def _kernels(rows) -> list[str]:
    present = {r.kernel for r in rows}
    return [k for k in ORDER if k in present] + sorted(present - set(ORDER))


def _fmt(x: float) -> str:
    return f"{x:.0f}" if x >= 10 else f"{x:.2g}"


def _case(dtype, causal, s) -> str:
    return f"{_SHORT.get(dtype, dtype)} {'causal' if causal else 'non-causal'} {s}"


def summary(rows) -> str:
    """One line per case: each kernel's TFLOP/s and ours against it; then what was not
    measured (or was wrong), and why."""
    lines, failed = [], []
    for dtype in dict.fromkeys(r.dtype for r in rows):
        for s in shapes(rows, dtype):
            for causal in (False, True):
                here = [r for r in rows if r.dtype == dtype and shape(r) == s
                        and r.causal == causal]
                if not here:
                    continue
                ours = find(here, OURS, s, causal, dtype)
                parts = []
                for k in _kernels(here):
                    r = find(here, k, s, causal, dtype)
                    if not measured(r):
                        failed.append(f"  {_case(dtype, causal, s)} {k}: {r.note}")
                        continue
                    part = f"{k} {_fmt(r.tflops)}"
                    if k == OURS and r.pct_peak is not None:
                        part += f" ({r.pct_peak:.0f}% of peak)"
                    elif k != OURS and measured(ours):
                        part += f" (ours {ours.tflops / r.tflops:.2f}x)"
                    parts.append(part)
                lines.append(f"{_case(dtype, causal, s)}: " + "; ".join(parts) + " TFLOP/s")
    if failed:
        lines += ["not measured or wrong:"] + failed
    return "\n".join(lines)


def plot_recorded(rows):
    """TFLOP/s bars: a panel per (dtype, causal), a group per shape, a bar per measured kernel."""
    dtypes = list(dict.fromkeys(r.dtype for r in rows))
    fig, axes = plt.subplots(len(dtypes), 2, figsize=(13, 3.9 * len(dtypes)), squeeze=False)
    for i, dtype in enumerate(dtypes):
        for j, causal in enumerate((False, True)):
            ax = axes[i][j]
            here = [dataclasses.replace(r, kernel=LABELS.get(r.kernel, r.kernel),
                                        tflops=r.tflops if measured(r) else None)
                    for r in sorted(rows, key=lambda r: ORDER.index(r.kernel)
                                    if r.kernel in ORDER else len(ORDER))
                    if r.dtype == dtype and r.causal == causal]
            if not here:
                ax.set_visible(False)
                continue
            title = f"{_SHORT.get(dtype, dtype)}, {'causal' if causal else 'non-causal'}"
            results.plot(here, "tflops", x=("B", "H_q", "N_q", "d"), by="kernel", kind="bar",
                         ax=ax, values=True, title=title)
            if (i, j) != (0, 0) and ax.get_legend():
                ax.get_legend().remove()
    fig.tight_layout()
    return fig


def _key(s: tuple, causal: bool) -> str:
    return "_".join(map(str, (s[0], s[2], s[3]))) + ("_causal" if causal else "_noncausal")


def quoted_values(rows) -> dict:
    """The quoted figures by glue key (fp16; ``flashbook.quoted``): ours against cuDNN at
    ``HEADLINE`` and against JAX's FA3 where both were measured, ``attention_fa3`` as a reader
    calls it where recorded (``results.as_called``); ``ch6_fp8_*`` (``fp8_recorded``: its record
    and its stored profile) and ``ch6_abl_*`` (``fa3_ablation``), from records of their own.
    ValueError without headline."""
    rows = results.as_called(rows)
    out = {}
    for causal in (False, True):
        ours, cudnn = find(rows, OURS, HEADLINE, causal), find(rows, "sdpa_cudnn", HEADLINE, causal)
        if not (measured(ours) and measured(cudnn)):
            raise ValueError(f"ch6: no measured {OURS} and sdpa_cudnn rows at {HEADLINE}, "
                             f"causal={causal}, to quote")
        label = _key(HEADLINE, causal).split("_")[-1]
        out[f"ch6_cudnn_{label}"] = cudnn.tflops
        out[f"ch6_vs_cudnn_{label}"] = ours.tflops / cudnn.tflops
        for s in shapes(rows):
            ours, jax = find(rows, OURS, s, causal), find(rows, JAX_FA3, s, causal)
            if measured(ours):
                out[f"ch6_ours_{_key(s, causal)}"] = ours.tflops
            if measured(ours) and measured(jax):
                out[f"ch6_jax_{_key(s, causal)}"] = jax.tflops
                out[f"ch6_vs_jax_{_key(s, causal)}"] = ours.tflops / jax.tflops
    fp8, ablation = fp8_recorded.record(), fa3_ablation.record()      # records of their own
    return out | (fp8_recorded.values(fp8) if fp8 else {}) | fp8_recorded.profile_values() | (
        fa3_ablation.values(ablation) if ablation else {})
