"""Chapter 6's FP8 forward (FlashAttention-3's third contribution), the kernel your Exercises 5-7
feed: e4m3 operands for both GEMMs with one scale per block of rows (Exercise 5's
``quantize_blocks``; the rotation of Exercise 6 applied to Q and K first, if at all).

``fp8_attention_kernel``: S = (Q8 K8^T) sq sk in fp32, the online softmax in base 2, and per
K/V tile Exercise 7's bookkeeping with two changes that cost nothing:

* P is computed as 2^8 exp(S - m), in [0, 256]: the shift of the exponent moves P's small
  values out of e4m3's subnormals (below 2^-6) before the cast; the row sum carries the same
  2^8, and the final division cancels it.
* The accumulator holds O / sv of the current tile: each step rescales it by alpha * sv_old /
  sv_new, one multiply per element, and ``tl.dot`` then adds P8 V8 in place (no second
  multiply by V's scale per element); the last sv multiplies it once at the end.

Causal: the tiles wholly below the diagonal run without a mask; only the diagonal tiles are
masked. wgmma reads an fp8 B operand only K-major, so V travels transposed, V^T ``(B, H, d,
N)`` with the keys contiguous, made once on the way in. Memory traffic per program: Q's tile
once, every K and V^T tile once, at one byte an element (half of fp16's).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
LOG2E = 1.4426950408889634
P_SHIFT = tl.constexpr(8.0)  # P = 2^P_SHIFT exp(S - m) <= 256 < 448: e4m3's normal range

__all__ = ["E4M3", "E4M3_MAX", "P_SHIFT", "attention_fp8", "fp8_attention_kernel"]


@triton.jit
def _fp8_step(acc, l_i, m_i, sv_old, q, c, K, KS, VT, VS, N, start_n, offs_m, offs_n, offs_d,
              HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr):
    """One K/V tile: acc (BLOCK_M, d) fp32 in units of the previous tile's V scale ``sv_old``;
    c = sq * qk_scale. Returns the new (acc, l_i, m_i, sv)."""
    k = tl.load(K + (start_n + offs_n)[:, None] * HEAD_DIM + offs_d[None, :])   # (BLOCK_N, d)
    c = c * tl.load(KS + start_n // BLOCK_N)
    s = tl.dot(q, tl.trans(k))                                    # fp32, unscaled
    if MASK:
        s = tl.where(offs_m[:, None] >= start_n + offs_n[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1) * c)                     # c > 0: max commutes
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(s * c - (m_new[:, None] - P_SHIFT))          # one FMA and one exp2
    l_i = l_i * alpha + tl.sum(p, 1)
    vt = tl.load(VT + offs_d[:, None] * N + (start_n + offs_n)[None, :])         # (d, BLOCK_N)
    sv = tl.load(VS + start_n // BLOCK_N)
    acc = tl.dot(p.to(tl.float8e4nv), tl.trans(vt), acc * (alpha * (sv_old / sv))[:, None])
    return acc, l_i, m_new, sv


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
    c = tl.load(QS + bh * (N // BLOCK_M) + start_m) * qk_scale
    K, VT = K + bh * N * HEAD_DIM, VT + bh * HEAD_DIM * N
    KS, VS = KS + bh * (N // BLOCK_N), VS + bh * (N // BLOCK_N)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    sv = tl.full([], 1.0, tl.float32)
    # causal: keys below the first query row of the tile need no mask; the rest up to its last
    # row straddle the diagonal
    unmasked = (start_m * BLOCK_M) // BLOCK_N * BLOCK_N if CAUSAL else N
    for start_n in range(0, unmasked, BLOCK_N):
        acc, l_i, m_i, sv = _fp8_step(acc, l_i, m_i, sv, q, c, K, KS, VT, VS, N, start_n,
                                      offs_m, offs_n, offs_d, HEAD_DIM, BLOCK_N, False)
    if CAUSAL:
        for start_n in range(unmasked, (start_m + 1) * BLOCK_M, BLOCK_N):
            acc, l_i, m_i, sv = _fp8_step(acc, l_i, m_i, sv, q, c, K, KS, VT, VS, N, start_n,
                                          offs_m, offs_n, offs_d, HEAD_DIM, BLOCK_N, True)
    o = acc * (sv / l_i)[:, None]
    tl.store(O + bh * N * HEAD_DIM + offs_m[:, None] * HEAD_DIM + offs_d[None, :],
             o.to(O.dtype.element_ty))


def attention_fp8(q8, qs, k8, ks, vt8, vs, causal: bool = False, out_dtype=torch.float16,
                  block_m: int = 64, block_n: int = 128, num_warps: int = 4, num_stages: int = 3):
    """O (B, H, N, d) ``out_dtype`` of softmax(Q K^T / sqrt(d)) V from e4m3 inputs: q8, k8
    (B, H, N, d) with block scales qs (B, H, N / block_m), ks (B, H, N / block_n); V transposed,
    vt8 (B, H, d, N), with vs (B, H, N / block_n) (Exercise 5's ``quantize_blocks`` of V, then
    ``.transpose(-1, -2).contiguous()``: the kernel's P V reads V K-major). GPU only (compute
    capability 8.9 or newer: fp8 tensor cores). The default tiles, 64 query rows against 128
    keys in one warpgroup, were the fastest of those ``python -m flashbook.fp8_bench`` times:
    with one warpgroup per program, several programs share an SM, and one's softmax can run
    while another's matmuls do."""
    if not q8.is_cuda or torch.cuda.get_device_capability(q8.device) < (8, 9):
        raise ValueError("attention_fp8: needs a GPU with fp8 tensor cores (compute capability "
                         "8.9 or newer).")
    return launch(q8, qs, k8, ks, vt8, vs, causal, out_dtype, block_m, block_n, num_warps,
                  num_stages)


def launch(q8, qs, k8, ks, vt8, vs, causal, out_dtype, block_m, block_n, num_warps, num_stages):
    """``attention_fp8`` without the GPU check: the argument checks and the launch (the tests run
    it in Triton's CPU interpreter)."""
    B, H, N, d = q8.shape
    for name, t, shape in (("q8", q8, (B, H, N, d)), ("k8", k8, (B, H, N, d)),
                           ("vt8", vt8, (B, H, d, N))):
        if t.dtype != E4M3 or tuple(t.shape) != shape or not t.is_contiguous():
            raise ValueError(f"attention_fp8: {name} must be a contiguous float8_e4m3fn tensor "
                             f"of shape {shape}; got {t.dtype} {tuple(t.shape)}.")
    if N % block_m or N % block_n or d not in (64, 128):
        raise ValueError(f"attention_fp8: needs N a multiple of {block_m} and {block_n} and d in "
                         f"(64, 128); got N = {N}, d = {d}.")
    for name, t, n in (("qs", qs, N // block_m), ("ks", ks, N // block_n),
                       ("vs", vs, N // block_n)):
        if t.dtype != torch.float32 or tuple(t.shape) != (B, H, n) or not t.is_contiguous():
            raise ValueError(f"attention_fp8: {name} must be contiguous float32 of shape "
                             f"{(B, H, n)} (one scale per block); got {t.dtype} {tuple(t.shape)}.")
    o = torch.empty((B, H, N, d), dtype=out_dtype, device=q8.device)
    fp8_attention_kernel[(N // block_m, B * H)](
        q8, k8, vt8, o, qs, ks, vs, LOG2E / math.sqrt(d), N, HEAD_DIM=d, BLOCK_M=block_m,
        BLOCK_N=block_n, CAUSAL=causal, num_warps=num_warps, num_stages=num_stages)
    return o
