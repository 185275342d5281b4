"""Chapter 9's one-kernel backward, in two forms: dQ added by scalar atomics, and dQ reduced
into fp32 by the TMA as FlashAttention-3 does it. ``flashbook bench ch9`` times both
(``ch9_bwd_atomic``: ``dq_tma=False``; ``ch9_bwd_fused``: the default on sm_90).

Course material, not package material: its dK/dV part is Exercise 1's answer, so it lives
beside the solutions and is loaded with ``sources.course_module("extras/ch9_one_kernel.py")``.

The two-kernel backward the student writes runs seven tile GEMMs per (Q tile, K/V tile) pair:
four in dK/dV (S^T, dV, dP^T, dK) and three in dQ (S and dP again, then dQ), 1.4x the five a
backward needs. This kernel runs the five: each K/V-stationary program also computes its
contribution dS K to the Q tile it just read and adds it into an fp32 buffer ``dq_acc``
(total_q, h_q * d). On sm_90 the add is one ``cp.reduce.async.bulk`` per tile (a tensor
descriptor's ``atomic_add``): the TMA engine does the read-modify-write in L2, in place of the
8192 scalar atomics per 64 x 128 tile of ``tl.atomic_add``, the other form (the only one the
CPU interpreter has: it has no TMA reduce).

Chapter 9's Section 7 quotes what the H200 measured: the TMA reduce is over twice as fast as
scalar atomics, yet the kernel only draws level with the two-kernel backward.

The price is determinism: the programs of one query tile add in whatever order they finish,
so dQ's last bits change between runs. FlashAttention-3's deterministic mode orders the adds
with a semaphore per tile; not done here.

Layout as ``launch``: q, do ``(total_q, h_q, d)`` contiguous, k, v ``(total_k, h_kv, d)``,
LSE and D ``(h_q, total_q)`` float32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashbook.device import current
from flashbook.chapters.ch9.launch import LOG2E, BwdConfig, _precision, check_backward_args

__all__ = ["fused_backward", "launch_fused", "fused_config", "bwd_fused_kernel", "delta_kernel"]


@triton.jit
def delta_kernel(O, DO, Delta, total_q, H: tl.constexpr, HEAD_DIM: tl.constexpr,
                 BLOCK_M: tl.constexpr):
    """D (H, total_q) = rowsum(dO * O) in fp32 for contiguous O, dO (total_q, H, HEAD_DIM)."""
    t = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    h = tl.program_id(1)
    offs = t[:, None] * (H * HEAD_DIM) + h * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :]
    ok = (t < total_q)[:, None]
    o = tl.load(O + offs, mask=ok, other=0.0).to(tl.float32)
    do = tl.load(DO + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(Delta + h * total_q + t, tl.sum(o * do, 1), mask=t < total_q)


@triton.jit
def _fused_step(dk, dv, k, v, Q, DO, LSE, Delta, DQ, q_start, m0, seqlen_q, cols, diag, head,
                stride_qt, stride_qh, total_q, sm_scale, qk_scale, MASKED: tl.constexpr,
                DQ_TMA: tl.constexpr, LOAD_TMA: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                DOT_PRECISION: tl.constexpr):
    """One Q tile past the stationary K/V tile: five GEMMs, dQ's share added to dq_acc."""
    rows = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    ok = rows < seqlen_q
    offs = (q_start + rows)[:, None] * stride_qt + head * stride_qh + offs_d[None, :]
    if LOAD_TMA:    # rows past seqlen_q are the next sequence's; their LSE = inf gives P = 0
        q = Q.load([q_start + m0, head * HEAD_DIM])                    # read BLOCK_M*d
        do = DO.load([q_start + m0, head * HEAD_DIM])                  # read BLOCK_M*d
    else:
        q = tl.load(Q + offs, mask=ok[:, None], other=0.0)
        do = tl.load(DO + offs, mask=ok[:, None], other=0.0)
    lse = tl.load(LSE + head * total_q + q_start + rows, mask=ok, other=float("inf"))
    Di = tl.load(Delta + head * total_q + q_start + rows, mask=ok, other=0.0)
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    pT = tl.math.exp2(tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION) * qk_scale
                      - lse2[None, :])                                 # (BLOCK_N, BLOCK_M)
    if MASKED:
        pT = tl.where(cols[:, None] <= rows[None, :] + diag, pT, 0.0)
    dv += tl.dot(pT.to(do.dtype), do, input_precision=DOT_PRECISION)  # dV += P^T dO
    dsT = pT * (tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION) - Di[None, :])
    dsT = dsT.to(q.dtype)
    dk += tl.dot(dsT, q, input_precision=DOT_PRECISION)                # dK += dS^T Q
    dq = tl.dot(tl.trans(dsT), k, input_precision=DOT_PRECISION) * sm_scale   # (BLOCK_M, d)
    if DQ_TMA:      # rows past seqlen_q belong to the next sequence: their dS is 0, adds 0
        DQ.atomic_add([q_start + m0, head * HEAD_DIM], dq)             # L2 reduce, BLOCK_M*d
    else:
        tl.atomic_add(DQ + offs, dq, mask=ok[:, None])                 # q's layout (contiguous)
    return dk, dv


@triton.jit
def bwd_fused_kernel(Q, K, V, DO, LSE, Delta, DK, DV, DQ, CU_Q, CU_K,
                     stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_dkt, stride_dkh, H_KV, total_q, sm_scale, qk_scale,
                     CAUSAL: tl.constexpr, GROUP: tl.constexpr, DQ_TMA: tl.constexpr,
                     LOAD_TMA: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     DOT_PRECISION: tl.constexpr):
    """dK, dV of one K/V tile (as the chapter's bwd_dkdv_kernel; Q and dO share strides, dK
    and dV too) and every dQ contribution of it, added to DQ (fp32 (total_q, h_q * d))."""
    n0 = tl.program_id(0) * BLOCK_N
    seq = tl.program_id(1) // H_KV
    kv_head = tl.program_id(1) % H_KV
    k_start = tl.load(CU_K + seq)
    seqlen_k = tl.load(CU_K + seq + 1) - k_start
    if n0 >= seqlen_k:
        return
    q_start = tl.load(CU_Q + seq)
    seqlen_q = tl.load(CU_Q + seq + 1) - q_start
    cols = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    kv_ok = (cols < seqlen_k)[:, None]
    k = tl.load(K + (k_start + cols)[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :],
                mask=kv_ok, other=0.0)                                 # read BLOCK_N*d, once
    v = tl.load(V + (k_start + cols)[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :],
                mask=kv_ok, other=0.0)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    diag = seqlen_k - seqlen_q               # bottom-right: row i sees key j iff j <= i + diag
    lo = 0
    full_lo = 0
    if CAUSAL:
        lo = tl.maximum(n0 - diag, 0) // BLOCK_M * BLOCK_M
        full_lo = tl.minimum(tl.maximum(tl.cdiv(n0 + BLOCK_N - 1 - diag, BLOCK_M) * BLOCK_M, lo),
                             seqlen_q)
    for g in range(GROUP):
        head = kv_head * GROUP + g
        for m0 in range(lo, full_lo, BLOCK_M):          # tiles across the diagonal: masked
            dk, dv = _fused_step(dk, dv, k, v, Q, DO, LSE, Delta, DQ, q_start, m0, seqlen_q,
                                 cols, diag, head, stride_qt, stride_qh, total_q, sm_scale,
                                 qk_scale, True, DQ_TMA, LOAD_TMA, HEAD_DIM, BLOCK_M, DOT_PRECISION)
        for m0 in range(full_lo, seqlen_q, BLOCK_M):    # every key visible: no mask
            dk, dv = _fused_step(dk, dv, k, v, Q, DO, LSE, Delta, DQ, q_start, m0, seqlen_q,
                                 cols, diag, head, stride_qt, stride_qh, total_q, sm_scale,
                                 qk_scale, False, DQ_TMA, LOAD_TMA, HEAD_DIM, BLOCK_M, DOT_PRECISION)
    out = (k_start + cols)[:, None] * stride_dkt + kv_head * stride_dkh + offs_d[None, :]
    tl.store(DK + out, (dk * sm_scale).to(DK.dtype.element_ty), mask=kv_ok)   # BLOCK_N*d
    tl.store(DV + out, dv.to(DV.dtype.element_ty), mask=kv_ok)


def fused_config(d: int, dtype: torch.dtype, capability: tuple | None) -> BwdConfig:
    """Tiles of the one-kernel backward: the K/V tile is stationary (BLOCK_N rows), as in
    dK/dV; on sm_90 the fastest of a sweep on the H200. fp32 (the exact path) takes small
    tiles that fit every GPU."""
    if capability is None:
        return BwdConfig(16, 16, 4, 1)
    if dtype == torch.float32:
        return BwdConfig(32, 32, 4, 1)
    if tuple(capability) >= (9, 0):
        return BwdConfig(64, 128, 8, 3) if d > 64 else BwdConfig(64, 64, 4, 3)
    return BwdConfig(32, 64, 4, 1)


def launch_fused(q, k, v, do, lse, delta, cu_seqlens_q, cu_seqlens_k, max_seqlen_k: int, *,
                 causal: bool, scale: float | None = None, config: BwdConfig | None = None,
                 dq_tma: bool | None = None, load_tma: bool | None = None):
    """(dQ in q's dtype, dK, dV) from D (``launch_preprocess``'s). ``dq_tma`` (None: on sm_90
    and later) adds dQ by TMA reduces, else by scalar atomics (the CPU interpreter has no TMA
    reduce); ``load_tma`` loads the Q and dO tiles by the TMA (off by default: on the H200 it
    was slower than pointer loads, which Triton pipelines with cp.async)."""
    name = "launch_fused"
    total_q, h_q, h_kv, d, scale = check_backward_args(name, q, k, v, do, (lse, delta), scale)
    if not (q.is_contiguous() and do.is_contiguous()):
        raise ValueError(f"{name}: q and do must be contiguous (dQ's buffer has their layout).")
    capability = current().capability if q.is_cuda else None
    cfg = config or fused_config(d, q.dtype, capability)
    hopper = capability is not None and tuple(capability) >= (9, 0)
    dq_tma = hopper if dq_tma is None else dq_tma
    load_tma = False if load_tma is None else load_tma     # measured: slower on the H200
    dq_acc = torch.zeros((total_q, h_q * d), dtype=torch.float32, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)    # contiguous: one stride set
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    n_bkv = (cu_seqlens_k.numel() - 1) * h_kv
    if n_bkv == 0 or max_seqlen_k == 0 or total_q == 0:
        return dq_acc.view(q.shape).to(q.dtype), dk.zero_(), dv.zero_()
    from triton.tools.tensor_descriptor import TensorDescriptor

    def rows_of(t, use):        # (total_q, h_q * d) tiles of BLOCK_M tokens x one head
        return TensorDescriptor.from_tensor(t.view(total_q, h_q * d), [cfg.BLOCK_M, d]) \
            if use else t
    q_arg, do_arg, dq_arg = rows_of(q, load_tma), rows_of(do, load_tma), rows_of(dq_acc, dq_tma)
    grid = (triton.cdiv(max_seqlen_k, cfg.BLOCK_N), n_bkv)
    bwd_fused_kernel[grid](q_arg, k, v, do_arg, lse, delta, dk, dv, dq_arg, cu_seqlens_q, cu_seqlens_k,
                           q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0),
                           v.stride(1), dk.stride(0), dk.stride(1), h_kv, total_q, scale,
                           scale * LOG2E, CAUSAL=causal, GROUP=h_q // h_kv, DQ_TMA=dq_tma,
                           LOAD_TMA=load_tma, HEAD_DIM=d, BLOCK_M=cfg.BLOCK_M,
                           BLOCK_N=cfg.BLOCK_N, DOT_PRECISION=_precision(q.dtype),
                           num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return dq_acc.view(q.shape).to(q.dtype), dk, dv


def fused_backward(q, k, v, o, lse, do, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int,
                   max_seqlen_k: int, causal: bool = False, softmax_scale=None, *,
                   config: BwdConfig | None = None, dq_tma: bool | None = None,
                   load_tma: bool | None = None):
    """dQ, dK, dV as the chapter's ``attention_backward`` (same arguments), in two launches:
    D, then the fused kernel. O and dO are made contiguous (a copy if they are not)."""
    if o.shape != q.shape:
        raise ValueError(f"fused_backward: o {tuple(o.shape)} must be shaped like q "
                         f"{tuple(q.shape)}.")
    o, do, q = o.contiguous(), do.contiguous(), q.contiguous()
    total_q, h_q, d = q.shape
    delta = torch.empty((h_q, total_q), dtype=torch.float32, device=q.device)
    if total_q * h_q:
        delta_kernel[(triton.cdiv(total_q, 64), h_q)](o, do, delta, total_q, H=h_q, HEAD_DIM=d,
                                                      BLOCK_M=64)
    return launch_fused(q, k, v, do, lse, delta, cu_seqlens_q, cu_seqlens_k, max_seqlen_k,
                        causal=causal, scale=softmax_scale, config=config, dq_tma=dq_tma,
                        load_tma=load_tma)
