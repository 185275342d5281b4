"""What the book's Gluon kernels (Chapter 6's Hopper FA3, Chapter 7's Blackwell FA4) share: the
TMA copy names that differ between triton 3.6 (the GPU images, Colab) and 3.9 (the CPU image),
and the tile helpers both kernels' roles call.

  TMA global -> shared   3.6 ``tma.async_copy_global_to_shared``   3.9 ``tma.async_load`` (the
                         old name still exists in 3.9 but raises "has been removed")
  TMA shared -> global   3.6 ``tma.async_copy_shared_to_global``   3.9 ``tma.async_store``

Blackwell's ``tma`` module re-exports Hopper's copy functions, so one pair serves both kernels.
Importing this module needs Triton's Gluon dialect (triton >= 3.5), not a GPU.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import tma

__all__ = ["tma_load", "tma_store", "m_block", "smem_tile", "head_descriptors"]

tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared
tma_store = tma.async_store if hasattr(tma, "async_store") else tma.async_copy_shared_to_global


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
