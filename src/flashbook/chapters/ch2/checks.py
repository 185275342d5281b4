"""Chapter 2's graded checks, one per exercise (the graded test cells call them).

Outputs are compared by ``check.check_attention`` (O only: these kernels return no LSE) on
``AttnCase``s, each paired with the tile sizes it runs with; the canary and race runs are the
chapter's own (``probes``). Kernels with barriers run in the race checker first: a missing
``syncthreads`` gives wrong values in the simulator only now and then, while the race checker
names it every time. Hidden checks add cases and canaries, and GPU-sized cases on a GPU.
"""
from __future__ import annotations

import contextlib
import inspect
import io
import math
from typing import Callable

import numpy as np
import torch

from flashbook import check
from flashbook.cases import AttnCase
from flashbook.check import CheckFailure, assert_close
from flashbook.device import current
from flashbook.race import race_check

from . import probes
from .launch import (TiledConfig, Tiles, as_flat, launch_fa1, launch_fa2_rows, launch_fa2_tiled,
                     launch_tile_copy)


def _pair(name: str, B: int, H: int, N: int, d: int, tiles) -> tuple[AttnCase, object]:
    """(a float32 case (B, H, N, N, d), the tiles it runs with)."""
    return AttnCase(name, B=B, H_q=H, N_q=N, d=d), tiles


def _outputs(launch: Callable, pairs: list, *, title: str, hint: str, seed: int) -> int:
    """Every case with its tiles against the float64 reference; returns the number of runs."""
    tiles_of = dict(pairs)
    if len(tiles_of) != len(pairs):
        raise ValueError(f"{title}: a case is listed twice")

    def run(q, k, v, case, tiles):
        return probes.run(launch, q, k, v, tiles, what=probes.describe(title, case, tiles))
    return check.check_attention(run, list(tiles_of), title=title,
                                 configs=lambda case: (tiles_of[case],), returns_lse=False,
                                 hint=hint, seed=seed, quiet=True)


def _extra(canaries) -> str:
    return f" + {len(canaries)} canary check{'s' if len(canaries) > 1 else ''} + race check"


# Launch adapters: launch(q, k, v, tiles, buffers=None) -> O.
def _fa1(kernel):
    return lambda q, k, v, t, buffers=None: launch_fa1(kernel, q, k, v, t.Bc, buffers=buffers)


def _rows(factory):
    return lambda q, k, v, t, buffers=None: launch_fa2_rows(factory, q, k, v, t.Bc, t.br,
                                                            buffers=buffers)


def _tiled(factory):
    return lambda q, k, v, cfg, buffers=None: launch_fa2_tiled(factory, q, k, v, cfg,
                                                               buffers=buffers)


# --------------------------------------------------- warm-up: a tile through shared memory

_HINT_COPY = ("thread tx loads elements tx, tx + T, tx + 2T, ... of the block's T*d-element tile "
              "(zeros past row N), all threads wait at cuda.syncthreads(), then thread tx writes "
              "row b*T + tx of Y (if it is < N) from row tx of the tile.")

# (N, d, T): rows, columns, threads per block (= rows per tile)
COPY = [(8, 4, 4), (13, 3, 4), (3, 5, 8)]
COPY_HIDDEN = [(1, 1, 4), (33, 8, 16), (20, 6, 32)]
COPY_GPU = [(1000, 64, 128), (4099, 32, 64)]


def _copy_race(kernel, title: str):
    """One launch (two blocks, a tail of 2 rows) in the race checker, on exact-size buffers."""
    N, d, T = 6, 3, 4
    X = np.arange(N * d, dtype=np.float32)
    Y = np.full(N * d, np.nan, np.float32)
    what = f"{title}, N={N}, d={d}, T={T}, race check"
    check.run_student(race_check, kernel, (math.ceil(N / T),), (T,), (X, Y, N, d), 4 * T * d,
                      what=what, index_hint=probes.INDEX_HINT)
    assert_close(torch.from_numpy(Y).reshape(N, d), torch.from_numpy(X).reshape(N, d),
                 what=f"{what} (threads run one after another)", dims=("row", "col"),
                 dtype=torch.float32, hint=_HINT_COPY)


def _grown(visible: list, hidden_extra: list, gpu_extra: list, hidden: bool) -> list:
    """The visible cases, plus the hidden ones when ``hidden`` (and GPU-sized ones on a GPU)."""
    if not hidden:
        return list(visible)
    return visible + hidden_extra + (gpu_extra if current().gpu else [])


def check_tile_copy(kernel, hidden: bool = False):
    """The warm-up ``tile_copy_kernel(X, Y, N, d)``: Y = X through one shared T x d tile per
    block, a barrier between the loads and the stores, every row of any N copied, nothing past
    the end touched."""
    check.require_implemented(kernel, "tile_copy_kernel")
    title = "tile_copy_kernel"
    _copy_race(kernel, title)
    cases = _grown(COPY, COPY_HIDDEN, COPY_GPU, hidden)
    dev = current().device
    for k, (N, d, T) in enumerate(cases):
        what = f"{title}, N={N}, d={d}, T={T}"
        x = torch.randn(N, d, generator=torch.Generator().manual_seed(50 + k)).to(dev)
        y = check.run_student(launch_tile_copy, kernel, x, T, what=what,
                              index_hint=probes.INDEX_HINT)
        assert_close(y, x.double(), what=what, dims=("row", "col"), dtype=torch.float32,
                     hint=_HINT_COPY)
    # the canary run: one tile of canaries behind the last row; a store to rows >= N hits them
    N, d, T = 5, 4, 4
    x = torch.randn(N, d, generator=torch.Generator().manual_seed(59)).to(dev)
    X = torch.cat([x.reshape(-1), torch.full((T * d,), 1.0e4, device=dev)])
    Y = torch.cat([torch.zeros(N * d, device=dev), torch.full((T * d,), 777.0, device=dev)])
    what = f"{title}, N={N}, d={d}, T={T}, canary"
    check.run_student(launch_tile_copy, kernel, x, T, buffers=dict(X=as_flat(X), Y=as_flat(Y)),
                      what=what, index_hint=probes.INDEX_HINT)
    if current().gpu:
        torch.cuda.synchronize()
    hit = sorted({int(i) // d + N for i in torch.nonzero(Y[N * d:] != 777.0).flatten()})
    if hit:
        raise CheckFailure(f"{what}: the kernel wrote rows {hit[:8]}, past the end of Y (it has "
                           f"{N} rows; they held the canary 777.0). Store only rows < N.")
    assert_close(Y[:N * d].reshape(N, d), x.double(), what=what, dims=("row", "col"),
                 dtype=torch.float32, hint=_HINT_COPY)
    check.report(title, len(cases), " + canary check + race check", hidden=hidden)


# ------------------------------------------------------------------ Exercises 1 and 2: FA1

_HINT_FA1 = ("compare with flash.cu line by line: m and l are read before and written after each "
             "step, O is rescaled by l_prev * exp(m_prev - m_new) and the new block by "
             "exp(m_tile - m_new), both divided by l_new; S is scaled by 1/sqrt(d).")

# N a multiple of Bc: the literal port need not handle a tail.
LITERAL = [_pair("two heads, two tiles", 1, 2, 16, 4, Tiles(8)),
           _pair("two tiles of 16", 1, 1, 32, 8, Tiles(16)),
           _pair("batch of two", 2, 1, 16, 16, Tiles(8))]
LITERAL_HIDDEN = [_pair("three tiles", 1, 2, 48, 16, Tiles(16)),
                  _pair("one tile", 2, 2, 8, 8, Tiles(8)),
                  _pair("tiles of 4", 1, 1, 4, 32, Tiles(4))]
LITERAL_GPU = [_pair("GPU size", 2, 4, 256, 64, Tiles(32)),
               _pair("GPU, 16 tiles", 1, 2, 512, 32, Tiles(32))]


def check_fa1_literal(kernel, hidden: bool = False):
    """The literal port of flash.cu: correct when N is a multiple of the tile (Bc = Br)."""
    check.require_implemented(kernel, "fa1_literal_kernel")
    title = "fa1_literal_kernel"
    raced = probes.race("fa1", kernel, *_pair("race, two tiles", 1, 1, 16, 4, Tiles(8)), title)
    pairs = _grown(LITERAL, LITERAL_HIDDEN, LITERAL_GPU, hidden)
    n = _outputs(_fa1(kernel), pairs, title=title, hint=_HINT_FA1, seed=10)
    raced()
    check.report(title, n, " + race check", hidden=hidden)


_HINT_BOUNDS = ("a tail tile has fewer than Bc valid keys and Br valid queries: load 0 for rows >= N, "
                "give keys >= N the score -inf (so exp gives 0), and skip the O/l/m stores of rows >= N.")

BOUNDED = [_pair("tail of 5", 1, 2, 13, 4, Tiles(8)),
           _pair("one row", 1, 1, 1, 8, Tiles(8)),
           _pair("tail of 15", 1, 2, 31, 8, Tiles(16)),
           _pair("tail of 1", 1, 1, 33, 4, Tiles(16))]
BOUNDED_HIDDEN = [_pair("four tiles, tail of 2", 1, 1, 50, 8, Tiles(16)),
                  _pair("N < Bc, batch of two", 2, 1, 7, 16, Tiles(8)),
                  _pair("three heads", 1, 3, 17, 4, Tiles(4)),
                  _pair("no tail", 1, 1, 64, 8, Tiles(16))]
BOUNDED_GPU = [_pair("GPU size", 2, 3, 1000, 64, Tiles(32)),
               _pair("GPU, tail of 13", 1, 2, 333, 32, Tiles(32))]
BOUNDED_CANARIES = [_pair("tail of 5", 1, 2, 13, 4, Tiles(8))]
BOUNDED_CANARIES_HIDDEN = [_pair("batch of two, tail of 1", 2, 1, 33, 8, Tiles(16)),
                           _pair("N < Bc", 1, 1, 5, 4, Tiles(8))]


def check_fa1_bounded(kernel, hidden: bool = False):
    """The bounds-fixed FA1 kernel: correct for every N, neighbour head untouched."""
    check.require_implemented(kernel, "fa1_bounded_kernel")
    title = "fa1_bounded_kernel"
    raced = probes.race("fa1", kernel, *_pair("race, tail of 3", 1, 1, 11, 4, Tiles(8)), title)
    pairs = _grown(BOUNDED, BOUNDED_HIDDEN, BOUNDED_GPU, hidden)
    n = _outputs(_fa1(kernel), pairs, title=title, hint=_HINT_BOUNDS, seed=20)
    canaries = BOUNDED_CANARIES + (BOUNDED_CANARIES_HIDDEN if hidden else [])
    for case, tiles in canaries:
        probes.canary(_fa1(kernel), case, tiles, title, with_lm=True)
    raced()
    check.report(title, n, _extra(canaries), hidden=hidden)


# ------------------------------------------------------------- Exercise 3: launch config

def check_launch_config(smem_bytes: Callable, launch_config: Callable, hidden: bool = False):
    """``smem_bytes(Bc, Br, d)`` and ``launch_config(B, H, N, d, Bc=32, Br=32, max_smem=None)``."""
    table = [((32, 32, 64), 28672), ((32, 32, 128), 53248), ((16, 16, 16), 4096)]
    if hidden:
        table += [((8, 8, 4), 640), ((64, 32, 64), 57344), ((32, 64, 32), 20480)]
    for args, want in table:
        got = check.run_student(smem_bytes, *args, what="smem_bytes")
        if got != want:
            raise CheckFailure(f"smem_bytes(Bc={args[0]}, Br={args[1]}, d={args[2]}) = {got}, "
                               f"expected {want}: Qi, Kj, Vj are Bc x d floats each, S is Br x Bc "
                               "floats, and a float is 4 bytes.")

    def call(*args, **kw):    # launch_config's ValueError is an answer here, not a failure
        return check.run_student(launch_config, *args, what="launch_config",
                                 passthrough=(ValueError,), **kw)

    # A configuration that fits must come back with the right numbers and print nothing.
    fits = [(1, 8, 1024, 64, 32, 32, 49152), (2, 3, 13, 16, 8, 8, 49152)]
    if hidden:
        fits += [(1, 1, 1, 128, 32, 32, 99 * 1024), (4, 2, 100, 8, 16, 16, 4096)]
    for B, H, N, d, Bc, Br, lim in fits:
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            try:
                cfg = call(B, H, N, d, Bc=Bc, Br=Br, max_smem=lim)
            except ValueError as e:
                raise CheckFailure(f"launch_config(B={B}, H={H}, N={N}, d={d}, Bc={Bc}, Br={Br}, "
                                   f"max_smem={lim}) raised ValueError({e}) but the kernel needs "
                                   f"{smem_bytes(Bc, Br, d)} B, which fits in max_smem={lim} B "
                                   "(a device that allows more must be able to use it).") from None
        if printed.getvalue():
            raise CheckFailure(f"launch_config printed {printed.getvalue().strip()!r}: a library must "
                               "not print on every call (flash.cu's printf); return or raise.")
        want = dict(grid=(B, H), block=Bc, smem=smem_bytes(Bc, Br, d), Tc=math.ceil(N / Bc),
                    Tr=math.ceil(N / Br))
        for key, val in want.items():
            got = getattr(cfg, key, None)
            if got != val:
                raise CheckFailure(f"launch_config(B={B}, H={H}, N={N}, d={d}, Bc={Bc}, Br={Br}).{key}"
                                   f" = {got!r}, expected {val!r}.")
    # Configurations that do not fit must raise ValueError naming both numbers.
    too_big = [(1, 8, 1024, 128, 32, 32, 49152)]
    if hidden:
        too_big += [(1, 1, 64, 64, 64, 64, 49152), (1, 1, 16, 16, 16, 16, 4095)]
    for B, H, N, d, Bc, Br, lim in too_big:
        need = 4 * (3 * Bc * d + Bc * Br)
        try:
            call(B, H, N, d, Bc=Bc, Br=Br, max_smem=lim)
        except ValueError as e:
            msg = str(e)
            if str(need) not in msg.replace(",", "") or str(lim) not in msg.replace(",", ""):
                raise CheckFailure(f"launch_config raised ValueError({msg!r}) for d={d}, Bc={Bc}, "
                                   f"Br={Br}, max_smem={lim}: say how much shared memory is needed "
                                   f"({need} B) and how much the device allows ({lim} B).") from None
            continue
        raise CheckFailure(f"launch_config(B={B}, H={H}, N={N}, d={d}, Bc={Bc}, Br={Br}, "
                           f"max_smem={lim}) did not raise: the kernel needs {need} B of shared memory, "
                           f"more than {lim} B, so the launch would fail (and flash.cu would "
                           "silently return zeros). Raise ValueError.")
    # Arguments that make no sense must raise ValueError too.
    nonsense = [dict(B=0, H=1, N=16, d=16), dict(B=1, H=1, N=16, d=16, Bc=0, Br=0),
                dict(B=1, H=1, N=16, d=16, Bc=16, Br=8),                          # Bc != Br
                dict(B=1, H=1, N=16, d=16, Bc=2048, Br=2048, max_smem=10**9)]     # > 1024 threads
    if hidden:
        nonsense += [dict(B=1, H=1, N=-3, d=16)]
    for kw in nonsense:
        try:
            call(**kw)
        except ValueError:
            continue
        raise CheckFailure(f"launch_config({', '.join(f'{a}={b}' for a, b in kw.items())}) did not "
                           "raise ValueError: check the arguments (positive sizes, Bc == Br as the "
                           "kernel assumes, at most 1024 threads per block).")
    check.report("smem_bytes + launch_config", len(table) + len(fits) + len(too_big) + len(nonsense), hidden=hidden)


# ----------------------------------------------------------- Exercises 4 and 5: FA2 order

FA2_PARAMS = ["Q", "K", "V", "N", "scale", "O"]


def _check_params(factory, args, what):
    """The factory returns a kernel taking (Q, K, V, N, scale, O): no l, m in global memory."""
    kern = check.run_student(factory, *args, what=what)
    if kern is None:
        raise CheckFailure(f"{what} returned None: it must return the @cuda.jit kernel.")
    params = list(inspect.signature(getattr(kern, "py_func", kern)).parameters)
    if len(params) != len(FA2_PARAMS):
        raise CheckFailure(f"the kernel from {what} takes ({', '.join(params)}); it must take exactly "
                           f"({', '.join(FA2_PARAMS)}). In FA2 order m, l and the output "
                           "accumulator stay on chip: there are no l, m arrays in global memory.")


_HINT_ROWS = ("per K/V tile: m_new = max(m, rowmax(S)), rescale l and acc by exp(m - m_new), add "
              "exp(S - m_new) and exp(S - m_new) @ V; divide acc by l once, at the end.")

ROWS = [_pair("tail of 5", 1, 2, 13, 4, Tiles(8, 8)),
        _pair("one row", 1, 1, 1, 8, Tiles(8, 8)),
        _pair("Bc > Br", 1, 1, 33, 8, Tiles(16, 8)),
        _pair("Br > Bc, batch of two", 2, 1, 31, 4, Tiles(8, 16))]
ROWS_HIDDEN = [_pair("d=16", 1, 1, 50, 16, Tiles(16, 16)),
               _pair("three heads", 1, 3, 17, 4, Tiles(4, 8)),
               _pair("no tail", 2, 2, 32, 8, Tiles(8, 8)),
               _pair("Br < Bc, d=32", 1, 1, 40, 32, Tiles(8, 4))]
ROWS_GPU = [_pair("GPU size", 2, 3, 1000, 64, Tiles(32, 32)),
            _pair("GPU, d=128", 1, 2, 300, 128, Tiles(32, 64))]


def check_fa2_rows(factory, hidden: bool = False):
    """The FA2-order kernel from ``make_fa2_rows(d, Bc)``: Q tiles in the grid, m/l/acc on chip."""
    check.require_implemented(factory, "make_fa2_rows")
    _check_params(factory, (8, 8), "make_fa2_rows")
    title = "make_fa2_rows"
    raced = probes.race("rows", factory, *_pair("race, tail of 4", 1, 1, 12, 4, Tiles(8, 4)), title)
    pairs = _grown(ROWS, ROWS_HIDDEN, ROWS_GPU, hidden)
    n = _outputs(_rows(factory), pairs, title=title, hint=_HINT_ROWS, seed=30)
    canaries = [_pair("tail of 5", 1, 2, 13, 4, Tiles(8, 8))]
    if hidden:
        canaries += [_pair("Br > Bc", 1, 1, 21, 8, Tiles(8, 16))]
    for case, tiles in canaries:
        probes.canary(_rows(factory), case, tiles, title, with_lm=False)
    raced()
    check.report(title, n, _extra(canaries), hidden=hidden)


_HINT_TILED = ("check each thread's rows/columns mapping, the row max across the threads that "
               "share a row, and the masking of keys >= N in the last tile.")

TILED = [_pair("tail, 2x2 micro-tiles", 1, 2, 13, 8, TiledConfig(8, 8, 2, 2)),
         _pair("d=16", 1, 1, 37, 16, TiledConfig(16, 16, 2, 2)),
         _pair("TM != TN", 1, 1, 20, 8, TiledConfig(16, 8, 4, 2))]
TILED_HIDDEN = [_pair("one row, batch of two", 2, 1, 1, 8, TiledConfig(8, 8, 2, 2)),
                _pair("BN > BM", 1, 1, 24, 16, TiledConfig(8, 16, 2, 4)),
                _pair("d=4", 1, 2, 9, 4, TiledConfig(4, 4, 2, 2))]
TILED_GPU = [_pair("GPU size", 2, 3, 1000, 64, TiledConfig(64, 32, 4, 4)),
             _pair("GPU, d=128", 1, 2, 257, 128, TiledConfig(32, 16, 4, 2)),
             _pair("GPU, d=32", 1, 2, 130, 32, TiledConfig(32, 32, 4, 4))]


def check_fa2_tiled(factory, hidden: bool = False):
    """The register-tiled kernel from ``make_fa2_tiled(d, BM, BN, TM, TN)``: any N, several tiles."""
    check.require_implemented(factory, "make_fa2_tiled")
    _check_params(factory, (8, 8, 8, 2, 2), "make_fa2_tiled")
    title = "fa2_tiled"
    raced = probes.race("tiled", factory,
                        *_pair("race, tail of 2", 1, 1, 10, 8, TiledConfig(8, 8, 2, 2)), title)
    pairs = _grown(TILED, TILED_HIDDEN, TILED_GPU, hidden)
    n = _outputs(_tiled(factory), pairs, title=title, hint=_HINT_TILED, seed=40)
    canaries = [_pair("tail of 3", 1, 2, 11, 8, TiledConfig(8, 8, 2, 2))]
    for case, cfg in canaries:
        probes.canary(_tiled(factory), case, cfg, title, with_lm=False)
    raced()
    check.report(title, n, _extra(canaries), hidden=hidden)
