"""The HBM traffic model of the two loop orders (Section 8 counts the bytes with it)."""
from __future__ import annotations

import math


def hbm_traffic(N: int, d: int, Bc: int, Br: int, order: str, *, B: int = 1, H: int = 1,
                itemsize: int = 4) -> dict:
    """Bytes each loop order moves between global memory (HBM) and the chip, with no cache.

    ``order='fa1'`` (flash.cu): per head, K and V are read once; for each of the Tc K/V tiles,
    every Q tile is read, the running (m, l) and O rows are read and written back; O, l, m are
    initialised in HBM first. ``order='fa2'``: Q is read once, each of the Tr query tiles reads
    all of K and V, O is written once, (m, l) never leave the chip.
    Returns reads, writes and total in bytes, and the per-tensor breakdown in elements.
    """
    Tc, Tr = math.ceil(N / Bc), math.ceil(N / Br)
    Nd = N * d
    if order == "fa1":
        parts = {"Q read": Tc * Nd, "K,V read": 2 * Nd, "O read": Tc * Nd, "O write": Tc * Nd,
                 "m,l read": Tc * 2 * N, "m,l write": Tc * 2 * N, "init O,m,l": Nd + 2 * N}
    elif order == "fa2":
        parts = {"Q read": Nd, "K,V read": Tr * 2 * Nd, "O read": 0, "O write": Nd,
                 "m,l read": 0, "m,l write": 0, "init O,m,l": 0}
    else:
        raise ValueError(f"order must be 'fa1' or 'fa2', got {order!r}")
    heads = B * H
    reads = sum(v for k, v in parts.items() if "read" in k) * heads * itemsize
    writes = sum(v for k, v in parts.items() if "read" not in k) * heads * itemsize
    return {"reads": reads, "writes": writes, "total": reads + writes,
            "parts": {k: v * heads for k, v in parts.items()}, "Tc": Tc, "Tr": Tr}


def traffic_table(N: int, d: int, Bc: int, Br: int, B: int = 1, H: int = 1) -> str:
    """A text table comparing the two orders (MB = 1e6 bytes)."""
    a = hbm_traffic(N, d, Bc, Br, "fa1", B=B, H=H)
    b = hbm_traffic(N, d, Bc, Br, "fa2", B=B, H=H)
    lines = [f"B={B}, H={H}, N={N}, d={d}, Bc={Bc}, Br={Br} (Tc={a['Tc']}, Tr={a['Tr']}), float32",
             f"{'':12}{'FA1 (flash.cu)':>16}{'FA2 order':>14}"]
    for key in a["parts"]:
        lines.append(f"{key:12}{a['parts'][key] * 4 / 1e6:13.1f} MB{b['parts'][key] * 4 / 1e6:11.1f} MB")
    for key in ("reads", "writes", "total"):
        lines.append(f"{key.upper():12}{a[key] / 1e6:13.1f} MB{b[key] / 1e6:11.1f} MB")
    lines.append(f"compulsory (read Q, K, V, write O once): {4 * 4 * N * d * B * H / 1e6:.1f} MB")
    return "\n".join(lines)
