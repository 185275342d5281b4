"""Chapter 6's FP8 forward on a GPU: its speed beside the book's fp16 forward and cuDNN, and its
error with and without the incoherent-processing rotation.

``python -m flashbook.fp8_bench --out DIR`` (a GPU with fp8 tensor cores) writes
``DIR/<gpu>.json``: its provenance and

* ``speed``: TFLOP/s at ``SHAPE`` (fp16 inputs), non-causal and causal, of ``ch6.attention_fp8``
  on inputs quantized once by the solution's ``quantize_blocks`` (Q in blocks of BLOCK_M rows, K
  and V of BLOCK_N; the kernel alone is timed, as a model keeping fp8 activations would call
  it) for each of ``CONFIGS``; of ``attention_fp8_gluon`` (the toolkit's Gluon FP8 forward)
  with its default config on inputs quantized alike, K and V in blocks of 256 keys
  (``GLUON_BLOCKS``: its fastest tiles take them), in each of ``GLUON_VARIANTS`` (half the
  exponentials by a polynomial on the FMA pipe, FlashAttention-4's trick; P staged four keys a
  store, on V^T with its keys permuted once on the way in; and that with one exponential in
  four, or in eight, on the FMA pipe); and of the fp16 ``attention_fa3`` (as a reader calls
  it) and cuDNN SDPA (``speed_cases``);
* ``accuracy``: RMS error against float64 SDPA at ``ACCURACY_SHAPE`` on Gaussian Q and K with
  four channels 20x larger (``ch6.outlier_inputs``), of the fp8 kernel without and with the
  solution's ``random_rotation``, of the Gluon kernel without and with ``exp2_fma`` (half, and
  one in eight with P staged four keys a store), and of fp16 SDPA;
* ``sass``: the Gluon kernel's main loop (its default config at d = 128, compiled here by this
  Triton's ptxas) in each of its variants, on the path a full tile takes (the mask's block,
  which only the diagonal and the tail run, left out): instructions, MUFU (exponentials) and
  the fp32 ALU ones a loop, per key of a tile a thread holds (``sass_counts``).

Timed with ``bench.time_ms`` (``triton.testing.do_bench`` medians, launched, not replayed from a
graph).
"""
from __future__ import annotations

import argparse
import inspect
import json
import shlex
import sys
from functools import partial
from pathlib import Path

import torch

from . import bench, results, sources

SHAPE = (1, 16, 16384, 128)
ACCURACY_SHAPE = (1, 4, 2048, 128)
# (BLOCK_M, BLOCK_N, warps, stages): attention_fp8's default first
CONFIGS = ((64, 128, 4, 3), (128, 128, 8, 3))
# the scales' blocks (Q rows, K/V keys) of attention_fp8_gluon's inputs: with K/V blocks of 256
# keys its default config is its fastest (fa3_fp8_launch.default_config)
GLUON_BLOCKS = (64, 256)
# the Gluon kernel's variants: (sass_counts' label, fp8_recorded's kernel name, keyword
# arguments); "sperm" takes V^T with its keys permuted (fa3_fp8_launch.permute_keys)
GLUON_VARIANTS = (("default", "GLUON", {}), ("exp2_fma", "GLUON_EXP2_FMA", dict(exp2_fma=True)),
                  ("sperm", "GLUON_SPERM", dict(p_path="sperm")),
                  ("sperm_fma4", "GLUON_SPERM_FMA4", dict(p_path="sperm", exp2_fma=2)),
                  ("sperm_fma8", "GLUON_SPERM_FMA8", dict(p_path="sperm", exp2_fma=3)))


def _prepared(ns, q, k, v, block_m, block_n, rotation=None):
    if rotation is not None:
        q, k = q.float() @ rotation, k.float() @ rotation
    (q8, qs), (k8, ks), (v8, vs) = (ns["quantize_blocks"](t, b) for t, b in
                                    ((q, block_m), (k, block_n), (v, block_n)))
    return q8, qs, k8, ks, v8.transpose(-1, -2).contiguous(), vs


def gluon_note(kwargs: dict | None = None) -> str:
    """The note of a Gluon kernel's row: the default config it runs on GLUON_BLOCKS, with
    ``kwargs`` (the variant's keyword arguments) in place of the defaults they override."""
    from flashbook import fa3_fp8_launch       # imports Triton's Gluon dialect, no GPU needed
    kwargs = dict(kwargs or {})
    c = fa3_fp8_launch.default_config(GLUON_BLOCKS[1])
    default = inspect.signature(fa3_fp8_launch.attention_fp8_gluon).parameters["p_path"].default
    p_path = kwargs.pop("p_path", f"{default} (the default)")
    return (f"BLOCK_M={c.BLOCK_M} BLOCK_N={c.BLOCK_N} stages={c.STAGES} p_path={p_path}, scales in "
            f"blocks of {GLUON_BLOCKS[0]} and {GLUON_BLOCKS[1]}"
            + "".join(f", {k}={v}" for k, v in kwargs.items()))


def _gluon_inputs(inputs: tuple, kwargs: dict) -> tuple:
    """The Gluon kernel's inputs for ``kwargs``: V^T's keys permuted for the paths that read
    them so (``fa3_fp8_launch.PERMUTED``)."""
    from flashbook.fa3_fp8_launch import PERMUTED, permute_keys
    if kwargs.get("p_path") not in PERMUTED:
        return inputs
    return (*inputs[:4], permute_keys(inputs[4]), inputs[5])


def speed_cases(ns, q, k, v, causal: bool) -> list[tuple[str, str, object]]:
    """(kernel, note, call) of each kernel timed: ``attention_fp8`` for each of ``CONFIGS`` and
    ``attention_fp8_gluon`` with its default config in each of ``GLUON_VARIANTS``, on q, k, v
    quantized once by the solution's ``quantize_blocks`` (``ns``; V transposed), then the fp16
    ``attention_fa3`` and cuDNN SDPA on q, k, v."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from flashbook.chapters import ch6
    from flashbook.chapters.ch6 import fp8_recorded as names
    from flashbook.fa3_launch import attention_fa3
    cases = []
    for i, (bm, bn, w, s) in enumerate(CONFIGS):
        cases.append((names.FP8, f"BLOCK_M={bm} BLOCK_N={bn} warps={w} stages={s}"
                      + (" (the default)" if i == 0 else ""),
                      partial(ch6.attention_fp8, *_prepared(ns, q, k, v, bm, bn), causal=causal,
                              block_m=bm, block_n=bn, num_warps=w, num_stages=s)))
    bm, bn = GLUON_BLOCKS
    gluon_inputs = _prepared(ns, q, k, v, bm, bn)        # quantized once for every variant
    for _, name, kwargs in GLUON_VARIANTS:
        cases.append((getattr(names, name), gluon_note(kwargs), partial(
            ch6.attention_fp8_gluon, *_gluon_inputs(gluon_inputs, kwargs), causal=causal,
            block_m=bm, block_n=bn, **kwargs)))
    cases.append((names.FP16, "", partial(attention_fa3, q, k, v, causal=causal)))

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return cases + [(names.CUDNN, "", cudnn)]


def measure() -> dict:
    from flashbook.chapters import ch6
    sdpa = torch.nn.functional.scaled_dot_product_attention
    ns = sources.solution_namespace("ch6")
    B, H, N, d = SHAPE
    q, k, v = (torch.randn(*SHAPE, device="cuda", dtype=torch.float16) for _ in range(3))
    speed = []
    for causal in (False, True):
        flops = 4 * B * H * N * N * d / (2 if causal else 1)

        for kernel, note, fn in speed_cases(ns, q, k, v, causal):
            fn()
            ms = bench.time_ms(fn)          # the timer the provenance names
            speed.append(dict(kernel=kernel, causal=causal, ms=round(ms, 4),
                              tflops=round(flops / ms / 1e9, 1), note=note))
    q, k = (ch6.outlier_inputs(ACCURACY_SHAPE, seed).cuda() for seed in (3, 4))
    v = torch.randn(*ACCURACY_SHAPE, device="cuda")
    rotation = ns["random_rotation"](ACCURACY_SHAPE[-1], 0).cuda()
    inputs = _prepared(ns, q, k, v, *GLUON_BLOCKS)                          # quantized once

    def gluon(causal, **kwargs):
        return ch6.attention_fp8_gluon(*_gluon_inputs(inputs, kwargs), causal=causal,
                                       block_m=GLUON_BLOCKS[0], block_n=GLUON_BLOCKS[1],
                                       **kwargs)
    accuracy = []
    for causal in (False, True):
        want = sdpa(q.double(), k.double(), v.double(), is_causal=causal)
        outputs = {
            "fp8": ch6.attention_fp8(*_prepared(ns, q, k, v, *CONFIGS[0][:2]), causal=causal),
            "fp8_rotated": ch6.attention_fp8(*_prepared(ns, q, k, v, *CONFIGS[0][:2], rotation),
                                             causal=causal),
            "fp8_gluon": gluon(causal=causal),
            "fp8_gluon_exp2_fma": gluon(causal=causal, exp2_fma=True),
            "fp8_gluon_sperm_fma8": gluon(causal=causal, **GLUON_VARIANTS[-1][2]),
            "fp16_sdpa": sdpa(q.half(), k.half(), v.half(), is_causal=causal)}
        for name, o in outputs.items():
            rms = (o.double() - want).pow(2).mean().sqrt().item()
            accuracy.append(dict(kernel=name, causal=causal, rms_error=rms))
    return dict(shape=SHAPE, accuracy_shape=ACCURACY_SHAPE, speed=speed, accuracy=accuracy,
                sass=sass_counts())


# the opcodes counted in the Gluon kernel's main loop: the exponential unit and the fp32 ALU
SASS_OPCODES = ("MUFU", "FFMA", "FADD", "FMUL", "FMNMX")


def sass_counts() -> dict:
    """The first main loop of the Gluon kernel's SASS (its default config for K/V scales in
    blocks of 256, d = 128, non-causal; ``aot.sass_loops``) in each of ``GLUON_VARIANTS``, on
    the path a full tile takes (``taken``: the mask's block left out): ``{label: {"n":
    instructions, <opcode>: count, ..., "keys": the keys of one tile a consumer thread holds},
    "figures": sass_figures(...)}``. Compiled by this machine's Triton, no GPU needed."""
    from flashbook import fa3_fp8_launch
    from flashbook.aot import cubin_resources, sass_loops
    config = fa3_fp8_launch.default_config(GLUON_BLOCKS[1])
    keys = config.BLOCK_M * config.BLOCK_N // 128        # of a tile, per consumer thread
    out = {}
    for label, _, kwargs in GLUON_VARIANTS:
        k = fa3_fp8_launch.compile_for_sm90(head_dim=SHAPE[-1], block_n=GLUON_BLOCKS[1],
                                            **kwargs)
        loop = sass_loops(cubin_resources(k.asm["cubin"], k.name)[1], SASS_OPCODES,
                          taken=True)[0]
        out[label] = dict(loop, keys=keys)
    return out | {"figures": sass_figures(out)}


# clocks a warp's MUFU instruction holds its quarter of the SM's exponential units on sm_90
# (16 exponentials a clock an SM, 4 a quarter: 32 lanes in 8 clocks)
MUFU_CLOCKS = 8


def sass_figures(counts: dict) -> dict:
    """Per key a thread holds, for each variant's label: the instructions its loop issues
    (``per_key_<label>``; a warp issues one a clock) and the clocks its exponentials hold the
    MUFU unit (``mufu_clocks_<label>``); the default's instructions besides MUFU
    (``other_per_key_default``), and what ``exp2_fma`` adds per exponential it takes off MUFU
    (``added_per_emulated``: it takes half of them)."""
    default, fma = counts["default"], counts["exp2_fma"]
    out = dict(other_per_key_default=(default["n"] - default["MUFU"]) / default["keys"],
               added_per_emulated=(fma["n"] - default["n"]) / (default["keys"] / 2))
    for label, c in counts.items():
        out[f"per_key_{label}"] = c["n"] / c["keys"]
        out[f"mufu_clocks_{label}"] = MUFU_CLOCKS * c["MUFU"] / c["keys"]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, help="default: the directory Chapter 6 reads the record "
                   "from (fp8_recorded.DATA_DIR, in the package)")
    p.add_argument("--commit", help="the commit of the sources, recorded in the provenance")
    args = p.parse_args(argv)
    from flashbook import setup
    backend = setup()
    if backend.capability is None or tuple(backend.capability) < (8, 9):
        print(f"fp8_bench needs a GPU with fp8 tensor cores (sm_89 or newer); this runtime: "
              f"{backend}.", file=sys.stderr)
        return 2
    command = "python -m flashbook.fp8_bench " + " ".join(
        shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    record = dict(provenance=dict(results.provenance(command), commit=args.commit), **measure())
    from flashbook.chapters.ch6 import fp8_recorded
    out = args.out or fp8_recorded.DATA_DIR
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{results.gpu_slug(torch.cuda.get_device_name(0))}.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record["speed"] + record["accuracy"], indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
