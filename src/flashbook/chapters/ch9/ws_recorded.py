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
