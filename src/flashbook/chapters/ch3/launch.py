"""Chapter 3 launch wrappers: they validate inputs (a clear ValueError, never a crashed kernel),
pick the tile config for this GPU, and launch the student's Triton kernels with fixed
signatures, so a check, a benchmark and the book all launch a kernel the same way."""
from __future__ import annotations

import torch

from flashbook.cases import cdiv, output, validate_qkv, validate_scale, validate_tensor
from flashbook.device import current
from flashbook.plans import Launch, Plans, contiguous_strides, key
# the tiles Chapter 3 derives, kept in the toolkit for the later chapters (re-exported here)
from flashbook.tiles import DTYPES, HEAD_DIMS, HEAD_DIMS_WHY, LOG2E, SHARED_MEMORY_PER_BLOCK, \
    Config, pick_config

__all__ = ["DTYPES", "HEAD_DIMS", "HEAD_DIMS_WHY", "LOG2E", "SHARED_MEMORY_PER_BLOCK", "Config",
           "pick_config", "copy_tiles", "softmax_rows", "attention_forward", "merge_states"]


def copy_tiles(kernel, x: torch.Tensor, block_r: int = 16, block_c: int = 16):
    """Launch ``kernel`` (the warm-up) to copy ``x`` (n_rows, n_cols), any strides, into a new
    contiguous tensor, one (block_r x block_c) tile per program.
    Kernel signature: kernel[(cdiv(n_rows, block_r), cdiv(n_cols, block_c))](X, Y, n_rows,
    n_cols, stride_xr, stride_xc, stride_yr, stride_yc, BLOCK_R=block_r, BLOCK_C=block_c).
    """
    validate_tensor("x", x, dims=2, dtypes=DTYPES, name="copy_tiles", contiguous="any")
    for label, b in (("block_r", block_r), ("block_c", block_c)):
        if b < 1 or b & (b - 1):
            raise ValueError(f"copy_tiles: {label} must be a power of two, got {b}.")
    n_rows, n_cols = x.shape
    y = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
    if n_rows and n_cols:
        grid = (cdiv(n_rows, block_r), cdiv(n_cols, block_c))
        kernel[grid](x, y, n_rows, n_cols, x.stride(0), x.stride(1), y.stride(0), y.stride(1),
                     BLOCK_R=block_r, BLOCK_C=block_c)
    return y


def softmax_rows(kernel, x: torch.Tensor, block: int = 32):
    """Launch ``kernel`` (Exercise 1) on every row of ``x`` (..., n): returns (y, lse).

    y has x's shape and dtype; lse (natural log, float32) has shape x.shape[:-1].
    Kernel signature: kernel[(rows,)](X, Y, LSE, n_cols, stride_x, stride_y, BLOCK=block).
    """
    if isinstance(x, torch.Tensor) and x.dim() == 0:
        raise ValueError("softmax_rows: x must have at least one dimension (the softmax axis).")
    validate_tensor("x", x, dims=x.dim() if isinstance(x, torch.Tensor) else 2, dtypes=DTYPES,
                    name="softmax_rows")
    if block < 1 or block & (block - 1):
        raise ValueError(f"softmax_rows: block must be a power of two, got {block}.")
    rows = x.reshape(-1, x.shape[-1]) if x.numel() else x.reshape(-1, max(x.shape[-1], 1))
    n_rows, n_cols = rows.shape
    y = torch.empty_like(rows)
    lse = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    if n_rows and n_cols:
        kernel[(n_rows,)](rows, y, lse, n_cols, rows.stride(0), y.stride(0), BLOCK=block)
    return y.reshape(x.shape), lse.reshape(x.shape[:-1])


_ATTENTION_PLANS = Plans()


def attention_forward(kernel, q, k, v, scale: float | None = None, config: Config | None = None,
                      two_tiles: bool = False):
    """Launch ``kernel`` (Exercise 2, or ``attn_fwd_two_tiles`` with ``two_tiles``) on
    q (B, H, N_q, d), k and v (B, H, N_k, d), any strides with a unit last one.

    Returns O (B, H, N_q, d) in q's dtype and LSE (B, H, N_q) in natural log, float32.
    ``config`` defaults to ``pick_config`` for this GPU (or the CPU interpreter).
    Memory traffic: Q read once, K and V once per query tile, O and LSE written once.
    The checks, the config and the grid are remembered by the inputs' metadata (``plans``): a
    repeated call costs a dict lookup, the two outputs and the launch.
    """
    plan_key = key(kernel, q, k, v, scale, config, two_tiles, current().capability)
    plan = _ATTENTION_PLANS.get(plan_key)
    if plan is None:
        plan = _ATTENTION_PLANS.remember(plan_key, _attention_plan(kernel, q, k, v, scale,
                                                                   config, two_tiles))
    lse_shape, launch = plan
    o = output(q.shape, dtype=q.dtype, device=q.device)
    lse = output(lse_shape, dtype=torch.float32, device=q.device)
    if launch is not None:
        launch(q, k, v, o, lse)
    return o, lse


def _attention_plan(kernel, q, k, v, scale, config, two_tiles):
    """attention_forward's checks, config and grid: (LSE's shape, the launch or None)."""
    B, H, _, N_q, N_k, d = validate_qkv(q, k, v, name="attention", dtypes=DTYPES,
                                        head_dims=HEAD_DIMS, head_dims_why=HEAD_DIMS_WHY)
    scale = validate_scale(scale, d)
    cfg = config or pick_config(d, q.dtype, current().capability, two_tiles=two_tiles)
    rows = cfg.BLOCK_M // 2 if two_tiles else cfg.BLOCK_M          # rows of one query tile
    if min(rows, cfg.BLOCK_N) < 16 or (two_tiles and cfg.BLOCK_M % 2):
        raise ValueError(f"attention: query and key tiles must be at least 16 (tl.dot needs 16 "
                         f"on a GPU), got BLOCK_M={cfg.BLOCK_M}"
                         f"{' (two tiles)' if two_tiles else ''}, BLOCK_N={cfg.BLOCK_N}.")
    # N_k == 0 still launches: the key loops run zero times and every row is empty, which the
    # kernel must turn into O = 0, LSE = -inf itself (the check's only way to give it empty rows).
    if B * H * N_q == 0:
        return (B, H, N_q), None
    o_strides = contiguous_strides(q.shape)                         # O: a new tensor
    grid = (cdiv(N_q, cfg.BLOCK_M), B * H)
    return (B, H, N_q), Launch(
        kernel, grid,
        (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
         v.stride(0), v.stride(1), v.stride(2), *o_strides[:3], H, N_q, N_k, scale * LOG2E),
        dict(HEAD_DIM=d, BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N,
             DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
             num_warps=cfg.num_warps, num_stages=cfg.num_stages))


def merge_states(kernel, o_a, lse_a, o_b, lse_b, block_r: int = 16):
    """Launch ``kernel`` (Exercise 3): merge two partial attention results over disjoint key sets.

    o_a, o_b: (..., d); lse_a, lse_b: (...) float32 natural log. Returns (o, lse).
    Kernel signature: kernel[grid](O_a, LSE_a, O_b, LSE_b, O, LSE, n_rows, HEAD_DIM=d, BLOCK_R=block_r).
    """
    name = "merge_states"
    validate_tensor("o_a", o_a, dims=o_a.dim() if isinstance(o_a, torch.Tensor) else 2,
                    dtypes=DTYPES, name=name)
    validate_tensor("o_b", o_b, dims=o_a.dim(), dtypes=DTYPES, name=name, device=o_a.device)
    for label, t in (("lse_a", lse_a), ("lse_b", lse_b)):
        validate_tensor(label, t, dims=o_a.dim() - 1, dtypes=(torch.float32,), name=name,
                        device=o_a.device)
        if tuple(t.shape) != tuple(o_a.shape[:-1]):
            raise ValueError(f"{name}: {label} has shape {tuple(t.shape)}, expected "
                             f"{tuple(o_a.shape[:-1])}.")
    if o_a.shape != o_b.shape or o_a.dtype != o_b.dtype:
        raise ValueError(f"{name}: o_a {tuple(o_a.shape)} {o_a.dtype} and o_b {tuple(o_b.shape)} "
                         f"{o_b.dtype} must match.")
    d = o_a.shape[-1]
    if d not in HEAD_DIMS:
        raise ValueError(f"{name}: head dimension d={d} is not supported; use one of "
                         f"{HEAD_DIMS}: {HEAD_DIMS_WHY}.")
    oa, ob = o_a.contiguous().reshape(-1, d), o_b.contiguous().reshape(-1, d)
    la, lb = lse_a.contiguous().reshape(-1), lse_b.contiguous().reshape(-1)
    n_rows = oa.shape[0]
    o = output(oa.shape, dtype=oa.dtype, device=oa.device)
    lse = output(la.shape, dtype=la.dtype, device=la.device)
    if n_rows:
        kernel[(cdiv(n_rows, block_r),)](oa, la, ob, lb, o, lse, n_rows,
                                               HEAD_DIM=d, BLOCK_R=block_r)
    return o.reshape(o_a.shape), lse.reshape(lse_a.shape)
