"""The forward pass Chapter 9 differentiates: Chapter 5's packed GQA kernel in its two-tile
form (causal masks bottom-right, O and the natural-log LSE ``(h_q, total_q)`` the backward
needs), from ``flashbook.gqa_kernels``, which ``flashbook release`` generates
from Chapter 5's solution: the package alone runs it, no checkout needed. The same kernel on
every device: in CPU mode two tiles of 16 rows, which take the group sizes the checks use. The
package holds this answer to Chapter 5's optional Exercise 1b (the instructor guide lists it);
the one-tile kernel, Exercise 1's answer, is not in the package."""
from __future__ import annotations

import functools

import numpy as np
import torch

from flashbook.device import current
from flashbook.gqa import launch_gqa, prefill_dtypes, validate_packed
from flashbook.varlen import window_bounds

__all__ = ["forward"]


def _dtypes(dtype) -> tuple:
    """The dtypes Chapter 5's launch takes here (``prefill_dtypes``: bf16 on a GPU of compute
    capability 8.0 or newer only), with this function's name in a bf16 refusal."""
    if dtype == torch.bfloat16 and dtype not in prefill_dtypes():
        raise ValueError("forward: bf16 needs a GPU of compute capability 8.0 or newer.")
    return prefill_dtypes()


def forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, *,
            causal: bool = False, softmax_scale: float | None = None, validate: bool = True):
    """O (total_q, h_q, d) and LSE (h_q, total_q) float32 of packed q (total_q, h_q, d), k, v
    (total_k, h_kv, d). ``validate`` runs Chapter 5's argument checks (host syncs: benchmarks
    replayed from CUDA graphs turn them off)."""
    settings = (q.dtype, causal, max_seqlen_q, max_seqlen_k, softmax_scale, validate)
    try:
        kw = _settings(*settings)
    except TypeError:           # an unhashable argument: worked out afresh (and refused there)
        kw = _settings.__wrapped__(*settings)
    args = (_kernel(), q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    if current().gpu:
        return launch_gqa(*args, **kw)
    with np.errstate(divide="ignore"):          # the interpreter's log(0) = -inf: no key seen
        return launch_gqa(*args, **kw)


@functools.lru_cache(maxsize=256)
def _settings(dtype, causal, max_seqlen_q, max_seqlen_k, softmax_scale, validate) -> dict:
    """``launch_gqa``'s keyword arguments for these Python arguments, worked out once (a
    training step calls the forward with the same ones every time). A refusal (bf16 without
    sm_80, a malformed length) raises and is not remembered."""
    return dict(window=window_bounds((-1, -1), causal, max_seqlen_q, max_seqlen_k),
                scale=softmax_scale, two_tiles=True, dtypes=_dtypes(dtype),
                validate=_validate if validate else None)


def _validate(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    """Chapter 5's argument checks (``validate_packed``), as ``launch_gqa`` runs them: before a
    new plan and on every call where values are checked."""
    validate_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                    name="forward", dtypes=prefill_dtypes())


@functools.cache
def _kernel():
    """Chapter 5's two-tile kernel, imported on first use (after ``flashbook.setup()``, which
    picks the interpreter or the GPU)."""
    from flashbook.gqa_kernels import attn_gqa_two_tiles
    return attn_gqa_two_tiles
