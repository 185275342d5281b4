"""Launching Chapter 2's kernels: tensors to flat buffers, launch shapes, shared-memory sizes.

The kernels work on flat (1-D) float32 buffers, as flash.cu does with raw pointers: element
(b, h, n, x) of a (B, H, N, d) tensor sits at ``((b * H + h) * N + n) * d + x``. The launchers
validate the tensors (``validate_qkv``), allocate the outputs and launch with the chapter's grid
and block; ``buffers=`` lets a check pass oversized flat buffers instead (the canary run).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable

import numpy as np
import torch

from flashbook import cases
from flashbook.check import CheckFailure, is_stub
from flashbook.device import current

#: Dynamic shared memory a Numba kernel may ask for at launch. Every CUDA GPU since Kepler allows
#: 48 KiB per block without an opt-in (cudaFuncSetAttribute), and Numba has no opt-in.
DEFAULT_SMEM_LIMIT = 48 * 1024

#: Largest head dimension the chapter's kernels accept (their local arrays are sized by it).
D_MAX = 128


def validate_qkv(q, k, v, *, name: str = "attention") -> tuple[int, int, int, int]:
    """``cases.validate_qkv`` with this chapter's rules: q, k, v of one shape (B, H, N, d),
    float32, contiguous (the kernels index flat row-major buffers), not empty, 1 <= d <= D_MAX.
    Raises ValueError saying what is wrong; returns (B, H, N, d)."""
    B, H, _, N, _, d = cases.validate_qkv(q, k, v, name=name, dtypes=(torch.float32,),
                                          d_max=D_MAX, contiguous="all", same_shape=True,
                                          allow_empty=False)
    return B, H, N, d


def as_flat(t: torch.Tensor):
    """A flat view a Numba kernel can take: a numpy array on CPU (the simulator), a device
    array sharing the tensor's memory on a GPU. No copy either way."""
    flat = t.reshape(-1)
    if flat.device.type == "cpu":
        return flat.numpy()
    # numba reads NUMBA_ENABLE_CUDASIM when first imported: import it only once setup() ran
    from numba import cuda
    return cuda.as_cuda_array(flat.detach(), sync=False)


def _refuse_stub(obj, what: str):
    """Launchers raise NotImplementedError for a stub (the notebook's demos catch it) instead of
    launching it: in the simulator a stub kernel fails obscurely, in its threads."""
    if is_stub(obj):
        raise NotImplementedError(f"{what} is still the stub (raise NotImplementedError).")


@dataclasses.dataclass(frozen=True)
class Tiles:
    """Tile rows of the FA1 and FA2-rows kernels: Bc keys (threads per block in FA1), Br
    queries (threads per block in FA2-rows; FA1 uses Br = Bc)."""
    Bc: int = 32
    Br: int | None = None     # None: Br = Bc

    @property
    def br(self) -> int:
        return self.Bc if self.Br is None else self.Br

    def __str__(self):
        return f"Bc={self.Bc}" + (f", Br={self.Br}" if self.Br is not None else "")


# ------------------------------------------------------------ warm-up: a tile copy

def launch_tile_copy(kernel, x: torch.Tensor, T: int = 32, *, buffers: dict | None = None):
    """Run the warm-up kernel ``kernel(X, Y, N, d)`` on a contiguous float32 ``x`` of shape (N, d).

    Grid ceil(N / T): block b copies rows b*T ... b*T + T - 1; T threads per block; dynamic
    shared memory for one T x d tile (4 * T * d bytes). Returns Y, a (N, d) tensor (None when
    ``buffers`` supplies the flat X and Y, e.g. one tile longer for the canary run).
    """
    _refuse_stub(kernel, "tile_copy_kernel")
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype != torch.float32 \
            or not x.is_contiguous() or x.numel() == 0:
        raise ValueError("launch_tile_copy: x must be a non-empty contiguous float32 (N, d) tensor.")
    if not 1 <= T <= 1024 or 4 * T * x.shape[1] > DEFAULT_SMEM_LIMIT:
        raise ValueError(f"launch_tile_copy: T={T} threads and a {T} x {x.shape[1]} tile do not fit "
                         f"one block (at most 1024 threads, {DEFAULT_SMEM_LIMIT} B of shared memory).")
    N, d = x.shape
    if buffers is None:
        y = torch.full_like(x, math.nan)
        bufs = dict(X=as_flat(x), Y=as_flat(y))
    else:
        y, bufs = None, buffers
    kernel[math.ceil(N / T), T, 0, 4 * T * d](bufs["X"], bufs["Y"], N, d)
    return y


# ---------------------------------------------------------------------- FA1 (flash.cu)

def fa1_smem_bytes(Bc: int, Br: int, d: int) -> int:
    """Dynamic shared memory flash.cu asks for: Qi, Kj, Vj (Bc x d each) and S (Br x Bc), float32."""
    return 4 * (3 * Bc * d + Bc * Br)


def launch_fa1(kernel, q, k, v, Bc: int = 32, *, grid=None, smem: int | None = None,
               buffers: dict | None = None, check: bool = True):
    """Run a flash.cu-shaped kernel ``kernel(Q, K, V, N, d, Tc, Tr, Bc, Br, scale, l, m, O)``.

    Like flash.cu's host code: grid (B, H), one block of Bc threads per (batch, head), Br = Bc,
    l = 0 and m = -inf in global memory, O = 0. Returns O as a (B, H, N, d) tensor (None when
    ``buffers`` supplies the flat Q, K, V, l, m, O arrays, e.g. oversized for the canary run).
    """
    _refuse_stub(kernel, "the FA1 kernel")
    if check:
        validate_qkv(q, k, v, name="launch_fa1")
    B, H, N, d = q.shape
    Br = Bc
    Tc = Tr = math.ceil(N / Bc)
    scale = np.float32(1.0 / math.sqrt(d))
    if buffers is None:
        O = torch.zeros_like(q)
        l = torch.zeros(B, H, N, device=q.device)
        m = torch.full((B, H, N), -math.inf, device=q.device)
        bufs = dict(Q=as_flat(q), K=as_flat(k), V=as_flat(v), l=as_flat(l), m=as_flat(m), O=as_flat(O))
    else:
        O, bufs = None, buffers
    smem = fa1_smem_bytes(Bc, Br, d) if smem is None else smem
    grid = grid or (B, H)
    kernel[grid, Bc, 0, smem](bufs["Q"], bufs["K"], bufs["V"], N, d, Tc, Tr, Bc, Br, scale,
                              bufs["l"], bufs["m"], bufs["O"])
    return O


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """How flash.cu's kernel is launched (Exercise 3 fills one in)."""
    grid: tuple      # (B, H): one block per (batch, head)
    block: int       # threads per block (= Bc, one per row)
    smem: int        # dynamic shared memory in bytes
    Tc: int          # number of K/V tiles
    Tr: int          # number of Q tiles


# ----------------------------------------------------------------- FA2 order, factories

def _compiled(cache: dict, factory: Callable, what: str, *args):
    """``factory(*args)`` (a kernel specialised for these sizes), built once per arguments."""
    _refuse_stub(factory, what)
    key = (factory, *args)
    if key not in cache:
        kern = factory(*args)
        if kern is None:
            raise CheckFailure(f"{what} returned None: it must return the @cuda.jit kernel.")
        cache[key] = kern
    return cache[key]


_ROWS_CACHE: dict = {}
_TILED_CACHE: dict = {}


def rows_kernel(factory: Callable, d: int, Bc: int):
    """``factory(d, Bc)``, compiled once per (factory, d, Bc)."""
    return _compiled(_ROWS_CACHE, factory, "make_fa2_rows", d, Bc)


def _fa2_buffers(q, k, v, buffers):
    """(O, flat buffers) for an FA2 launch: a fresh O, or the caller's buffers (canary runs)."""
    if buffers is not None:
        return None, buffers
    O = torch.empty_like(q)
    return O, dict(Q=as_flat(q), K=as_flat(k), V=as_flat(v), O=as_flat(O))


def launch_fa2_rows(factory, q, k, v, Bc: int = 32, Br: int = 64, *, buffers=None, check=True):
    """Run the FA2-order kernel ``factory(d, Bc)(Q, K, V, N, scale, O)``.

    Grid (ceil(N / Br), B * H): block x is a tile of Br query rows, block y a (batch, head);
    Br threads per block, one per query row. The kernel's K and V tiles (Bc x d each) are static
    shared arrays. There are no l or m arrays: they live in registers.
    """
    if check:
        validate_qkv(q, k, v, name="launch_fa2_rows")
    if not (1 <= Bc <= 128 and 1 <= Br <= 1024):
        raise ValueError(f"launch_fa2_rows: need 1 <= Bc <= 128 and 1 <= Br <= 1024, got Bc={Bc}, Br={Br}.")
    B, H, N, d = q.shape
    if 8 * Bc * d > DEFAULT_SMEM_LIMIT:
        raise ValueError(f"launch_fa2_rows: K and V tiles need {8 * Bc * d} B of shared memory "
                         f"(Bc={Bc}, d={d}), more than {DEFAULT_SMEM_LIMIT} B; use a smaller Bc.")
    kern = rows_kernel(factory, d, Bc)
    scale = np.float32(1.0 / math.sqrt(d))
    O, bufs = _fa2_buffers(q, k, v, buffers)
    kern[(math.ceil(N / Br), B * H), Br](bufs["Q"], bufs["K"], bufs["V"], N, scale, bufs["O"])
    return O


@dataclasses.dataclass(frozen=True)
class TiledConfig:
    """Tile shape of the register-tiled kernel.

    A block computes BM query rows against BN keys at a time with (BN // TN) x (BM // TM)
    threads; thread (tx, ty) owns score rows ty + (BM // TM) * r (r < TM), score columns
    tx + (BN // TN) * c (c < TN) and output columns tx + (BN // TN) * c (c < d // (BN // TN)).
    """
    BM: int = 64
    BN: int = 32
    TM: int = 4
    TN: int = 4

    @property
    def threads(self) -> tuple[int, int]:
        return self.BN // self.TN, self.BM // self.TM

    def smem_bytes(self, d: int) -> int:
        """Q (BM x d+1), K (BN x d+1), V (BN x d), P (BM x BN), partial maxima (BM x BN//TN)."""
        ntx = self.BN // self.TN
        return 4 * (self.BM * (d + 1) + self.BN * (d + 1) + self.BN * d + self.BM * self.BN
                    + self.BM * ntx)

    def validate(self, d: int):
        ntx, nty = self.threads
        problems = []
        if self.BM % self.TM or self.BN % self.TN:
            problems.append("BM must be a multiple of TM and BN of TN")
        elif d % ntx:
            problems.append(f"d={d} must be a multiple of BN // TN = {ntx}")
        elif ntx * nty > 1024:
            problems.append(f"{ntx * nty} threads per block > 1024")
        if self.smem_bytes(d) > DEFAULT_SMEM_LIMIT:
            problems.append(f"needs {self.smem_bytes(d)} B of shared memory > {DEFAULT_SMEM_LIMIT} B")
        if problems:
            raise ValueError(f"tiled config {self} with d={d}: " + "; ".join(problems) + ".")


def tiled_config(d: int, gpu: bool | None = None) -> TiledConfig:
    """The tile shape the chapter uses for head dimension d (small tiles in the simulator)."""
    gpu = current().gpu if gpu is None else gpu
    if not gpu:
        return TiledConfig(16, 16, 2, 2) if d % 8 == 0 else TiledConfig(8, 8, 2, 2)
    if d <= 64 and d % 8 == 0:
        return TiledConfig(64, 32, 4, 4)
    if d % 8 == 0:
        return TiledConfig(32, 16, 4, 2)
    return TiledConfig(16, 8, 2, 2) if d % 4 == 0 else TiledConfig(8, 2, 2, 2)


def tiled_kernel(factory: Callable, d: int, cfg: TiledConfig):
    """``factory(d, BM, BN, TM, TN)``, compiled once per (factory, d, config)."""
    return _compiled(_TILED_CACHE, factory, "make_fa2_tiled", d, cfg.BM, cfg.BN, cfg.TM, cfg.TN)


def launch_fa2_tiled(factory, q, k, v, cfg: TiledConfig | None = None, *, buffers=None, check=True):
    """Run the register-tiled kernel ``factory(d, BM, BN, TM, TN)(Q, K, V, N, scale, O)``.

    Grid (ceil(N / BM), B * H), block (BN // TN, BM // TM); static shared memory only.
    """
    if check:
        validate_qkv(q, k, v, name="launch_fa2_tiled")
    B, H, N, d = q.shape
    cfg = cfg or tiled_config(d)
    cfg.validate(d)
    kern = tiled_kernel(factory, d, cfg)
    scale = np.float32(1.0 / math.sqrt(d))
    O, bufs = _fa2_buffers(q, k, v, buffers)
    kern[(math.ceil(N / cfg.BM), B * H), cfg.threads](bufs["Q"], bufs["K"], bufs["V"], N, scale,
                                                      bufs["O"])
    return O
