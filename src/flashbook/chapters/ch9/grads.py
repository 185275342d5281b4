"""Reference gradients of attention (float64 autograd), the inputs of a backward check, and
the memory a naive backward keeps: what Chapter 9's checks compare the kernels with.

``attention_grads`` differentiates the book's conventions (scale on S, bottom-right causal
mask, GQA by head groups, packed varlen) with torch autograd in float64, so it shares no code
with the kernels: a row that sees no key gets zero gradients (its P is 0), not NaN.
"""
from __future__ import annotations

import math

import torch

from flashbook.cases import AttnCase, make_inputs, seeded
from flashbook.reference import visible_mask

__all__ = ["attention_grads", "backward_inputs", "dense_attention", "stored_p_bytes"]


def dense_attention(q, k, v, scale=None, causal=False):
    """Differentiable softmax(Q K^T * scale) V for (B, H_q, N_q, d) q and (B, H_kv, N_k, d)
    k, v in their dtype; returns (O, LSE (B, H_q, N_q) natural log). Materialises S and P."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if causal:
        vis = visible_mask(q.shape[-2], k.shape[-2], causal=True, device=q.device)
        has_key = vis.any(-1)[:, None]                       # rows that see some key
        s = s.masked_fill(~vis, float("-inf")).masked_fill(~has_key, 0.0)
        p = torch.softmax(s, -1) * has_key
        lse = torch.logsumexp(s, -1).masked_fill(~has_key[:, 0], float("-inf"))
    else:
        p, lse = torch.softmax(s, -1), torch.logsumexp(s, -1)
    return torch.matmul(p, v), lse


def _sequences(case: AttnCase, tensors, keys):
    """(start, end) row ranges of each sequence of a packed case."""
    cu = case.cu_seqlens(keys=keys).tolist()
    return list(zip(cu, cu[1:]))


def attention_grads(case: AttnCase, q, k, v, do):
    """(O, LSE, dQ, dK, dV) of ``case`` in float64 (LSE float32), shaped as the case's tensors:
    dense (B, H, N, d) or packed (total, H, d) with LSE (H, total)."""
    q, k, v, do = (t.detach().double().requires_grad_(i < 3) for i, t in
                   enumerate((q, k, v, do)))
    if not case.varlen:
        o, lse = dense_attention(q, k, v, case.scale, case.causal)
    else:
        outs, lses = [], []
        for (qs, qe), (ks, ke) in zip(_sequences(case, q, False), _sequences(case, k, True)):
            ob, lb = dense_attention(q[qs:qe].transpose(0, 1)[None], k[ks:ke].transpose(0, 1)[None],
                                     v[ks:ke].transpose(0, 1)[None], case.scale, case.causal)
            if ke == ks:                                     # no keys: O = 0, LSE = -inf
                ob, lb = torch.nan_to_num(ob) * 0, torch.full_like(lb, float("-inf"))
            outs.append(ob[0].transpose(0, 1))
            lses.append(lb[0])
        o, lse = torch.cat(outs, 0), torch.cat(lses, -1)
    dq, dk, dv = torch.autograd.grad(o, (q, k, v), do, allow_unused=True)
    dq, dk, dv = (torch.zeros_like(t) if g is None else g for g, t in ((dq, q), (dk, k), (dv, v)))
    return o.detach(), lse.detach().float(), dq, dk, dv


def backward_inputs(case: AttnCase, seed: int):
    """Seeded q, k, v, dO and the float64 (O, LSE, dQ, dK, dV); q, k, v, dO in the case's
    dtype, O in it too (as a forward would return it), LSE float32."""
    q, k, v = make_inputs(case, seed)
    do = seeded(q.shape, seed + 7, case.dtype).view_as(q) if case.layout == "bhnd" or \
        case.varlen else seeded(q.transpose(1, 2).shape, seed + 7, case.dtype).transpose(1, 2)
    o, lse, dq, dk, dv = attention_grads(case, q, k, v, do)
    return q, k, v, do, o.to(case.dtype), lse, (dq, dk, dv)


def stored_p_bytes(B, H, N_q, N_k, itemsize=2):
    """Bytes a backward that stores P (B, H, N_q, N_k) keeps from the forward to the backward."""
    return B * H * N_q * N_k * itemsize
