"""Chapter 8's partial softmax states, solved (the references the checks compare with).

A partial state of one query row over a set of keys J is ``(m, l, O)``: the largest scaled score
``m = max_j s_j``, the sum ``l = sum_j exp(s_j - m)`` and the normalised output
``O = sum_j exp(s_j - m) v_j / l`` (what a kernel writes). Its log-sum-exp is ``m + log l``, so
``(O, LSE)`` is the same state with ``l`` folded into ``m``: ``(m, l, O) = (LSE, 1, O)``. The empty
state (no key) is ``(-inf, 0, 0)``, the identity of the merge. Shapes: ``m`` and ``l`` (...),
``O`` (..., d); everything here computes in the inputs' dtype (fp32 or fp64).
"""
from __future__ import annotations

import math

import torch

__all__ = ["identity", "merge_states", "merge_lse", "state_of", "block_attention",
           "wire_roundtrip_error"]


def identity(shape, d: int, dtype=torch.float64, device="cpu"):
    """The empty state (-inf, 0, 0) of ``shape`` rows of width ``d``."""
    return (torch.full(shape, -math.inf, dtype=dtype, device=device),
            torch.zeros(shape, dtype=dtype, device=device),
            torch.zeros((*shape, d), dtype=dtype, device=device))


def merge_states(a, b):
    """(m, l, O) + (m, l, O) -> (m, l, O), shifted by the larger max; two empty sides give the
    empty state, never NaN."""
    (ma, la, oa), (mb, lb, ob) = a, b
    m = torch.maximum(ma, mb)
    m_safe = torch.where(torch.isinf(m) & (m < 0), torch.zeros_like(m), m)
    wa = la * torch.exp(ma - m_safe)                 # exp(-inf) = 0 for an empty side
    wb = lb * torch.exp(mb - m_safe)
    l = wa + wb
    inv = torch.where(l > 0, 1.0 / torch.where(l > 0, l, torch.ones_like(l)), torch.zeros_like(l))
    o = oa * (wa * inv)[..., None] + ob * (wb * inv)[..., None]
    return m, l, o


def merge_lse(o_a, lse_a, o_b, lse_b):
    """The (O, LSE) form: the state (LSE, 1, O) merged; returns (O, LSE)."""
    one_a = torch.where(torch.isinf(lse_a) & (lse_a < 0), 0.0, 1.0).to(lse_a.dtype)
    one_b = torch.where(torch.isinf(lse_b) & (lse_b < 0), 0.0, 1.0).to(lse_b.dtype)
    m, l, o = merge_states((lse_a, one_a, o_a), (lse_b, one_b, o_b))
    return o, m + torch.log(l)


def block_attention(q, k, v, q_pos=None, k_pos=None, causal: bool = False, scale=None):
    """The partial (O, LSE) of queries q (B, H_q, n, d) over one block of keys k, v
    (B, H_kv, n_k, d), in q's dtype: key j is visible to query i when ``k_pos[j] <= q_pos[i]``
    (``causal``; positions in the whole sequence, (n,) and (n_k,) int64). A row that sees no
    key gives O = 0, LSE = -inf. Materialises the (n, n_k) scores: for checks and CPU runs."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    g = q.shape[1] // k.shape[1]
    if g > 1:
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    s = torch.matmul(q, k.transpose(-1, -2)) * scale                 # (B, H, n, n_k)
    if causal:
        s = s.masked_fill(k_pos[None, :] > q_pos[:, None], -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    return torch.matmul(p, v), lse


def state_of(scores, v):
    """The (m, l, O) state of score rows ``scores`` (..., n) over values v (n, d), float64."""
    m = scores.amax(-1)
    m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    e = torch.exp(scores - m_safe[..., None])
    l = e.sum(-1)
    o = (e @ v) / torch.where(l > 0, l, torch.ones_like(l))[..., None]
    return m, l, o


def wire_roundtrip_error(parts: int = 8, keys: int = 4096, d: int = 64, boost: float = 12.0,
                         seed: int = 0) -> dict:
    """Chain-merge ``parts`` partial states of one set of query rows over ``keys`` keys, rounding
    what travels between parts to a wire dtype; return the max |O - O_exact| for each wire
    format: m, l and O all fp32; all fp16 (the mesh kernel's choice); LSE fp32 with O fp16.
    ``boost`` scales the logits (large logits are where fp16's m goes wrong)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(16, d, generator=g, dtype=torch.float64) * boost
    k = torch.randn(keys, d, generator=g, dtype=torch.float64)
    v = torch.randn(keys, d, generator=g, dtype=torch.float64)
    s = q @ k.T / math.sqrt(d)
    exact = torch.softmax(s, -1) @ v
    shards = [state_of(s[:, i::parts], v[i::parts]) for i in range(parts)]

    def chain(wire):
        acc = shards[0]
        for nxt in shards[1:]:
            acc = merge_states(wire(acc), nxt)
        return (acc[2] - exact).abs().max().item()

    def f16(t):
        return t.to(torch.float16).to(torch.float64)

    def lse_f32(st):
        m, l, o = st
        lse = (m + torch.log(l)).to(torch.float32).to(torch.float64)
        return lse, torch.ones_like(l), f16(o)
    return {"fp32 m, l, O": chain(lambda st: tuple(t.to(torch.float32).to(torch.float64)
                                                     for t in st)),
            "fp16 m, l, O (the mesh kernel)": chain(lambda st: tuple(f16(t) for t in st)),
            "fp32 LSE, fp16 O": chain(lse_f32),
            "largest l": max(st[1].max().item() for st in shards),
            "largest m": max(st[0].max().item() for st in shards)}
