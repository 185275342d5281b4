"""Chapter 9 launch: the backward pass's three kernels on Chapter 4's packed layout.

Layout: q, dO, O ``(total_q, h_q, d)``; k, v ``(total_k, h_kv, d)`` with ``h_q = G * h_kv``
(Chapter 5); sequence ``b`` owns rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` (int32, batch + 1
entries); LSE and D ``(h_q, total_q)`` float32, LSE in natural log (the forward's). Outputs dQ in
q's dtype, dK and dV in k's dtype (one per K/V head: the G query heads' contributions summed
in fp32 inside the kernel).

* ``launch_preprocess``: D = rowsum(dO * O), grid ``(cdiv(total_q, BLOCK), h_q)``.
* ``launch_dkdv``: K/V stationary, grid ``(cdiv(max_seqlen_k, BLOCK_N), batch * h_kv)``: each
  program keeps one K and one V tile and its dK, dV accumulators on chip and streams the Q,
  dO, LSE, D tiles of its G query heads past them.
* ``launch_dq``: Q stationary, grid ``(cdiv(max_seqlen_q, BLOCK_M), batch * h_q)``: each
  program keeps its Q, dO tiles and its dQ accumulator and streams K and V.

Like Chapter 4's ``launch_varlen`` these check what the launch needs; the public wrapper
(``validate_packed``) checks that cu_seqlens describe the tensors.
"""
from __future__ import annotations

import dataclasses

import torch

from flashbook.cases import cdiv, validate_scale, validate_tensor
from flashbook.device import current
from flashbook.tiles import HEAD_DIMS, HEAD_DIMS_WHY, LOG2E

__all__ = ["BwdConfig", "bwd_config", "check_backward_args", "launch_preprocess", "launch_dkdv",
           "launch_dq", "BWD_DTYPES", "HEAD_DIMS", "LOG2E"]

BWD_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclasses.dataclass(frozen=True)
class BwdConfig:
    """Tiles of one backward kernel: BLOCK_M query rows x BLOCK_N keys per step."""
    BLOCK_M: int
    BLOCK_N: int
    num_warps: int
    num_stages: int


def bwd_config(kernel: str, d: int, dtype: torch.dtype, capability: tuple | None) -> BwdConfig:
    """The tiles of ``kernel`` ("dkdv" or "dq") for head dim ``d`` on a GPU of this compute
    capability (None: the CPU interpreter, 16 x 16 tiles so small cases cross tile edges).

    dK/dV keeps a K, a V tile and two fp32 accumulators of BLOCK_N x d: its stationary side is
    BLOCK_N; dQ keeps Q, dO and one accumulator of BLOCK_M x d. On sm_90 the stationary side
    is 128 rows, the streamed side 64 (d = 128) or 32 / 64 (d <= 64), with three pipeline
    stages: the fastest of the candidates ``python -m flashbook.chapters.ch9.tune`` sweeps on
    the H200 (two stages made dQ slower at d = 128; at d = 64 a 128-row streamed side made
    dK/dV slower). Elsewhere, and for fp32 (the exact path, not a fast one), tiles
    that fit a T4's 64 KB per block (tests/test_ch9.py compiles them ahead of time)."""
    if kernel not in ("dkdv", "dq"):
        raise ValueError(f"bwd_config: kernel must be 'dkdv' or 'dq', got {kernel!r}")
    if capability is None:
        return BwdConfig(16, 16, 4, 1)
    cc = tuple(capability)
    if dtype == torch.float32:      # the exact path, not a fast one: tiles that fit every GPU
        return BwdConfig(32, 32, 4, 1)
    wide = d > 64
    if cc >= (9, 0):
        if wide:
            return BwdConfig(64, 128, 8, 3) if kernel == "dkdv" else BwdConfig(128, 64, 8, 3)
        return BwdConfig(32, 128, 4, 3) if kernel == "dkdv" else BwdConfig(64, 64, 4, 3)
    if cc in ((8, 0), (8, 7)):                      # A100: 163 KB per block
        return BwdConfig(32, 128, 8, 2) if kernel == "dkdv" else BwdConfig(128, 32, 8, 2)
    tile = 32 if wide else 64                       # T4 (64 KB), sm_86/89 (99 KB)
    return BwdConfig(tile, tile, 4, 1)


def _precision(dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _check(name, tensors, d):
    q = tensors[0][1]
    for label, t in tensors:
        validate_tensor(label, t, dims=3, dtypes=BWD_DTYPES, name=name,
                        device=None if label == "q" else q.device)
    if len({t.dtype for _, t in tensors}) > 1:
        raise ValueError(f"{name}: " + ", ".join(label for label, _ in tensors) + " must share "
                         "a dtype, got " + ", ".join(str(t.dtype) for _, t in tensors) + ".")
    if d not in HEAD_DIMS:
        raise ValueError(f"{name}: head dimension d={d} is not supported; use one of "
                         f"{HEAD_DIMS}: {HEAD_DIMS_WHY}.")
    if q.dtype == torch.bfloat16 and current().capability is None:
        raise ValueError(f"{name}: bf16 tl.dot is wrong in the CPU interpreter; use float16 "
                         "or float32 on a CPU.")


def _stats(name, lse, total_q, h_q, device):
    validate_tensor("lse", lse, dims=2, dtypes=(torch.float32,), name=name, device=device,
                    contiguous="all")
    if tuple(lse.shape) != (h_q, total_q):
        raise ValueError(f"{name}: lse must be (h_q, total_q) = {(h_q, total_q)}, got "
                         f"{tuple(lse.shape)}.")


def check_backward_args(name, q, k, v, do, stats, scale):
    """The checks every backward launch shares: q, k, v, dO alike in dtype and device, dO
    shaped like q, v like k, h_q a multiple of h_kv, the (h_q, total_q) float32 row
    statistics ``stats`` (LSE, D), the scale. Returns (total_q, h_q, h_kv, d, scale)."""
    _check(name, (("q", q), ("k", k), ("v", v), ("do", do)), q.shape[-1])
    total_q, h_q, d = q.shape
    h_kv = k.shape[1]
    if h_q % h_kv or k.shape != v.shape or do.shape != q.shape or k.shape[2] != d:
        raise ValueError(f"{name}: need do like q {tuple(q.shape)}, v like k {tuple(k.shape)} "
                         f"and h_q a multiple of h_kv.")
    for t in stats:
        _stats(name, t, total_q, h_q, q.device)
    return total_q, h_q, h_kv, d, validate_scale(scale, d, name)


def launch_preprocess(kernel, o, do, *, block: int = 64):
    """D (h_q, total_q) float32 = rowsum(dO * O): reads 2 * total_q * h_q * d elements."""
    name = "launch_preprocess"
    _check(name, (("o", o), ("do", do)), o.shape[-1])
    if o.shape != do.shape:
        raise ValueError(f"{name}: o {tuple(o.shape)} and do {tuple(do.shape)} must match.")
    total_q, h_q, d = o.shape
    delta = torch.empty((h_q, total_q), dtype=torch.float32, device=o.device)
    if total_q * h_q == 0:
        return delta
    kernel[(cdiv(total_q, block), h_q)](o, do, delta, o.stride(0), o.stride(1),
                                               do.stride(0), do.stride(1), total_q,
                                               HEAD_DIM=d, BLOCK_M=block)
    return delta


def launch_dkdv(kernel, q, k, v, do, lse, delta, cu_seqlens_q, cu_seqlens_k, max_seqlen_k: int,
                *, causal: bool, scale: float | None = None, config: BwdConfig | None = None):
    """dK, dV (total_k, h_kv, d) in k's dtype; the kernel sums the G query heads of each K/V
    head. Reads K, V once and Q, dO, LSE, D once per key tile that sees them."""
    total_q, h_q, h_kv, d, scale = check_backward_args("launch_dkdv", q, k, v, do,
                                                       (lse, delta), scale)
    cfg = config or bwd_config("dkdv", d, q.dtype, current().capability)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    n_bkv = (cu_seqlens_k.numel() - 1) * h_kv
    if n_bkv == 0 or max_seqlen_k == 0 or total_q == 0:
        return dk, dv
    grid = (cdiv(max_seqlen_k, cfg.BLOCK_N), n_bkv)
    kernel[grid](q, k, v, do, lse, delta, dk, dv, cu_seqlens_q, cu_seqlens_k,
                 q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                 do.stride(0), do.stride(1), dk.stride(0), dk.stride(1), dv.stride(0),
                 dv.stride(1), h_kv, total_q, scale, scale * LOG2E, CAUSAL=causal,
                 GROUP=h_q // h_kv, HEAD_DIM=d, BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N,
                 DOT_PRECISION=_precision(q.dtype), num_warps=cfg.num_warps,
                 num_stages=cfg.num_stages)
    return dk, dv


def launch_dq(kernel, q, k, v, do, lse, delta, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int,
              *, causal: bool, scale: float | None = None, config: BwdConfig | None = None):
    """dQ (total_q, h_q, d) in q's dtype. Reads Q, dO, LSE, D once and K, V once per query tile
    that sees them."""
    total_q, h_q, h_kv, d, scale = check_backward_args("launch_dq", q, k, v, do, (lse, delta),
                                                       scale)
    cfg = config or bwd_config("dq", d, q.dtype, current().capability)
    dq = torch.zeros_like(q)
    n_bh = (cu_seqlens_q.numel() - 1) * h_q
    if n_bh == 0 or max_seqlen_q == 0 or k.shape[0] == 0:
        return dq
    grid = (cdiv(max_seqlen_q, cfg.BLOCK_M), n_bh)
    kernel[grid](q, k, v, do, lse, delta, dq, cu_seqlens_q, cu_seqlens_k,
                 q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                 do.stride(0), do.stride(1), dq.stride(0), dq.stride(1), h_q, total_q, scale,
                 scale * LOG2E, CAUSAL=causal, GROUP=h_q // h_kv, HEAD_DIM=d,
                 BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, DOT_PRECISION=_precision(q.dtype),
                 num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return dq
