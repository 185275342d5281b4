"""Chapter 4's optional exercise: the masked kernel with two query tiles per program, checked
as Exercise 2b's kernel is (``checks``), with tile configs of two halves of 16 rows or more."""
from __future__ import annotations

from flashbook.check import report, require_implemented

from .checks import _check_packed, count_masked_loads

HINT = ("tile A holds rows m0 .. m0 + HALF - 1 of the program and tile B the next HALF; each "
        "tile's partial key tiles take visible_pairs of its own rows, and both tiles are stored "
        "with attn_store_rows.")


def count_two_tile_loads(kernel, hidden: bool = False) -> str:
    """``checks.count_masked_loads`` for the two-tile kernel (the CPU-mode child's target)."""
    return count_masked_loads(kernel, hidden, two_tiles=True)


def check_two_tile_kernel(kernel, hidden: bool = False):
    """Exercise 4 (optional): the two-tile kernel matches float64 attention on Exercise 2b's
    cases and random shapes, and (CPU mode) each program loads the K tiles its rows see, once
    for each query tile, taking the masked path for the partial ones only."""
    require_implemented(kernel, "attn_masked_two_tiles")
    n = _check_packed(kernel, hidden, True, "two-tile kernel", HINT, two_tiles=True)
    report("two-tile kernel", n, extra=count_two_tile_loads(kernel, hidden), hidden=hidden)
