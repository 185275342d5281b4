"""What each piece of Chapter 6's Gluon FA3 forward buys, measured in one run on an sm_90 GPU.

``python -m flashbook.fa3_ablation --commit SHA --out DIR`` writes ``DIR/<gpu>.json``: its
provenance and one row per (shape, causal) of ``SHAPES``, fp16, each with the TFLOP/s of

* ``default``: ``attention_fa3(q, k, v, causal)`` as a reader calls it (the planner's choice);
* ``grid``: the planner's tiles launched as a grid, one CTA per query tile (not persistent);
* ``two_consumers`` (d = 64 only, where the planner runs three consumer warpgroups): the
  fastest tiles with two, as a grid;
* ``persistent``: the two-consumer tiles, one CTA per SM walking a head-major snake
  (``GROUP=1``);
* ``no_overlap``: the planner's choice without the intra-warpgroup overlap (``OVERLAP=False``:
  the softmax of tile j waits for PV(j - 1) instead of running while it is on the tensor cores);
* ``cudnn``: cuDNN's SDPA forward;

and each Gluon variant's largest error against float32 SDPA at that shape, checked before it is
timed, the config each ran (``default``'s is the planner's pick) and each variant's ``ROUNDS``
timings (``rounds_ms``: their spread is the run's noise). Chapter 6 quotes the
record through ``values`` (glue keys ``ch6_abl_*``); ``DATA_DIR`` holds one record per GPU,
and the prose quotes one. Timed with ``bench.time_ms`` (``triton.testing.do_bench`` medians,
launched as a user launches), the variants in turn, ``ROUNDS`` times, the median of each.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import statistics
import sys
from pathlib import Path

import torch

from . import bench, results

DATA_DIR = Path(__file__).resolve().parent / "data" / "fa3_ablation"
SHAPES = ((1, 16, 16384, 128), (2, 16, 4096, 128), (1, 16, 16384, 64), (4, 16, 4096, 64))
VARIANTS = ("default", "grid", "two_consumers", "persistent", "no_overlap", "cudnn")


def variants(d: int) -> tuple:
    """The variants a row of head dim d has: ``two_consumers`` only at d = 64."""
    return tuple(v for v in VARIANTS if d == 64 or v != "two_consumers")
TOLERANCE = 2e-2        # fp16 O against float32 SDPA, max |error|
ROUNDS = 3


def configs(B: int, H: int, N: int, d: int, causal: bool) -> dict:
    """variant -> the ``Config`` it passes (None: none, the planner's choice)."""
    from flashbook import fa3_planner
    from flashbook.fa3_launch import pick_config
    pick = pick_config(d, torch.float16, causal, B, H, N, N)
    two = next(c for c, _ in fa3_planner.rank(d, B=B, H=H, N_q=N, causal=causal))
    out = dict(default=None, grid=dataclasses.replace(pick, PERSISTENT=False), two_consumers=two,
               persistent=dataclasses.replace(two, PERSISTENT=True, GROUP=1),
               no_overlap=dataclasses.replace(pick, OVERLAP=False))
    return {name: config for name, config in out.items() if name in variants(d)}


def measure_case(B: int, H: int, N: int, d: int, causal: bool) -> dict:
    """One row: every variant checked against float32 SDPA, then timed."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from flashbook.fa3_launch import attention_fa3, pick_config
    passed = configs(B, H, N, d, causal)
    picked = pick_config(d, torch.float16, causal, B, H, N, N)       # what "default" runs
    sdpa = torch.nn.functional.scaled_dot_product_attention
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, N, d, device="cuda", dtype=torch.float16) for _ in range(3))
    want = sdpa(q.float(), k.float(), v.float(), is_causal=causal)
    flops = 4 * B * H * N * N * d / (2 if causal else 1)
    row = dict(shape=[B, H, N, d], causal=causal, tflops={}, max_error={},
               config={name: repr(cfg or picked) for name, cfg in passed.items()})
    calls = {name: (lambda c=cfg: attention_fa3(q, k, v, causal=causal, config=c)[0])
             for name, cfg in passed.items()}

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return sdpa(q, k, v, is_causal=causal)
    calls["cudnn"] = cudnn
    for name, call in calls.items():
        err = (call().float() - want).abs().max().item()
        if not err <= TOLERANCE:           # NaN included: a wrong kernel is not timed
            raise RuntimeError(f"{name} at {row['shape']} causal={causal}: max |error| {err}")
        row["max_error"][name] = err
    # every variant timed in turn, ROUNDS times, each keeping its median: timed once each, the
    # call as a reader makes it and the grid launch (one kernel, one config) differed by 3 %
    rounds = [{name: bench.time_ms(call) for name, call in calls.items()} for _ in range(ROUNDS)]
    row["rounds_ms"] = {name: [round(r[name], 4) for r in rounds] for name in calls}
    for name in calls:
        ms = statistics.median(r[name] for r in rounds)
        row["tflops"][name] = round(flops / ms / 1e9, 1)
    return row


def measure(shapes=SHAPES) -> list[dict]:
    return [measure_case(*shape, causal) for shape in shapes for causal in (False, True)]


def record() -> dict | None:
    """The one GPU's record in ``DATA_DIR``, or None (``results.one_record``)."""
    return results.one_record(DATA_DIR, "ch6: forward ablation")


def spread_pct(rec: dict) -> float:
    """The largest (slowest / fastest - 1) * 100 over every row's and variant's rounds."""
    return max(100 * (max(ms) / min(ms) - 1) for row in rec["rows"]
               for ms in row["rounds_ms"].values())


def values(rec: dict) -> dict:
    """Glue key -> figure: the GPU; per row and variant, TFLOP/s
    (``ch6_abl_<variant>_<B>_<N>_<d>_<causal|noncausal>``) and its ratio to cuDNN's
    (``ch6_abl_<variant>_vs_cudnn_...``); ``ch6_abl_spread_pct``, the largest spread of one
    variant's rounds (slowest over fastest - 1, in %): differences below it are noise."""
    out = {"ch6_abl_gpu": rec["provenance"]["gpu"].replace("NVIDIA ", ""),
           "ch6_abl_spread_pct": spread_pct(rec)}
    for row in rec["rows"]:
        B, _, N, d = row["shape"]
        case = f"{B}_{N}_{d}_{'causal' if row['causal'] else 'noncausal'}"
        cudnn = row["tflops"]["cudnn"]
        for name, tflops in row["tflops"].items():
            out[f"ch6_abl_{name}_{case}"] = tflops
            if name != "cudnn":
                out[f"ch6_abl_{name}_vs_cudnn_{case}"] = tflops / cudnn
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(DATA_DIR), help="directory of the <gpu>.json record")
    ap.add_argument("--commit", help="the sources' commit, recorded in the provenance")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        sys.exit("fa3_ablation: needs an sm_90 GPU (H100/H200), as the Gluon FA3 kernel does")
    rows = measure()
    prov = results.provenance("python -m flashbook.fa3_ablation " + shlex.join(
        sys.argv[1:] if argv is None else argv)) | dict(git_commit=args.commit)
    out = Path(args.out) / f"{results.gpu_slug(torch.cuda.get_device_name(0))}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(provenance=prov, rows=rows), indent=1) + "\n")
    print(json.dumps(rows, indent=1), f"\nwrote {out}")


if __name__ == "__main__":
    main()
