"""Chapter 7 benchmark (``flashbook bench ch7``, an H100/H200): FlashAttention-4's two numerical
tricks, each on and off (``TRICKS``), in Chapter 3's ``attn_fwd_two_tiles`` (``ch3_two_tiles*``:
``attn_update`` rebound by ``triton_namespace`` to the solution's ``lazy_update`` and
``exp2_poly_tl``, launched by ``launch_two_tiles``, since Chapter 3's wrappers take no bf16) and
in Chapter 6's Gluon FA3 kernel with the tricks as hooks (``ch6_gluon_fa3*``, ``gluon_tricks``).
``_poly_half`` (Triton only) puts the cubic on every second column; the probes ``_exp_x2`` (two
MUFU.EX2 a score) and ``_no_exp`` (a clamp; O is wrong) bound the exponentials' share of the
time. Cases: ``bench.FORWARD_SHAPES``, non-causal, fp16 and bf16, against ``sdpa_cudnn``; the
chapter's ``attention_lazy`` on the fp16 cases, from a CUDA graph and as a reader calls it. Each
note gives the config and ``err``, max |O - O_ref| on head (0, 0) against float64 attention.
"""
from __future__ import annotations

import math

import torch
import triton

from flashbook import sources
from flashbook.bench import FORWARD_SHAPES as SHAPES, attention_bytes, free_cuda_cache, \
    public_row
from flashbook.bench_setups import measure, sdpa_setup
from flashbook.reference import attention_flops
from flashbook.results import Row
from flashbook.tiles import LOG2E, pick_config

GRAPH_TIMER = True
TAU = 8.0                      # base 2: an exponential may grow to 256 before O is rescaled
TRICKS = {"": ("hw", None), "_lazy": ("hw", TAU), "_poly": ("poly", None),   # suffix: (exp2,
          "_lazy_poly": ("poly", TAU), "_poly_half": ("poly_half", None),    # tau or None)
          "_exp_x2": ("doubled", None), "_no_exp": ("removed", None)}
GLUON_EXP2 = ("hw", "poly", "doubled", "removed")        # Gluon has no _poly_half
PROBES = ("_exp_x2", "_no_exp")
# the rows that are Chapter 7's solutions (Exercises 2 and 3b in Chapter 3's kernel)
REFERENCES = ("ch3_two_tiles_lazy", "ch3_two_tiles_poly", "ch7_attention_lazy")

# The exponentials the Triton variants may use (``BENCH_EXP2``); the cubic is the Chapter 7
# solution's ``exp2_poly_tl``, put beside these in the namespace.
EXP2_FUNCTIONS = '''
@triton.jit
def exp2_hw(x):
    return tl.math.exp2(x)


@triton.jit
def exp2_doubled(x):
    # two exponentials whose product is 2^(x (1 + 2^-24)); distinct, so neither is folded away
    return tl.math.exp2(x * 0.5) * tl.math.exp2(x * 0.50000006)


@triton.jit
def exp2_removed(x):
    return tl.maximum(x * 0.125 + 1.0, 0.0)


@triton.jit
def exp2_poly_half(x):
    """(M, N): even columns on the special-function unit, odd columns on the cubic."""
    M: tl.constexpr = x.shape[0]
    N: tl.constexpr = x.shape[1]
    even, odd = tl.split(tl.reshape(x, [M, N // 2, 2]))
    return tl.reshape(tl.join(tl.math.exp2(even), exp2_poly_tl(odd)), [M, N])
'''

# Chapter 3's update with its exponential of P swapped (alpha stays on MUFU: one per row).
EAGER_UPDATE = '''
@triton.jit
def attn_update(acc, l_i, m_i, s, v_ptrs, start_n, N_k, qk_scale, offs_n,
                MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr):
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    p = BENCH_EXP2(s * qk_scale - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    if MASKED:
        v = tl.load(v_ptrs, mask=((start_n + offs_n) < N_k)[:, None], other=0.0)
    else:
        v = tl.load(v_ptrs)
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
    return acc, l_i, m_new
'''

# Chapter 3's update replaced by the Chapter 7 solution's lazy_update (its count is dropped).
LAZY_UPDATE = '''
@triton.jit
def attn_update(acc, l_i, m_i, s, v_ptrs, start_n, N_k, qk_scale, offs_n,
                MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr):
    if MASKED:
        v = tl.load(v_ptrs, mask=((start_n + offs_n) < N_k)[:, None], other=0.0)
    else:
        v = tl.load(v_ptrs)
    acc, l_i, m_i, rescaled = lazy_update(acc, l_i, m_i, s, v, qk_scale, BENCH_TAU, BENCH_EXP2,
                                          DOT_PRECISION)
    return acc, l_i, m_i
'''


def triton_namespace(exp2: str, tau: float | None) -> dict:
    """Chapter 3's solution namespace with ``attn_update`` rebound to one trick setting (a fresh
    namespace each call, so nothing compiled for another setting is reused)."""
    import triton.language as tl

    from flashbook.chapters.ch7.exp2poly import fit_exp2
    ns = sources.solution_namespace("ch3")
    # the two solution cells of Chapter 7 that the tricks are, with the cubic's coefficients
    # they read (the chapter's cell before Exercise 3b makes the same constexprs)
    ns.update({f"C{i}": tl.constexpr(c) for i, c in enumerate(fit_exp2(3))})
    cells = sources.cells_by_id(sources.read(sources.source("ch7").path))
    for cell in ("ch7_lazy_update", "ch7_exp2_poly_tl"):
        sources.exec_cell(cells[cell], f"<ch7 benchmark: {cell}>", ns)
    sources.exec_cell(EXP2_FUNCTIONS, "<ch7 benchmark: exponentials>", ns)
    names = {"hw": "exp2_hw", "poly": "exp2_poly_tl", "poly_half": "exp2_poly_half",
             "doubled": "exp2_doubled", "removed": "exp2_removed"}
    ns["BENCH_EXP2"] = ns[names[exp2]]
    ns["BENCH_TAU"] = tl.constexpr(float(tau or 0.0))
    sources.exec_cell(LAZY_UPDATE if tau is not None else EAGER_UPDATE,
                      f"<ch7 benchmark: attn_update exp2={exp2} tau={tau}>", ns)
    return ns


def launch_two_tiles(kernel, q, k, v, config):
    """Chapter 3's launch of ``attn_fwd_two_tiles`` (``ch3.attention_forward``) without its
    dtype check: fp16 or bf16 q, k, v (B, H, N, d) contiguous; returns O."""
    B, H, N_q, d = q.shape
    N_k = k.shape[2]
    o = torch.empty_like(q)
    lse = torch.empty((B, H, N_q), dtype=torch.float32, device=q.device)
    kernel[(triton.cdiv(N_q, config.BLOCK_M), B * H)](
        q, k, v, o, lse, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1),
        k.stride(2), v.stride(0), v.stride(1), v.stride(2), o.stride(0), o.stride(1),
        o.stride(2), H, N_q, N_k, LOG2E / math.sqrt(d), HEAD_DIM=d, BLOCK_M=config.BLOCK_M,
        BLOCK_N=config.BLOCK_N, DOT_PRECISION="tf32", num_warps=config.num_warps,
        num_stages=config.num_stages)
    return o


def head0_reference(q, k, v) -> torch.Tensor:
    """float64 attention of head (0, 0), (N_q, d), in query chunks (a (2048, N_k) float64 S at
    a time: 256 MiB at N_k = 16384)."""
    q0, k0, v0 = (t[0, 0].double() for t in (q, k, v))
    scale = 1.0 / math.sqrt(q.shape[-1])
    return torch.cat([torch.softmax(c @ k0.T * scale, dim=-1) @ v0 for c in q0.split(2048)])


def error(o, want) -> float:
    return (o[0, 0].double() - want).abs().max().item()


def columns(B, H, N, d, dtype) -> dict:
    """``bench_setups.measure``'s keywords for one non-causal case."""
    return dict(B=B, H_q=H, N_q=N, d=d, dtype=dtype, causal=False,
                flops=attention_flops(B, H, N, N, d, False),
                nbytes=attention_bytes(B, H, N, N, d, dtype.itemsize))


def _row(name, fn, want, note, **kw) -> Row:
    """One row of ``fn()`` (O of one forward), its error on head (0, 0) in the note."""
    def setup():
        probe = "; a timing probe, not attention" if name.endswith(PROBES) else ""
        return fn, f"err={error(fn(), want):.1e}{probe}"
    role = "reference" if name in REFERENCES else "variant"
    return measure(name, role, setup, note=note, **kw)


def lazy_rows(attention_lazy, q, k, v, want, cap, **kw) -> list[Row]:
    """The chapter's ``attention_lazy`` on one case: config passed from a CUDA graph, then as a
    reader calls it (``public``)."""
    from .lazy import DTYPES, pick_config as lazy_config
    if q.dtype not in DTYPES:
        return []
    cfg = lazy_config(q.shape[-1], q.dtype, cap)
    note = (f"max_growth=256; BLOCK_M={cfg.BLOCK_M} BLOCK_N={cfg.BLOCK_N} "
            f"warps={cfg.num_warps} stages={cfg.num_stages}")
    row = _row("ch7_attention_lazy", lambda: attention_lazy(q, k, v, config=cfg)[0], want, note,
               **kw)
    if row.ms is None:
        return [row]
    return [row, public_row(row, lambda: attention_lazy(q, k, v), "attention_lazy(q, k, v)")]


def run(case_list=None) -> list[Row]:
    from flashbook.fa3_launch import attention_fa3, pick_config as gluon_config

    from .gluon_tricks import hooks                 # Gluon, imported when the run needs it
    cap = torch.cuda.get_device_capability(0)
    namespaces = {suffix: triton_namespace(*trick) for suffix, trick in TRICKS.items()}
    attention_lazy = sources.solution_namespace("ch7")["attention_lazy"]
    rows = []
    cases = [(s, dtype) for dtype in (torch.float16, torch.bfloat16) for s in SHAPES]
    for (B, H, N, d), dtype in case_list or cases:
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(B, H, N, d, device="cuda", dtype=dtype, generator=g)
                   for _ in range(3))
        want = head0_reference(q, k, v)
        kw = columns(B, H, N, d, dtype)
        cfg = pick_config(d, dtype, cap, two_tiles=True)
        for suffix, (exp2, tau) in TRICKS.items():
            kernel = namespaces[suffix]["attn_fwd_two_tiles"]
            note = (f"exp2={exp2} tau={tau}; BLOCK_M={cfg.BLOCK_M} BLOCK_N={cfg.BLOCK_N} "
                    f"warps={cfg.num_warps} stages={cfg.num_stages}")
            rows.append(_row(f"ch3_two_tiles{suffix}",
                             lambda: launch_two_tiles(kernel, q, k, v, cfg), want, note, **kw))
        rows += lazy_rows(attention_lazy, q, k, v, want, cap, **kw)
        gcfg = gluon_config(d, dtype, False, B, H, N, N)
        for suffix, (exp2, tau) in TRICKS.items():
            if exp2 not in GLUON_EXP2:
                continue
            note = (f"exp2={exp2} tau={tau}; BLOCK_M={gcfg.BLOCK_M} BLOCK_N={gcfg.BLOCK_N} "
                    f"STAGES={gcfg.STAGES}")
            rows.append(_row(f"ch6_gluon_fa3{suffix}",
                             lambda: attention_fa3(q, k, v, config=gcfg,
                                                   hooks=hooks(exp2, tau))[0], want, note, **kw))
        rows.append(measure("sdpa_cudnn", "baseline", sdpa_setup(
            "sdpa_cudnn", q, k, v, False, gqa=False, check=lambda o: f"err={error(o, want):.1e}"),
            note="baseline", **kw))
        del q, k, v
        free_cuda_cache()
    return rows
