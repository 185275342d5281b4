"""Chapter 5 launch: grouped-query prefill (the M-fold) and decode against a KV cache.

Prefill takes Chapter 4's packed layout with fewer K/V heads: q ``(total_q, h_q, d)``, k and v
``(total_k, h_kv, d)``, ``h_q = G * h_kv``. One program takes one K/V head of one sequence and
the G query heads that share it, folded into the rows of its tile (PackGQA, for any G: row r
of tile m is folded row ``f = m * BLOCK_M + r``, query head ``kv_head * G + f % G`` at position
``f // G``), so every K/V tile is loaded once for G heads. Decode's one tile starts at row 0
(row r: query head ``kv_head * G + r % G`` of new token ``r // G``) and follows flash-attn's
``flash_attn_with_kvcache``: q ``(B, n_new, h_q, d)``, a contiguous cache ``(B, max_len, h_kv,
d)`` or a paged one ``(num_pages, page_size, h_kv, d)`` with ``block_table (B, max_pages)``
int32, and ``cache_seqlens (B,)`` int32, the valid length of each sequence's cache (the new
tokens included). O ``(B, n_new, h_q, d)``, LSE ``(B, h_q, n_new)`` float32.

Like Chapter 4's ``launch_varlen`` these check only what the launch needs; the public wrappers
(the chapter's last exercise) validate the arguments. The prefill launch (``launch_gqa``,
``validate_packed``) lives in the toolkit, ``flashbook.gqa``, because Chapter 9's forward runs
it too; this module re-exports it.
"""
from __future__ import annotations

import torch

from flashbook.cases import output, validate_scale, values_checked
from flashbook.device import current
# the packed GQA prefill launch, which Chapter 9's forward runs too, is the toolkit's
from flashbook.gqa import launch_gqa, prefill_dtypes, validate_packed
from flashbook.plans import Launch, Plans, contiguous_strides, key
from flashbook.tiles import DTYPES, HEAD_DIMS, HEAD_DIMS_WHY, LOG2E, Config, decode_block_m, \
    pick_config
from flashbook.varlen import window_bounds

__all__ = ["launch_gqa", "launch_decode", "decode_block_m", "decode_config", "paged_cache",
           "validate_packed", "prefill_dtypes", "DTYPES", "HEAD_DIMS", "HEAD_DIMS_WHY", "Config",
           "pick_config"]


DECODE_MAX_ROWS = 128


def decode_chunk(G: int, n_new: int) -> int:
    """New tokens per launch: as many as keep the tile within ``DECODE_MAX_ROWS`` rows (one at
    least, when G alone is larger)."""
    return max(1, min(n_new, DECODE_MAX_ROWS // G))


def decode_config(capability: tuple | None) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) of the decode kernel on a GPU of this compute capability
    (None: the CPU interpreter). sm_90: measured on an H200 (B=32, h_q=32, h_kv=8, context 8192,
    d=128), where 128-key tiles with two stages read a contiguous cache at 4394 GB/s and paged
    ones (pages of 16 to 256) at 4310-4389, against 4121-4387 with 64-key tiles. Others: 64-key
    tiles, which fit a T4's shared memory (tests/test_ch5.py compiles both ahead of time)."""
    if capability is None:
        return 16, 4, 1
    return (128, 4, 2) if tuple(capability) >= (9, 0) else (64, 4, 3)


_DECODE_PLANS = Plans()


def launch_decode(kernel, q, k_cache, v_cache, cache_seqlens, block_table=None, *,
                  causal: bool = True, scale: float | None = None, block_n: int | None = None,
                  num_warps: int | None = None, num_stages: int | None = None, out=None,
                  validate=None):
    """Launch the decode kernel, one program per (sequence, K/V head); returns (O, LSE).

    The cache is passed as rows ``(rows, h_kv, d)``: a contiguous cache's ``B * max_len`` rows
    (``rows_per_seq = max_len``) or a paged cache's ``num_pages * page_size`` rows
    (``rows_per_seq = page_size``; a key tile may span pages, each key looks its page up).
    The tiles, grid and strides are remembered by the inputs' metadata (``plans``).
    ``validate``: the public wrapper's checks, ``validate(q, k_cache, v_cache, cache_seqlens,
    block_table)``, run before a new plan is made and on every call where values are checked."""
    o, lse = out if out is not None else (None, None)
    plan_key = key(kernel, q, k_cache, v_cache, cache_seqlens, block_table, causal, scale,
                   block_n, num_warps, num_stages, o, lse, current().capability, validate)
    plan = _DECODE_PLANS.get(plan_key)
    if validate is not None and (plan is None or values_checked()):
        validate(q, k_cache, v_cache, cache_seqlens, block_table)
    if plan is None:
        plan = _DECODE_PLANS.remember(plan_key, _decode_plan(
            kernel, q, k_cache, v_cache, cache_seqlens, block_table, causal, scale, block_n,
            num_warps, num_stages, out))
    B, n_new, h_q, d = q.shape
    h_kv = k_cache.shape[2]
    if plan is _CHUNKED:
        return _decode_in_chunks(kernel, q, k_cache, v_cache, cache_seqlens, block_table,
                                 decode_chunk(h_q // h_kv, n_new), causal=causal, scale=scale,
                                 block_n=block_n, num_warps=num_warps, num_stages=num_stages,
                                 out=out)
    copies, launch = plan
    if out is None:
        o = output(q.shape, dtype=q.dtype, device=q.device)
        lse = output((B, h_q, n_new), dtype=torch.float32, device=q.device)
    if launch is not None:
        if copies:          # a cache whose sequences do not follow each other: rows copied
            k_cache, v_cache = k_cache.reshape(-1, h_kv, d), v_cache.reshape(-1, h_kv, d)
        launch(q, k_cache, v_cache, o, lse, cache_seqlens,
               block_table if block_table is not None else cache_seqlens)
    return o, lse


_CHUNKED = object()     # the plan of a call with more new tokens than one tile takes


def _decode_plan(kernel, q, k_cache, v_cache, cache_seqlens, block_table, causal, scale, block_n,
                 num_warps, num_stages, out):
    """launch_decode's tiles, window and grid: (whether the cache is copied to rows, its
    ``Launch`` or None), or ``_CHUNKED`` (launched in chunks of new tokens, each planned on its
    own). The kernel indexes the cache as rows ``(rows, h_kv, d)``: the cache itself when its
    first two dimensions merge (``reshape``'s view, no copy), else a copy."""
    B, n_new, h_q, d = q.shape
    h_kv = k_cache.shape[2]
    G = h_q // h_kv
    if n_new > decode_chunk(G, n_new):
        return _CHUNKED
    paged = block_table is not None
    rows_per_seq = k_cache.shape[1]
    tiles = decode_config(current().capability)
    BN, num_warps, num_stages = block_n or tiles[0], num_warps or tiles[1], num_stages or tiles[2]
    k_rows, v_rows = _row_strides(k_cache), _row_strides(v_cache)
    copies = k_rows is None or v_rows is None
    if copies:
        k_rows = v_rows = contiguous_strides((1, h_kv, d))[:2]
    max_keys = rows_per_seq * (block_table.shape[1] if paged else 1)
    BM = decode_block_m(G, n_new)
    window = window_bounds((-1, -1), causal, BM, max_keys)   # padding rows count as queries
    scale = validate_scale(scale, d, "launch_decode")
    o_strides = contiguous_strides(q.shape) if out is None else out[0].stride()
    if B * h_kv * n_new == 0:
        return copies, None
    return copies, Launch(
        kernel, (B * h_kv,),
        (q.stride(0), q.stride(1), q.stride(2), k_rows[0], k_rows[1], v_rows[0], v_rows[1],
         o_strides[0], o_strides[1], o_strides[2], block_table.stride(0) if paged else 0,
         rows_per_seq, h_kv, n_new, scale * LOG2E, window[0], window[1]),
        dict(GROUP=G, PAGED=paged, HEAD_DIM=d, BLOCK_M=BM, BLOCK_N=BN,
             DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
             num_warps=num_warps, num_stages=num_stages))


def _row_strides(cache) -> tuple[int, int] | None:
    """(row, head) strides of ``cache (n, rows_per_seq, h_kv, d)`` seen as ``(n * rows_per_seq,
    h_kv, d)`` rows, or None when its first two dimensions do not merge into one (a slice of a
    longer cache: ``reshape`` copies it)."""
    n, rows, _, _ = cache.shape
    s0, s1, s2, _ = cache.stride()
    if n > 1 and rows > 1 and s0 != rows * s1:
        return None
    return (s1 if rows > 1 or n == 1 else s0), s2


def _decode_in_chunks(kernel, q, k_cache, v_cache, cache_seqlens, block_table, chunk: int, *,
                      causal: bool, out, **launch):
    """``launch_decode`` for many new tokens, ``chunk`` of them per launch, into views of one O
    and LSE. The new tokens are the last ``n_new`` of each sequence: under the causal mask, the
    chunk [c0, c1) sees the cache as if it ended ``n_new - c1`` keys earlier (bottom-right
    alignment), so it is launched with ``cache_seqlens - (n_new - c1)``, a device op (no sync);
    without the mask every chunk sees the whole cache."""
    B, n_new, h_q, _ = q.shape
    o, lse = out or (output(q.shape, dtype=q.dtype, device=q.device),
                     output((B, h_q, n_new), dtype=torch.float32, device=q.device))
    for c0 in range(0, n_new, chunk):
        c1 = min(c0 + chunk, n_new)
        seqlens = cache_seqlens - (n_new - c1) if causal else cache_seqlens
        part = output((B, h_q, c1 - c0), dtype=torch.float32, device=q.device)
        launch_decode(kernel, q[:, c0:c1], k_cache, v_cache, seqlens, block_table,
                      causal=causal, out=(o[:, c0:c1], part), **launch)   # O: by its strides
        lse[:, :, c0:c1] = part                     # the kernel writes LSE contiguous
    return o, lse


def paged_cache(k_cache, v_cache, page_size: int, seed: int = 0, spare: int = 0):
    """(k_pages, v_pages, block_table): contiguous caches (B, max_len, h_kv, d) cut into pages of
    ``page_size`` tokens, stored at shuffled places (``torch.randperm``, fixed seed) of pools of
    ``B * max_len / page_size + spare`` pages (the spare ones filled with NaN); ``block_table``
    (B, max_len / page_size) int32 maps page j of sequence b to its place:
    ``k_pages[block_table[b, j]]`` is ``k_cache[b, j * page_size:(j + 1) * page_size]``."""
    B, n, h, d = k_cache.shape
    if n % page_size:
        raise ValueError(f"paged_cache: max_len={n} is not a multiple of page_size={page_size}")
    per_seq = n // page_size
    g = torch.Generator().manual_seed(seed)
    table = torch.randperm(B * per_seq + spare, generator=g)[:B * per_seq].view(B, per_seq)
    table = table.to(k_cache.device)

    def scatter(c):
        pool = torch.full((B * per_seq + spare, page_size, h, d), float("nan"), dtype=c.dtype,
                          device=c.device)
        pool[table.flatten()] = c.reshape(B * per_seq, page_size, h, d)
        return pool
    return scatter(k_cache), scatter(v_cache), table.to(torch.int32)
