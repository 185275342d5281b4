"""Plain torch references (introduced in Chapter 1).

Book-wide conventions (every chapter keeps them):
  * tensors are shaped (B, H, N, d); ``scale`` defaults to 1/sqrt(d) and multiplies S in fp32
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
    i = torch.arange(n_q, device=device)[:, None]
    j = torch.arange(n_k, device=device)[None, :]
    return j <= i + (n_k - n_q)


def attention(q, k, v, scale: float | None = None, causal: bool = False,
              return_lse: bool = False, dtype=torch.float64):
    """softmax(Q K^T * scale) V computed in ``dtype`` (float64 by default).

    q: (B, H, N_q, d), k and v: (B, H, N_k, d). Returns O in q's dtype and, if asked,
    LSE (B, H, N_q) in float32. Memory: materialises S and P, (B, H, N_q, N_k) each.
    """
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    s = torch.matmul(q.to(dtype), k.to(dtype).transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(~causal_mask(q.shape[-2], k.shape[-2], q.device), float("-inf"))
    o = torch.matmul(softmax(s), v.to(dtype)).to(q.dtype)
    if return_lse:
        return o, logsumexp(s).to(torch.float32)
    return o


def attention_flops(B: int, H: int, N_q: int, N_k: int, d: int, causal: bool = False) -> float:
    """FLOPs of the two matmuls of the forward pass: 2 * (2 * N_q * N_k * d) per head.

    A causal mask halves the useful work when N_q == N_k (we count N_q*N_k/2 pairs).
    """
    pairs = N_q * N_k / (2 if causal else 1)
    return 4.0 * B * H * pairs * d
