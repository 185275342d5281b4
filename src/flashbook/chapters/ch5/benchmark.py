"""Chapter 5 benchmark: grouped-query prefill (the M-fold against one program per query head)
and decode against a KV cache (contiguous and paged), beside torch SDPA, compiled
FlexAttention and the GPU's memory ceilings.

GPU run (``flashbook bench ch5``): fp16, d = 128, h_q = 32 query heads sharing h_kv = 8 K/V
heads (G = 4), in one process on one GPU, timed by ``ch4.benchmark.measure``: replayed from a
CUDA graph (launched from Python where a call cannot be captured, the note saying so); a row
that fails (refused inputs, out of memory, ...) has ``ms`` empty and a note saying why. Our
wrappers run once (that call's O is compared), then are timed, with ``validate_gqa`` and
``validate_decode`` made no-ops (``quiet``): the launch alone is timed, as the baselines' is.
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

Decode and ceiling rows: FLOPs ``decode_flops`` = 4 * B * h_q * n_new * context * d; ``gbps``
= bytes of K and V read per second, ``kv_bytes`` = B * context * h_kv * d * 2 bytes * 2
tensors (1 GiB; Q and O, 0.05% more, are not counted; the same bytes for every decode row,
though an expanded baseline reads G times more); ``hbm_read`` counts the bytes read,
``d2d_copy`` bytes read plus written; and ``pct_peak`` is % of the datasheet HBM bandwidth
(``bench.gpu_peak().hbm_gbps``), not of tensor TFLOP/s.
"""
from __future__ import annotations

import dataclasses
import functools
import types
import warnings

import torch

from flashbook import sources
from flashbook.bench import SDPA_BACKENDS, attention_bytes, flex_compile_limits, \
    free_cuda_cache, gpu_peak, join_notes, public_row
from flashbook.chapters.ch4 import benchmark as ch4
from flashbook.reference import attention_flops
from flashbook.chapters.ch5.launch import paged_cache
from flashbook.results import Row

GRAPH_TIMER = True
DTYPE = torch.float16
PREFILL = (1, 32, 8, 16384, 128)         # (B, h_q, h_kv, N, d)
DECODE = (32, 32, 8, 8192, 128)          # (B, h_q, h_kv, context, d), one new token
LONG = (1, 32, 8, 131072, 128)           # batch 1, long context
PAGE_SIZES = (256, 64)
READ_BYTES, COPY_BYTES = 4 * 2**30, 2 * 2**30
MATH_LIMIT = 2**30                       # bytes of fp32 S past which sdpa_math is skipped
KERNELS = [("ch5_two_tiles", "reference", "attention_gqa_two_tiles"),
           ("ch5_mfold", "variant", "attention_gqa"),
           ("ch5_per_head", "variant", "attention_gqa_per_head")]


# ------------------------------------------------------------------ helpers (CPU-testable)

def decode_flops(B: int, h_q: int, n_new: int, context: int, d: int) -> float:
    """The two matmuls of a decode step: 4 * d per (query head, new token, cached key)."""
    return 4.0 * B * h_q * n_new * context * d


def kv_bytes(B: int, context: int, h_kv: int, d: int, itemsize: int = 2) -> float:
    """Bytes of K and V a decode step reads: every cached token of every K/V head, once."""
    return 2.0 * B * context * h_kv * d * itemsize


def expanded_note(k, group: int) -> str:
    """The expanded-K/V rows' note: the extra memory of K and V (B, h_kv, N, d) expanded to
    h_q = group * h_kv heads."""
    return (f"K/V expanded to h_q heads (repeat_interleave, not timed): "
            f"+{2 * k.nbytes * (group - 1) / 2**20:.0f} MiB")


def measure(kernel, role, setup, *, B, H_q, H_kv, N_q, N_k, d, causal, flops, nbytes,
            hbm=False, note="") -> Row:
    """One row, timed by ``ch4.benchmark.measure`` (its guard: a failure becomes the note),
    with this chapter's shape columns and rates: ``gbps`` = ``nbytes`` / time; ``hbm``:
    ``pct_peak`` of the datasheet HBM bandwidth instead of tensor TFLOP/s; ``flops`` 0: no
    TFLOP/s (nor % of tensor peak)."""
    r = ch4.measure(kernel, role, setup, B=B, N=N_q, causal=causal, flops=flops,
                    tokens=B * N_q, note=note)
    rates = {}
    if r.ms is not None:
        gbps = nbytes / (r.ms * 1e-3) / 1e9
        peak = gpu_peak()
        pct = r.pct_peak if flops else None
        if hbm:
            pct = 100.0 * gbps / peak.hbm_gbps if peak else None
        rates = dict(gbps=gbps, tflops=r.tflops if flops else None, pct_peak=pct)
    return dataclasses.replace(r, H_q=H_q, H_kv=H_kv, N_q=N_q, N_k=N_k, d=d, **rates)


def quiet(ns: dict) -> dict:
    """The namespace to hand ``ch4.benchmark.ours``, with no-op validators (the timed call is
    the launch alone) and every solution function rebound to it, so a wrapper that calls
    another (``attention_gqa_per_head`` calls ``attention_gqa``) skips the checks too."""
    def noop(*a, **kw):
        return None
    out = {**ns, "validate_gqa": noop, "validate_decode": noop}
    for name, f in ns.items():
        if isinstance(f, types.FunctionType) and f.__globals__ is ns and \
                name not in ("validate_gqa", "validate_decode"):
            g = types.FunctionType(f.__code__, out, f.__name__, f.__defaults__, f.__closure__)
            g.__kwdefaults__ = f.__kwdefaults__
            out[name] = g
    return out


def sdpa_gqa(backend: str, causal: bool = False, gqa: bool = True):
    """SDPA restricted to one backend (a key of bench.SDPA_BACKENDS), as f(q, k, v)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def f(q, k, v):
        with sdpa_kernel(getattr(SDPBackend, SDPA_BACKENDS[backend])):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
    return f


def refusal(e: BaseException, caught) -> str:
    """Why a backend refused: torch's own reason (a UserWarning) where it gave one."""
    skip = ("not used because", "runtime disabled", "Aborting execution")
    why = [str(w.message).split(" (Triggered internally")[0].strip() for w in caught]
    why = [w for w in why if w and not any(s in w for s in skip)]
    return "refused: " + (why or [(str(e).strip().splitlines() or [""])[0]])[0][:140]


def sdpa_setup(backend, q, k, v, causal, expand=False):
    """A setup for ``measure``: SDPA on one backend with ``enable_gqa`` (``expand``: on K/V
    expanded to the query heads first, not timed); a refusal raises with torch's reason."""
    def setup():
        kk, vv = k, v
        if expand:
            g = q.shape[1] // k.shape[1]
            kk, vv = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
        f = sdpa_gqa(backend, causal, gqa=not expand)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                f(q, kk, vv)
            except RuntimeError as e:
                raise RuntimeError(refusal(e, caught)) from None
        return (lambda: f(q, kk, vv)), ""
    return setup


def expect(q, k, v, causal, backends):
    """(name, O) of the first SDPA backend that accepts these inputs (the check), or ("", None)."""
    for name in backends:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return name, sdpa_gqa(name, causal)(q, k, v)
        except Exception:  # noqa: BLE001 - refused or out of memory: try the next
            free_cuda_cache()
    return "", None


def err_note(name, want):
    """A check: ``max|O-name|`` of an O laid out as ``want``; no note without ``want``."""
    return lambda o: f"max|O-{name}|={ch4.max_err(o, want):.1e}" if want is not None else ""


# ------------------------------------------------------------------------------ the run

def run(prefill=PREFILL, decode=DECODE, long_decode=LONG, page_sizes=PAGE_SIZES,
        read_bytes=READ_BYTES, copy_bytes=COPY_BYTES, device="cuda", ns=None,
        compile_flex=True) -> list[Row]:
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
    return rows


def prefill_rows(ns, flex, B, h_q, h_kv, N, d, device="cuda") -> list[Row]:
    from torch.nn.attention.flex_attention import noop_mask
    q = torch.randn(B * N, h_q, d, device=device, dtype=DTYPE)
    k, v = (torch.randn(B * N, h_kv, d, device=device, dtype=DTYPE) for _ in range(2))
    cu = ch4.cu_seqlens([N] * B, device)
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
            rows.append(measure(kernel, role, ch4.ours(
                ns, wrapper, (q, k, v, cu, cu, N, N),
                lambda o: check(o.view(B, N, h_q, d).transpose(1, 2)), causal=causal), **kw))
            if role == "reference":                    # the same call as a reader makes it
                rows.append(public_row(rows[-1], functools.partial(
                    ns[wrapper], q, k, v, cu, cu, N, N, causal=causal),
                    f"{wrapper}(q, k, v, cu_q, cu_k, {N}, {N}, causal={causal})"))
        for backend in SDPA_BACKENDS:
            setup = sdpa_setup(backend, q4, k4, v4, causal)
            if backend == "sdpa_math" and math_s > MATH_LIMIT:
                setup = ch4.refused_setup(f"skipped: it materialises S and P in fp32, "
                                     f"{math_s / 2**30:.3g} GiB each")
            rows.append(measure(backend, "baseline", setup, note="enable_gqa=True", **kw))
        rows.append(measure("sdpa_cudnn", "baseline",
                            sdpa_setup("sdpa_cudnn", q4, k4, v4, causal, expand=True),
                            note=expanded_note(k4, h_q // h_kv), **kw))
        rows.append(measure("flex_attention", "baseline", ch4.flex_setup(
            flex, ch4.causal_mod if causal else noop_mask, q4, k4, v4, want, name),
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
    rows = [measure("ch5_decode", "reference", ch4.ours(ns, "decode", (q, kc, vc, lens), keep),
                    note=note, **kw)]
    rows.append(public_row(rows[0], functools.partial(ns["decode"], q, kc, vc, lens),
                           "decode(q, k_cache, v_cache, cache_seqlens)"))
    for page in page_sizes:
        def setup(page=page):
            kp, vp, table = paged_cache(kc, vc, page, seed=0)
            return ch4.ours(ns, "decode", (q, kp, vp, lens),
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


READ_OPS = {"x.sum()": lambda x: x.sum(),
            "torch.linalg.vector_norm(x)": lambda x: torch.linalg.vector_norm(x)}


def ceiling_rows(read_bytes, copy_bytes, B, h_q, h_kv, context, d, device="cuda") -> list[Row]:
    """``hbm_read`` (the faster of the ``READ_OPS``) and ``d2d_copy``, with the decode case's
    shape columns (they are not attention: no TFLOP/s)."""
    kw = dict(B=B, H_q=h_q, H_kv=h_kv, N_q=1, N_k=context, d=d, causal=False, flops=0.0,
              hbm=True)

    def ones(nbytes):
        return torch.ones(nbytes // DTYPE.itemsize, device=device, dtype=DTYPE)

    def read_setup(op):
        x = ones(read_bytes)                               # in the guard of ``measure``
        return (lambda: READ_OPS[op](x)), ""
    tried = {}
    for op in READ_OPS:
        tried[op] = measure("hbm_read", "baseline", functools.partial(read_setup, op),
                            nbytes=read_bytes, note=f"read ceiling: {op} over "
                            f"{read_bytes / 2**30:.2f} GiB of fp16", **kw)
        free_cuda_cache()
    best = min(tried, key=lambda op: (tried[op].ms is None, tried[op].ms or 0.0))
    others = "; ".join(f"{op}: " + (f"{r.gbps:.0f} GB/s" if r.ms is not None else "failed")
                       for op, r in tried.items() if op != best)
    rows = [dataclasses.replace(tried[best], note=join_notes(tried[best].note,
                                                            others and f"beside {others}"))]

    def copy_setup():
        src = ones(copy_bytes)
        dst = torch.empty_like(src)
        return (lambda: dst.copy_(src)), ""
    rows.append(measure("d2d_copy", "baseline", copy_setup, nbytes=2 * copy_bytes,
                        note=f"dst.copy_(src) of {copy_bytes / 2**30:.2f} GiB: gbps counts "
                             "bytes read + written", **kw))
    free_cuda_cache()
    return rows
