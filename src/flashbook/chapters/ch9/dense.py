"""What Chapter 9's dense API (Exercise 4's Function and ``flash_attention``) needs around the
packed kernels: dense ``(B, H, N, d)`` or flash-attn's ``(B, N, H, d)`` tensors seen as packed
batches, their offsets, the packed O and LSE seen back in the caller's layout (and dO, O and the
LSE packed again for the backward), and the forward alone, its launch remembered.

A dense batch is a packed batch two ways, both read through strides, with no copy:
* B sequences of N tokens (``cu_seqlens = [0, N, ..., B*N]``, h heads) where one token stride
  steps across the batch too (batch stride = N x token stride: flash-attn's layout as it is
  allocated, or one sequence);
* one sequence of N tokens with B*h heads (``cu_seqlens = [0, N]``) where one head stride steps
  across the batch (batch stride = h x head stride: ``(B, H, N, d)`` as it is allocated). The
  kernels find query head j's K/V head as ``j // G``, which is ``b * h_kv + h // G`` for
  ``j = b * h_q + h``: GQA survives the fold.
Anything else is copied into the first form (``to_packed``). Every choice reads host metadata
only (shapes, strides, ``requires_grad``): nothing waits for the device.
"""
from __future__ import annotations

import numpy as np
import torch

from flashbook import reference
from flashbook.cases import validate_scale
from flashbook.device import current
from flashbook.launcher import capturing, output
from flashbook.plans import Plans, key, recorded_launches

from .forward import forward

__all__ = ["LAYOUTS", "to_packed", "from_packed", "lse_from_packed", "lse_to_packed",
           "dense_offsets", "packed_views", "forward_only", "dense_forward"]

LAYOUTS = ("bhnd", "bnhd")       # (B, H, N, d), and flash-attn's (B, N, H, d)


def _layout(layout: str) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS} ((B, H, N, d) or flash-attn's "
                         f"(B, N, H, d)), got {layout!r}.")
    return layout


def to_packed(t, layout: str = "bhnd", sequences: int | None = None):
    """(B, H, N, d) (``layout="bnhd"``: (B, N, H, d)) -> (B * N, H, d): a view where the batch
    and sequence axes merge (one sequence, or flash-attn's layout), else a contiguous copy. With
    ``sequences=1`` (``packed_views``'s heads fold, B > 1) -> (N, B * H, d) the same way: how a
    backward packs dO and O like the q it packed. The kernels take the token and head strides
    (the last dimension is made contiguous)."""
    B, X, Y, d = t.shape           # (B, H, N, d), or (B, N, H, d) for "bnhd"
    if sequences == 1 and B > 1:   # the heads fold: through (N, B, H, d)
        heads_first = t.permute(2, 0, 1, 3) if layout == "bhnd" else t.transpose(0, 1)
        packed = heads_first.reshape(heads_first.shape[0], B * heads_first.shape[2], d)
    elif layout == "bhnd":         # compared inline (the old dense path ran it three times a call)
        packed = t.transpose(1, 2).reshape(B * Y, X, d)
    elif _layout(layout) == "bnhd":
        packed = t.reshape(B * X, Y, d)
    return packed if packed.stride(2) == 1 else packed.contiguous()


_TOKENS, _HEADS = 1, 2           # the folds a tensor's strides allow (a bit each)


def _folds(t, layout: str) -> int:
    """Which folds of the batch ``t``'s strides allow without a copy: ``_TOKENS`` (into the
    tokens) and/or ``_HEADS`` (into the heads); 0 when its last dimension is strided."""
    B, N, n_stride, H, h_stride, d, d_stride, b_stride = _dims(t, layout)
    if d_stride != 1 and d != 1:
        return 0
    if B == 1:
        return _TOKENS | _HEADS
    return (_TOKENS if b_stride == N * n_stride else 0) | (_HEADS if b_stride == H * h_stride
                                                             else 0)


def _dims(t, layout: str) -> tuple:
    """(B, N, its stride, H, its stride, d, its stride, the batch stride) of a dense tensor."""
    B, X, Y, d = t.shape
    sB, sX, sY, sd = t.stride()
    if layout == "bhnd":
        return B, Y, sY, X, sX, d, sd, sB
    return B, X, sX, Y, sY, d, sd, sB


def _recipe(t, layout: str, fold: int):
    """How a tensor of t's metadata is seen packed, folded as ``fold`` says (its strides allow
    it): a function of the tensor, giving (B*N, H, d) or (N, B*H, d). One ``as_strided`` where
    autograd records nothing, else at most two views autograd undoes with views
    (``as_strided``'s backward zero-fills a buffer and copies the gradient into it)."""
    B, N, n_stride, H, h_stride, d, _, _ = _dims(t, layout)
    if not (t.requires_grad and torch.is_grad_enabled()):
        size = (B * N, H, d) if fold == _TOKENS else (N, B * H, d)
        stride = (n_stride, h_stride, 1)
        return lambda x: x.as_strided(size, stride)             # at x's own storage offset
    if fold == _TOKENS:                                         # through (B, N, H, d)
        if layout == "bhnd":
            return lambda x: x.transpose(1, 2).view(B * N, H, d)
        return lambda x: x.view(B * N, H, d)
    if layout == "bhnd":                                        # through (B*H, N, d)
        return lambda x: x.view(B * H, N, d).transpose(0, 1)
    return lambda x: x.transpose(0, 1).view(N, B * H, d)        # through (N, B, H, d)


def _copy(layout: str):
    return lambda x: to_packed(x, layout)


def _packing(q, k, v, layout: str) -> tuple:
    """((q's, k's, v's recipe), sequences): how ``packed_views`` packs tensors of this
    metadata (the checks of its arguments run here, on its first call with them)."""
    if layout != "bhnd":
        _layout(layout)
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"flash_attention: q, k, v must have 4 dimensions ({layout}), got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}.")
    if q.shape[0] == 0:         # no packed view of zero rows keeps N: O could not be unpacked
        raise ValueError(f"flash_attention: the batch is empty (q {tuple(q.shape)}); B must be "
                         "at least 1.")
    both = _folds(q, layout) & _folds(k, layout) & _folds(v, layout)
    if both:
        fold = both & _TOKENS or _HEADS                              # tokens first
        recipes = tuple(_recipe(t, layout, fold) for t in (q, k, v))
        return recipes, q.shape[0] if fold == _TOKENS else 1
    recipes = tuple(_recipe(t, layout, _TOKENS) if _folds(t, layout) & _TOKENS
                    else _copy(layout) for t in (q, k, v))
    return recipes, q.shape[0]


_PACKINGS = Plans()


def packed_views(q, k, v, layout: str = "bhnd"):
    """(q, k, v packed, sequences) of dense q (B, h_q, N_q, d), k and v (B, h_kv, N_k, d)
    (``layout="bnhd"``: (B, N, h, d)): each folded as the module docstring says, all three the
    same way, as views of the caller's tensors. ``sequences`` is B (the batch folded into the
    tokens: q (B*N_q, h_q, d)) or 1 (into the heads: q (N_q, B*h_q, d)); pass it to
    ``dense_offsets``, ``from_packed`` and ``lse_from_packed``. Strides that allow neither
    fold: copies, folded into the tokens (``to_packed``). How tensors of one metadata (shapes,
    strides, whether autograd records them) are packed is worked out once and remembered."""
    grad = torch.is_grad_enabled()
    try:
        packing_key = (layout, q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(),
                       grad and q.requires_grad, grad and k.requires_grad,
                       grad and v.requires_grad)
    except AttributeError:      # not tensors: ``_packing`` says what is wrong
        packing_key = None
    packing = _PACKINGS.get(packing_key)
    if packing is None:
        packing = _PACKINGS.remember(packing_key, _packing(q, k, v, layout))
    (see_q, see_k, see_v), sequences = packing
    return see_q(q), see_k(k), see_v(v), sequences


def from_packed(t, B, layout: str = "bhnd", sequences: int | None = None):
    """(B * N, H, d) -> (B, H, N, d) (``layout="bnhd"``: (B, N, H, d)), a view. ``sequences``
    as ``packed_views`` gave it: B (the default) or 1 (t is (N, B * H, d))."""
    total, H, d = t.shape
    if sequences is None or sequences == B:
        t = t.view(B, total // B if B else 0, H, d)
        if layout != "bhnd" and _layout(layout) == "bnhd":
            return t
        return t.transpose(1, 2)
    t = t.view(total, B, H // B, d)                                 # (N, B, H, d)
    if layout != "bhnd" and _layout(layout) == "bnhd":
        return t.transpose(0, 1)
    return t.permute(1, 2, 0, 3)


def lse_from_packed(lse, B, sequences: int | None = None):
    """A packed LSE (H, B * N) -> (B, H, N), a view; with ``sequences=1`` (``packed_views``'s
    heads fold) the LSE is (B * H, N)."""
    if sequences is None or sequences == B:
        return lse.view(lse.shape[0], B, -1).transpose(0, 1)
    return lse.view(B, -1, lse.shape[1])


def lse_to_packed(lse, sequences: int):
    """``lse_from_packed``'s inverse: (B, H, N) -> (H, B * N) (``sequences=1``: (B * H, N)), a
    view of an LSE that ``lse_from_packed`` (or ``dense_forward``) gave, else a copy."""
    B, H, N = lse.shape
    if sequences == 1:
        return lse.reshape(B * H, N)
    return lse.transpose(0, 1).reshape(H, B * N)


_OFFSETS: dict = {}
_KEPT_AT_MOST = 256                 # offsets tensors kept (never freed: see dense_offsets)


def dense_offsets(B: int, N: int, device) -> torch.Tensor:
    """``cu_seqlens`` of a dense batch of B sequences of N tokens: ``[0, N, 2N, ..., B*N]``
    int32 on ``device``. Made once per (B, N, device) and shared (read it, never write it): a
    new one costs two device ops (``arange``, a multiply) on every call; a kept one costs a
    dict lookup. A kept one is never freed, so a CUDA graph captured after it was made may
    read it (``torch.cuda.graph`` synchronises before it captures: its values are there);
    one made while a graph is captured is not kept (the graph's kernels fill it only when
    replayed), nor one past ``_KEPT_AT_MOST``."""
    kept = _OFFSETS.get((B, N, device))
    if kept is not None:
        return kept
    made = torch.arange(B + 1, dtype=torch.int32, device=device) * N
    if len(_OFFSETS) < _KEPT_AT_MOST and not capturing():
        _OFFSETS[(B, N, device)] = _OFFSETS[(B, N, torch.device(device))] = made
    return made


def forward_only(q, k, v) -> bool:
    """True when autograd records nothing of a call on q, k, v (grad mode off, or none of them
    requires grad) and the kernels take their dtype (float64 is the Function's reference
    path): ``dense_forward`` then gives what the Function would, without it."""
    return q.dtype != torch.float64 and not (torch.is_grad_enabled() and (
        q.requires_grad or k.requires_grad or v.requires_grad))


class _Plan:
    """What a dense forward remembers by its inputs' metadata: the forward's launch (None:
    nothing to compute), its offsets, its output buffers' shapes and how O and the LSE are seen
    in the caller's layout (size, stride)."""

    __slots__ = ("launch", "cu_q", "cu_k", "o_shape", "lse_shape", "o_view", "lse_view")


_PLANS = Plans()


def dense_forward(q, k, v, causal: bool = False, softmax_scale=None, layout: str = "bhnd",
                  return_lse: bool = False):
    """O in q's layout (and the LSE (B, h_q, N_q)) of dense q, k, v: the forward alone, called
    where autograd records nothing (``forward_only``, or inside Exercise 4's Function). The
    first call with inputs of this metadata packs them (``packed_views``), runs ``forward``
    (Chapter 5's checks and plan) and remembers its launch; a later one launches it again on
    the caller's own tensors (a packed view of a tensor starts at its data pointer; the strides
    are the plan's), with new output buffers: no view, no check, no offsets made, nothing read
    from the device. float64 (gradcheck's dtype, which the kernels do not take) runs the
    float64 reference on the packed views, every call."""
    plan_key = key(q, k, v, causal, softmax_scale, layout)
    plan = _PLANS.get(plan_key)
    if plan is None:
        return _first_call(plan_key, q, k, v, causal, softmax_scale, layout, return_lse)
    o = output(plan.o_shape, dtype=q.dtype, device=q.device)
    lse = output(plan.lse_shape, dtype=torch.float32, device=q.device)
    if plan.launch is not None:
        if current().gpu:
            plan.launch(q, k, v, o, lse, plan.cu_q, plan.cu_k)
        else:
            with np.errstate(divide="ignore"):      # the interpreter's log(0) = -inf
                plan.launch(q, k, v, o, lse, plan.cu_q, plan.cu_k)
    o = o.as_strided(*plan.o_view)
    return (o, lse.as_strided(*plan.lse_view)) if return_lse else o


def _first_call(plan_key, q, k, v, causal, softmax_scale, layout, return_lse):
    """``dense_forward`` through ``forward`` on packed views, its launch remembered (not while
    a CUDA graph is captured: its offsets would be filled only when the graph replays)."""
    seq = 2 if layout == "bhnd" else 1
    B, N_q, N_k = q.shape[0], q.shape[seq], k.shape[seq]
    q_p, k_p, v_p, S = packed_views(q, k, v, layout)
    cu_q, cu_k = dense_offsets(S, N_q, q.device), dense_offsets(S, N_k, q.device)
    scale = validate_scale(softmax_scale, q.shape[-1])
    if q.dtype == torch.float64:     # gradcheck's dtype: the float64 reference, never remembered
        o_p, lse_p = reference.attention_varlen(q_p, k_p, v_p, cu_q, cu_k, scale, causal)
        o, lse = from_packed(o_p, B, layout, S), lse_from_packed(lse_p, B, S)
        return (o, lse) if return_lse else o
    with recorded_launches() as made:
        o_p, lse_p = forward(q_p, k_p, v_p, cu_q, cu_k, N_q, N_k, causal=causal,
                             softmax_scale=scale)
    o, lse = from_packed(o_p, B, layout, S), lse_from_packed(lse_p, B, S)
    views = (q_p, k_p, v_p)
    if len(made) <= 1 and not capturing() and all(
            a.data_ptr() == b.data_ptr() for a, b in zip(views, (q, k, v))):
        plan = _Plan()
        plan.launch = made[0][0] if made else None
        plan.cu_q, plan.cu_k = cu_q, cu_k
        plan.o_shape, plan.lse_shape = tuple(o_p.shape), tuple(lse_p.shape)
        plan.o_view = (tuple(o.shape), o.stride(), o.storage_offset())
        plan.lse_view = (tuple(lse.shape), lse.stride(), lse.storage_offset())
        _PLANS.remember(plan_key, plan)
    return (o, lse) if return_lse else o
