"""The packed grouped-query prefill launch that Chapter 5 teaches and Chapter 9's forward
runs: q ``(total_q, h_q, d)``, k and v ``(total_k, h_kv, d)``, ``h_q = G * h_kv``, sequences
by ``cu_seqlens`` (Chapter 4's layout). One program takes one K/V head of one sequence and the
G query heads that share it, folded into the rows of its tiles (PackGQA: the (position, head)
pairs flattened position-major, ``f = position * G + head in group``, and cut into tiles of
BLOCK_M rows, so row r of tile m is pair ``m * BLOCK_M + r``), so every K/V tile is loaded once
for G heads, for any G. ``launch_gqa`` checks what the launch needs; ``validate_packed`` is the
public wrappers' argument check (``chapters.ch5`` re-exports all three)."""
from __future__ import annotations

import torch

from .cases import as_window, cdiv, host_values, output, validate_scale, validate_tensor, \
    values_checked
from .device import current
from .plans import Launch, Plans, contiguous_strides, key, validate_once
from .tiles import DTYPES, HEAD_DIMS, HEAD_DIMS_WHY, LOG2E, Config, pick_config
from .varlen import heads_per_section

__all__ = ["launch_gqa", "validate_packed", "prefill_dtypes"]


def prefill_dtypes() -> tuple:
    """The dtypes the prefill launch takes here: float16 and float32, and bfloat16 on a GPU of
    compute capability 8.0 or newer. Not bf16 in CPU mode: the interpreter's bf16 ``tl.dot`` is
    wrong, so the checks cannot grade it there (the kernels cast P to V's dtype, so the same
    code is right in bf16 on a GPU)."""
    cc = current().capability
    return DTYPES if cc is None or tuple(cc) < (8, 0) else (*DTYPES, torch.bfloat16)


_GQA_PLANS = Plans()


def launch_gqa(kernel, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int,
               max_seqlen_k: int, *, window: tuple[int, int], scale: float | None = None,
               config: Config | None = None, sections: int | None = None, out=None,
               two_tiles: bool = False, dtypes: tuple | None = None, validate=None,
               validate_args: tuple = ()):
    """Launch the M-fold prefill kernel (``two_tiles``: its two-tile form, whose BLOCK_M holds
    both tiles, and which takes ``WINDOWED``: False compiles the masked bands out when no causal
    mask or window applies); returns (O, LSE (h_q, total_q)).

    Grid: ``(cdiv(max_seqlen_q * G, BLOCK_M) * S, batch * h_kv // S)``: Chapter 4's sections,
    over (sequence, K/V head) pairs. ``window``: non-negative ``(left, right)``
    (``window_bounds``). ``dtypes``: those accepted (default ``prefill_dtypes()``). The checks,
    config and grid are remembered by the inputs' metadata (``plans``). ``validate``: the public
    wrapper's checks, run as Chapter 4's ``launch_varlen`` runs them (before a new plan, and on
    every call where values are checked), as ``validate(q, k, v, cu_seqlens_q, cu_seqlens_k,
    max_seqlen_q, max_seqlen_k, *validate_args)``."""
    o, lse = out if out is not None else (None, None)
    plan_key = key(kernel, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                   window, scale, config, sections, o, lse, two_tiles, dtypes,
                   current().capability, validate, validate_args)
    plan = _GQA_PLANS.get(plan_key)
    if validate is not None and (plan is None or values_checked()):
        validate(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *validate_args)
    if plan is None:
        plan = _GQA_PLANS.remember(plan_key, _gqa_plan(
            kernel, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, window,
            scale, config, sections, out, two_tiles, dtypes))
    launch = plan
    if out is None:
        o = output(q.shape, dtype=q.dtype, device=q.device)
        lse = output((q.shape[1], q.shape[0]), dtype=torch.float32, device=q.device)
    if launch is not None:
        launch(q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k)
    return o, lse


def _gqa_plan(kernel, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, window,
              scale, config, sections, out, two_tiles, dtypes):
    """launch_gqa's checks, config and grid: the ``Launch``, or None when there is nothing to
    compute."""
    name = "launch_gqa"
    for label, t in (("q", q), ("k", k), ("v", v)):
        validate_tensor(label, t, dims=3, dtypes=dtypes or prefill_dtypes(), name=name)
    total_q, h_q, d = q.shape
    h_kv = k.shape[1]
    if d not in HEAD_DIMS:
        raise ValueError(f"{name}: head dimension d={d} is not supported; use one of "
                         f"{HEAD_DIMS}: {HEAD_DIMS_WHY}.")
    if h_q % h_kv if h_kv else h_q:
        raise ValueError(f"{name}: h_q={h_q} must be a multiple of h_kv={h_kv}.")
    if h_kv == 0:                       # no heads: an empty batch folded into the heads
        return None
    G = h_q // h_kv
    cfg = config or pick_config(d, q.dtype, current().capability, two_tiles=two_tiles)
    tiles = 2 if two_tiles else 1
    if cfg.BLOCK_M // tiles < 16:
        raise ValueError(f"{name}: BLOCK_M={cfg.BLOCK_M} gives tiles of fewer than 16 rows.")
    # Any G: the kernels fold the flattened (position, head) pairs, so no group size needs a
    # copy of K and V (G = 3, 5, 7 or 71 as much as 4 or 8).
    k_strides, v_strides = k.stride(), v.stride()
    scale = validate_scale(scale, d, name)
    o_strides = contiguous_strides(q.shape) if out is None else out[0].stride()
    n_bkv = (cu_seqlens_q.numel() - 1) * h_kv
    if n_bkv == 0 or max_seqlen_q == 0:
        return None
    S = sections or heads_per_section(n_bkv, 2 * max(max_seqlen_k, 1) * d * k.element_size(),
                                      q.device)
    grid = (cdiv(max_seqlen_q * G, cfg.BLOCK_M) * S, n_bkv // S)    # tiles of folded rows
    # every row sees every key when the window reaches past both ends (no causal mask)
    windowed = window[0] < max_seqlen_k or window[1] < max_seqlen_q
    specialised = dict(WINDOWED=windowed) if two_tiles else {}
    return Launch(
        kernel, grid,
        (q.stride(0), q.stride(1), k_strides[0], k_strides[1], v_strides[0], v_strides[1],
         o_strides[0], o_strides[1], h_kv, total_q, scale * LOG2E, window[0], window[1], S),
        dict(GROUP=G, HEAD_DIM=d, BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N,
             DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
             num_warps=cfg.num_warps, num_stages=cfg.num_stages, **specialised))


# The most rows a decode tile holds (G heads x new tokens): more new tokens are taken in chunks.
# A 1,024-row tile (G = 8, 128 new tokens) needed 256 KB of shared memory on an H200 (it has
# 227 KB) and compiled for minutes in the CPU interpreter.


def validate_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                    window_size=(-1, -1), *, name: str = "attention_gqa",
                    dtypes: tuple | None = None):
    """Chapter 4's argument checks of a packed batch (its Exercise 3), with h_q a multiple of
    h_kv: a ValueError that names the argument. Reads cu_seqlens' values with
    ``cases.host_values`` (once per tensor; the value checks are skipped while a CUDA graph is
    captured, and on a GPU's hot path outside the graded checks and
    ``flashbook.check_values()``). ``dtypes``: as ``launch_gqa``'s. The metadata checks run
    once per metadata (``plans.validate_once``)."""
    validate_once(_check_packed, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                  max_seqlen_k, as_window(window_size), name, dtypes)


def _check_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, window_size,
                  name, dtypes):
    for label, t in (("q", q), ("k", k), ("v", v)):
        validate_tensor(label, t, dims=3, dtypes=dtypes or prefill_dtypes(), name=name)
    if not q.dtype == k.dtype == v.dtype or not q.device == k.device == v.device:
        raise ValueError(f"{name}: q, k, v must share a dtype and a device.")
    if q.shape[2] not in HEAD_DIMS:
        raise ValueError(f"{name}: q's head dimension d={q.shape[2]} is not one of {HEAD_DIMS}: "
                         f"{HEAD_DIMS_WHY}.")
    heads_q, heads_kv = q.shape[1], k.shape[1]       # both 0 for an empty batch seen as heads
    if k.shape != v.shape or k.shape[2] != q.shape[2] or (
            heads_q % heads_kv if heads_kv else heads_q):
        raise ValueError(f"{name}: k {tuple(k.shape)} and v {tuple(v.shape)} must be (total_k, "
                         f"h_kv, d) with q's d and h_kv dividing q's {q.shape[1]} heads.")
    for label, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.dtype != torch.int32 or \
                cu.device != q.device:
            raise ValueError(f"{name}: {label} must be a 1-d torch.int32 tensor on {q.device}.")
    for label, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name}: {label} must be an int, got {value!r}.")
    window_size = as_window(window_size)          # NumPy or torch integers: Python ints
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2 or not all(
            isinstance(w, int) and not isinstance(w, bool) and w >= -1 for w in window_size):
        raise ValueError(f"{name}: window_size must be two ints >= -1, got {window_size!r}.")
    offsets_q, offsets_k = host_values(cu_seqlens_q), host_values(cu_seqlens_k)
    if offsets_q is None or offsets_k is None:    # a CUDA graph is being captured
        return
    lengths = []
    for label, offsets, total in (("cu_seqlens_q", offsets_q, q.shape[0]),
                                  ("cu_seqlens_k", offsets_k, k.shape[0])):
        steps = [b - a for a, b in zip(offsets, offsets[1:])]
        if len(offsets) < 2 or offsets[0] != 0 or offsets[-1] != total or min(steps) < 0:
            raise ValueError(f"{name}: {label} must rise from 0 to the token count {total} "
                             f"(batch + 1 >= 2 entries), got {list(offsets[:4])}..."
                             f"{list(offsets[-2:])}.")
        lengths.append(steps)
    if len(lengths[0]) != len(lengths[1]):
        raise ValueError(f"{name}: cu_seqlens_q and cu_seqlens_k describe different batch sizes.")
    for label, value, steps in (("max_seqlen_q", max_seqlen_q, lengths[0]),
                                ("max_seqlen_k", max_seqlen_k, lengths[1])):
        if value < max(steps):
            raise ValueError(f"{name}: {label} must be an int >= the longest sequence "
                             f"({max(steps)}), got {value!r}.")
