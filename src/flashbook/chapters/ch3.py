"""Chapter 3 helpers: launch wrappers that validate inputs, the tile configs the chapter picks
per GPU, graded checks for the three exercises, and the online-softmax pictures.

The student writes Triton kernels with fixed signatures; the wrappers here launch them, so a
check, a benchmark and the book all launch a kernel the same way.
"""
from __future__ import annotations

import dataclasses
import itertools
import math

import torch

from .. import oob, reference
from ..check import CheckFailure, _report, assert_close
from ..device import current

LOG2E = 1.4426950408889634      # log2(e): exp(x) = exp2(x * LOG2E)
HEAD_DIMS = (16, 32, 64, 128)
DTYPES = (torch.float16, torch.float32)


# ------------------------------------------------------------------------ tile configs

@dataclasses.dataclass(frozen=True)
class Config:
    """Launch parameters of the attention kernel: tile sizes and the compiler's knobs."""
    BLOCK_M: int      # query rows per program (the Q tile stays in registers)
    BLOCK_N: int      # keys per step of the loop (K and V tiles stream through shared memory)
    num_warps: int    # 4 warps = one Hopper warpgroup; 8 = two
    num_stages: int   # how many K/V tiles the software pipeline keeps in flight


# Shared memory a block may use, by compute capability (bytes).
SMEM_LIMIT = {(7, 5): 64 * 1024, (8, 0): 163 * 1024, (8, 6): 99 * 1024, (8, 9): 99 * 1024,
              (9, 0): 227 * 1024}


def pick_config(d: int, dtype: torch.dtype, capability: tuple | None,
                two_tiles: bool = False) -> Config:
    """The tile config the chapter uses for head dim ``d`` and ``dtype`` on a GPU of this
    compute capability (None: CPU interpreter, where small tiles exercise the tail masks).
    ``two_tiles``: the config of ``attn_fwd_two_tiles``, whose BLOCK_M covers both query tiles.

    Measured on an H200 (src/flashbook/data/bench/ch3); the sm_75/sm_80 entries are chosen to
    fit those GPUs' shared memory (tests/test_ch3.py compiles every one ahead of time). Where the
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
    if cc >= (8, 0):                                # sm_86 / sm_89: about 100 KB
        return Config(128, 64, 4, 2) if d <= 64 else Config(64, 64, 4, 2)
    return Config(64, 64, 4, 2) if d <= 64 else Config(64, 32, 4, 2)   # T4: 64 KB


# ---------------------------------------------------------------------------- wrappers

def _validate(name, t, *, dims, dtypes=DTYPES, device=None):
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}.")
    if t.dim() != dims:
        raise ValueError(f"{name} must have {dims} dimensions, got shape {tuple(t.shape)}.")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} has dtype {t.dtype}; this kernel takes "
                         f"{', '.join(str(d) for d in dtypes)}.")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device} but the other inputs are on {device}.")
    want = current().device
    if t.device.type != want:
        raise ValueError(f"{name} is on {t.device.type}, but this runtime runs kernels on {want} "
                         f"({current().kind}); move it with .to('{want}').")
    if t.numel() and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension (stride(-1) == 1), got "
                         f"strides {t.stride()}; call .contiguous() first.")


def softmax_rows(kernel, x: torch.Tensor, block: int = 32):
    """Launch ``kernel`` (Exercise 1) on every row of ``x`` (..., n): returns (y, lse).

    y has x's shape and dtype; lse (natural log, float32) has shape x.shape[:-1].
    Kernel signature: kernel[(rows,)](X, Y, LSE, n_cols, stride_x, stride_y, BLOCK=block).
    """
    import triton
    if isinstance(x, torch.Tensor) and x.dim() == 0:
        raise ValueError("x must have at least one dimension (the softmax axis).")
    _validate("x", x, dims=x.dim() if isinstance(x, torch.Tensor) else 2)
    if block < 1 or block & (block - 1):
        raise ValueError(f"block must be a power of two, got {block}.")
    rows = x.reshape(-1, x.shape[-1]) if x.numel() else x.reshape(-1, max(x.shape[-1], 1))
    n_rows, n_cols = rows.shape
    y = torch.empty_like(rows)
    lse = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    if n_rows and n_cols:
        kernel[(n_rows,)](rows, y, lse, n_cols, rows.stride(0), y.stride(0), BLOCK=block)
    return y.reshape(x.shape), lse.reshape(x.shape[:-1])


def attention_forward(kernel, q, k, v, scale: float | None = None, config: Config | None = None,
                      two_tiles: bool = False):
    """Launch ``kernel`` (Exercise 2, or ``attn_fwd_two_tiles`` with ``two_tiles``) on
    q (B, H, N_q, d), k and v (B, H, N_k, d).

    Returns O (B, H, N_q, d) in q's dtype and LSE (B, H, N_q) in natural log, float32.
    ``config`` defaults to ``pick_config`` for this GPU (or the CPU interpreter).
    """
    import triton
    _validate("q", q, dims=4)
    _validate("k", k, dims=4, device=q.device)
    _validate("v", v, dims=4, device=q.device)
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}.")
    B, H, N_q, d = q.shape
    if k.shape[:2] != (B, H) or v.shape != k.shape or k.shape[-1] != d:
        raise ValueError(f"shapes do not match: q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}; expected k and v to be (B, H, N_k, d) with q's "
                         "B, H and d.")
    if d not in HEAD_DIMS:
        raise ValueError(f"head dim d={d} is not supported; use one of {HEAD_DIMS} "
                         "(tl.arange needs a power of two and tl.dot at least 16).")
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    if not scale > 0:
        raise ValueError(f"scale must be positive, got {scale}.")
    N_k = k.shape[2]
    cfg = config or pick_config(d, q.dtype, current().capability, two_tiles=two_tiles)
    rows = cfg.BLOCK_M // 2 if two_tiles else cfg.BLOCK_M          # rows of one query tile
    if min(rows, cfg.BLOCK_N) < 16 or (two_tiles and cfg.BLOCK_M % 2):
        raise ValueError(f"query and key tiles must be at least 16 (tl.dot needs 16 on a GPU), "
                         f"got BLOCK_M={cfg.BLOCK_M}{' (two tiles)' if two_tiles else ''}, "
                         f"BLOCK_N={cfg.BLOCK_N}.")
    o = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty((B, H, N_q), dtype=torch.float32, device=q.device)
    if N_k == 0:
        o.zero_()
        lse.fill_(float("-inf"))
        return o, lse
    if B * H * N_q == 0:
        return o, lse
    grid = (triton.cdiv(N_q, cfg.BLOCK_M), B * H)
    kernel[grid](q, k, v, o, lse,
                 q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                 v.stride(0), v.stride(1), v.stride(2), o.stride(0), o.stride(1), o.stride(2),
                 H, N_q, N_k, scale * LOG2E,
                 HEAD_DIM=d, BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N,
                 DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
                 num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return o, lse


def merge_states(kernel, o_a, lse_a, o_b, lse_b, block_r: int = 16):
    """Launch ``kernel`` (Exercise 3): merge two partial attention results over disjoint key sets.

    o_a, o_b: (..., d); lse_a, lse_b: (...) float32 natural log. Returns (o, lse).
    Kernel signature: kernel[grid](O_a, LSE_a, O_b, LSE_b, O, LSE, n_rows, HEAD_DIM=d, BLOCK_R=block_r).
    """
    import triton
    _validate("o_a", o_a, dims=o_a.dim() if isinstance(o_a, torch.Tensor) else 2)
    _validate("o_b", o_b, dims=o_a.dim(), device=o_a.device)
    for name, t in (("lse_a", lse_a), ("lse_b", lse_b)):
        _validate(name, t, dims=o_a.dim() - 1, dtypes=(torch.float32,), device=o_a.device)
        if tuple(t.shape) != tuple(o_a.shape[:-1]):
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(o_a.shape[:-1])}.")
    if o_a.shape != o_b.shape or o_a.dtype != o_b.dtype:
        raise ValueError(f"o_a {tuple(o_a.shape)} {o_a.dtype} and o_b {tuple(o_b.shape)} "
                         f"{o_b.dtype} must match.")
    d = o_a.shape[-1]
    if d not in HEAD_DIMS:
        raise ValueError(f"head dim d={d} is not supported; use one of {HEAD_DIMS}.")
    oa, ob = o_a.contiguous().reshape(-1, d), o_b.contiguous().reshape(-1, d)
    la, lb = lse_a.contiguous().reshape(-1), lse_b.contiguous().reshape(-1)
    n_rows = oa.shape[0]
    o = torch.empty_like(oa)
    lse = torch.empty_like(la)
    if n_rows:
        kernel[(triton.cdiv(n_rows, block_r),)](oa, la, ob, lb, o, lse, n_rows,
                                               HEAD_DIM=d, BLOCK_R=block_r)
    return o.reshape(o_a.shape), lse.reshape(lse_a.shape)


# ------------------------------------------------------------------------------ checks

def _seeded(shape, seed, dtype, scale=1.0, device=None):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(
        device=device or current().device, dtype=dtype)


def _guarded(fn, *args, what, **kwargs):
    import numpy as np
    try:
        with np.errstate(divide="ignore"):      # log(0) = -inf is intended (empty rows)
            return oob.call(fn, *args, what=what, **kwargs)
    except NotImplementedError:
        raise CheckFailure(f"{what}: not implemented yet (the stub still raises "
                           "NotImplementedError).") from None
    except ValueError as e:
        raise CheckFailure(f"{what}: the wrapper rejected the launch: {e}") from None


def _no_nan(t, what):
    if torch.isnan(t).any():
        raise CheckFailure(f"{what}: contains NaN. Typical causes: exp(-inf - (-inf)) in a row whose "
                           "running max is still -inf, 0 * NaN from an unmasked load of padding, "
                           "or 0/0 when a row's sum is 0.")


def softmax_cases(hidden: bool = False):
    inf = float("inf")
    cases = [
        ("random (4, 50), float32", _seeded((4, 50), 0, torch.float32, 3.0)),
        ("one column (3, 1)", _seeded((3, 1), 1, torch.float32)),
        ("large logits +-1e4 (2, 40)", torch.cat([_seeded((1, 40), 2, torch.float32, 1e4),
                                                  torch.full((1, 40), -1e4).to(current().device)])),
        ("-inf entries (2, 37)", _seeded((2, 37), 3, torch.float32).masked_fill(
            torch.arange(37, device=current().device) % 3 == 0, -inf)),
    ]
    if hidden:
        row = _seeded((3, 70), 4, torch.float32, 5.0)
        row[1] = -inf
        cases += [
            ("a row of only -inf (3, 70)", row),
            ("3-d float16 (2, 3, 45)", _seeded((2, 3, 45), 5, torch.float16, 4.0)),
            ("long rows (2, 300), logits up to 1e3", _seeded((2, 300), 6, torch.float32, 300.0)),
            ("increasing row (1, 100): the max changes every block",
             torch.linspace(-50, 50, 100, device=current().device)[None].float()),
        ]
    return cases


def check_softmax_kernel(kernel, hidden: bool = False, blocks=(16, 32, 64)):
    """Exercise 1: y = softmax(x) and lse = logsumexp(x) along the last axis, for every block size.

    A row of only -inf must give y = 0 and lse = -inf. Results must not depend on BLOCK.
    """
    n = 0
    for name, x in softmax_cases(hidden):
        x = oob.embed(x.contiguous(), pad=256)
        want_y = reference.softmax(x.double())
        want_l = reference.logsumexp(x.double())
        outs = []
        for block in blocks:
            what = f"softmax kernel, case {name}, BLOCK={block}"
            y, lse = _guarded(softmax_rows, kernel, x, block=block, what=what)
            if y.dtype != x.dtype:
                raise CheckFailure(f"{what}: y has dtype {y.dtype}, expected {x.dtype}.")
            _no_nan(y, what + ", y")
            _no_nan(lse, what + ", lse")
            dims = [f"axis{i}" for i in range(x.dim() - 2)] + ["row", "col"]
            assert_close(y, want_y, what=what + ", y", dims=dims, dtype=x.dtype,
                         atol=1e-3 if x.dtype == torch.float16 else None,
                         hint="keep a running max m and a running sum l; when m grows, multiply l "
                              "by exp(m_old - m_new) before adding the new block's terms.")
            assert_close(lse, want_l, what=what + ", lse", dims=dims[:-1], dtype=torch.float32,
                         atol=1e-4, rtol=1e-5,
                         hint="lse = m + log(l) in natural log; a row of only -inf has lse = -inf.")
            outs.append(y)
            n += 1
        for (b1, y1), (b2, y2) in itertools.combinations(zip(blocks, outs), 2):
            diff = (y1.double() - y2.double()).abs().max().item()
            if diff > (1e-3 if x.dtype == torch.float16 else 1e-5):
                raise CheckFailure(f"softmax kernel, case {name}: BLOCK={b1} and BLOCK={b2} differ "
                                   f"by {diff:.3g}; the online softmax is exact, so the block "
                                   "size must not change the result.")
    _report("online softmax kernel", n)


@dataclasses.dataclass(frozen=True)
class AttnCase:
    name: str
    B: int
    H: int
    N_q: int
    N_k: int
    d: int
    dtype: torch.dtype = torch.float32
    boost: float = 1.0
    scale: float | None = None
    strided: bool = False    # q, k, v as (B, N, H, d) tensors viewed as (B, H, N, d)

    def describe(self):
        dt = str(self.dtype).replace("torch.", "")
        extra = f", logits x{self.boost:g}" if self.boost != 1 else ""
        extra += f", scale={self.scale:g}" if self.scale is not None else ""
        extra += ", strided (B,N,H,d) layout" if self.strided else ""
        return (f"'{self.name}' (B={self.B}, H={self.H}, N_q={self.N_q}, N_k={self.N_k}, "
                f"d={self.d}, {dt}{extra})")


def attention_cases(hidden: bool = False):
    cases = [
        AttnCase("one tile", 1, 2, 16, 16, 16),
        AttnCase("tails: N not a multiple of the tile", 1, 2, 13, 37, 32),
        AttnCase("float16, d=64", 2, 1, 64, 64, 64, torch.float16),
        AttnCase("N=1", 1, 1, 1, 1, 16),
        AttnCase("large logits", 1, 1, 24, 40, 16, boost=60.0),
    ]
    if hidden:
        cases += [
            AttnCase("d=128 float16, large logits", 1, 1, 40, 72, 128, torch.float16, boost=6.0),
            AttnCase("d=128 float32", 1, 1, 17, 33, 128),
            AttnCase("more queries than keys", 1, 2, 45, 7, 32, torch.float16),
            AttnCase("explicit scale", 1, 1, 20, 50, 16, scale=0.3),
            AttnCase("strided inputs", 2, 2, 19, 19, 16, strided=True),
            AttnCase("float16, d=16, logits x8", 1, 3, 33, 65, 16, torch.float16, boost=8.0),
        ]
    return cases


def _make_attn(case: AttnCase, seed: int):
    dev = current().device
    if case.strided:
        q = _seeded((case.B, case.N_q, case.H, case.d), seed, case.dtype, case.boost).transpose(1, 2)
        k = _seeded((case.B, case.N_k, case.H, case.d), seed + 1, case.dtype).transpose(1, 2)
        v = _seeded((case.B, case.N_k, case.H, case.d), seed + 2, case.dtype).transpose(1, 2)
        return q, k, v
    q = oob.embed(_seeded((case.B, case.H, case.N_q, case.d), seed, case.dtype, case.boost),
                  pad=4096)
    k = oob.embed(_seeded((case.B, case.H, case.N_k, case.d), seed + 1, case.dtype), pad=4096)
    v = oob.embed(_seeded((case.B, case.H, case.N_k, case.d), seed + 2, case.dtype), pad=4096)
    assert q.device.type == dev
    return q, k, v


def check_attention_kernel(kernel, hidden: bool = False, configs=None, two_tiles: bool = False):
    """Exercise 2: the forward kernel returns O and LSE (natural log) that match float64 attention.

    Every case runs with several tile shapes (and must give the same result with each), with its
    inputs surrounded by NaN so an unmasked tail load shows up; in CPU mode every address is
    checked by the out-of-bounds guard. ``two_tiles``: ``kernel`` is ``attn_fwd_two_tiles``,
    whose BLOCK_M holds two query tiles.
    """
    gpu = current().gpu
    if configs is None:
        configs = [Config(16, 16, 4, 1), Config(32, 16, 4, 1), Config(16, 64, 4, 1)]
        if gpu:
            configs = [None, Config(32, 32, 4, 2), Config(64, 16, 4, 2)]
        if two_tiles:
            configs = [cfg and dataclasses.replace(cfg, BLOCK_M=2 * cfg.BLOCK_M)
                       for cfg in configs]
    n = 0
    for i, case in enumerate(attention_cases(hidden)):
        q, k, v = _make_attn(case, 100 * i + (7 if hidden else 0))
        want_o, want_l = reference.attention(q.double(), k.double(), v.double(), scale=case.scale,
                                             return_lse=True)
        outs = []
        for cfg in configs:
            tiles = f"{cfg.BLOCK_M}x{cfg.BLOCK_N} tiles" if cfg else "the GPU's default tiles"
            what = f"attention kernel, case {case.describe()}, {tiles}"
            o, lse = _guarded(attention_forward, kernel, q, k, v, scale=case.scale, config=cfg,
                              two_tiles=two_tiles, what=what)
            _no_nan(o, what + ", O")
            _no_nan(lse, what + ", LSE")
            if o.dtype != case.dtype:
                raise CheckFailure(f"{what}: O has dtype {o.dtype}, expected {case.dtype}.")
            assert_close(o, want_o, what=what + ", O", dims=("b", "h", "row", "col"),
                         dtype=case.dtype,
                         hint="rescale acc and l by alpha = exp2(m_old - m_new) whenever the "
                              "running max grows, mask keys >= N_k to -inf in the last tile, and "
                              "divide by l once after the loop.")
            assert_close(lse, want_l, what=what + ", LSE", dims=("b", "h", "row"),
                         dtype=torch.float32, atol=2e-4, rtol=1e-4,
                         hint="the kernel works in base 2: m and log2(l) are base-2 numbers, so "
                              "LSE = (m + log2(l)) * ln(2) in natural log.")
            outs.append((tiles, o))
            n += 1
        tol = 2e-3 if case.dtype == torch.float16 else 2e-5
        for (t1, o1), (t2, o2) in itertools.combinations(outs, 2):
            diff = (o1.double() - o2.double()).abs().max().item()
            if diff > tol:
                raise CheckFailure(f"attention kernel, case {case.describe()}: {t1} and {t2} "
                                   f"differ by {diff:.3g}; the result must not depend on the tile "
                                   "size.")
        for t, name in ((q, "q"), (k, "k"), (v, "v")):
            if hasattr(t, "_flashbook_canary") and not oob.canaries_intact(t):
                raise CheckFailure(f"attention kernel, case {case.describe()}: memory around {name} "
                                   "was overwritten: a store without a mask.")
    _report("attention forward kernel", n)


def merge_reference(o_a, lse_a, o_b, lse_b):
    """float64 merge of two partial results: the book's conventions (O = 0, LSE = -inf if empty)."""
    la, lb = lse_a.double(), lse_b.double()
    lse = torch.logaddexp(la, lb)
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    wa = torch.where(torch.isfinite(la), torch.exp(la - safe), torch.zeros_like(la))
    wb = torch.where(torch.isfinite(lb), torch.exp(lb - safe), torch.zeros_like(lb))
    o = wa[..., None] * o_a.double() + wb[..., None] * o_b.double()
    return o, lse


def merge_cases(hidden: bool = False):
    cases = [("B=1, H=2, N=20, d=16, keys split 9 + 14", (1, 2, 20, 16), 9, 14, torch.float32),
             ("B=2, H=1, N=7, d=32, keys split 30 + 3", (2, 1, 7, 32), 30, 3, torch.float32)]
    if hidden:
        cases += [("float16, N=33, d=64, keys split 5 + 50", (1, 2, 33, 64), 5, 50, torch.float16),
                  ("one side empty (N_k=0) for every row", (1, 1, 11, 16), 0, 12, torch.float32),
                  ("both sides empty", (1, 1, 5, 16), 0, 0, torch.float32)]
    return cases


def _partial(q, k, v):
    B, H, N, d = q.shape
    if k.shape[2] == 0:
        return (torch.zeros_like(q),
                torch.full((B, H, N), float("-inf"), dtype=torch.float32, device=q.device))
    o, lse = reference.attention(q.double(), k.double(), v.double(), return_lse=True,
                                 scale=1.0 / math.sqrt(d))
    return o.to(q.dtype), lse.float()


def check_merge_kernel(kernel, hidden: bool = False, blocks=(16, 8)):
    """Exercise 3: merging the results for keys [0, s) and [s, N_k) gives attention over all keys.

    Runs under the out-of-bounds guard: rows are not a multiple of BLOCK_R.
    """
    n = 0
    for i, (name, (B, H, N, d), n_a, n_b, dtype) in enumerate(merge_cases(hidden)):
        q = _seeded((B, H, N, d), 300 + i, dtype, 2.0)
        k = _seeded((B, H, n_a + n_b, d), 400 + i, dtype)
        v = _seeded((B, H, n_a + n_b, d), 500 + i, dtype)
        o_a, l_a = _partial(q, k[:, :, :n_a], v[:, :, :n_a])
        o_b, l_b = _partial(q, k[:, :, n_a:], v[:, :, n_a:])
        if n_a + n_b:
            want_o, want_l = reference.attention(q.double(), k.double(), v.double(),
                                                 return_lse=True)
        else:
            want_o, want_l = torch.zeros_like(q, dtype=torch.float64), torch.full(
                (B, H, N), float("-inf"), dtype=torch.float64, device=q.device)
        for block in blocks:
            what = f"merge kernel, case '{name}', BLOCK_R={block}"
            o, lse = _guarded(merge_states, kernel, o_a, l_a, o_b, l_b, block_r=block, what=what)
            _no_nan(o, what + ", O")
            _no_nan(lse, what + ", LSE")
            assert_close(o, want_o, what=what + ", O", dims=("b", "h", "row", "col"), dtype=dtype,
                         hint="weights w_a = exp(lse_a - lse) and w_b = exp(lse_b - lse) with "
                              "lse = log(exp(lse_a) + exp(lse_b)), computed from the larger one.")
            assert_close(lse, want_l, what=what + ", LSE", dims=("b", "h", "row"),
                         dtype=torch.float32, atol=1e-4, rtol=1e-5,
                         hint="if both sides are empty (-inf), the result is O = 0, LSE = -inf.")
            n += 1
    _report("merge of two partial states", n)


# ------------------------------------------------------------------------- pictures

def online_softmax_trace(x, block: int):
    """The running (m, l) after each block of ``x`` (1-d), in float64, for plots and tables."""
    x = torch.as_tensor(x, dtype=torch.float64)
    m, l, rows = float("-inf"), 0.0, []
    for start in range(0, x.numel(), block):
        xb = x[start:start + block]
        m_new = max(m, float(xb.max()))
        alpha = math.exp(m - m_new) if m != float("-inf") else 0.0
        l = l * alpha + float(torch.exp(xb - m_new).sum())
        rows.append(dict(block=start // block, m=m_new, l=l, alpha=alpha))
        m = m_new
    return rows


def plot_online_softmax(x, blocks=(4, 8, 16)):
    """m and l/exp(-m) after each element as the blocks stream in: the curves end in the same
    place (the log-sum-exp) whatever the block size."""
    import matplotlib.pyplot as plt
    x = torch.as_tensor(x, dtype=torch.float64)
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
    for i, b in enumerate(blocks):
        tr = online_softmax_trace(x, b)
        ends = [min((r["block"] + 1) * b, x.numel()) for r in tr]
        axes[0].step(ends, [r["m"] for r in tr], where="post", label=f"block {b}", color=f"C{i}")
        axes[1].plot(ends, [r["m"] + math.log(r["l"]) for r in tr], "o-", ms=3,
                     label=f"block {b}", color=f"C{i}")
    axes[1].axhline(float(torch.logsumexp(x, 0)), color="black", ls=":", label="logsumexp(x)")
    axes[0].set_title("running max m")
    axes[1].set_title("running m + log(l)")
    for ax in axes:
        ax.set_xlabel("elements seen")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_tiles(N_q: int, N_k: int, block_m: int, block_n: int, program: int = 0):
    """Which tiles one program visits: its Q tile (row band) and every K/V tile, the last masked."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle
    fig, ax = plt.subplots(figsize=(5, 4))
    ax.add_patch(Rectangle((0, 0), N_k, N_q, fill=False, lw=1.5))
    r0 = program * block_m
    for j, c0 in enumerate(range(0, N_k, block_n)):
        tail = c0 + block_n > N_k
        ax.add_patch(Rectangle((c0, r0), min(block_n, N_k - c0), min(block_m, N_q - r0),
                               color="C3" if tail else "C0", alpha=0.35 + 0.4 * (j % 2)))
        if tail:
            ax.add_patch(Rectangle((N_k, r0), c0 + block_n - N_k, block_m, hatch="//",
                                   fill=False, ec="C3"))
    if r0 + block_m > N_q:
        ax.add_patch(Rectangle((0, N_q), N_k, r0 + block_m - N_q, hatch="\\\\", fill=False, ec="grey"))
    ax.set_xlim(-1, N_k + block_n)
    ax.set_ylim(N_q + block_m, -1)
    ax.set_xlabel("key j (K/V tiles stream left to right)")
    ax.set_ylabel("query i")
    ax.set_title(f"program {program}: one {block_m}-row Q tile, {block_n}-key K/V tiles\n"
                 "red: the one masked tail tile; hatched: lanes past the end (masked)")
    fig.tight_layout()
    return fig


def load_bench(gpu: str = "h200"):
    """Rows of the recorded Chapter 3 benchmark (src/flashbook/data/bench/ch3/<gpu>.csv), or []."""
    from ..benchmarks import recorded
    found = recorded("ch3", gpu)
    return found[0] if found else []


def plot_bench(rows):
    """Grouped bars: TFLOP/s per shape for the chapter's kernels and the SDPA baselines."""
    import matplotlib.pyplot as plt
    shapes = list(dict.fromkeys((r["B"], r["H_q"], r["N_q"], r["d"]) for r in rows))
    kernels = list(dict.fromkeys(r["kernel"] for r in rows))
    fig, ax = plt.subplots(figsize=(8, 3.6))
    width = 0.8 / max(len(kernels), 1)
    for i, kname in enumerate(kernels):
        ys = []
        for s in shapes:
            hit = [r for r in rows if r["kernel"] == kname and (r["B"], r["H_q"], r["N_q"], r["d"]) == s]
            ys.append(hit[0]["tflops"] if hit and hit[0]["tflops"] else 0.0)
        ax.bar([j + i * width for j in range(len(shapes))], ys, width, label=kname, color=f"C{i}")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(shapes))])
    ax.set_xticklabels([f"B={b} H={h}\nN={n} d={d}" for b, h, n, d in shapes], fontsize=8)
    ax.set_ylabel("TFLOP/s (fp16)")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return fig
