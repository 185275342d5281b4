"""Chapter 4 launch: one low-level launcher for the packed ("varlen") attention kernels.

Layout (flash-attn's ``flash_attn_varlen_func``): q ``(total_q, H, d)``, k and v ``(total_k, H, d)``,
any token and head strides with a unit last one; sequence ``b`` owns rows
``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` of q (and likewise of k and v through ``cu_seqlens_k``),
int32 offsets of length batch + 1. Outputs: O ``(total_q, H, d)`` in q's dtype, LSE ``(H, total_q)``
float32, natural log. A dense batch ``(B, N, H, d)`` is the packed batch ``q.view(B * N, H, d)``
with ``cu_seqlens = arange(B + 1) * N``.

``launch_varlen`` checks only what the launch itself needs (tensor types, devices, tile sizes);
whether ``cu_seqlens`` and the maximum lengths describe the tensors is the public wrapper's job
(the chapter's Exercise 3): call the kernels through a wrapper that validates them.
"""
from __future__ import annotations

import functools

import torch

from flashbook.cases import cdiv, output, validate_scale, validate_tensor, values_checked
from flashbook.check import is_stub
from flashbook.device import current
from flashbook.plans import Launch, Plans, contiguous_strides, key
from flashbook.tiles import DTYPES, HEAD_DIMS, HEAD_DIMS_WHY, LOG2E, Config, pick_config
from flashbook.varlen import heads_per_section, window_bounds

__all__ = ["launch_varlen", "window_bounds", "heads_per_section", "pick_kernel", "Config",
           "pick_config", "HEAD_DIMS", "HEAD_DIMS_WHY", "DTYPES"]


@functools.lru_cache(maxsize=64)
def _still_a_stub(kernel) -> bool:
    return is_stub(kernel)


_NOTED: set[str] = set()


def pick_kernel(two_tile, one_tile, wrapper: str):
    """``(kernel, two_tiles)`` for a public wrapper: the two-tile kernel, or the one-tile kernel
    while the two-tile one is still the stub of its chapter's optional exercise (the wrapper
    then says so, once). Cached per kernel: a wrapper's launched calls pay nothing for it."""
    if not _still_a_stub(two_tile):
        return two_tile, True
    if wrapper not in _NOTED:
        _NOTED.add(wrapper)
        names = [getattr(getattr(k, "fn", k), "__name__", "?") for k in (two_tile, one_tile)]
        print(f"{wrapper}: {names[0]} (the optional exercise) is still a stub, so this runs "
              f"your one-tile {names[1]} instead.")
    return one_tile, False


def default_sections(n_bh: int, max_seqlen_k: int, k: torch.Tensor) -> int:
    """``heads_per_section`` for a launch over ``n_bh`` (sequence, head) pairs whose K/V
    (``k``'s head dim and dtype, ``max_seqlen_k`` keys) a section should keep in L2."""
    return heads_per_section(n_bh, 2 * max(max_seqlen_k, 1) * k.shape[-1] * k.element_size(),
                             k.device)


_VARLEN_PLANS = Plans()


def launch_varlen(kernel, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int,
                  max_seqlen_k: int, *, window: tuple[int, int] | None = None,
                  scale: float | None = None, config: Config | None = None,
                  two_tiles: bool = False, out: tuple | None = None,
                  sections: int | None = None, validate=None, validate_args: tuple = ()):
    """Launch a varlen kernel; returns (O, LSE).

    Grid: ``(cdiv(max_seqlen_q, BLOCK_M) * G, batch * H // G)`` with ``G`` (``sections``,
    default ``heads_per_section``) (sequence, head) pairs per section: the first axis, the one
    that varies fastest in launch order, walks the query tiles of G pairs, the longest rows
    first, so the programs in flight share a few pairs' K and V (they stay in L2) and each
    section ends with its shortest programs. ``program_tile`` in the chapter decodes it.
    Programs whose tile starts past their sequence's end return at once.

    ``window``: None launches a kernel without mask arguments (Exercise 1); else ``(left,
    right)`` as ``window_bounds`` returns them (non-negative) for the masked kernels. ``out``: an
    (O, LSE) pair to write into (the checks pre-fill it with canaries). The checks, config and
    grid are remembered by the inputs' metadata (``plans``). ``validate``: the public wrapper's
    argument checks, run as ``validate(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
    max_seqlen_k, *validate_args)`` before a new plan is made and on every call where values are
    checked (``cases.values_checked()``: the checks then read index tensors' values, which the
    key does not hold). So a repeated call builds one key, not one for its checks and one for
    its launch.
    """
    o, lse = out if out is not None else (None, None)
    plan_key = key(kernel, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                   window, scale, config, two_tiles, o, lse, sections, current().capability,
                   validate, validate_args)
    plan = _VARLEN_PLANS.get(plan_key)
    if validate is not None and (plan is None or values_checked()):
        validate(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *validate_args)
    if plan is None:
        plan = _VARLEN_PLANS.remember(plan_key, _varlen_plan(
            kernel, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, window,
            scale, config, two_tiles, out, sections))
    if out is None:
        o = output(q.shape, dtype=q.dtype, device=q.device)
        lse = output((q.shape[1], q.shape[0]), dtype=torch.float32, device=q.device)
    if plan is not _EMPTY:
        plan(q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k)
    return o, lse


_EMPTY = object()       # a plan that launches nothing (no sequence, head or query row)


def _varlen_plan(kernel, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                 window, scale, config, two_tiles, out, sections):
    """launch_varlen's checks, config and grid: its ``Launch`` (or ``_EMPTY``)."""
    name = "launch_varlen"
    for label, t in (("q", q), ("k", k), ("v", v)):
        validate_tensor(label, t, dims=3, dtypes=DTYPES, name=name, device=q.device
                        if isinstance(q, torch.Tensor) and label != "q" else None)
    for label, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        validate_tensor(label, t, dims=1, dtypes=(torch.int32,), name=name, device=q.device,
                        contiguous="all")
    total_q, H, d = q.shape
    if d not in HEAD_DIMS:
        raise ValueError(f"{name}: head dimension d={d} is not supported; use one of "
                         f"{HEAD_DIMS}: {HEAD_DIMS_WHY}.")
    scale = validate_scale(scale, d, name)
    cfg = config or pick_config(d, q.dtype, current().capability, two_tiles=two_tiles)
    rows = cfg.BLOCK_M // 2 if two_tiles else cfg.BLOCK_M
    if min(rows, cfg.BLOCK_N) < 16:
        raise ValueError(f"{name}: query and key tiles must be at least 16 (tl.dot needs 16 on a "
                         f"GPU), got BLOCK_M={cfg.BLOCK_M}, BLOCK_N={cfg.BLOCK_N}.")
    o_strides = contiguous_strides(q.shape) if out is None else out[0].stride()
    batch = cu_seqlens_q.numel() - 1
    if batch < 1 or H == 0 or max_seqlen_q == 0:
        return _EMPTY
    n_bh = batch * H
    G = sections or default_sections(n_bh, max_seqlen_k, k)
    if n_bh % G:
        raise ValueError(f"{name}: sections={G} must divide batch * H = {n_bh}.")
    grid = (cdiv(max_seqlen_q, cfg.BLOCK_M) * G, n_bh // G)
    masks = {} if window is None else dict(window_left=window[0], window_right=window[1])
    return Launch(kernel, grid,
                  (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                   o_strides[0], o_strides[1], H, total_q, scale * LOG2E),
                  dict(masks, heads_per_section=G, HEAD_DIM=d, BLOCK_M=cfg.BLOCK_M,
                       BLOCK_N=cfg.BLOCK_N,
                       DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
                       num_warps=cfg.num_warps, num_stages=cfg.num_stages))
