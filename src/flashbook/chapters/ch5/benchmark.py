"""Chapter 5 benchmark: grouped-query prefill (the M-fold against one program per query head)
and decode against a KV cache (contiguous and paged), beside torch SDPA, compiled
FlexAttention and the GPU's memory ceilings.

GPU run (``flashbook bench ch5``): fp16, d = 128, h_q = 32 query heads sharing h_kv = 8 K/V
heads (G = 4), in one process on one GPU, timed by ``bench_setups.measure``: replayed from a
CUDA graph (launched from Python where a call cannot be captured, the note saying so); a row
that fails (refused inputs, out of memory, ...) has ``ms`` empty and a note saying why. Our
wrappers run once (that call's O is compared), then are timed, with ``validate_gqa`` and
``validate_decode`` made no-ops (``bench_setups.quiet``): the launch alone is timed, as the
baselines' is.
Beside each reference row a ``public`` row times the same call as a reader makes it: the
wrapper with its checks and no config, launched (``bench.public_row``).

1. Prefill, (B, h_q, h_kv, N, d) = (1, 32, 8, 16384, 128), causal and not, on the packed
   ``q.view(B*N, h_q, d)``: ``ch5_two_tiles`` (reference, ``attention_gqa_two_tiles``),
   ``ch5_mfold`` (variant, ``attention_gqa``, the one-tile kernel of Exercise 1),
   ``ch5_per_head`` (variant, ``attention_gqa_per_head``: that kernel on K/V repeated per
   query head, the ``repeat_interleave`` inside the timing); on contiguous (B, h, N, d) copies,
   SDPA with ``enable_gqa=True`` on each backend (rows ``sdpa_cudnn``, ``sdpa_flash``,
   ``sdpa_efficient``, ``sdpa_math``; a refusal's note gives torch's reason; math is skipped
   where its fp32 S passes 1 GiB), ``sdpa_cudnn`` on K/V expanded to h_q heads by
   ``repeat_interleave`` (not timed; the note gives the extra memory), ``flex_attention``
   (compiled, ``enable_gqa=True``, causal or full block mask). Notes: ``max|O-sdpa_cudnn|``
   (else the first backend that accepts). FLOPs ``reference.attention_flops(B, h_q, N, N, d,
   causal)``; GB/s: ``bench.attention_bytes`` with h_kv K/V heads; ``pct_peak``: of tensor
   TFLOP/s.
2. Decode, B = 32 sequences, one new token each against 8192 cached tokens (``cache_seqlens``
   = 8192, the new token included), causal: ``ch5_decode`` (reference, contiguous cache),
   ``ch5_decode_paged`` (reference, the same cache in pages of 256, then 64 tokens at places
   shuffled with a fixed seed, ``paged_cache``; notes ``page_size=...``, ``max|O-contiguous|``),
   ``sdpa_cudnn`` and ``sdpa_flash`` with ``enable_gqa=True`` (q (B, h_q, 1, d), K/V
   (B, h_kv, 8192, d), ``is_causal=False``: one new token sees the whole cache), ``sdpa_cudnn``
   on expanded K/V only where cuDNN refuses ``enable_gqa``, ``flex_attention`` (compiled,
   ``enable_gqa=True``, no block mask). Then the ceilings, not attention (the decode case's
   shape columns, no TFLOP/s): ``hbm_read``, the faster of ``x.sum()`` and
   ``torch.linalg.vector_norm(x)`` over 4 GiB of fp16 (the note names it and gives the other's
   GB/s), and ``d2d_copy``, ``dst.copy_(src)`` of 2 GiB.
3. Batch 1, context 131072: ``ch5_decode`` and ``sdpa_cudnn`` (note ``batch 1``): one program
   per (sequence, K/V head) keeps only h_kv = 8 SMs busy; Chapter 8 splits the keys.
4. Prefill with a group that divides no tile, G = 7 (Qwen2.5-7B's heads, (1, 28, 4, 16384,
   128)): the rows of 1., told apart by their H_q and H_kv columns (PackGQA: the kernels fold
   (position, head) pairs for any G, with no copy of K and V; ``recorded`` reads 1.'s G = 4).

Decode and ceiling rows: FLOPs ``decode_flops`` = 4 * B * h_q * n_new * context * d; ``gbps``
= bytes of K and V read per second, ``kv_bytes`` = B * context * h_kv * d * 2 bytes * 2
tensors (1 GiB; Q and O, 0.05% more, are not counted; the same bytes for every decode row,
though an expanded baseline reads G times more); ``hbm_read`` counts the bytes read,
``d2d_copy`` bytes read plus written; and ``pct_peak`` is % of the datasheet HBM bandwidth
(``bench.gpu_peak().hbm_gbps``), not of tensor TFLOP/s.
"""
from __future__ import annotations

import functools

import torch

from flashbook import bench_setups, sources
from flashbook.bench import SDPA_BACKENDS, attention_bytes, flex_compile_limits, free_cuda_cache, \
    join_notes, public_row
from flashbook.bench_setups import causal_mod, ceiling_rows, cu_seqlens, decode_flops, \
    err_note, expanded_note, expect, flex_setup, kv_bytes, ours, quiet, refused_setup, \
    sdpa_setup
from flashbook.chapters.ch5.launch import paged_cache
from flashbook.reference import attention_flops
from flashbook.results import Row

GRAPH_TIMER = True
DTYPE = torch.float16
PREFILL = (1, 32, 8, 16384, 128)         # (B, h_q, h_kv, N, d)
DECODE = (32, 32, 8, 8192, 128)          # (B, h_q, h_kv, context, d), one new token
LONG = (1, 32, 8, 131072, 128)           # batch 1, long context
PREFILL_G7 = (1, 28, 4, 16384, 128)      # Qwen2.5-7B's heads: G = 7 divides no tile
PAGE_SIZES = (256, 64)
READ_BYTES, COPY_BYTES = bench_setups.READ_BYTES, bench_setups.COPY_BYTES
MATH_LIMIT = 2**30                       # bytes of fp32 S past which sdpa_math is skipped
KERNELS = [("ch5_two_tiles", "reference", "attention_gqa_two_tiles"),
           ("ch5_mfold", "variant", "attention_gqa"),
           ("ch5_per_head", "variant", "attention_gqa_per_head")]


# ------------------------------------------------------------------ helpers (CPU-testable)

def measure(kernel, role, setup, **kw) -> Row:
    """``bench_setups.measure`` of this chapter's fp16 rows."""
    return bench_setups.measure(kernel, role, setup, dtype=DTYPE, **kw)


# ------------------------------------------------------------------------------ the run

def run(prefill=PREFILL, decode=DECODE, long_decode=LONG, page_sizes=PAGE_SIZES,
        read_bytes=READ_BYTES, copy_bytes=COPY_BYTES, device="cuda", ns=None,
        compile_flex=True, prefill_g7=PREFILL_G7) -> list[Row]:
    """Every row; a section whose shape is None is left out. ``ns``: the solution namespace
    (default ``sources.solution_namespace("ch5")``)."""
    from torch.nn.attention.flex_attention import flex_attention
    ns = quiet(ns if ns is not None else sources.solution_namespace("ch5"))
    flex = functools.partial(torch.compile(flex_attention, dynamic=False) if compile_flex
                             else flex_attention, enable_gqa=True)
    rows: list[Row] = []
    with flex_compile_limits():
        if prefill:
            rows += prefill_rows(ns, flex, *prefill, device=device)
            free_cuda_cache()
        if decode:
            rows += decode_rows(ns, flex, *decode, page_sizes=page_sizes, device=device)
            free_cuda_cache()
            rows += ceiling_rows(read_bytes, copy_bytes, *decode, device=device)
            free_cuda_cache()
        if long_decode:
            rows += decode_rows(ns, flex, *long_decode, page_sizes=(), device=device,
                                full=False, note="batch 1: see Chapter 8 (split-KV)")
            free_cuda_cache()
        if prefill_g7:
            rows += prefill_rows(ns, flex, *prefill_g7, device=device)
            free_cuda_cache()
    return rows


def prefill_rows(ns, flex, B, h_q, h_kv, N, d, device="cuda") -> list[Row]:
    from torch.nn.attention.flex_attention import noop_mask
    q = torch.randn(B * N, h_q, d, device=device, dtype=DTYPE)
    k, v = (torch.randn(B * N, h_kv, d, device=device, dtype=DTYPE) for _ in range(2))
    cu = cu_seqlens([N] * B, device)
    q4, k4, v4 = (t.view(B, N, -1, d).transpose(1, 2).contiguous() for t in (q, k, v))
    math_s = 4.0 * B * h_q * N * N                         # bytes of the math backend's S
    refs = ("sdpa_cudnn", "sdpa_flash", "sdpa_efficient") + \
        (("sdpa_math",) if math_s <= MATH_LIMIT else ())
    rows = []
    for causal in (True, False):
        kw = dict(B=B, H_q=h_q, H_kv=h_kv, N_q=N, N_k=N, d=d, causal=causal,
                  flops=attention_flops(B, h_q, N, N, d, causal),
                  nbytes=attention_bytes(B, h_q, N, N, d, DTYPE.itemsize, h_kv))
        name, want = expect(q4, k4, v4, causal, refs)
        check = err_note(name, want)
        for kernel, role, wrapper in KERNELS:
            rows.append(measure(kernel, role, ours(
                ns, wrapper, (q, k, v, cu, cu, N, N),
                lambda o: check(o.view(B, N, h_q, d).transpose(1, 2)), causal=causal), **kw))
            if role == "reference":                    # the same call as a reader makes it
                rows.append(public_row(rows[-1], functools.partial(
                    ns[wrapper], q, k, v, cu, cu, N, N, causal=causal),
                    f"{wrapper}(q, k, v, cu_q, cu_k, {N}, {N}, causal={causal})"))
        for backend in SDPA_BACKENDS:
            setup = sdpa_setup(backend, q4, k4, v4, causal)
            if backend == "sdpa_math" and math_s > MATH_LIMIT:
                setup = refused_setup(f"skipped: it materialises S and P in fp32, "
                                     f"{math_s / 2**30:.3g} GiB each")
            rows.append(measure(backend, "baseline", setup, note="enable_gqa=True", **kw))
        rows.append(measure("sdpa_cudnn", "baseline",
                            sdpa_setup("sdpa_cudnn", q4, k4, v4, causal, expand=True),
                            note=expanded_note(k4, h_q // h_kv), **kw))
        rows.append(measure("flex_attention", "baseline", flex_setup(
            flex, causal_mod if causal else noop_mask, q4, k4, v4, want, name),
            note=f"enable_gqa=True; {'causal' if causal else 'full'} block mask", **kw))
        want = check = None                                # frees O before the next case
        free_cuda_cache()
    return rows


def decode_rows(ns, flex, B, h_q, h_kv, context, d, page_sizes=PAGE_SIZES, device="cuda",
                full=True, note="") -> list[Row]:
    """One new token per sequence against a full cache; ``full`` False: ``ch5_decode`` and
    cuDNN only (the batch-1 case)."""
    q = torch.randn(B, 1, h_q, d, device=device, dtype=DTYPE)
    kc, vc = (torch.randn(B, context, h_kv, d, device=device, dtype=DTYPE) for _ in range(2))
    lens = torch.full((B,), context, dtype=torch.int32, device=device)
    q4, k4, v4 = (t.transpose(1, 2).contiguous() for t in (q, kc, vc))
    kw = dict(B=B, H_q=h_q, H_kv=h_kv, N_q=1, N_k=context, d=d, causal=True, hbm=True,
              flops=decode_flops(B, h_q, 1, context, d),
              nbytes=kv_bytes(B, context, h_kv, d, DTYPE.itemsize))
    name, want = expect(q4, k4, v4, False, ("sdpa_cudnn", "sdpa_flash", "sdpa_math"))
    check, mine = err_note(name, want), {}

    def keep(o):
        mine["o"] = o                                      # the paged rows' check
        return check(o.transpose(1, 2))
    rows = [measure("ch5_decode", "reference", ours(ns, "decode", (q, kc, vc, lens), keep),
                    note=note, **kw)]
    rows.append(public_row(rows[0], functools.partial(ns["decode"], q, kc, vc, lens),
                           "decode(q, k_cache, v_cache, cache_seqlens)"))
    for page in page_sizes:
        def setup(page=page):
            kp, vp, table = paged_cache(kc, vc, page, seed=0)
            return ours(ns, "decode", (q, kp, vp, lens),
                            err_note("contiguous", mine.get("o")), block_table=table)()
        rows.append(measure("ch5_decode_paged", "reference", setup,
                            note=join_notes(note, f"page_size={page}"), **kw))
        free_cuda_cache()
    for backend in ("sdpa_cudnn", "sdpa_flash") if full else ("sdpa_cudnn",):
        rows.append(measure(backend, "baseline", sdpa_setup(backend, q4, k4, v4, False),
                            note=join_notes(note, "enable_gqa=True; is_causal=False (one new "
                                                 "token sees the whole cache)"), **kw))
        if backend == "sdpa_cudnn" and rows[-1].ms is None:
            rows.append(measure(backend, "baseline",
                                sdpa_setup(backend, q4, k4, v4, False, expand=True),
                                note=join_notes(note, expanded_note(k4, h_q // h_kv)), **kw))
        free_cuda_cache()
    if full:
        def flex_setup():
            fn = lambda: flex(q4, k4, v4)  # noqa: E731
            return fn, err_note(name, want)(fn())          # compiles outside the timing
        rows.append(measure("flex_attention", "baseline", flex_setup,
                            note="enable_gqa=True; no block mask", **kw))
    return rows
