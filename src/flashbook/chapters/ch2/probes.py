"""Chapter 2's own probes, beyond comparing outputs with the reference.

* The **canary** run: the flat buffers get one extra "neighbour head" behind the last one (huge
  Q, K, V; canary values in O, l, m). A tail tile that loads or stores rows >= N reads or
  overwrites that head, which is what such a kernel does to the next head of a real batch.
* The **race** run: ``race.race_check`` executes one launch thread by thread (the Numba
  simulator runs threads concurrently and is no race detector: a missing barrier there gives
  wrong values only now and then), then the output is compared.

A ``launch`` here is ``launch(q, k, v, tiles, buffers=None) -> O`` (see ``checks``).
"""
from __future__ import annotations

import math
from typing import Callable

import numpy as np
import torch

from flashbook import check
from flashbook.cases import AttnCase, expected, make_inputs
from flashbook.check import CheckFailure, assert_close
from flashbook.device import current
from flashbook.race import race_check

from .launch import as_flat, fa1_smem_bytes, rows_kernel, tiled_kernel

#: Why a simulated kernel indexes past an array, in this chapter: the tail tile.
INDEX_HINT = ("In flash.cu's tail tile, threads whose row is >= N still load and store: guard every "
              "global load and store with the row (or key) index < N.")

DIMS = ("b", "h", "row", "col")


def describe(title: str, case: AttnCase, tiles) -> str:
    """What a failure message starts with (check.check_attention's form)."""
    return f"{title}, case {case.describe()}, {tiles}"


def run(launch: Callable, q, k, v, tiles, *, what: str, buffers=None):
    """``launch`` through check.run_student, with the chapter's hint for an index past an array."""
    return check.run_student(launch, q, k, v, tiles, buffers=buffers, what=what,
                             index_hint=INDEX_HINT)


# ----------------------------------------------------------------------------- canary

def canary_buffers(q, k, v, *, with_lm: bool, fill: float = 1.0e4) -> dict:
    """Flat buffers one head longer than q, k, v (B, H, N, d): the extra 'neighbour head' holds
    huge Q/K/V values (reading them wrecks the softmax) and canaries: O 777, l 555, m 333."""
    B, H, N, d = q.shape
    dev = q.device
    extra = N * d

    def padded(t, value):
        return torch.cat([t.reshape(-1), torch.full((extra,), value, device=dev)])

    bufs = {"Q": padded(q, fill), "K": padded(k, fill), "V": padded(v, fill),
            "O": torch.cat([torch.zeros(B * H * N * d, device=dev),
                            torch.full((extra,), 777.0, device=dev)])}
    if with_lm:
        bufs["l"] = torch.cat([torch.zeros(B * H * N, device=dev), torch.full((N,), 555.0, device=dev)])
        bufs["m"] = torch.cat([torch.full((B * H * N,), -math.inf, device=dev),
                               torch.full((N,), 333.0, device=dev)])
    return bufs


def canary(launch: Callable, case: AttnCase, tiles, title: str, *, with_lm: bool):
    """Run with a neighbour head behind the last one: its O (and l, m) rows must stay untouched
    and the real heads' O must be right."""
    q, k, v = make_inputs(case, 1234)
    bufs = canary_buffers(q, k, v, with_lm=with_lm)
    what = f"{describe(title, case, tiles)}, canary"
    run(launch, q, k, v, tiles, what=what, buffers={n: as_flat(t) for n, t in bufs.items()})
    if current().gpu:
        torch.cuda.synchronize()
    B, H, N, d = q.shape
    changed = torch.nonzero(bufs["O"][B * H * N * d:] != 777.0).flatten()
    if changed.numel():
        rows = sorted({int(i) // d for i in changed})
        raise CheckFailure(
            f"{what}: the kernel wrote into the NEXT head's output rows {rows[:10]} (they held the "
            "canary 777.0). Threads of the last tile whose row is >= N still store O: in a real "
            "batch those rows belong to the neighbouring head (a race between two blocks). Store "
            "only rows < N.")
    for name, value in (("l", 555.0), ("m", 333.0)):
        if name in bufs:
            bad = torch.nonzero(bufs[name][B * H * N:] != value).flatten().tolist()
            if bad:
                raise CheckFailure(f"{what}: the kernel wrote {name} of the NEXT head's rows "
                                   f"{bad[:10]}. Store {name} only for rows < N.")
    assert_close(bufs["O"][:B * H * N * d].reshape(B, H, N, d), expected(case, q, k, v)[0],
                 what=f"{what} (with a neighbour head of huge values after the last head)",
                 dims=DIMS, dtype=torch.float32,
                 hint="rows past N in the last K/V tile belong to the next head: load zeros there "
                      "and give those columns a score of -inf so they get no weight.")


# ------------------------------------------------------------------------------- race

def race(kind: str, kernel, case: AttnCase, tiles, title: str) -> Callable[[], None]:
    """Run one launch in the race checker: a race or a divergent barrier fails now, with a
    message that says which threads and which shared word. Returns the comparison of that run's
    output with the reference, to call once the ordinary outputs passed (a kernel that is wrong
    without racing must fail there, with their hint, not here).

    ``kind``: "fa1" (``kernel`` is the kernel, Tiles), "rows" (the make_fa2_rows factory,
    Tiles) or "tiled" (the make_fa2_tiled factory, a TiledConfig).
    """
    q, k, v = make_inputs(case, 99, device="cpu")
    B, H, N, d = q.shape
    scale = np.float32(1.0 / math.sqrt(d))
    Q, K, V = (t.reshape(-1).numpy().copy() for t in (q, k, v))     # flat (B*H*N*d,)
    O = np.zeros(B * H * N * d, np.float32)
    if kind == "fa1":
        T = math.ceil(N / tiles.Bc)
        l, m = np.zeros(B * H * N, np.float32), np.full(B * H * N, -np.inf, np.float32)
        launch = (kernel, (B, H), (tiles.Bc,), (Q, K, V, N, d, T, T, tiles.Bc, tiles.Bc, scale, l, m, O),
                  fa1_smem_bytes(tiles.Bc, tiles.Bc, d))
    elif kind == "rows":
        launch = (rows_kernel(kernel, d, tiles.Bc), (math.ceil(N / tiles.br), B * H), (tiles.br,),
                  (Q, K, V, N, scale, O), 0)
    elif kind == "tiled":
        launch = (tiled_kernel(kernel, d, tiles), (math.ceil(N / tiles.BM), B * H), tiles.threads,
                  (Q, K, V, N, scale, O), 0)
    else:
        raise ValueError(f"kind must be 'fa1', 'rows' or 'tiled', got {kind!r}")
    what = f"{describe(title, case, tiles)}, race check"
    check.run_student(race_check, *launch, what=what, index_hint=INDEX_HINT)

    def compare():
        assert_close(torch.from_numpy(O).reshape(B, H, N, d), expected(case, q, k, v)[0],
                     what=f"{what} (threads run one after another)", dims=DIMS,
                     dtype=torch.float32,
                     hint="a result that changes when threads run in another order is a race.")
    return compare
