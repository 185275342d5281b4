"""Ulysses and all-gather context parallelism for ``ring_bench``: the same problem, kernel and
packed ``(tokens, H, d)`` layout as its ring, on any backend (NCCL on GPUs, gloo on CPU for the
check of this code).

* ``ulysses``: contiguous sequence shards; one all-to-all of Q, K and V (rank j receives head
  group j of every rank's tokens, so the received parts, in rank order, are the whole sequence
  in order), one full-sequence attention of H/P heads, one all-to-all of O and the LSE back.
  Causal needs no zig-zag: every rank computes every position of its heads, so the work is the
  same on every rank. Per rank it sends (P-1)/P of its Q, K, V, O (and LSE): 4 (N/P) H d (P-1)/P
  elements (H = h_q = h_kv here).
* ``allgather``: one all-gather of K and V (every rank then holds all of it: 2 N H d elements,
  2 (N/P) H d (P-1) sent per rank, as the ring), then each rank attends its own queries. Causal
  with zig-zag shards: each of the rank's two query chunks attends the keys up to its end, with
  the kernel's bottom-right causal alignment (query i of a chunk ending at e sees keys <= e - c +
  i), so both chunks are exact and the ranks' work is balanced.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def _to_heads(t: torch.Tensor, P: int) -> torch.Tensor:
    """(n, H, ...) sequence shard -> (P n, H/P, ...): head group r of every rank's tokens."""
    n, H = t.shape[:2]
    parts = t.reshape(n, P, H // P, *t.shape[2:]).movedim(1, 0).contiguous()   # (P, n, H/P, ..)
    got = torch.empty_like(parts)
    dist.all_to_all_single(got, parts)          # got[i]: rank i's tokens, my head group
    return got.reshape(P * n, H // P, *t.shape[2:])


def _to_sequence(t: torch.Tensor, P: int) -> torch.Tensor:
    """(P n, H/P, ...) head shard -> (n, H, ...): this rank's tokens, every head."""
    N, h = t.shape[:2]
    parts = t.reshape(P, N // P, h, *t.shape[2:]).contiguous()                 # (P, n, H/P, ..)
    got = torch.empty_like(parts)
    dist.all_to_all_single(got, parts)          # got[j]: head group j of my tokens
    return got.movedim(0, 1).reshape(N // P, P * h, *t.shape[2:])


def ulysses(attention, q, k, v, causal: bool):
    """This rank's (O (n, H, d), LSE (H, n)) from contiguous shards q, k, v (n, H, d)."""
    P = dist.get_world_size()
    if q.shape[1] % P or k.shape[1] % P:
        raise ValueError(f"ulysses: P = {P} must divide the heads ({q.shape[1]}, {k.shape[1]}).")
    qh, kh, vh = (_to_heads(t, P) for t in (q, k, v))
    N = qh.shape[0]
    cu = torch.tensor([0, N], dtype=torch.int32, device=q.device)
    o, lse = attention(qh, kh, vh, cu, cu, N, N, causal=causal)
    return _to_sequence(o, P), _to_sequence(lse.transpose(0, 1), P).transpose(0, 1)


def allgather(attention, q, k, v, causal: bool, ranges):
    """This rank's (O, LSE) from its shard q, k, v (n, H, d): contiguous (``ranges`` one
    (start, stop)) or zig-zag (two). K and V are all-gathered and put back in sequence order."""
    P = dist.get_world_size()
    kv = torch.stack([k, v]).contiguous()                                      # (2, n, H, d)
    parts = [torch.empty_like(kv) for _ in range(P)]
    dist.all_gather(parts, kv)
    n = kv.shape[1]
    if len(ranges) == 1:                        # contiguous: rank order is sequence order
        full = torch.cat(parts, dim=1)
    else:                                       # zig-zag: rank r holds chunks r and 2P-1-r
        c = n // 2
        chunks = [None] * (2 * P)
        for r, part in enumerate(parts):
            chunks[r], chunks[2 * P - 1 - r] = part[:, :c], part[:, c:]
        full = torch.cat(chunks, dim=1)
    k_all, v_all = full[0], full[1]
    outs, lses, row = [], [], 0
    for start, stop in ranges:
        m = stop - start
        qc = q[row:row + m]
        row += m
        end = stop if causal else k_all.shape[0]
        cu_q = torch.tensor([0, m], dtype=torch.int32, device=q.device)
        cu_k = torch.tensor([0, end], dtype=torch.int32, device=q.device)
        o, lse = attention(qc, k_all[:end], v_all[:end], cu_q, cu_k, m, end, causal=causal)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses, dim=1)
