"""The tile sizes and constants of the book's Triton attention kernels: Chapter 3 derives them,
and Chapters 4-9 launch the same tiles (so they live here, in the toolkit, not in Chapter 3's
package). ``pick_config`` gives the config for a head dim, dtype and GPU; ``Config`` is one;
``HEAD_DIMS`` and ``DTYPES`` are what the kernels take, and ``HEAD_DIMS_WHY`` the sentence a
refusal of another head dim says."""
from __future__ import annotations

import dataclasses

import torch

from .launcher import next_pow2

LOG2E = 1.4426950408889634      # log2(e): exp(x) = exp2(x * LOG2E)
HEAD_DIMS = (16, 32, 64, 128)   # tl.arange needs a power of two, tl.dot at least 16
# what a refusal of another head dimension says (Chapters 3-5, 8 and 9 use these tiles)
HEAD_DIMS_WHY = ("the kernels' tiles are a power of two wide (tl.arange) and at least 16 "
                 "(tl.dot); for another d, zero-pad q, k and v to the next of these (scale "
                 "1/sqrt(d) with your d) and slice O back")
DTYPES = (torch.float16, torch.float32)

# Shared memory one block may use (the opt-in maximum per block), by compute capability, from
# NVIDIA's table (CUDA C++ Programming Guide, "Technical Specifications per Compute Capability").
# An SM holds 64 KB (T4), 164 KB (A100), 100 KB (sm_86/sm_89) or 228 KB (H100/H200); from sm_80
# on, 1 KB of it is reserved per block, so a kernel can use at most these values.
SHARED_MEMORY_PER_BLOCK = {
    (7, 5): 64 * 1024,      # T4:         64 KB = 65536 B
    (8, 0): 163 * 1024,     # A100:      163 KB = 166912 B (of the SM's 164 KB)
    (8, 6): 99 * 1024,      # A10G, RTX 30: 99 KB (of 100 KB)
    (8, 9): 99 * 1024,      # L4, RTX 40:   99 KB (of 100 KB)
    (9, 0): 227 * 1024,     # H100/H200: 227 KB = 232448 B (of the SM's 228 KB)
}


@dataclasses.dataclass(frozen=True)
class Config:
    """Launch parameters of the attention kernel: tile sizes and the compiler's knobs."""
    BLOCK_M: int      # query rows per program (the Q tile stays in registers)
    BLOCK_N: int      # keys per step of the loop (K and V tiles stream through shared memory)
    num_warps: int    # 4 warps = one Hopper warpgroup; 8 = two
    num_stages: int   # how many K/V tiles the software pipeline keeps in flight


def pick_config(d: int, dtype: torch.dtype, capability: tuple | None,
                two_tiles: bool = False) -> Config:
    """The tile config the chapter uses for head dim ``d`` and ``dtype`` on a GPU of this
    compute capability (None: CPU interpreter, where small tiles exercise the tail masks).
    ``two_tiles``: the config of ``attn_fwd_two_tiles``, whose BLOCK_M covers both query tiles.

    Measured on an H200 (src/flashbook/data/bench/ch3); the sm_75/sm_80 entries are chosen to
    fit those GPUs' shared memory per block (``SHARED_MEMORY_PER_BLOCK``: 64 KB on a T4, 163 KB
    on an A100; tests/test_ch3.py compiles every one ahead of time and checks it against them). Where the
    two-tile kernel was not measured it takes the one-tile config: the same Q, K and V tiles in
    shared memory, the same accumulator registers.
    """
    if capability is None:
        return Config(32, 32, 4, 1)
    cc = tuple(capability)
    if two_tiles and cc >= (9, 0) and dtype != torch.float32:
        return Config(256, 64, 8, 3) if d > 64 else Config(128, 64, 4, 3)
    if dtype == torch.float32:                      # 4-byte tiles: half the tile area
        return Config(64, 32, 4, 2) if cc >= (8, 0) and d <= 64 else Config(32, 32, 4, 2)
    if cc >= (9, 0):
        return Config(128, 64, 4, 3) if d <= 64 else Config(128, 64, 8, 3)
    if cc == (8, 0) or cc == (8, 7):
        return Config(128, 64, 4, 3) if d <= 64 else Config(128, 64, 8, 2)
    if cc >= (8, 0):                                # sm_86 / sm_89: 99 KB per block
        return Config(128, 64, 4, 2) if d <= 64 else Config(64, 64, 4, 2)
    return Config(64, 64, 4, 2) if d <= 64 else Config(64, 32, 4, 2)   # T4: 64 KB per block


def decode_block_m(G: int, n_new: int) -> int:
    """Rows of a decode tile (Chapter 5's M-fold, Chapter 8's split kernel): the G query heads of
    a K/V head x n_new new tokens, at least 16 (``tl.dot``'s minimum)."""
    return max(16, next_pow2(G * n_new))
