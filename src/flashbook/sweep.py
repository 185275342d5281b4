"""The book's fastest kernels over a sweep of shapes, against cuDNN, the FA2 backend and Flex.

``python -m flashbook.sweep --out DIR`` measures, on a GPU, in one process:

* **forward**: Chapter 6's Gluon FA3 kernel as a reader calls it (``attention_fa3(q, k, v,
  causal=...)``: no config), over N in ``FORWARD_N`` at ``TOKENS`` tokens per batch (B = TOKENS /
  N), H = 16, d in {64, 128}, causal and not, fp16 and bf16;
* **backward**: Chapter 9's backward (the students' two kernels, ``attention_backward``, on the
  packed copies of the same inputs), fp16, the same N, d = 128, causal and not;
* **triton_forward**: Chapters 3-5's fastest forwards as a reader calls them (Chapter 3's
  ``attention_two_tiles``, non-causal; Chapter 4's ``attention_varlen`` on B equal sequences;
  Chapter 5's ``attention_gqa_two_tiles``, 16 query heads over 4 K/V heads), fp16, the same N,
  d, masks;
* **flex**: compiled FlexAttention (``torch.compile(flex_attention)``) as a third baseline of the
  MHA forwards, fp16, d = 128;
* **decode**: Chapter 8's ``decode_split_kv`` as a reader calls it (the split count chosen by
  itself), over B in ``DECODE_B`` x context in ``DECODE_CONTEXT``, h_q = 32, h_kv = 8, d = 128,
  fp16, one new token; points whose cache (and SDPA's copy of it) would not fit are left out;

each beside ``sdpa_cudnn`` and ``sdpa_flash`` (SDPA restricted to one backend; decode with
``enable_gqa``, cuDNN on K/V expanded to the query heads where it refuses). Every call is timed
launched (``triton.testing.do_bench`` medians), not replayed from a graph: as a user calls it.
Rows are ``results.Row``s, written as ``DIR/<gpu>.csv`` with their provenance; the benchmarks
appendix draws them as ratios to cuDNN (``ratio_tables``).
"""
from __future__ import annotations

import argparse
import functools
import math
import shlex
import sys
import warnings
from pathlib import Path

import torch

from . import results, sources
from .bench import attention_bytes, free_cuda_cache, gpu_peak, time_ms, why_failed
from .reference import attention_flops
from .results import Row

DATA_DIR = Path(__file__).resolve().parent / "data" / "sweep"
FORWARD_N = (512, 1024, 2048, 4096, 8192, 16384, 32768)
TOKENS, HEADS = 32768, 16
DECODE_B = (1, 8, 32, 128)
DECODE_CONTEXT = (1024, 8192, 32768, 131072)
DECODE_HEADS, DECODE_D = (32, 8), 128
MAX_CACHE_GIB = 20          # K + V of one decode point (SDPA copies it, cuDNN expanded to h_q)
BASELINES = ("sdpa_cudnn", "sdpa_flash")
BWD_FACTOR = 2.5            # a backward's FLOPs per forward FLOP (Chapter 9's convention)
GQA_GROUP = 4               # Chapter 5's rows: 16 query heads over 4 K/V heads


def _row(kernel, role, fn, *, B, H_q, H_kv, N_q, N_k, d, dtype, causal, flops, nbytes,
         note="") -> Row:
    """Time ``fn`` and make its row; a failure (a refusal, out of memory) is a noted row."""
    dt = str(dtype).replace("torch.", "")
    shape = dict(kernel=kernel, role=role, B=B, H_q=H_q, H_kv=H_kv, N_q=N_q, N_k=N_k, d=d,
                 dtype=dt, causal=causal)
    try:
        ms = time_ms(fn)
    except Exception as e:  # noqa: BLE001 - recorded as a row that says why
        free_cuda_cache()
        return Row(**shape, ms=None, tflops=None, gbps=None, pct_peak=None,
                   note=results_note(note, f"not measured: {why_failed(e)}"))
    peak = gpu_peak()
    tflops = flops / (ms * 1e-3) / 1e12
    return Row(**shape, ms=ms, tflops=tflops, gbps=nbytes / (ms * 1e-3) / 1e9,
               pct_peak=100 * tflops / peak.tensor_tflops if peak else None, note=note)


def results_note(*parts) -> str:
    return "; ".join(p for p in parts if p)


def _sdpa(backend: str, q, k, v, causal: bool, gqa: bool = False):
    """SDPA on one backend (``bench.sdpa``) as a zero-argument call; a refusal raises
    (checked once here)."""
    from .bench import sdpa
    run = sdpa(backend, gqa=gqa)

    def call():
        return run(q, k, v, causal)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        call()
    return call


def _fail(why):
    def call():
        raise RuntimeError(why)
    return call


def forward_rows(ns=None, ns_n=FORWARD_N, dims=(64, 128),
                 dtypes=(torch.float16, torch.bfloat16)) -> list[Row]:
    from flashbook import fa3_launch as gluon_fa3
    rows = []
    for dtype in dtypes:
        for d in dims:
            for causal in (False, True):
                for N in ns_n:
                    B = max(1, TOKENS // N)
                    q, k, v = (torch.randn(B, HEADS, N, d, device="cuda", dtype=dtype)
                               for _ in range(3))
                    kw = dict(B=B, H_q=HEADS, H_kv=HEADS, N_q=N, N_k=N, d=d, dtype=dtype,
                              causal=causal, flops=attention_flops(B, HEADS, N, N, d, causal),
                              nbytes=attention_bytes(B, HEADS, N, N, d, dtype.itemsize))
                    rows.append(_row("ch6_gluon_fa3", "reference",
                                     lambda: gluon_fa3.attention_fa3(q, k, v, causal=causal),
                                     note="attention_fa3(q, k, v, causal): no config", **kw))
                    for name in BASELINES:
                        try:
                            fn = _sdpa(name, q, k, v, causal)
                        except Exception as e:  # noqa: BLE001 - the backend refused
                            fn = _fail(why_failed(e))
                        rows.append(_row(name, "baseline", fn, **kw))
                    del q, k, v
                    free_cuda_cache()
    return rows


def backward_rows(ns9=None, ns_n=FORWARD_N, d=128, dtype=torch.float16) -> list[Row]:
    from flashbook.chapters.ch9 import benchmark as ch9b
    ns9 = ns9 or sources.solution_namespace("ch9")
    rows = []
    for causal in (False, True):
        for N in ns_n:
            B = max(1, TOKENS // N)
            q, k, v, do = (torch.randn(B, HEADS, N, d, device="cuda", dtype=dtype)
                           for _ in range(4))
            kw = dict(B=B, H_q=HEADS, H_kv=HEADS, N_q=N, N_k=N, d=d, dtype=dtype,
                      causal=causal, nbytes=attention_bytes(B, HEADS, N, N, d, dtype.itemsize),
                      flops=BWD_FACTOR * attention_flops(B, HEADS, N, N, d, causal))
            try:
                bwd = ch9b.ours_fns(ns9, q, k, v, do, causal)[0]
            except Exception as e:  # noqa: BLE001
                bwd = _fail(why_failed(e))
            rows.append(_row("ch9_bwd", "reference", bwd,
                             note="attention_backward on the packed inputs", **kw))
            for name in BASELINES:
                try:
                    fn = ch9b.sdpa_grads_fn(name, q, k, v, do, causal, "bwd")[0]
                except Exception as e:  # noqa: BLE001
                    fn = _fail(why_failed(e))
                rows.append(_row(f"{name}_bwd", "baseline", fn, **kw))
            del q, k, v, do
            free_cuda_cache()
    return rows


def decode_rows(ns8=None, batches=DECODE_B, contexts=DECODE_CONTEXT) -> list[Row]:
    ns8 = ns8 or sources.solution_namespace("ch8")
    h_q, h_kv = DECODE_HEADS
    d, dtype = DECODE_D, torch.float16
    rows = []
    for B in batches:
        for ctx in contexts:
            cache_bytes = 2 * B * ctx * h_kv * d * dtype.itemsize
            if cache_bytes > MAX_CACHE_GIB * 2**30:
                continue
            q = torch.randn(B, 1, h_q, d, device="cuda", dtype=dtype)
            kc, vc = (torch.randn(B, ctx, h_kv, d, device="cuda", dtype=dtype)
                      for _ in range(2))
            lens = torch.full((B,), ctx, dtype=torch.int32, device="cuda")
            kw = dict(B=B, H_q=h_q, H_kv=h_kv, N_q=1, N_k=ctx, d=d, dtype=dtype, causal=True,
                      flops=attention_flops(B, h_q, 1, ctx, d), nbytes=cache_bytes)
            rows.append(_row("ch8_decode_split_kv", "reference",
                             lambda: ns8["decode_split_kv"](q, kc, vc, lens),
                             note="decode_split_kv(q, k_cache, v_cache, cache_seqlens)", **kw))
            q4, k4, v4 = (t.transpose(1, 2).contiguous() for t in (q, kc, vc))
            del kc, vc
            for name in BASELINES:
                note = "enable_gqa=True"
                try:
                    fn = _sdpa(name, q4, k4, v4, False, gqa=True)
                except Exception:  # noqa: BLE001 - refused enable_gqa: K/V expanded
                    g = h_q // h_kv
                    ke, ve = (t.repeat_interleave(g, dim=1) for t in (k4, v4))
                    note = f"K/V expanded to {h_q} heads (not timed)"
                    try:
                        fn = _sdpa(name, q4, ke, ve, False)
                    except Exception as e:  # noqa: BLE001
                        fn = _fail(why_failed(e))
                rows.append(_row(name, "baseline", fn, note=note, **kw))
                free_cuda_cache()
            del q4, k4, v4
            free_cuda_cache()
    return rows


def _packed(B: int, N: int, H: int, d: int, dtype):
    """(B * N, H, d) packed tokens of B sequences of N, and their int32 cu_seqlens."""
    cu = torch.arange(0, B * N + 1, N, dtype=torch.int32, device="cuda")
    return torch.randn(B * N, H, d, device="cuda", dtype=dtype), cu


def triton_forward_rows(ns_n=FORWARD_N, dims=(64, 128), dtype=torch.float16,
                        group=GQA_GROUP) -> list[Row]:
    """Chapters 3-5's fastest forwards as a reader calls them: Chapter 3's
    ``attention_two_tiles`` (non-causal: the chapter has no mask), Chapter 4's
    ``attention_varlen`` on B equal sequences, Chapter 5's ``attention_gqa_two_tiles`` with
    ``group`` query heads per K/V head. The MHA rows are compared with the ``forward`` part's baselines
    (the same shapes, in the same run); the GQA rows get their own (``enable_gqa``)."""
    ns = {c: sources.solution_namespace(c) for c in ("ch3", "ch4", "ch5")}
    rows = []
    for d in dims:
        for causal in (False, True):
            for N in ns_n:
                B, h_kv = max(1, TOKENS // N), HEADS // group
                flops = attention_flops(B, HEADS, N, N, d, causal)
                kw = dict(B=B, H_q=HEADS, H_kv=HEADS, N_q=N, N_k=N, d=d, dtype=dtype,
                          causal=causal, flops=flops,
                          nbytes=attention_bytes(B, HEADS, N, N, d, dtype.itemsize))
                (qp, cu), (kp, _), (vp, _) = (_packed(B, N, HEADS, d, dtype) for _ in range(3))
                if not causal:
                    q, k, v = (t.view(B, N, HEADS, d).transpose(1, 2).contiguous()
                               for t in (qp, kp, vp))
                    rows.append(_row("ch3_two_tiles", "reference",
                                     lambda: ns["ch3"]["attention_two_tiles"](q, k, v),
                                     note="attention_two_tiles(q, k, v)", **kw))
                    del q, k, v
                rows.append(_row("ch4_varlen", "reference",
                                 lambda: ns["ch4"]["attention_varlen"](qp, kp, vp, cu, cu, N, N,
                                                                       causal=causal),
                                 note="attention_varlen on B equal sequences", **kw))
                del kp, vp
                (kg, _), (vg, _) = (_packed(B, N, h_kv, d, dtype) for _ in range(2))
                gkw = dict(kw, H_kv=h_kv, nbytes=(2 * B * N * HEADS * d + 2 * B * N * h_kv * d)
                           * dtype.itemsize)
                rows.append(_row("ch5_gqa_two_tiles", "reference",
                                 lambda: ns["ch5"]["attention_gqa_two_tiles"](
                                     qp, kg, vg, cu, cu, N, N, causal=causal),
                                 note=f"attention_gqa_two_tiles, {HEADS}:{h_kv} heads", **gkw))
                q4, k4, v4 = (t.view(B, N, -1, d).transpose(1, 2).contiguous()
                              for t in (qp, kg, vg))
                del qp, kg, vg
                for name in BASELINES:
                    note = "enable_gqa=True"
                    try:
                        fn = _sdpa(name, q4, k4, v4, causal, gqa=True)
                    except Exception:  # noqa: BLE001 - refused enable_gqa: K/V expanded
                        ke, ve = (t.repeat_interleave(group, dim=1) for t in (k4, v4))
                        note = f"K/V expanded to {HEADS} heads (not timed)"
                        try:
                            fn = _sdpa(name, q4, ke, ve, causal)
                        except Exception as e:  # noqa: BLE001
                            fn = _fail(why_failed(e))
                    rows.append(_row(name, "baseline", fn, note=note, **gkw))
                    free_cuda_cache()
                del q4, k4, v4
                free_cuda_cache()
    return rows


def flex_rows(ns_n=FORWARD_N, d=128, dtype=torch.float16, causals=(False, True)) -> list[Row]:
    """Compiled FlexAttention beside the forward part's rows (MHA, fp16, d = 128: each shape
    and mask compiles once, a minute or so each, so the other d is left out). The parts
    ``flex_noncausal`` and ``flex_causal`` are its halves, each written when done."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    from .bench import flex_compile_limits
    flex = torch.compile(flex_attention, dynamic=False)
    rows = []
    with flex_compile_limits():
        for causal in causals:
            for N in ns_n:
                B = max(1, TOKENS // N)
                q, k, v = (torch.randn(B, HEADS, N, d, device="cuda", dtype=dtype)
                           for _ in range(3))
                kw = dict(B=B, H_q=HEADS, H_kv=HEADS, N_q=N, N_k=N, d=d, dtype=dtype,
                          causal=causal, flops=attention_flops(B, HEADS, N, N, d, causal),
                          nbytes=attention_bytes(B, HEADS, N, N, d, dtype.itemsize))
                try:
                    mask = create_block_mask(_causal_mod, None, None, N, N, device="cuda") \
                        if causal else None
                    fn = functools.partial(flex, q, k, v, block_mask=mask)
                    fn()                                     # compiles outside the timing
                except Exception as e:  # noqa: BLE001 - recorded as a row that says why
                    fn = _fail(why_failed(e))
                rows.append(_row("flex_attention", "baseline", fn,
                                 note="torch.compile(flex_attention)", **kw))
                print(f"flex causal={causal} N={N}: {rows[-1].ms} ms {rows[-1].note}", flush=True)
                del q, k, v
                free_cuda_cache()
    return rows


def _causal_mod(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


PARTS = {"forward": functools.partial(forward_rows, dtypes=(torch.float16,)),
         "forward_bf16": functools.partial(forward_rows, dtypes=(torch.bfloat16,)),
         "backward": backward_rows, "decode": decode_rows,
         "triton_forward": triton_forward_rows, "flex": flex_rows,
         "flex_noncausal": functools.partial(flex_rows, causals=(False,)),
         "flex_causal": functools.partial(flex_rows, causals=(True,))}


# Our reading of why each kernel falls behind cuDNN where the sweep says it does: mechanisms,
# not measurements (the figures beside them are computed from the rows, never written here).
WHY = {
    "ch3": "one Triton program per pair of query tiles and no warp specialisation: at short "
           "lengths each program runs few key tiles, so loading Q and storing O, which nothing "
           "overlaps, weigh more",
    "ch4": "Chapter 3's kernel with the varlen lookups and the mask bands; at short causal "
           "lengths most tiles are diagonal ones, which pay the mask",
    "ch5": "the M-fold reads each K/V tile once for its G heads, but its tile holds G heads' "
           "rows of fewer positions, so a causal diagonal band covers more of it, and at d = 128 "
           "Triton's software pipeline has fewer registers to overlap loads with the matmuls",
    "ch6": "the Gluon kernel's producer warp and consumer warpgroups need several key "
           "tiles per program to fill their pipeline: at N <= 1024, and at d = 64 causal, whose "
           "work tiles are short, the fill and drain of each are not hidden. Since the "
           "persistent kernel frees Q after its last QK^T and stores O from a tile of its own "
           "(commit 56567fc, after the H200 sweep was recorded), a short problem's Q loads and "
           "O stores overlap the neighbouring work tiles, which closed most of the gap at "
           "d = 128 on the H100",
    "ch8": "two launches (split, then combine) from Python against cuDNN's one: the host time "
           "of a call (the overhead table above) exceeds the GPU time of small batches and "
           "contexts; where B x h_kv programs already fill the GPU (one split, one launch) the "
           "one-pass kernel reads the cache at the rate Triton's loads reach",
    "ch9": "two kernels (dK and dV, then dQ) that each recompute P: the second pass over K, V "
           "and dO is what a fused backward saves",
}


def _problem(r) -> tuple:
    """The problem a row measured: rows of one problem are compared with each other."""
    return r.dtype, r.d, r.causal, r.B, r.H_kv, r.N_q, r.N_k


def _times(rows) -> dict:
    """{problem: {kernel: ms}}."""
    by = {}
    for r in rows:
        by.setdefault(_problem(r), {})[r.kernel] = r.ms
    return by


def reading(rows) -> str:
    """Markdown: per kernel of ours, where it stands against cuDNN and FA2 over the sweep (the
    geometric mean, the worst point, the points below 0.95 and 0.90) and why (``WHY``)."""
    by = _times(rows)
    out = []
    for kernel in sorted({r.kernel for r in rows if r.role == "reference"}):
        suffix = "_bwd" if kernel.endswith("bwd") else ""
        points = []
        for r in rows:
            if r.kernel != kernel or not r.ms:
                continue
            other = by[_problem(r)]
            cudnn, fa2 = other.get("sdpa_cudnn" + suffix), other.get("sdpa_flash" + suffix)
            where = (f"B={r.B}, {r.N_k // 1024}k" if kernel.startswith("ch8") else
                     f"N={r.N_q}, d={r.d}, {r.dtype}, {'causal' if r.causal else 'non-causal'}")
            points.append((cudnn / r.ms if cudnn else None, fa2 / r.ms if fa2 else None, where))
        vs = [p[0] for p in points if p[0]]
        if not vs:
            continue
        worst = min((p for p in points if p[0]), key=lambda p: p[0])
        below = [p[2] for p in points if p[0] and p[0] < 0.95]
        under_fa2 = [p[2] for p in points if p[1] and p[1] < 1.0]
        text = (f"- `{kernel}`: {math.prod(vs) ** (1 / len(vs)):.2f}x cuDNN (geometric mean of "
                f"{len(vs)} points), worst {worst[0]:.2f}x at {worst[2]}; "
                f"{len(below)} points below 0.95x, {sum(v < 0.90 for v in vs)} below 0.90x; ")
        text += (f"below FA2 at {', '.join(under_fa2)}" if under_fa2 else "never below FA2")
        why = WHY.get(kernel.split("_")[0])
        out.append(text + (f". Why: {why}." if why else "."))
    return "\n".join(out)


def ratio_tables(rows) -> str:
    """Markdown: for each part and each of our kernels, ms(cuDNN) / ms(ours) per shape (> 1:
    ours is faster), one table per (kernel, dtype, d, causal), columns the swept length (or
    batch x context for decode)."""
    by = _times(rows)
    ours = sorted({r.kernel for r in rows if r.role == "reference"})
    out = []
    for kernel in ours:
        base = "sdpa_cudnn_bwd" if kernel.endswith("bwd") else "sdpa_cudnn"
        fa2 = "sdpa_flash_bwd" if kernel.endswith("bwd") else "sdpa_flash"
        decode = kernel.startswith("ch8")
        groups = sorted({(r.dtype, r.d, r.causal) for r in rows if r.kernel == kernel})
        for dtype, d, causal in groups:
            mine = [r for r in rows if r.kernel == kernel and (r.dtype, r.d, r.causal) ==
                    (dtype, d, causal)]
            cols = [f"B={r.B}, {r.N_k // 1024}k" if decode else f"N={r.N_q}" for r in mine]
            out += [f"`{kernel}`, {dtype}, d = {d}" + ("" if decode else
                                                     f", {'causal' if causal else 'non-causal'}")
                    + ": cuDNN's time / ours (and FA2's, Flex's / ours)", "",
                    "| " + " | ".join(["vs"] + cols) + " |", "|" + "---|" * (len(cols) + 1)]
            keys = [_problem(r) for r in mine]
            others = [("cuDNN", base), ("FA2", fa2)] + \
                ([("Flex", "flex_attention")] if any("flex_attention" in by[k] for k in keys)
                 and not kernel.endswith("bwd") else [])
            for label, other in others:
                cells = []
                for r in mine:
                    theirs = by[_problem(r)].get(other)
                    cells.append(f"{theirs / r.ms:.2f}" if theirs and r.ms else "–")
                out.append("| " + " | ".join([label] + cells) + " |")
            out.append("")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=DATA_DIR)
    p.add_argument("--parts", default="decode,backward,forward,forward_bf16,triton_forward,flex",
                   help=f"comma-separated, in order (each written when done): {', '.join(PARTS)}")
    p.add_argument("--commit", help="the commit of the sources, recorded in the provenance")
    args = p.parse_args(argv)
    from flashbook import setup
    setup()
    command = "python -m flashbook.sweep " + " ".join(
        shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]) if a)
    rows = []
    for part in args.parts.split(","):
        rows += PARTS[part]()
        slug = results.gpu_slug(torch.cuda.get_device_name(0))
        results.write(rows, args.out, slug, dict(results.provenance(command),
                                                 commit=args.commit, parts=args.parts))
        print(f"{part}: {len(rows)} rows so far", flush=True)
    print(ratio_tables(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
