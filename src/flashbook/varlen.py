"""What the varlen launchers of Chapters 4, 5 and 9 share, worked out on the host from Python
arguments: a sliding window's bounds as the kernels take them (``window_bounds``), and how many
(sequence, head) pairs the grid walks together so that their K and V stay in L2
(``heads_per_section``; Chapter 4 teaches both)."""
from __future__ import annotations

import functools

import torch

from .cases import as_window


def window_bounds(window: tuple[int, int], causal: bool, max_seqlen_q: int,
                  max_seqlen_k: int) -> tuple[int, int]:
    """``(left, right)`` as the kernels take them: non-negative key counts, an unlimited side
    (negative in flash-attn's ``window_size``) replaced by a bound no sequence reaches
    (``max_seqlen_q + max_seqlen_k``), and ``causal`` making the right side 0. ``window`` may
    hold NumPy or torch integers (``cases.as_window``); anything but two integers is a
    ValueError (a wrapper may work out the bounds before its checks run)."""
    if max_seqlen_q.__class__ is not int or max_seqlen_k.__class__ is not int:
        raise ValueError(f"max_seqlen_q and max_seqlen_k must be ints, got {max_seqlen_q!r} and "
                         f"{max_seqlen_k!r}.")
    unlimited = max_seqlen_q + max_seqlen_k
    if not _two_ints(window):
        window = as_window(window)                   # NumPy or torch integers: Python ints
        if not _two_ints(window):
            raise ValueError(f"window_size must be two ints >= -1 (-1: unlimited), got "
                             f"{window!r}.")
    left, right = window
    left = unlimited if left < 0 else left
    right = 0 if causal else (unlimited if right < 0 else right)
    return int(left), int(right)


def _two_ints(window) -> bool:
    """A tuple of two Python ints (not bools): a window as the kernels' bounds are made from."""
    return window.__class__ is tuple and len(window) == 2 and window[0].__class__ is int and \
        window[1].__class__ is int


def heads_per_section(n_bh: int, kv_bytes: int, device: torch.device | str) -> int:
    """How many (sequence, head) pairs the grid walks together: the largest divisor of ``n_bh``
    whose K and V (``kv_bytes`` each pair) fit in half of the GPU's L2 cache; 1 on a CPU.

    The programs in flight then read the K and V of a few pairs, which stay in L2, while each
    section's tiles still start with the longest rows (``program_tile`` in the chapter)."""
    device = torch.device(device)
    if device.type != "cuda":
        return 1
    return _largest_divisor(n_bh, max(1, _l2_bytes(device.index) // 2 // max(kv_bytes, 1)))


@functools.lru_cache(maxsize=None)
def _l2_bytes(index: int | None) -> int:
    """The GPU's L2 cache, asked once per device (a call's host time is the book's budget)."""
    return torch.cuda.get_device_properties(torch.cuda.current_device() if index is None
                                            else index).L2_cache_size


@functools.lru_cache(maxsize=4096)
def _largest_divisor(n: int, at_most: int) -> int:
    """The largest divisor of ``n`` that is at most ``at_most`` (one loop per new pair)."""
    return max(g for g in range(1, min(at_most, n) + 1) if n % g == 0)
