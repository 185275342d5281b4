"""Seeded random problems that hunt tile-boundary bugs (the checks' sweeps): packed
(``sweep``), dense (``dense_sweep``) and decode problems (``DecodeCase``, ``decode_sweep``).
The same seed gives the same cases on every machine."""
from __future__ import annotations

import dataclasses
import random
from typing import Sequence

import torch

from .cases import LAYOUTS, AttnCase


def sweep(name: str, seed: int, n: int, *, block_m: int, block_n: int, tiles: int = 3,
          groups: Sequence[int] = range(1, 9), d: int = 16, dtype: torch.dtype = torch.float32,
          masks: bool = True, max_sequences: int = 3, fold: bool = False,
          windows: bool = True) -> list[AttnCase]:
    """``n`` seeded random valid packed problems that hunt tile-boundary bugs, which hand-picked
    cases can miss: 1 to ``max_sequences`` sequences whose query and key lengths run from 0 to
    ``tiles`` tiles (``block_m`` query rows, ``block_n`` keys; the GPU's tile shapes find what the
    small CPU tiles cannot), most of them next to a tile edge (a multiple of the tile, -1, +1),
    some with a few queries against many keys or the reverse;
    G from ``groups`` with h_kv of 1 or 2; with ``masks``, causal, a sliding window (unless not
    ``windows``) or neither.
    ``fold``: a query tile holds ``block_m // G`` positions of G heads (Chapter 5's M-fold), so
    the query lengths' tile edges are multiples of that. The same seed gives the same cases on
    every machine."""
    rng = random.Random(seed)

    def length(block: int, most: int = tiles) -> int:
        return _near_edge(rng, block, most)

    out = []
    for i in range(n):
        G, h_kv = rng.choice(list(groups)), rng.choice((1, 2))
        count = rng.randint(1, max_sequences)
        rows = max(1, block_m // G) if fold else block_m
        # a third of the cases: a few queries against many keys (a tall tile's padding rows
        # then outnumber the real ones), or many queries against a few keys
        family = rng.choice(("edges", "few queries", "few keys"))
        lens_q = [rng.randint(0, max(1, rows // 4)) if family == "few queries" else length(rows)
                  for _ in range(count)]
        lens_k = [rng.randint(0, block_n // 2) if family == "few keys" else
                  length(block_n, tiles + 1 if family == "few queries" else tiles)
                  for _ in range(count)]
        j = rng.randrange(count)            # at least one sequence with queries and keys
        lens_q[j], lens_k[j] = max(lens_q[j], 1), max(lens_k[j], 1)
        lens_q, lens_k = tuple(lens_q), tuple(lens_k)
        kind = rng.choice(("none", "causal") + (("window",) if windows else ())) \
            if masks else "none"
        window = None
        if kind == "window":     # flash-attn's (left, right); -1 is unlimited on that side
            window = (rng.choice((-1, rng.randint(0, 2 * block_n))),
                      rng.choice((-1, 0, rng.randint(0, block_n))))
        out.append(AttnCase(f"{name} {i + 1}/{n} (seed {seed})", seqlens=lens_q,
                            seqlens_k=lens_k, H_q=G * h_kv, H_kv=h_kv, d=d, dtype=dtype,
                            causal=kind == "causal", window=window))
    return out


def _near_edge(rng: random.Random, block: int, tiles: int, least: int = 0) -> int:
    """A length from ``least`` to ``tiles`` tiles, most often next to a tile edge."""
    edge = rng.randint(0, tiles) * block
    return max(least, edge + rng.choice((-1, 0, 1, rng.randint(-block // 2, block // 2))))


def dense_sweep(name: str, seed: int, n: int, *, block_m: int, block_n: int, tiles: int = 3,
                d: int = 16, dtypes: Sequence[torch.dtype] = (torch.float32,)) -> list[AttnCase]:
    """``n`` seeded random dense (B, H, N, d) problems for a kernel without masks: query and key
    lengths from 1 to ``tiles`` tiles of the given tile shape, most next to a tile edge, B and H
    from 1 to 3, either memory layout, a dtype from ``dtypes``."""
    rng = random.Random(seed)
    return [AttnCase(f"{name} {i + 1}/{n} (seed {seed})", B=rng.randint(1, 2),
                     H_q=rng.randint(1, 3), N_q=_near_edge(rng, block_m, tiles, 1),
                     N_k=_near_edge(rng, block_n, tiles, 1), d=d, dtype=rng.choice(list(dtypes)),
                     layout=rng.choice(LAYOUTS)) for i in range(n)]


@dataclasses.dataclass(frozen=True)
class DecodeCase:
    """One decode problem: ``n_new`` query tokens per sequence against a KV cache holding
    ``lengths`` keys (the new tokens' included), ``max_len`` slots per sequence, contiguous
    (``page`` None) or in pages of ``page`` slots."""
    name: str
    B: int
    n_new: int
    h_q: int
    h_kv: int
    lengths: tuple[int, ...]
    max_len: int
    page: int | None = None


def decode_sweep(name: str, seed: int, n: int, *, block_n: int, tiles: int = 3,
                 groups: Sequence[int] = range(1, 9), new_tokens: Sequence[int] = (1,),
                 pages: Sequence[int | None] = (None,), max_batch: int = 3) -> list[DecodeCase]:
    """``n`` seeded random valid decode problems that hunt key-tile-boundary bugs: 1 to
    ``max_batch`` sequences whose cache lengths run up to ``tiles`` key tiles of ``block_n`` (the
    GPU's tile finds what small CPU tiles cannot), most of them next to a tile edge, each at
    least ``n_new`` (the new tokens are in the cache); G from ``groups`` with h_kv of 1 or 2; a
    page size from ``pages`` (None: contiguous), ``max_len`` a whole number of pages."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        G, h_kv = rng.choice(list(groups)), rng.choice((1, 2))
        n_new, page = rng.choice(list(new_tokens)), rng.choice(list(pages))
        lengths = tuple(_near_edge(rng, block_n, tiles, max(1, n_new))
                        for _ in range(rng.randint(1, max_batch)))
        max_len = max(lengths) + rng.choice((0, rng.randint(1, block_n)))
        if page:
            max_len = -(-max_len // page) * page
        out.append(DecodeCase(f"{name} {i + 1}/{n} (seed {seed})", len(lengths), n_new,
                              G * h_kv, h_kv, lengths, max_len, page))
    return out
