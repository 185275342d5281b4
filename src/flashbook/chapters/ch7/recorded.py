"""Chapter 7's recorded benchmark (``benchmark.py`` documents the rows), read back: each trick's
speed and error change against the same kernel without it, a figure, and the figures the chapter
quotes (``CHAPTER.figures``)."""
from __future__ import annotations

import matplotlib.pyplot as plt

from .benchmark import PROBES, TRICKS

KERNELS = {"ch3_two_tiles": "Chapter 3's two-tile Triton kernel",
           "ch6_gluon_fa3": "Chapter 6's Gluon FA3 kernel"}
LABELS = {"_lazy": "lazy rescale", "_poly": "poly exp2", "_lazy_poly": "both",
          "_poly_half": "poly on half", "_exp_x2": "probe: exp x2", "_no_exp": "probe: no exp"}
HEADLINE = (1, 16, 16384, 128, "float16")


def case(row) -> tuple:
    return (row.B, row.H_q, row.N_q, row.d, row.dtype)


def error_of(row) -> float | None:
    return next((float(p.strip()[4:]) for p in (row.note or "").split(";")
                 if p.strip().startswith("err=")), None)


def find(rows, kernel: str, case_: tuple, public: bool = False):
    return next((r for r in rows if r.kernel == kernel and (r.role == "public") == public
                 and case(r) == tuple(case_)), None)


def change(rows, kernel: str, suffix: str, case_: tuple) -> float | None:
    """Speed of ``kernel + suffix`` over ``kernel`` as is on one case (1.0: no change)."""
    base, other = find(rows, kernel, case_), find(rows, kernel + suffix, case_)
    if base is None or other is None or not base.tflops or not other.tflops:
        return None
    return other.tflops / base.tflops


def cases(rows) -> list[tuple]:
    return list(dict.fromkeys(case(r) for r in rows))


def _label(c) -> str:
    B, H, N, d, dtype = c
    return f"({B},{H},{N},{d}) {'bf16' if dtype == 'bfloat16' else 'fp16'}"


def summary(rows) -> str:
    """Per case and kernel: TFLOP/s as is, then each setting's speed change and error."""
    lines = []
    for c in cases(rows):
        for kernel, name in KERNELS.items():
            base = find(rows, kernel, c)
            if base is None or base.tflops is None:
                continue
            parts = [f"as is {base.tflops:.0f} TFLOP/s (err {error_of(base):.1e})"]
            for suffix in TRICKS:
                ratio = change(rows, kernel, suffix, c)
                if suffix and ratio is not None:
                    err = error_of(find(rows, kernel + suffix, c))
                    parts.append(f"{LABELS[suffix]} {ratio:.2f}x"
                                 + ("" if suffix in PROBES else f" (err {err:.1e})"))
            lines.append(f"{_label(c)} {name}: " + ", ".join(parts))
        line = lazy_as_called(rows, c)
        if line:
            lines.append(f"{_label(c)} {line}")
    return "\n".join(lines)


def lazy_as_called(rows, case_: tuple) -> str | None:
    """The chapter's ``attention_lazy`` on one case: as a reader calls it, against its config
    passed and replayed from a CUDA graph; None where either was not measured."""
    graph = find(rows, "ch7_attention_lazy", case_)
    called = find(rows, "ch7_attention_lazy", case_, public=True)
    if graph is None or called is None or not graph.tflops or not called.tflops:
        return None
    return (f"attention_lazy(q, k, v) as called: {called.tflops:.0f} TFLOP/s, "
            f"{called.tflops / graph.tflops:.2f}x its launch replayed from a CUDA graph")


def plot_recorded(rows):
    """Speed of each setting relative to the kernel as is (1.0 = unchanged), one panel per
    kernel, a group of bars per case."""
    fig, axes = plt.subplots(1, len(KERNELS), figsize=(13, 4.2), sharey=True)
    settings = [s for s in TRICKS if s]
    for ax, (kernel, name) in zip(axes, KERNELS.items()):
        here = [c for c in cases(rows) if find(rows, kernel, c) is not None]
        width = 0.8 / len(settings)
        for i, suffix in enumerate(settings):
            values = [change(rows, kernel, suffix, c) or 0.0 for c in here]
            xs = [j + (i - len(settings) / 2 + 0.5) * width for j in range(len(here))]
            if any(values):
                ax.bar(xs, values, width, label=LABELS[suffix], color=f"C{i}",
                       hatch="//" if suffix in PROBES else None)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(here)), [_label(c) for c in here], rotation=20, fontsize=8)
        ax.set_title(name, fontsize=10)
        ax.set_ylim(0, 1.15)
    axes[0].set_ylabel("speed relative to the kernel as is")
    axes[-1].legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    return fig


def quoted_values(rows) -> dict:
    """The figures Section 9 quotes (``flashbook.quoted``), by glue key: at ``HEADLINE``, each
    kernel's speed change with each trick and with each probe."""
    out = {}
    for kernel in KERNELS:
        for trick in ("_lazy", "_poly", "_exp_x2", "_no_exp"):
            ratio = change(rows, kernel, trick, HEADLINE)
            if ratio is None:
                raise ValueError(f"ch7: no measured {kernel} rows at {HEADLINE} to quote")
            out[f"ch7_{kernel}{trick}"] = ratio
    return out
