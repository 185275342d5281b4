"""Plain torch references (introduced in Chapter 1).

Book-wide conventions (every chapter keeps them):
  * tensors are shaped (B, H, N, d) (packed varlen: (total, H, d)); ``scale`` defaults to 1/sqrt(d) and multiplies S in fp32
    or wider, never the low-precision inputs;
  * the log-sum-exp (LSE) is in natural log, shaped (B, H, N_q);
  * a causal mask is aligned bottom-right: query i sees key j iff j <= i + (N_k - N_q);
  * a query row that sees no key gets O = 0 and LSE = -inf, never NaN.
"""
from __future__ import annotations

import math

import torch


def softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Numerically stable softmax; an all -inf slice gives zeros (not NaN)."""
    m = x.amax(dim=dim, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(x - m)
    s = e.sum(dim=dim, keepdim=True)
    return torch.where(s > 0, e / s, torch.zeros_like(e))


def logsumexp(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """log(sum(exp(x))) along ``dim``; an all -inf slice gives -inf."""
    return torch.logsumexp(x, dim=dim)


def causal_mask(n_q: int, n_k: int, device=None) -> torch.Tensor:
    """Boolean (n_q, n_k) mask, True where query i may see key j (bottom-right aligned)."""
    return visible_mask(n_q, n_k, causal=True, device=device)


def visible_mask(n_q: int, n_k: int, causal: bool = False, window: tuple | None = None,
                 device=None) -> torch.Tensor:
    """Boolean (n_q, n_k) mask, True where query i may see key j.

    Both masks are aligned bottom-right (query i sits at key position i + n_k - n_q).
    ``window = (left, right)`` as flash-attn defines it: key j is visible iff
    pos - left <= j <= pos + right, a negative side meaning unlimited; ``causal`` is the
    window (unlimited, 0).
    """
    pos = torch.arange(n_q, device=device)[:, None] + (n_k - n_q)
    j = torch.arange(n_k, device=device)[None, :]
    visible = torch.ones(n_q, n_k, dtype=torch.bool, device=device)
    left, right = window if window is not None else (-1, -1)
    if causal:
        right = 0 if right < 0 else min(right, 0)
    if left >= 0:
        visible &= j >= pos - left
    if right >= 0:
        visible &= j <= pos + right
    return visible


def attention(q, k, v, scale: float | None = None, causal: bool = False,
              return_lse: bool = False, dtype=torch.float64, window: tuple | None = None):
    """softmax(Q K^T * scale) V computed in ``dtype`` (float64 by default).

    q: (B, H_q, N_q, d), k and v: (B, H_kv, N_k, d) with H_q a multiple of H_kv (grouped-query
    attention: query head h reads K/V head h // (H_q / H_kv)). Returns O in q's dtype and, if
    asked, LSE (B, H_q, N_q) in float32. Memory: materialises S and P, (B, H_q, N_q, N_k) each.
    """
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    group = q.shape[1] // k.shape[1]
    if group != 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    s = torch.matmul(q.to(dtype), k.to(dtype).transpose(-1, -2)) * scale
    if causal or window is not None:
        s = s.masked_fill(~visible_mask(q.shape[-2], k.shape[-2], causal, window, q.device),
                          float("-inf"))
    o = torch.matmul(softmax(s), v.to(dtype)).to(q.dtype)
    if return_lse:
        return o, logsumexp(s).to(torch.float32)
    return o


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, scale: float | None = None,
                     causal: bool = False, window: tuple | None = None):
    """Packed ("varlen") attention: q (total_q, H_q, d), k and v (total_k, H_kv, d); sequence b
    owns rows cu_seqlens_q[b]:cu_seqlens_q[b+1] of q (and likewise of k, v). Masks apply per
    sequence. Returns O (total_q, H_q, d) and LSE (H_q, total_q) in float32, as flash-attn."""
    o = torch.zeros_like(q)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float32,
                     device=q.device)
    for b in range(len(cu_seqlens_q) - 1):
        qs, qe = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        ks, ke = int(cu_seqlens_k[b]), int(cu_seqlens_k[b + 1])
        if qe == qs or ke == ks:
            continue
        ob, lb = attention(q[qs:qe].transpose(0, 1)[None], k[ks:ke].transpose(0, 1)[None],
                           v[ks:ke].transpose(0, 1)[None], scale, causal, True, window=window)
        o[qs:qe] = ob[0].transpose(0, 1)
        lse[:, qs:qe] = lb[0]
    return o, lse


def attention_flops(B: int, H: int, N_q: int, N_k: int, d: int, causal: bool = False) -> float:
    """FLOPs of the two matmuls of the forward pass: 2 * (2 * N_q * N_k * d) per head.

    A causal mask halves the useful work when N_q == N_k (we count N_q*N_k/2 pairs).
    """
    pairs = N_q * N_k / (2 if causal else 1)
    return 4.0 * B * H * pairs * d
