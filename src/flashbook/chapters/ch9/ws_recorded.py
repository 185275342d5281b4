"""Chapter 9's record of the warp-specialized Gluon backward's ablation, read back: the figures
Section 7's table quotes. The record is what ``solutions/extras/
ch9_ws_bwd_bench.py --ablation --record`` wrote on a GPU, one JSON per GPU in ``DATA_DIR``; like
the chapter's benchmark, the prose quotes one GPU's record (None until one exists).

A row is one (shape, causal) case: TFLOP/s by variant, where a variant is named as the script
named it when it ran ("all on" or "default", "<switch> on/off", the one-kernel backward, cuDNN),
so the glue keys name the variant (``ch9_ws_<variant>_<causal|noncausal>``) and a new record
with other variants fails the book's build until the prose follows it."""
from __future__ import annotations

import re
from pathlib import Path

from flashbook import results

DATA_DIR = Path(__file__).resolve().parents[2] / "data" / "ws_bwd"
CUDNN = "cudnn"
# Nsight Compute profiles at (1, 16, 16384, 128) fp16 (each header gives its command): the
# warp-specialized backward's and, to compare with, Chapter 6's forward's
PROFILES = Path(__file__).resolve().parents[2] / "data" / "profiles"
PROFILED = {"ws": "ch9_ws_bwd_h100_{}_ncu.txt", "fwd": "ch6_fa3_fwd_h100_{}_ncu.txt"}
_PROFILE_METRICS = {
    "pipe": r"Shared is the highest-utilized pipeline \(([\d.]+)%\)",    # tensor-core dominated
    "no_eligible": r"No Eligible\s+%\s+([\d.]+)",
    "spills": r"Local Memory Spilling Requests\s+([\d,]+)",
}
QUOTED = (("ws", "pipe", "noncausal"), ("ws", "pipe", "causal"), ("ws", "no_eligible", "noncausal"),
          ("ws", "spills", "noncausal"), ("fwd", "pipe", "noncausal"),
          ("fwd", "no_eligible", "noncausal"))


def record() -> dict | None:
    """The one GPU's record, or None; several records are an error (the prose quotes one)."""
    return results.one_record(DATA_DIR, "ch9: warp-specialized backward")


def slug(variant: str) -> str:
    """'longest_first off' -> 'longest_first_off'; 'one kernel, no warp specialization' ->
    'one_kernel' (the words before a comma)."""
    return re.sub(r"\W+", "_", variant.split(",")[0].strip()).strip("_")


def values(rec: dict) -> dict:
    """Glue key -> figure: the GPU; per case, every variant's TFLOP/s and its ratio to cuDNN's
    backward timed in the same run."""
    out = {"ch9_ws_gpu": rec["provenance"]["gpu"].replace("NVIDIA ", "")}
    for row in rec["rows"]:
        label = "causal" if row["causal"] else "noncausal"
        cudnn = row["tflops"][CUDNN]
        for variant, tflops in row["tflops"].items():
            out[f"ch9_ws_{slug(variant)}_{label}"] = tflops
            if variant != CUDNN:
                out[f"ch9_ws_{slug(variant)}_vs_cudnn_{label}"] = tflops / cudnn
    return out


def profile_values(directory: Path = PROFILES) -> dict:
    """Glue key -> figure read from the stored profiles, for each of ``QUOTED``:
    ``ch9_profile_<kernel>_<metric>_<causal|noncausal>``, metric ``pipe`` (the tensor-dominated
    shared pipeline's utilisation, %), ``no_eligible`` (% of scheduler cycles with no warp
    ready) or ``spills`` (local-memory spill requests, millions). ValueError if one is missing."""
    out = {}
    for kernel, metric, label in QUOTED:
        path = directory / PROFILED[kernel].format(label)
        value = results.profile_figures(path, {metric: _PROFILE_METRICS[metric]}, "ch9")[metric]
        out[f"ch9_profile_{kernel}_{metric}_{label}"] = value / (1e6 if metric == "spills" else 1)
    return out
