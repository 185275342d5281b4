"""Chapter 6's FP8 forward (FlashAttention-3's third contribution), the kernel your Exercises 5-7
feed: e4m3 operands for both GEMMs with one scale per block of rows (Exercise 5's
``quantize_blocks``; the rotation of Exercise 6 applied to Q and K first, if at all).

``fp8_attention_kernel``: S = (Q8 K8^T) sq sk in fp32, the online softmax in base 2, P cast to
e4m3 as it is (it lies in [0, 1]) and ``acc = acc * alpha + (P8 V8) sv`` per K/V tile: Exercise
7's bookkeeping. wgmma reads an fp8 B operand only K-major, so V travels transposed, V^T
``(B, H, d, N)`` with the keys contiguous, made once on the way in. Memory traffic per program:
Q's tile once, every K and V^T tile once, at one byte an element (half of fp16's).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
LOG2E = 1.4426950408889634

__all__ = ["E4M3", "E4M3_MAX", "attention_fp8", "fp8_attention_kernel"]


@triton.jit
def fp8_attention_kernel(Q, K, VT, O, QS, KS, VS, qk_scale, N,
                         HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         CAUSAL: tl.constexpr):
    """One (query tile, batch * head) program. Q, K (BH, N, d) e4m3; VT (BH, d, N) e4m3; O
    (BH, N, d) fp16; QS (BH, N / BLOCK_M), KS and VS (BH, N / BLOCK_N) fp32 block scales;
    qk_scale = softmax scale * log2(e). N a multiple of BLOCK_M and BLOCK_N."""
    start_m = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + bh * N * HEAD_DIM + offs_m[:, None] * HEAD_DIM + offs_d[None, :])
    sq = tl.load(QS + bh * (N // BLOCK_M) + start_m) * qk_scale
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    k_ptrs = K + bh * N * HEAD_DIM + offs_n[:, None] * HEAD_DIM + offs_d[None, :]
    vt_ptrs = VT + bh * HEAD_DIM * N + offs_d[:, None] * N + offs_n[None, :]
    hi = (start_m + 1) * BLOCK_M if CAUSAL else N
    for start_n in range(0, hi, BLOCK_N):
        k = tl.load(k_ptrs + start_n * HEAD_DIM)                       # (BLOCK_N, d)
        sk = tl.load(KS + bh * (N // BLOCK_N) + start_n // BLOCK_N)
        s = tl.dot(q, tl.trans(k)) * (sq * sk)                         # log2 units
        if CAUSAL:
            s = tl.where(offs_m[:, None] >= start_n + offs_n[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        vt = tl.load(vt_ptrs + start_n)                                # (d, BLOCK_N)
        sv = tl.load(VS + bh * (N // BLOCK_N) + start_n // BLOCK_N)
        acc = acc * alpha[:, None] + tl.dot(p.to(tl.float8e4nv), tl.trans(vt)) * sv
        m_i = m_new
    o = acc / l_i[:, None]
    tl.store(O + bh * N * HEAD_DIM + offs_m[:, None] * HEAD_DIM + offs_d[None, :],
             o.to(O.dtype.element_ty))


def attention_fp8(q8, qs, k8, ks, vt8, vs, causal: bool = False, out_dtype=torch.float16,
                  block_m: int = 128, block_n: int = 128, num_warps: int = 8,
                  num_stages: int = 3):
    """O (B, H, N, d) ``out_dtype`` of softmax(Q K^T / sqrt(d)) V from e4m3 inputs: q8, k8
    (B, H, N, d) with block scales qs (B, H, N / block_m), ks (B, H, N / block_n); V transposed,
    vt8 (B, H, d, N), with vs (B, H, N / block_n) (Exercise 5's ``quantize_blocks`` of V, then
    ``.transpose(-1, -2).contiguous()``: the kernel's P V reads V K-major). GPU only (compute
    capability 8.9 or newer: fp8 tensor cores)."""
    if not q8.is_cuda or torch.cuda.get_device_capability(q8.device) < (8, 9):
        raise ValueError("attention_fp8: needs a GPU with fp8 tensor cores (compute capability "
                         "8.9 or newer).")
    B, H, N, d = q8.shape
    for name, t, shape in (("q8", q8, (B, H, N, d)), ("k8", k8, (B, H, N, d)),
                           ("vt8", vt8, (B, H, d, N))):
        if t.dtype != E4M3 or tuple(t.shape) != shape or not t.is_contiguous():
            raise ValueError(f"attention_fp8: {name} must be a contiguous float8_e4m3fn tensor "
                             f"of shape {shape}; got {t.dtype} {tuple(t.shape)}.")
    if N % block_m or N % block_n or d not in (64, 128):
        raise ValueError(f"attention_fp8: needs N a multiple of {block_m} and {block_n} and d in "
                         f"(64, 128); got N = {N}, d = {d}.")
    for name, t, n in (("qs", qs, N // block_m), ("ks", ks, N // block_n), ("vs", vs, N // block_n)):
        if t.dtype != torch.float32 or tuple(t.shape) != (B, H, n) or not t.is_contiguous():
            raise ValueError(f"attention_fp8: {name} must be contiguous float32 of shape "
                             f"{(B, H, n)} (one scale per block); got {t.dtype} {tuple(t.shape)}.")
    o = torch.empty((B, H, N, d), dtype=out_dtype, device=q8.device)
    fp8_attention_kernel[(N // block_m, B * H)](
        q8, k8, vt8, o, qs, ks, vs, LOG2E / math.sqrt(d), N, HEAD_DIM=d, BLOCK_M=block_m,
        BLOCK_N=block_n, CAUSAL=causal, num_warps=num_warps, num_stages=num_stages)
    return o
