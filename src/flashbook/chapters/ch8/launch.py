"""Chapter 8 launch: split-KV decode (Flash-Decoding) against a contiguous KV cache.

One decode step: q ``(B, 1, h_q, d)`` (one new token per sequence), a cache ``(B, max_len, h_kv,
d)`` with ``cache_seqlens (B,)`` int32 valid lengths (the new token included). The keys of each
sequence are cut into ``num_splits`` ranges of ``keys_per_split`` keys (a multiple of the key
tile); program ``(b * h_kv + kv_head, split)`` runs the online softmax over its range for the
G query heads of its K/V head, folded into the rows of one tile (Chapter 5's M-fold), and writes
a partial ``(O, LSE)`` in fp32: ``O_part (B, h_q, S, d)``, ``LSE_part (B, h_q, S)``. The combine
kernel, one program per ``(b, query head)``, merges the S partials: O ``(B, 1, h_q, d)`` in q's
dtype and LSE ``(B, h_q, 1)`` float32, natural log.

Traffic: the cache is read once (``2 * B * max_len * h_kv * d`` elements); the partials add
``B * h_q * S * (d + 1) * 4`` bytes written and read again (0.1 % of the cache at batch 1,
context 131072, h_q = 32, S = 32, d = 128).
"""
from __future__ import annotations

import functools

import torch

from flashbook.cases import MAX_ELEMENTS, cdiv, element_span, host_values, next_pow2, output, \
    validate_scale, validate_tensor, values_checked
from flashbook.device import current
from flashbook.plans import Launch, Plans, Workspace, contiguous_strides, key, validate_once
from flashbook.tiles import DTYPES, HEAD_DIMS, HEAD_DIMS_WHY, LOG2E, SHARED_MEMORY_PER_BLOCK, \
    decode_block_m

__all__ = ["choose_num_splits", "split_config", "launch_split_kv", "launch_combine",
           "sequences_per_launch", "validate_split_decode", "sm_count"]

MAX_SPLITS = 128
MAX_KEYS_PER_SPLIT = 16384      # choose_num_splits: the longest range one program reads


def sm_count(device=None) -> int | None:
    """The GPU's streaming multiprocessors (None on CPU)."""
    if not current().gpu:
        return None
    return _multiprocessors(torch.device(device or "cuda:0"))


@functools.lru_cache(maxsize=16)
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_num_splits(batch: int, h_kv: int, max_len: int, sms: int | None, block_n: int,
                      max_keys_per_split: int = MAX_KEYS_PER_SPLIT,
                      max_splits: int = MAX_SPLITS) -> int:
    """How many ranges to cut each sequence's keys into, from two rules read off a sweep of
    split counts and tile shapes at every batch x context of the book's decode sweep (an H100,
    torch 2.11, triton 3.6, 2026-12-05; the chapter's benchmark records its own split sweep):

    * **fill the GPU**: when the ``batch x h_kv`` programs are fewer than a third of the SMs,
      as many splits as give every SM one program, and no more (at batch 1, 8 K/V heads and
      132 SMs: 16 splits, 128 programs): with three stages of K and V tiles a program takes
      most of an SM's shared memory, so a 133rd program would wait for a second wave. From a
      third of the SMs on, one program per (sequence, K/V head) with three stages of loads in
      flight already reads as fast as the split launch, whose partials cost a write, a read
      and a second kernel;
    * **keep each range short**: at most ``max_keys_per_split`` keys a range (16384), so that a
      long context is read by more programs than the waves of ``batch x h_kv`` alone give
      (batch 32, 131072 keys: 8 splits, not 1).

    Never more splits than key tiles, nor ``max_splits``. Without a GPU (``sms`` None) it splits
    into ranges of 4 key tiles, so that the checks see several splits. Then rounded so that
    every split but the last has the same number of whole tiles."""
    tiles = max(1, -(-max_len // block_n))
    if sms is None:
        want = -(-tiles // 4)
    else:
        programs = max(1, batch * h_kv)
        fill = 1 if 3 * programs >= sms else sms // programs
        want = max(fill, -(-max_len // max_keys_per_split))
    want = max(1, min(want, tiles, max_splits))
    tiles_per_split = -(-tiles // want)
    return -(-tiles // tiles_per_split)


def split_config(capability: tuple | None, itemsize: int = 2,
                 head_dim: int = 128) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) of the split kernel: on sm_90 128-key tiles with three
    stages of K/V loads in flight (two where three rings of K and V tiles would not fit in
    shared memory: fp32 at d = 128), which read faster than two stages at every point of the
    decode sweep; 64-key tiles and three stages elsewhere; 16 in the CPU interpreter."""
    if capability is None:
        return 16, 4, 1
    if tuple(capability) >= (9, 0):
        rings = 3 * 2 * 128 * head_dim * itemsize     # three stages of K and V tiles
        room = SHARED_MEMORY_PER_BLOCK[(9, 0)] - Q_AND_LAYOUT
        return 128, 4, 3 if rings <= room else 2
    return 64, 4, 3


Q_AND_LAYOUT = 27 * 1024    # split_config: what the rings leave for Q, barriers and the layout


_SPLIT_PLANS = Plans()


def launch_split_kv(split_kernel, combine_kernel, q, k_cache, v_cache, cache_seqlens,
                    num_splits: int | None = None, *, scale: float | None = None,
                    block_n: int | None = None, num_warps: int | None = None,
                    num_stages: int | None = None, out=None, validate=None):
    """Launch the split kernel on grid ``(B * h_kv, num_splits)``, then the combine kernel on
    ``(B * h_q,)``; returns (O (B, 1, h_q, d), LSE (B, h_q, 1)). ``num_splits`` defaults to
    ``choose_num_splits`` for this GPU. Checks only what the launch needs (the public wrapper
    validates the arguments: pass its checks as ``validate``, run as ``validate(q, k_cache,
    v_cache, cache_seqlens, num_splits)`` before a new plan is made and on every call where
    values are checked).

    With one split there is nothing to merge: the split kernel writes O and LSE itself (its
    normalised fp32 partial, stored in O's dtype) and the combine is not launched. A cache that
    spans more elements than 32-bit offsets reach (``cases.MAX_ELEMENTS``) is launched a slice
    of sequences at a time, each slice within the limit.

    The tiles, grids and strides are remembered by the inputs' metadata (``plans``), with the
    fp32 partials (``O_part``, ``LSE_part``) each plan writes and merges: scratch that one call's
    two kernels use in stream order, so calls on one stream share it, and a call on another
    stream gets its own (``plans.Workspace``)."""
    o, lse = out if out is not None else (None, None)
    plan_key = key(split_kernel, combine_kernel, q, k_cache, v_cache, cache_seqlens, num_splits,
                   scale, block_n, num_warps, num_stages, o, lse, current().capability,
                   validate)
    plan = _SPLIT_PLANS.get(plan_key)
    if validate is not None and (plan is None or values_checked()):
        validate(q, k_cache, v_cache, cache_seqlens, num_splits)
    if plan is None:
        plan = _SPLIT_PLANS.remember(plan_key, _split_plan(
            split_kernel, combine_kernel, q, k_cache, v_cache, num_splits, scale, block_n,
            num_warps, num_stages, out))
    if out is None:
        o = output(q.shape, dtype=q.dtype, device=q.device)
        lse = output((q.shape[0], q.shape[2], 1), dtype=torch.float32, device=q.device)
    if plan is None:
        return o, lse
    if plan.__class__ is int:           # a cache too large for one launch: sequences per launch
        for b in range(0, q.shape[0], plan):
            launch_split_kv(split_kernel, combine_kernel, q[b:b + plan], k_cache[b:b + plan],
                            v_cache[b:b + plan], cache_seqlens[b:b + plan], num_splits,
                            scale=scale, block_n=block_n, num_warps=num_warps,
                            num_stages=num_stages, out=(o[b:b + plan], lse[b:b + plan]))
        return o, lse
    split, combine, workspace = plan
    if combine is None:                 # one split: its partial is the answer
        split(q, k_cache, v_cache, o, lse, cache_seqlens)
    else:
        o_part, lse_part = workspace.get(q.device)
        split(q, k_cache, v_cache, o_part, lse_part, cache_seqlens)
        combine(o_part, lse_part, o, lse)        # O (B, 1, h_q, d), LSE (B, h_q, 1) as rows
    return o, lse


def _split_plan(split_kernel, combine_kernel, q, k_cache, v_cache, num_splits, scale, block_n,
                num_warps, num_stages, out):
    """launch_split_kv's tiles, splits and grids: (the split ``Launch``, the combine ``Launch``,
    the partials' ``Workspace``; both None with one split), None when there is nothing to
    launch, or the number of sequences per launch when the cache is too large for one."""
    B, n_new, h_q, d = q.shape
    max_len, h_kv = k_cache.shape[1], k_cache.shape[2]
    G = h_q // h_kv
    if max(element_span(k_cache), element_span(v_cache)) > MAX_ELEMENTS:
        return sequences_per_launch(k_cache, v_cache)
    cfg = split_config(current().capability, q.element_size(), d)
    BN, warps, stages = block_n or cfg[0], num_warps or cfg[1], num_stages or cfg[2]
    S = num_splits or choose_num_splits(B, h_kv, max_len, sm_count(q.device), BN)
    if not 1 <= S <= MAX_SPLITS:
        raise ValueError(f"launch_split_kv: num_splits must lie in [1, {MAX_SPLITS}], got {S}.")
    keys_per_split = cdiv(cdiv(max_len, S), BN) * BN
    scale = validate_scale(scale, d, "launch_split_kv")
    if B * h_q == 0:
        return None
    if out is None:
        o_rows, lse_rows = contiguous_strides((B, h_q, d)), contiguous_strides((B, h_q))
    else:        # out's O (B, 1, h_q, d) and LSE (B, h_q, 1) seen as (B, h_q, d) and (B, h_q)
        o_rows = (out[0].stride(0), out[0].stride(2), out[0].stride(3))
        lse_rows = (out[1].stride(0), out[1].stride(1))
    if lse_rows != contiguous_strides((B, h_q)):
        raise ValueError("launch_split_kv: out's LSE must be contiguous (B, h_q, 1).")
    if o_rows[2] != 1:
        raise ValueError("launch_split_kv: out's O must be contiguous in its last dimension.")
    if S == 1:          # the partial is the answer: written to O and LSE (B, h_q, 1) directly
        part = (o_rows[0], o_rows[1], 0)
    else:
        part = contiguous_strides((B, h_q, S, d))
    split = Launch(
        split_kernel, (B * h_kv, S),
        (q.stride(0), q.stride(2), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
         v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), part[0], part[1], part[2],
         h_kv, keys_per_split, scale * LOG2E),
        dict(GROUP=G, HEAD_DIM=d, BLOCK_M=decode_block_m(G, 1), BLOCK_N=BN,
             DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
             num_warps=warps, num_stages=stages))
    if S == 1:
        return split, None, None
    combine = Launch(combine_kernel, (B * h_q,),
                     (S, part[0], part[1], part[2], o_rows[0], o_rows[1], h_q),
                     dict(HEAD_DIM=d, BLOCK_S=max(2, next_pow2(S))))
    return split, combine, Workspace(((B, h_q, S, d), (B, h_q, S)), torch.float32)


def sequences_per_launch(*caches) -> int:
    """How many sequences of these caches ``(B, max_len, h_kv, d)`` one launch may take: the most
    whose elements stay within the kernels' 32-bit offsets (``cases.MAX_ELEMENTS``)."""
    counts = []
    for cache in caches:
        one = element_span(cache[:1])
        if one > MAX_ELEMENTS:
            raise ValueError(f"launch_split_kv: one sequence of the cache spans {one:,} elements, "
                             f"more than the kernels' 32-bit offsets reach ({MAX_ELEMENTS:,}).")
        counts.append((MAX_ELEMENTS - one) // max(cache.stride(0), 1) + 1)
    return min(counts)


def launch_combine(combine_kernel, o_part, lse_part, dtype=None, out=None):
    """Merge partials ``o_part (B, h_q, S, d)`` fp32 and ``lse_part (B, h_q, S)`` fp32 (natural
    log; -inf for an empty split) into O (B, h_q, d) (``dtype``, default fp32) and LSE (B, h_q).
    One program per (b, head), all S partials in one tile."""
    B, h_q, S, d = o_part.shape
    o, lse = out or (output((B, h_q, d), dtype=dtype or torch.float32, device=o_part.device),
                     output((B, h_q), dtype=torch.float32, device=o_part.device))
    if B * h_q:
        combine_kernel[(B * h_q,)](o_part, lse_part.contiguous(), o, lse, S,
                                   o_part.stride(0), o_part.stride(1), o_part.stride(2),
                                   o.stride(0), o.stride(1), h_q, HEAD_DIM=d,
                                   BLOCK_S=max(2, next_pow2(S)))
    return o, lse


def validate_split_decode(q, k_cache, v_cache, cache_seqlens, num_splits=None):
    """The public wrapper's argument checks: a ValueError naming the argument. cache_seqlens'
    values are read with ``cases.host_values`` (once per tensor; not while a CUDA graph is
    captured, so the wrapper can be captured; not on a GPU's hot path, outside the graded checks
    and ``flashbook.check_values()``, which would wait for the device). The metadata checks
    run once per metadata (``plans.validate_once``)."""
    validate_once(_check_split_decode, q, k_cache, v_cache, cache_seqlens, num_splits)


def _check_split_decode(q, k_cache, v_cache, cache_seqlens, num_splits):
    name = "decode_split_kv"
    validate_tensor("q", q, dims=4, dtypes=DTYPES, name=name)
    for label, t in (("k_cache", k_cache), ("v_cache", v_cache)):   # launched in slices of
        validate_tensor(label, t, dims=4, dtypes=DTYPES, name=name, span_of="item")  # sequences
    if not q.dtype == k_cache.dtype == v_cache.dtype or \
            not q.device == k_cache.device == v_cache.device:
        raise ValueError(f"{name}: q, k_cache and v_cache must share a dtype and a device.")
    B, n_new, h_q, d = q.shape
    if n_new != 1:
        raise ValueError(f"{name}: q must hold one new token per sequence (B, 1, h_q, d), got "
                         f"{tuple(q.shape)}; several new tokens: use Chapter 5's decode.")
    if d not in HEAD_DIMS:
        raise ValueError(f"{name}: q's head dimension d={d} is not one of {HEAD_DIMS}: "
                         f"{HEAD_DIMS_WHY}.")
    if k_cache.shape != v_cache.shape or k_cache.shape[0] != B or k_cache.shape[3] != d or \
            h_q % k_cache.shape[2]:
        raise ValueError(f"{name}: k_cache {tuple(k_cache.shape)} and v_cache "
                         f"{tuple(v_cache.shape)} must be (B={B}, max_len, h_kv, d={d}) with h_kv "
                         f"dividing h_q={h_q}.")
    if not isinstance(cache_seqlens, torch.Tensor) or cache_seqlens.dtype != torch.int32 or \
            tuple(cache_seqlens.shape) != (B,) or cache_seqlens.device != q.device:
        raise ValueError(f"{name}: cache_seqlens must be a ({B},) torch.int32 tensor on "
                         f"{q.device}.")
    if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(
            num_splits, int) or not 1 <= num_splits <= MAX_SPLITS):
        raise ValueError(f"{name}: num_splits must be an int in [1, {MAX_SPLITS}] or None, got "
                         f"{num_splits!r}.")
    lengths = host_values(cache_seqlens)     # None while captured, or on a GPU's hot path
    if lengths is not None and (min(lengths, default=1) < 1
                                or max(lengths, default=0) > k_cache.shape[1]):
        raise ValueError(f"{name}: cache_seqlens must lie in [1, {k_cache.shape[1]}], got "
                         f"{list(lengths[:8])}.")
