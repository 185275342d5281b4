"""Attention problems as data (introduced in Chapter 1; every chapter's checks use them).

``AttnCase`` describes one seeded problem; ``make_inputs`` builds its q, k, v; ``expected``
computes its float64 reference (the random sweeps of problems are in ``case_sweeps``). The
wrappers' argument checks live here and nowhere else: ``validate_qkv`` is the check every
Triton kernel wrapper runs (``as_window`` turns a ``window_size`` of NumPy or torch integers
into Python ints first), ``validate_dense_qkv`` the Gluon (TMA) launchers', ``validate_tensor``
and ``validate_scale`` their parts, so a bad call raises a ``ValueError`` that says what is
wrong instead of crashing a kernel;
``host_values``, ``check_values`` and ``output`` (from ``launcher``, re-exported here) are how a
wrapper reads an index tensor for its content checks without making a GPU's hot path wait, and
allocates its outputs.

Conventions (see ``reference``): dense tensors are (B, H, N, d); packed ("varlen") tensors are
(total, H, d) with sequences given by lengths; H_q is a multiple of H_kv (grouped-query
attention); causal masks and windows are aligned bottom-right.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import operator
from typing import Sequence

import torch

from . import oob, reference
from .device import current

LAYOUTS = ("bhnd", "bnhd", "kvpacked")   # kvpacked: packed cases, K and V views of one tensor


@dataclasses.dataclass(frozen=True)
class AttnCase:
    """One seeded attention problem.

    ``layout="bnhd"``: the tensors are (B, N, H, d) in memory, viewed as (B, H, N, d) (strided,
    as a model's projection produces them). ``layout="kvpacked"`` (packed cases): K and V are
    views of one (total_k, 2, H, d) tensor, so their token stride is twice q's (the checks
    make them with ``kv_packed``). ``seqlens``: a packed batch of sequences of these
    query lengths (``seqlens_k``: key lengths, default the same); B is then the sequence count.
    ``logit_boost`` multiplies q: large values stress the softmax's stability.
    ``constant_scores``: q all -1 and k all +1, so every score is ``-d * scale`` (with a large
    ``scale``, far below any finite start of a running max, and out of float16's range).
    """
    name: str
    B: int = 1
    H_q: int = 2
    N_q: int = 16
    N_k: int | None = None                    # default: N_q
    d: int = 16
    H_kv: int | None = None                   # default: H_q
    dtype: torch.dtype = torch.float32
    causal: bool = False
    window: tuple[int, int] | None = None     # (left, right); a negative side is unlimited
    seqlens: tuple[int, ...] | None = None
    seqlens_k: tuple[int, ...] | None = None
    layout: str = "bhnd"
    scale: float | None = None
    logit_boost: float = 1.0
    constant_scores: bool = False

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")
        if self.H_q % self.h_kv:
            raise ValueError(f"H_q={self.H_q} is not a multiple of H_kv={self.h_kv}")

    @property
    def n_k(self) -> int:
        return self.N_q if self.N_k is None else self.N_k

    @property
    def h_kv(self) -> int:
        return self.H_q if self.H_kv is None else self.H_kv

    @property
    def varlen(self) -> bool:
        return self.seqlens is not None

    def cu_seqlens(self, keys: bool = False) -> torch.Tensor:
        """int32 (batch + 1,) offsets of the packed sequences, starting at 0 (flash-attn's)."""
        lens = (self.seqlens_k or self.seqlens) if keys else self.seqlens
        return torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32)

    def describe(self) -> str:
        dt = str(self.dtype).replace("torch.", "")
        heads = f"H={self.H_q}" if self.h_kv == self.H_q else f"H_q={self.H_q}, H_kv={self.h_kv}"
        size = (f"seqlens={list(self.seqlens)}" + (f", seqlens_k={list(self.seqlens_k)}"
                                                    if self.seqlens_k else "")
                if self.varlen else f"B={self.B}, {heads}, N_q={self.N_q}, N_k={self.n_k}")
        if self.varlen:
            size += f", {heads}"
        extra = ", causal" if self.causal else ""
        extra += f", window={self.window}" if self.window is not None else ""
        extra += f", scale={self.scale:g}" if self.scale is not None else ""
        extra += f", logits x{self.logit_boost:g}" if self.logit_boost != 1 else ""
        if self.constant_scores:
            scale = self.scale if self.scale is not None else 1 / math.sqrt(self.d)
            extra += f", every score {-self.d * scale:g}"
        extra += ", strided (B, N, H, d) layout" if self.layout == "bnhd" else ""
        extra += ", K and V views of one (total_k, 2, H, d) tensor" \
            if self.layout == "kvpacked" else ""
        return f"'{self.name}' ({size}, d={self.d}, {dt}{extra})"


def seeded(shape, seed: int, dtype=torch.float32, scale: float = 1.0, device=None) -> torch.Tensor:
    """A seeded normal tensor (drawn in float64 on the CPU, so every device gets the same)."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(shape, generator=g, dtype=torch.float64) * scale
    return t.to(device=device or current().device, dtype=dtype)


def make_inputs(case: AttnCase, seed: int = 0, *, device=None, pad: int = 0):
    """Seeded (q, k, v) for ``case``: (B, H_q, N_q, d) and (B, H_kv, N_k, d), or packed
    (total, H, d) for a varlen case, in ``case.dtype`` on ``device`` (default: this runtime's).

    ``pad > 0`` places each contiguous tensor inside a NaN-filled buffer (``oob.embed``): an
    unmasked read past its end poisons the output and a write past it breaks the canaries.
    """
    if case.varlen:
        tq, tk = sum(case.seqlens), sum(case.seqlens_k or case.seqlens)
        shapes = [(tq, case.H_q, case.d), (tk, case.h_kv, case.d), (tk, case.h_kv, case.d)]
    elif case.layout == "bnhd":
        shapes = [(case.B, case.N_q, case.H_q, case.d), (case.B, case.n_k, case.h_kv, case.d),
                  (case.B, case.n_k, case.h_kv, case.d)]
    else:
        shapes = [(case.B, case.H_q, case.N_q, case.d), (case.B, case.h_kv, case.n_k, case.d),
                  (case.B, case.h_kv, case.n_k, case.d)]
    boosts = (case.logit_boost, 1.0, 1.0)
    out = [seeded(s, seed + i, case.dtype, b, device) for i, (s, b) in enumerate(zip(shapes, boosts))]
    if case.constant_scores:
        out[0], out[1] = torch.full_like(out[0], -1.0), torch.full_like(out[1], 1.0)
    if case.layout == "bnhd" and not case.varlen:
        return tuple(t.transpose(1, 2) for t in out)
    if pad:
        return tuple(oob.embed(t, pad=pad) for t in out)
    return tuple(out)


def kv_packed(k: torch.Tensor, v: torch.Tensor, pad: int = 256):
    """K and V (total_k, H, d) as the two halves of one (total_k, 2, H, d) tensor (inside NaN
    padding), as a fused KV projection produces them: token stride 2 * H * d, not H * d."""
    kv = oob.embed(torch.stack((k, v), dim=1), pad=pad)
    return kv[:, 0], kv[:, 1]


def expected(case: AttnCase, q, k, v):
    """The float64 reference (O, LSE) of ``case`` on these inputs (the kernel's own, possibly
    rounded, values): O in float64, LSE in float32, shaped as the case's outputs."""
    if case.varlen:
        o, lse = reference.attention_varlen(q.double(), k.double(), v.double(),
                                            case.cu_seqlens(), case.cu_seqlens(keys=True),
                                            case.scale, case.causal, case.window)
        return o, lse
    return reference.attention(q.double(), k.double(), v.double(), scale=case.scale,
                               causal=case.causal, window=case.window, return_lse=True)


def grid(cases: Sequence[AttnCase], **axes) -> list[AttnCase]:
    """Every case crossed with every value of each axis, e.g. ``grid(cases, causal=(False,
    True), dtype=(torch.float16,))``."""
    out = []
    for case in cases:
        for values in itertools.product(*axes.values()):
            out.append(dataclasses.replace(case, **dict(zip(axes, values))))
    return out


# ------------------------------------------------------------------------ validation

# Triton types an integer argument below 2**31 as int32, and the kernels multiply such strides
# by tile indices in int32: an element offset past 2**31 - 1 wraps (an illegal address on a GPU,
# silently wrong reads in the interpreter). Seen on an H200: a (32, 131072, 8, 128) fp16 cache.
MAX_ELEMENTS = 2**31 - 1


def element_span(t: torch.Tensor) -> int:
    """How many elements a kernel's offsets into ``t`` range over: 1 + the largest offset."""
    if not t.numel():
        return 0
    return 1 + sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride()))


_TENSOR_PASSED: dict = {}    # the metadata of inputs that passed validate_tensor
TENSOR_CACHE_SIZE = 1024


def validate_tensor(label: str, t, *, dims: int, dtypes: Sequence[torch.dtype], name: str,
                    contiguous: str = "last", device=None, span_of: str = "tensor"):
    """One input of a kernel wrapper: a tensor of ``dims`` dimensions and an accepted dtype, on
    this runtime's device (and on ``device``, the other inputs'), with ``contiguous="last"``
    (unit stride in the last dimension) or ``"all"`` (a flat row-major buffer), whose elements
    32-bit offsets reach (``MAX_ELEMENTS``): the whole tensor's, or with ``span_of="item"`` one
    item's of its first dimension (a wrapper that launches a slice of items at a time).

    Every check reads host metadata only, so an input that passed once passes again: it is
    remembered by that metadata (as ``validate_qkv`` remembers its inputs), and a repeated
    call costs building one key and one dict lookup."""
    try:
        key = (t.shape, t.stride(), t.dtype, t.device, current().device, label, dims,
               dtypes if isinstance(dtypes, tuple) else tuple(dtypes), name, contiguous, device,
               MAX_ELEMENTS, span_of)
        if key in _TENSOR_PASSED:
            return
    except (AttributeError, TypeError):          # not a tensor: the checks say what is wrong
        key = None
    _check_tensor(label, t, dims=dims, dtypes=dtypes, name=name, contiguous=contiguous,
                  device=device, span_of=span_of)
    if key is not None:
        if len(_TENSOR_PASSED) >= TENSOR_CACHE_SIZE:
            _TENSOR_PASSED.clear()
        _TENSOR_PASSED[key] = True


def _check_tensor(label: str, t, *, dims, dtypes, name, contiguous, device, span_of):
    """validate_tensor's checks, run on an input whose metadata has not passed before."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: {label} must be a torch.Tensor, got {type(t).__name__}.")
    if t.dim() != dims:
        raise ValueError(f"{name}: {label} must have {dims} dimensions, got shape {tuple(t.shape)}.")
    if t.dtype not in dtypes:
        why = ("; bfloat16 is taken only on a GPU of compute capability 8.0 or newer, and only by "
               "Chapter 5's prefill and Chapter 9 (the CPU interpreter's bf16 tl.dot is wrong, so "
               "the other chapters' graded kernels are fp16/fp32)"
               if t.dtype == torch.bfloat16 else "")
        raise ValueError(f"{name}: {label} has dtype {t.dtype}; this kernel takes "
                         f"{', '.join(str(d) for d in dtypes)} here (convert with "
                         f".to({dtypes[0]})){why}.")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: {label} is on {t.device} but the other inputs are on {device}.")
    want = current().device
    if t.device.type != want:
        raise ValueError(f"{name}: {label} is on {t.device.type}, but this runtime runs kernels on "
                         f"{want} ({current().kind}); move it with .to('{want}').")
    if contiguous == "all" and not t.is_contiguous():
        raise ValueError(f"{name}: {label} is not contiguous (strides {t.stride()}: a transposed or "
                         "sliced view?); the kernel indexes a flat row-major buffer: pass "
                         ".contiguous().")
    if contiguous == "last" and t.numel() and t.stride(-1) != 1:
        raise ValueError(f"{name}: {label} must be contiguous in its last dimension (stride(-1) "
                         f"== 1), got strides {t.stride()}; call .contiguous() first.")
    if span_of == "item":
        span = element_span(t[:1])
        if span > MAX_ELEMENTS:
            raise ValueError(f"{name}: one item of {label}'s first dimension spans {span:,} "
                             f"elements (shape {tuple(t.shape)}, strides {t.stride()}); the "
                             f"book's Triton kernels compute offsets in 32-bit integers, so it "
                             f"may span at most {MAX_ELEMENTS:,}.")
        return
    span = element_span(t)
    if span > MAX_ELEMENTS:
        raise ValueError(f"{name}: {label} spans {span:,} elements (shape {tuple(t.shape)}, "
                         f"strides {t.stride()}); the book's Triton kernels compute offsets in "
                         f"32-bit integers, so a tensor may span at most {MAX_ELEMENTS:,}: "
                         "split the call (fewer sequences or heads per call) to stay below it.")


def as_window(window_size):
    """flash-attn's ``window_size`` as a tuple of Python ints when it holds integers of another
    kind: NumPy or torch integer scalars, or a 1-d integer tensor of two entries (read with
    ``host_values``). Anything else is returned unchanged, for the validator to refuse (floats,
    bools, a wrong length)."""
    if window_size.__class__ is tuple and len(window_size) == 2 and \
            window_size[0].__class__ is int and window_size[1].__class__ is int:
        return window_size                      # the common call: nothing to convert
    if isinstance(window_size, torch.Tensor):
        if window_size.dim() != 1 or window_size.is_floating_point() or \
                window_size.dtype == torch.bool:
            return window_size
        values = _read(window_size)
        if values is None:
            raise ValueError("window_size: a tensor cannot be read while a CUDA graph is being "
                             "captured; pass two Python ints.")
        return tuple(values)
    if not isinstance(window_size, (tuple, list)):
        return window_size
    out = []
    for w in window_size:
        if isinstance(w, bool) or str(getattr(w, "dtype", "")) in ("bool", "torch.bool"):
            return window_size
        try:
            out.append(operator.index(w))      # int, numpy integers, 0-d integer tensors
        except TypeError:
            return window_size
    return tuple(out)


_QKV_PASSED: dict = {}       # the metadata of inputs that passed validate_qkv -> its result
QKV_CACHE_SIZE = 256


def validate_qkv(q, k, v, *, name: str = "attention",
                 dtypes: Sequence[torch.dtype] = (torch.float16, torch.float32),
                 head_dims: Sequence[int] | None = None, d_max: int | None = None,
                 head_dims_why: str = "", contiguous: str = "last", same_shape: bool = False,
                 gqa: bool = False, allow_empty: bool = True) -> tuple[int, int, int, int, int, int]:
    """Check dense q (B, H_q, N_q, d), k and v (B, H_kv, N_k, d) for a kernel wrapper; raise a
    ValueError that names the problem. Returns (B, H_q, H_kv, N_q, N_k, d).

    ``same_shape``: q, k, v must be one shape (kernels that assume N_q == N_k); ``gqa``: H_q may
    be a multiple of H_kv; ``head_dims``: the accepted d (else 1..``d_max``), and
    ``head_dims_why`` what the refusal of another says; ``allow_empty``:
    zero-sized B, H or N are accepted (the wrapper returns early).
    """
    # Every check reads only host metadata (shapes, strides, dtypes, devices) and the runtime's
    # device, so inputs that passed once pass again: remembered by that metadata, a repeated
    # call costs one dict lookup instead of the checks (a few µs of a launch's host time).
    args = dict(name=name, dtypes=dtypes, head_dims=head_dims, d_max=d_max,
                head_dims_why=head_dims_why, contiguous=contiguous, same_shape=same_shape,
                gqa=gqa, allow_empty=allow_empty)
    try:
        key = (q.shape, q.stride(), q.dtype, q.device, k.shape, k.stride(), k.dtype, k.device,
               v.shape, v.stride(), v.dtype, v.device, current().device, name, tuple(dtypes),
               None if head_dims is None else tuple(head_dims), d_max, head_dims_why,
               contiguous, same_shape, gqa, allow_empty)
        passed = _QKV_PASSED.get(key)
    except (AttributeError, TypeError):          # not tensors: the checks say what is wrong
        return _check_qkv(q, k, v, **args)
    if passed is None:
        passed = _check_qkv(q, k, v, **args)
        if len(_QKV_PASSED) >= QKV_CACHE_SIZE:
            _QKV_PASSED.clear()
        _QKV_PASSED[key] = passed
    return passed


def _check_qkv(q, k, v, *, name, dtypes, head_dims, d_max, head_dims_why, contiguous,
               same_shape, gqa, allow_empty):
    """validate_qkv's checks, run on inputs whose metadata has not passed before."""
    for label, t in (("q", q), ("k", k), ("v", v)):
        validate_tensor(label, t, dims=4, dtypes=dtypes, name=name, contiguous=contiguous,
                        device=q.device if isinstance(q, torch.Tensor) and label != "q" else None)
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"{name}: q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}.")
    B, H_q, N_q, d = q.shape
    _, H_kv, N_k, _ = k.shape
    if same_shape and not (q.shape == k.shape == v.shape):
        raise ValueError(f"{name}: shapes do not match: q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}; q, k and v must have the same shape (B, H, N, d).")
    heads_ok = H_kv == H_q or (gqa and H_kv > 0 and H_q % H_kv == 0)
    if k.shape[0] != B or k.shape[-1] != d or v.shape != k.shape or not heads_ok:
        need = "H_q a multiple of H_kv" if gqa else "q's H"
        raise ValueError(f"{name}: shapes do not match: q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}; expected k and v to be (B, H_kv, N_k, d) with q's B "
                         f"and d and {need}.")
    if not allow_empty and min(B, H_q, N_q, N_k) < 1:
        raise ValueError(f"{name}: empty input (B={B}, H={H_q}, N_q={N_q}, N_k={N_k}).")
    if head_dims is not None and d not in head_dims:
        raise ValueError(f"{name}: head dimension d={d} is not supported; use one of "
                         f"{tuple(head_dims)}" + (f": {head_dims_why}" if head_dims_why else "")
                         + ".")
    if d_max is not None and not 1 <= d <= d_max:
        raise ValueError(f"{name}: head dimension d={d} is outside 1..{d_max}.")
    return B, H_q, H_kv, N_q, N_k, d


def validate_scale(scale, d: int, name: str = "attention") -> float:
    """``scale`` as a positive float; None means 1/sqrt(d)."""
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    if not scale > 0 or math.isinf(scale):
        raise ValueError(f"{name}: scale must be a positive finite number, got {scale}.")
    return scale


# What a wrapper does at call time lives in ``launcher``; these names are part of ``cases``'s API
# (the chapters and the students' validators call ``cases.host_values``, ``cases.output`` ...).
from .launcher import (POISON_ENV, VALUES_ENV, _read, capturing, cdiv,  # noqa: E402,F401
                       check_values, host_values, next_pow2, output, poisoned_outputs,
                       values_checked)
from .plans import validate_once  # noqa: E402,F401


def validate_dense_qkv(name: str, q, k, v, head_dims, *, heads_note: str = "",
                       head_dim_note: str = "") -> tuple[int, int, int, int]:
    """The input checks both Gluon launchers share: q ``(B, H, N_q, d)``, k and v
    ``(B, H, N_k, d)``, one dtype of fp16 or bf16, d in ``head_dims``, contiguous and 16-byte
    aligned (TMA's requirement), B*H within the grid. Raises a ValueError naming the problem;
    returns (B, H, N_q, d). The notes are appended to the heads and head-dim messages."""
    for label, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}: {label} must be a torch.Tensor, got {type(t).__name__}.")
        if t.dim() != 4:
            raise ValueError(f"{name}: {label} must be 4-D (B, H, N, d), got shape "
                             f"{tuple(t.shape)}.")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"{name}: q, k and v must share a dtype, got {q.dtype}, {k.dtype}, "
                         f"{v.dtype}.")
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"{name}: dtype {q.dtype} is not supported; the kernel takes "
                         "torch.float16 or torch.bfloat16 (convert with .half()).")
    B, H, N_q, d = q.shape
    if k.shape != v.shape or k.shape[0] != B or k.shape[1] != H or k.shape[3] != d:
        raise ValueError(f"{name}: k and v must be (B, H, N_k, d) = ({B}, {H}, N_k, {d}) like q; "
                         f"got k {tuple(k.shape)}, v {tuple(v.shape)}{heads_note}.")
    if d not in head_dims:
        raise ValueError(f"{name}: head dim d={d} is not supported; the kernel takes d in "
                         f"{tuple(head_dims)}{head_dim_note}.")
    for label, t in (("q", q), ("k", k), ("v", v)):
        if not t.is_contiguous():
            raise ValueError(f"{name}: {label} must be contiguous (B, H, N, d), got strides "
                             f"{t.stride()}; call .contiguous() first.")
        if t.numel() and t.data_ptr() % 16:
            raise ValueError(f"{name}: {label}'s data must be 16-byte aligned for TMA (a sliced "
                             "view?); pass a fresh .contiguous() copy.")
    if B * H > 65535:
        raise ValueError(f"{name}: B*H = {B * H} exceeds the grid's 65535 programs in y.")
    return B, H, N_q, d
