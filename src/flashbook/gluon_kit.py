"""What the book's Gluon kernels (Chapter 6's Hopper FA3, Chapter 7's Blackwell FA4) share: the
TMA copy names that differ between triton 3.6 (the GPU images, Colab) and 3.9 (the CPU image),
and the tile helpers both kernels' roles call; for Chapter 9's two Gluon backwards (the course's
``solutions/extras``), the check of their backward-only inputs and the LSE and D rows they
TMA-load; for every launcher, the check that the device is an sm_90 GPU (``require_sm90``).

  TMA global -> shared   3.6 ``tma.async_copy_global_to_shared``   3.9 ``tma.async_load`` (the
                         old name still exists in 3.9 but raises "has been removed")
  TMA shared -> global   3.6 ``tma.async_copy_shared_to_global``   3.9 ``tma.async_store``
  TMA reduce-add         3.6 none in Gluon (the builder has the op) 3.9 ``tma.async_atomic_add``
  CTA barrier            3.6 ``gl.thread_barrier``                   3.9 ``gl.barrier``
  smem reinterpret       3.6 ``desc._reinterpret``                   3.9 ``desc.reinterpret``

Blackwell's ``tma`` module re-exports Hopper's copy functions, so one pair serves both kernels.
Importing this module needs Triton's Gluon dialect (triton >= 3.5), not a GPU.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import tma

from .cases import validate_dense_qkv   # the Gluon launchers' argument check, in cases

__all__ = ["tma_load", "tma_store", "tma_reduce_add", "cta_barrier", "smem_reinterpret",
           "m_block", "smem_tile", "head_descriptors",
           "validate_dense_qkv", "validate_backward_inputs", "lse_and_delta_rows",
           "capability", "require_sm90"]

tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared
tma_store = tma.async_store if hasattr(tma, "async_store") else tma.async_copy_shared_to_global
cta_barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier


@builtin
def smem_reinterpret(desc, dtype, shape, layout, _semantic=None):
    """The shared memory of ``desc`` seen with another dtype, shape or layout (no copy)."""
    view = desc.reinterpret if hasattr(desc, "reinterpret") else desc._reinterpret
    return view(dtype, shape, layout, _semantic=_semantic)

if hasattr(tma, "async_atomic_add"):
    tma_reduce_add = tma.async_atomic_add
else:                   # triton 3.6: the op exists (Triton's own descriptor atomics use it)
    from triton._C.libtriton import ir as _ir

    @builtin
    def tma_reduce_add(tensor_desc, coord, src, _semantic=None):
        """Add the shared-memory tile ``src`` into global memory at ``coord`` of
        ``tensor_desc`` (``cp.reduce.async.bulk.tensor ... .add``: the adds happen in L2).
        Wait for it to finish reading ``src`` with ``tma.store_wait``."""
        coord = _semantic._convert_to_ir_values(coord, require_i64=False)
        _semantic.builder.create_async_tma_reduce(_ir.DESCRIPTOR_REDUCE_KIND.ADD,
                                                  tensor_desc.handle, coord, src.handle)


@gluon.jit
def m_block():
    """The CTA's block of query rows along grid axis 0, the last block first: with a causal mask
    the last blocks have the most work, and they start first."""
    return gl.num_programs(0) - 1 - gl.program_id(0)


@gluon.jit
def smem_tile(ring, slot, ROWS: gl.constexpr, HEAD_DIM: gl.constexpr):
    """Slot ``slot`` of a shared-memory ring of (1, ROWS, d) TMA boxes, as the (ROWS, d) matrix
    the tensor cores read."""
    return ring.index(slot).reshape([ROWS, HEAD_DIM])


def head_descriptors(descriptor_type, q, k, v, o, block_m: int, block_n: int, row_layout,
                     key_layout) -> tuple:
    """TMA descriptors of q, k, v, o ``(B, H, N, d)`` viewed as ``(B*H, N, d)``: boxes of
    ``(1, block_m, d)`` rows for q and o and ``(1, block_n, d)`` keys for k and v, so a box past
    the end of a head reads zeros and a store past it is clipped. ``descriptor_type``: Gluon's
    Hopper or Blackwell ``TensorDescriptor``."""
    d = q.shape[-1]
    out = []
    for t, rows, layout in ((q, block_m, row_layout), (k, block_n, key_layout),
                            (v, block_n, key_layout), (o, block_m, row_layout)):
        t3 = t.view(t.shape[0] * t.shape[1], t.shape[2], d)
        out.append(descriptor_type(t3, list(t3.shape), list(t3.stride()), [1, rows, d], layout))
    return tuple(out)


def rebased(descriptor, base):
    """``descriptor`` (a TMA descriptor a plan keeps) for the tensor ``base`` of the same shape,
    strides, dtype and alignment: the launcher reads only the base's address from it. Made
    without the dataclass's ``__post_init__`` checks (2-4 µs each), which the kept descriptor
    passed for that same metadata."""
    out = object.__new__(type(descriptor))
    out.__dict__.update(descriptor.__dict__)
    out.base = base
    return out


@functools.lru_cache(maxsize=16)
def capability(device: torch.device) -> tuple:
    """A CUDA device's compute capability, read once (the launchers check it on every call)."""
    return tuple(torch.cuda.get_device_capability(device))


def require_sm90(name: str, device: torch.device, uses: str) -> None:
    """The Gluon launchers' device check: ValueError unless ``device`` is an sm_90 GPU
    (H100/H200), naming what the kernel ``uses`` of it and what the device is instead."""
    cap = capability(device) if device.type == "cuda" else None
    if cap != (9, 0):
        found = (f"{torch.cuda.get_device_name(device)} is sm_{cap[0]}{cap[1]}" if cap
                 else f"the tensors are on {device.type}")
        raise ValueError(f"{name}: needs an sm_90 GPU (H100/H200: {uses}); {found}. Gluon has no "
                         "CPU interpreter: the kernel runs only on a CUDA GPU of compute "
                         "capability 9.0.")


def validate_backward_inputs(name: str, q, o, lse, do) -> None:
    """A Gluon backward's own inputs beside q, k, v: O and dO contiguous and like q
    ``(B, H, N_q, d)``; the forward's natural-log LSE ``(B, H, N_q)`` float32, contiguous."""
    B, H, N_q = q.shape[:3]
    for label, t in (("o", o), ("do", do)):
        if not isinstance(t, torch.Tensor) or t.shape != q.shape or t.dtype != q.dtype \
                or t.device != q.device or not t.is_contiguous():
            raise ValueError(f"{name}: {label} must be a contiguous tensor like q "
                             f"{tuple(q.shape)} {q.dtype} on {q.device}.")
    if not isinstance(lse, torch.Tensor) or tuple(lse.shape) != (B, H, N_q) \
            or lse.dtype != torch.float32 or lse.device != q.device \
            or not lse.is_contiguous():
        raise ValueError(f"{name}: lse must be float32 (B, H, N_q) = {(B, H, N_q)}, contiguous, "
                         f"on {q.device}: the forward's natural-log LSE.")


@triton.jit
def _delta_kernel(O, DO, Delta, N, N_PAD, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr):
    """D (B*H, N_PAD) fp32 = rowsum(dO * O) of dense (B*H, N, HEAD_DIM) O and dO."""
    bh = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    offs = bh * N * HEAD_DIM + rows[:, None] * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :]
    ok = (rows < N)[:, None]
    o = tl.load(O + offs, mask=ok, other=0.0).to(tl.float32)
    do = tl.load(DO + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(Delta + bh * N_PAD + rows, tl.sum(o * do, 1), mask=rows < N)


def lse_and_delta_rows(o, do, lse):
    """(LSE, D) as ``(B*H, N_pad)`` fp32 rows for the TMA, D = rowsum(dO * O) (one Triton
    kernel); N_pad is N_q rounded up to 4 floats, the TMA's 16-byte row stride."""
    B, H, N_q, d = o.shape
    n_pad = triton.cdiv(N_q, 4) * 4
    lse_rows = torch.empty((B * H, n_pad), dtype=torch.float32, device=o.device)
    lse_rows[:, :N_q] = lse.view(B * H, N_q)
    delta = torch.empty_like(lse_rows)
    _delta_kernel[(triton.cdiv(N_q, 64), B * H)](o, do, delta, N_q, n_pad, HEAD_DIM=d, BLOCK=64)
    return lse_rows, delta
