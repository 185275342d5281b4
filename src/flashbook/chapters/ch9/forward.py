"""The forward pass Chapter 9 differentiates: Chapter 5's packed GQA kernel in its two-tile
form (causal masks bottom-right, O and the natural-log LSE ``(h_q, total_q)`` the backward
needs), from ``flashbook.gqa_kernels``, which ``flashbook release`` generates
from Chapter 5's solution: the package alone runs it, no checkout needed. The same kernel on
every device: in CPU mode two tiles of 16 rows, which take the group sizes the checks use. The
package holds this answer to Chapter 5's optional Exercise 1b (the instructor guide lists it);
the one-tile kernel, Exercise 1's answer, is not in the package.

The student's autograd Function calls ``forward`` on every training step with tensors of the
same metadata: its launch is remembered by that metadata (``plans``), as ``dense_forward``'s is,
and a later call makes only its output buffers and the launch."""
from __future__ import annotations

import functools
import math

import numpy as np
import torch

from flashbook.device import current
from flashbook.gqa import launch_gqa, prefill_dtypes, validate_packed
from flashbook.launcher import poisoning, values_checked
from flashbook.plans import Plans, recorded_launches, tensor_key
from flashbook.varlen import window_bounds

__all__ = ["forward"]


def _dtypes(dtype) -> tuple:
    """The dtypes Chapter 5's launch takes here (``prefill_dtypes``: bf16 on a GPU of compute
    capability 8.0 or newer only), with this function's name in a bf16 refusal."""
    if dtype == torch.bfloat16 and dtype not in prefill_dtypes():
        raise ValueError("forward: bf16 needs a GPU of compute capability 8.0 or newer.")
    return prefill_dtypes()


class _Plan:
    """What ``forward`` remembers by its inputs' metadata: the launch (None: nothing to
    compute), made again on the call's own tensors and new output buffers."""

    __slots__ = ("launch",)


_PLANS = Plans()


def forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, *,
            causal: bool = False, softmax_scale: float | None = None, validate: bool = True):
    """O (total_q, h_q, d) and LSE (h_q, total_q) float32 of packed q (total_q, h_q, d), k, v
    (total_k, h_kv, d). ``validate`` runs Chapter 5's argument checks (host syncs: benchmarks
    replayed from CUDA graphs turn them off). The first call with inputs of this metadata
    (shapes, strides, dtypes, devices, alignment, the Python arguments) runs the checks and
    Chapter 5's launch and remembers the launch; a later one skips both, except that the
    checks run again wherever values are checked (``launcher.values_checked``: they read the
    offsets' values, which the metadata does not hold), as Chapter 5's launch runs them."""
    backend = current()
    try:        # ``plans.key`` spelled out: five tensors, no isinstance per part
        plan_key = (tensor_key(q), tensor_key(k), tensor_key(v), tensor_key(cu_seqlens_q),
                    tensor_key(cu_seqlens_k), max_seqlen_q, max_seqlen_k, causal,
                    softmax_scale, validate, backend.capability)
    except AttributeError:      # not tensors: Chapter 5's checks say what is wrong
        plan_key = None
    plan = _PLANS.get(plan_key)
    if plan is None:
        return _first_call(plan_key, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                           max_seqlen_k, causal, softmax_scale, validate)
    if validate and values_checked():
        _validate(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    # ``launcher.output``'s buffers (row-major; NaN inside ``poisoned_outputs``), made from q:
    # ``torch.empty`` parses a shape and a device on every call
    o = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
    if poisoning():
        o.fill_(math.nan), lse.fill_(math.nan)
    if plan.launch is not None:
        if backend.gpu:
            plan.launch(q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k)
        else:
            with np.errstate(divide="ignore"):      # the interpreter's log(0) = -inf
                plan.launch(q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k)
    return o, lse


def _first_call(plan_key, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                causal, softmax_scale, validate):
    """``forward`` through Chapter 5's ``launch_gqa`` (its checks, plan and launch), the launch
    it made remembered under ``plan_key`` (a refusal raises: nothing is remembered)."""
    settings = (q.dtype, causal, max_seqlen_q, max_seqlen_k, softmax_scale, validate)
    try:
        kw = _settings(*settings)
    except TypeError:           # an unhashable argument: worked out afresh (and refused there)
        kw = _settings.__wrapped__(*settings)
    args = (_kernel(), q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    with recorded_launches() as made:
        if current().gpu:
            o, lse = launch_gqa(*args, **kw)
        else:
            with np.errstate(divide="ignore"):      # the interpreter's log(0) = -inf: no key seen
                o, lse = launch_gqa(*args, **kw)
    if len(made) <= 1:
        plan = _Plan()
        plan.launch = made[0][0] if made else None
        _PLANS.remember(plan_key, plan)
    return o, lse


@functools.lru_cache(maxsize=256)
def _settings(dtype, causal, max_seqlen_q, max_seqlen_k, softmax_scale, validate) -> dict:
    """``launch_gqa``'s keyword arguments for these Python arguments, worked out once per
    plan. A refusal (bf16 without sm_80, a malformed length) raises and is not remembered."""
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
