"""Chapter 6's FP8 record (``python -m flashbook.fp8_bench``), read back: the figures Section 8
quotes and its plot. One JSON per GPU in ``DATA_DIR``; like the chapter's benchmark, the prose
quotes one GPU's record (None until one exists). Also the figures Section 8 quotes from the
Nsight Compute profile of the Gluon kernel's fastest path (``PROFILE``)."""
from __future__ import annotations

import inspect
import re
from pathlib import Path

import matplotlib.pyplot as plt

from flashbook import results

from .fp8 import attention_fp8

DATA_DIR = Path(__file__).resolve().parents[2] / "data" / "fp8"
FP8, FP16, CUDNN = "ch6_attention_fp8", "ch6_attention_fa3_fp16", "sdpa_cudnn_fp16"
GLUON = "ch6_attention_fp8_gluon"          # attention_fp8_gluon, its default config; variants:
GLUON_EXP2_FMA, GLUON_SPERM = GLUON + "_exp2_fma", GLUON + "_sperm"
GLUON_SPERM_FMA4, GLUON_SPERM_FMA8 = GLUON + "_sperm_fma4", GLUON + "_sperm_fma8"
# the stored profile of attention_fp8_gluon(p_path="sperm") at fp8_bench.SHAPE (its header says
# how it was made) and the figures the prose quotes from it, each the first group of its pattern
PROFILE = DATA_DIR.parent / "profiles" / "ch6_fp8_sperm_h100_noncausal_ncu.txt"
PROFILE_METRICS = {
    "tensor": r"sm__pipe_tensor_cycles_active\.avg\.pct_of_peak_sustained_active\s+%\s+([\d.]+)",
    "xu": r"sm__inst_executed_pipe_xu\.avg\.pct_of_peak_sustained_active\s+%\s+([\d.]+)",
    "issue": r"Issue Slots Busy\s+%\s+([\d.]+)",
    "no_eligible": r"No Eligible\s+%\s+([\d.]+)",
    "clock": r"SM Frequency\s+Ghz\s+([\d.]+)"}
ERRORS = {"fp8": "fp8", "fp8_rotated": "fp8, rotated", "fp8_gluon": "fp8 Gluon",
          "fp8_gluon_exp2_fma": "fp8 Gluon, exp2_fma",
          "fp8_gluon_sperm_fma8": "fp8 Gluon, sperm, 1/8 on FMA", "fp16_sdpa": "fp16 SDPA"}


def record() -> dict | None:
    """The one GPU's FP8 record, or None (``results.one_record``)."""
    return results.one_record(DATA_DIR, "ch6: FP8")


def default_config() -> str:
    """The note ``fp8_bench`` gives the rows timed with ``attention_fp8``'s default tiles."""
    p = inspect.signature(attention_fp8).parameters
    return "BLOCK_M={} BLOCK_N={} warps={} stages={}".format(
        *(p[k].default for k in ("block_m", "block_n", "num_warps", "num_stages")))


def best(rec: dict, kernel: str, causal: bool, config: str | None = None) -> dict:
    """``kernel``'s fastest row over its tile configs, or of those whose note starts ``config``."""
    rows = [r for r in rec["speed"] if r["kernel"] == kernel and r["causal"] == causal
            and (config is None or r["note"].startswith(config))]
    if not rows:
        raise ValueError(f"ch6: the FP8 record has no {kernel} row, causal={causal}"
                         + (f", {config}" if config else ""))
    return max(rows, key=lambda r: r["tflops"])


def error(rec: dict, kernel: str, causal: bool) -> float:
    return next(r["rms_error"] for r in rec["accuracy"]
                if r["kernel"] == kernel and r["causal"] == causal)


def values(rec: dict) -> dict:
    """Glue key -> figure (``flashbook.quoted``): the GPU; TFLOP/s of the fp8 kernel's default
    tiles (as ``attention_fp8`` runs unless told otherwise) over the fp16 forward and cuDNN, and
    of the Gluon one's variants (``fp8_bench.GLUON_VARIANTS``); the RMS error without and with the
    rotation, the gain; ``fp8_bench.sass_counts``'s figures of the Gluon main loop."""
    out = {"ch6_fp8_gpu": rec["provenance"]["gpu"].replace("NVIDIA ", "")}
    for causal in (False, True):
        label = "causal" if causal else "noncausal"
        fp8 = out[f"ch6_fp8_tflops_{label}"] = best(rec, FP8, causal, default_config())["tflops"]
        out[f"ch6_fp8_vs_fp16_{label}"] = fp8 / best(rec, FP16, causal)["tflops"]
        out[f"ch6_fp8_vs_cudnn_{label}"] = fp8 / best(rec, CUDNN, causal)["tflops"]
        for name, kernel in zip(("gluon", "sperm", "sperm_fma4", "sperm_fma8"),
                                (GLUON, GLUON_SPERM, GLUON_SPERM_FMA4, GLUON_SPERM_FMA8)):
            tflops = out[f"ch6_fp8_{name}_tflops_{label}"] = best(rec, kernel, causal)["tflops"]
            out[f"ch6_fp8_{name}_vs_fp16_{label}"] = tflops / best(rec, FP16, causal)["tflops"]
        fma = out[f"ch6_fp8_exp2_fma_tflops_{label}"] = best(rec, GLUON_EXP2_FMA, causal)["tflops"]
        out[f"ch6_fp8_exp2_fma_vs_mufu_{label}"] = fma / out[f"ch6_fp8_gluon_tflops_{label}"]
        for kernel in ("fp8_gluon", "fp8_gluon_exp2_fma", "fp8_gluon_sperm_fma8"):
            out[f"ch6_{kernel}_err_{label}"] = error(rec, kernel, causal)
        plain = out[f"ch6_fp8_err_plain_{label}"] = error(rec, "fp8", causal)
        rotated = out[f"ch6_fp8_err_rotated_{label}"] = error(rec, "fp8_rotated", causal)
        out[f"ch6_fp8_err_gain_{label}"] = plain / rotated
    return out | {f"ch6_fp8_sass_{k}": v for k, v in rec["sass"]["figures"].items()}


def profile_values(path: Path = PROFILE) -> dict:
    """Glue key -> figure of the stored profile: ``ch6_fp8_prof_<metric>`` for each of
    ``PROFILE_METRICS`` (tensor pipe and XU (exponential) pipe busy, issue slots busy, cycles
    with no eligible warp, all % of the active cycles; ncu's locked SM clock, GHz) and
    ``ch6_fp8_prof_gpu``. ValueError naming the report and the figure when one is missing."""
    path = Path(path)
    out = {f"ch6_fp8_prof_{k}": v for k, v in
           results.profile_figures(path, PROFILE_METRICS, "ch6: FP8 profile").items()}
    gpu = re.search(r"^# gpu: NVIDIA ([^,]+),", path.read_text(), re.M)
    if gpu is None:
        raise ValueError(f"ch6: FP8 profile: the profile {path.name} has no '# gpu:' line")
    return out | {"ch6_fp8_prof_gpu": gpu.group(1)}


def _label(note: str) -> str:
    """'BLOCK_M=64 BLOCK_N=128 warps=4 stages=3' -> 'fp8 64x128, 4 warps, 3 stages (default)'."""
    v = dict(part.split("=") for part in note.split() if "=" in part)
    return (f"fp8 {v['BLOCK_M']}x{v['BLOCK_N']}, {v['warps']} warps, {v['stages']} stages"
            + (" (default)" if note.startswith(default_config()) else ""))


def plot(rec: dict):
    """Left: TFLOP/s of the fp8 kernel (each tile config timed), the Gluon one without and with
    ``exp2_fma``, the fp16 forward and cuDNN; right: RMS error against float64 (log)."""
    fig, (speed, err) = plt.subplots(1, 2, figsize=(12, 4.6))
    configs = list(dict.fromkeys(r["note"] for r in rec["speed"] if r["kernel"] == FP8))
    bars_of = [(_label(c), FP8, c) for c in configs] + [(label, kernel, None) for label, kernel in (
        ("fp8 Gluon (default)", GLUON), ("fp8 Gluon, exp2_fma", GLUON_EXP2_FMA),
        ("fp8 Gluon, sperm", GLUON_SPERM), ("fp8 Gluon, sperm, 1/4 on FMA", GLUON_SPERM_FMA4),
        ("fp8 Gluon, sperm, 1/8 on FMA", GLUON_SPERM_FMA8), ("fp16 (Gluon FA3)", FP16),
        ("fp16 cuDNN", CUDNN))]
    width = 0.8 / len(bars_of)
    for i, (label, kernel, config) in enumerate(bars_of):
        ys = [best(rec, kernel, c, config)["tflops"] for c in (False, True)]
        bars = speed.bar([x + i * width for x in (0, 1)], ys, width, label=label)
        speed.bar_label(bars, fmt="%.0f", fontsize=7)
    centre = width * (len(bars_of) - 1) / 2
    speed.set(xticks=[centre, 1 + centre], xticklabels=["non-causal", "causal"], ylabel="TFLOP/s",
              title=f"{tuple(rec['shape'])}, {rec['provenance']['gpu']}")
    speed.legend(fontsize=7, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.12))
    width = 0.8 / len(ERRORS)
    for i, (kernel, label) in enumerate(ERRORS.items()):
        ys = [error(rec, kernel, c) for c in (False, True)]
        bars = err.bar([x + i * width for x in (0, 1)], ys, width, label=label)
        err.bar_label(bars, fmt="%.1e", fontsize=7)
    err.set(yscale="log", xticks=[2 * width, 1 + 2 * width], xticklabels=["non-causal", "causal"],
            ylabel="RMS error against float64",
            title=f"outlier channels, {tuple(rec['accuracy_shape'])}")
    err.legend(fontsize=8)
    fig.tight_layout()
    return fig
