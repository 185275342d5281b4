"""Attention over a sequence sharded across ranks (context parallelism; Chapter 8 teaches it):
which positions each rank holds, contiguous or zig-zag, the causal work that layout gives a
rank, and ``ShardedCase``, one seeded problem a check runs on P processes."""
from __future__ import annotations

import dataclasses

import torch


def zigzag_positions(n: int, world_size: int, rank: int) -> torch.Tensor:
    """Positions rank ``rank`` holds under the zig-zag layout: the sequence cut into
    2 * world_size chunks, rank r taking chunks r and 2 * world_size - 1 - r (n divisible by
    2 * world_size)."""
    c = n // (2 * world_size)
    a, b = rank, 2 * world_size - 1 - rank
    return torch.cat([torch.arange(a * c, (a + 1) * c), torch.arange(b * c, (b + 1) * c)])


def contiguous_positions(n: int, world_size: int, rank: int) -> torch.Tensor:
    c = n // world_size
    return torch.arange(rank * c, (rank + 1) * c)


def causal_work(positions: torch.Tensor) -> int:
    """(query, key) pairs a rank holding these query positions computes under a causal mask."""
    return int((positions + 1).sum())


@dataclasses.dataclass(frozen=True)
class ShardedCase:
    """One seeded attention problem, its sequence of ``n`` positions sharded over the ranks
    (``layout``): q, k, v (B, H, n, d) built in float64 and cast to ``dtype`` (a name, so that
    the case travels to other processes as JSON)."""
    name: str
    n: int                   # the whole sequence
    B: int = 1
    H_q: int = 2
    H_kv: int = 2
    d: int = 8
    dtype: str = "float64"
    causal: bool = False
    layout: str = "contiguous"   # or "zigzag"
    seed: int = 0

    def positions(self, world_size: int, rank: int) -> torch.Tensor:
        f = zigzag_positions if self.layout == "zigzag" else contiguous_positions
        return f(self.n, world_size, rank)

    def inputs(self):
        g = torch.Generator().manual_seed(self.seed)
        dt = getattr(torch, self.dtype)
        q = torch.randn(self.B, self.H_q, self.n, self.d, generator=g, dtype=torch.float64)
        k = torch.randn(self.B, self.H_kv, self.n, self.d, generator=g, dtype=torch.float64)
        v = torch.randn(self.B, self.H_kv, self.n, self.d, generator=g, dtype=torch.float64)
        return q.to(dt), k.to(dt), v.to(dt)

    def describe(self, world_size: int) -> str:
        return (f"'{self.name}' ({world_size} processes, n={self.n}, H_q={self.H_q}, "
                f"H_kv={self.H_kv}, d={self.d}, {self.dtype}, "
                f"{'causal, ' if self.causal else ''}{self.layout} shards)")
