"""The host side of Chapter 6's FP8 forward in Gluon (``fa3_fp8_kernel``: FlashAttention-3's
warp specialization and ping-pong with e4m3 GEMMs): ``attention_fp8_gluon``, which takes Chapter
6's ``attention_fp8``'s arguments and returns what it returns within rounding, and the
ahead-of-time compile ``compile_for_sm90`` the tests read without a GPU. Chapter 6 re-exports
``attention_fp8_gluon``.

Inputs as ``attention_fp8``'s: q8 ``(B, H, N_q, d)``, k8 ``(B, H, N_k, d)`` and V transposed
once on the way in, vt8 ``(B, H, d, N_k)`` (``v8.transpose(-1, -2).contiguous()``: wgmma reads
an fp8 B operand only K-major; FlashAttention-3 transposes V in the kernel instead), all
``float8_e4m3fn``; block scales qs ``(B, H, cdiv(N_q, block_m))``, ks and vs ``(B, H,
cdiv(N_k, block_n))`` float32. Any lengths (TMA reads zeros past a head; rows and keys past the
end are masked); causal bottom-right, masked on the diagonal tiles only. vt8's rows must be
16-byte aligned for TMA: when N_k is not a multiple of 16 the wrapper copies V^T into a
zero-padded buffer first. The kernel's K/V tile (``config.BLOCK_N``) must divide ``block_n`` so
each tile has one K scale and one V scale. ``p_path`` picks how P reaches the second GEMM
(``P_PATHS``, ``fa3_fp8_kernel.p_operand``); with "sperm", "perm" and "perm4" (``PERMUTED``)
vt8 is ``permute_keys(V^T)``, a ``PermutedKeys`` of ``(B, H, d, cdiv(N_k, 32) * 32)``, its keys
permuted within each 32 so that P stays in its threads (made once on the way in, as the
transpose is); these paths take no other vt8, and the others take no ``PermutedKeys``.

With no config, ``default_config``: the fastest tiles measured on an H100, 64 query rows a
consumer against 256 keys a tile in two stages, where the scales' ``block_n`` is a multiple of
256; 128 keys in three stages where it is a multiple of 128. The default p_path is "smem"
(V^T as it comes); "sperm", on V^T with its keys permuted, measured a few percent faster.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
from triton.experimental.gluon import language as gl

from flashbook.aot import gluon_ast_source
from flashbook.cases import cdiv
from flashbook.fa3_fp8_kernel import fp8_kernel
from flashbook.fa3_planner import Config, register_budget
from flashbook.gluon_kit import rebased, require_sm90
from flashbook.planning import H100, MBARRIER_BYTES
from flashbook.plans import Launch, Plans, key

__all__ = ["attention_fp8_gluon", "compile_for_sm90", "default_config", "FASTEST", "FALLBACK",
           "shared_memory", "Config", "P_PATHS", "PERMUTED", "PERM_32", "PermutedKeys",
           "permute_keys"]

E4M3 = torch.float8_e4m3fn          # the fp8 format of the inputs (Chapter 6's ``fp8.E4M3``)
# the default tiles (``default_config``), each with p_path "smem": the fastest measured on an
# H100, and the one for scales in blocks of 128 keys. (Three consumers of 64 x 128, the fp16
# kernel's d = 64 design, measured slower on an H100 at (1, 16, 16384, 128): 855 against 890
# TFLOP/s with "sperm"; 64 x 256 tiles, which only two consumers can hold, matter more here.)
FASTEST = Config(BLOCK_M=64, BLOCK_N=256, STAGES=2, OVERLAP=True)
FALLBACK = Config(BLOCK_M=64, BLOCK_N=128, STAGES=3, OVERLAP=True)
# how P reaches PV's wgmma (``fa3_fp8_kernel.p_operand``): registers through warp shuffles,
# staged in shared memory (two bytes a store, or four with V^T's keys permuted), or registers
# with V^T's keys permuted so that no thread exchanges data
P_PATHS = ("regs", "smem", "sperm", "perm", "perm4")
PERMUTED = ("sperm", "perm", "perm4")          # the paths whose vt8 is permute_keys(V^T)
# "perm": column k of each 32 keys of V^T holds key PERM_32[k]. With k = 16h + 4q + 2j + e
# (q = thread % 4 of a quad), wgmma's fp8 A layout (k_width=4) gives thread q columns 4q..4q+3
# and 16+4q..16+4q+3 of each 32, while S's accumulator gives it keys 8j + 2q + e (j = 0..3,
# e = 0, 1); PERM_32 maps the one set onto the other, so P's conversion stays in the thread.
PERM_32 = tuple(16 * h + 8 * j + 2 * q + e
                for h in range(2) for q in range(4) for j in range(2) for e in range(2))
OUT_DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16"}
HEAD_DIMS = (64, 128)
LOG2E = 1.4426950408889634
NAME = "attention_fp8_gluon"


def shared_memory(config: Config, head_dim: int, p_path: str = "regs") -> int:
    """Bytes of shared memory the tiles and barriers take (one byte an element): two Q tiles,
    ``STAGES`` K tiles and as many V^T tiles, with ``p_path`` "smem" two P tiles, 4 * STAGES + 4
    mbarriers."""
    tiles = (2 * config.BLOCK_M + 2 * config.STAGES * config.BLOCK_N) * head_dim
    if p_path in ("smem", "sperm"):
        tiles += 2 * config.BLOCK_M * config.BLOCK_N
    return tiles + (4 * config.STAGES + 4) * MBARRIER_BYTES


class PermutedKeys(NamedTuple):
    """V^T with its keys permuted (``permute_keys``' result), the vt8 of the ``PERMUTED`` paths
    and of no other: a V^T handed to the wrong path is refused, not read in the wrong order."""
    vt: torch.Tensor


def permute_keys(vt8: torch.Tensor) -> PermutedKeys:
    """V^T ``(..., d, N_k)`` -> ``(..., d, cdiv(N_k, 32) * 32)`` with the keys of each group of
    32 in ``PERM_32``'s order, zeros past N_k: ``attention_fp8_gluon``'s vt8 for p_path
    "sperm", "perm" and "perm4". Made once on the way in, like the transpose."""
    *lead, d, n = vt8.shape
    out = vt8.new_zeros(*lead, d, cdiv(n, 32) * 32)
    out[..., :n] = vt8
    perm = torch.tensor(PERM_32, device=vt8.device)
    idx = (torch.arange(0, out.shape[-1], 32, device=vt8.device)[:, None] + perm).flatten()
    return PermutedKeys(out.view(torch.uint8)[..., idx].view(vt8.dtype).contiguous())


def _layout(rows: int, cols: int):
    """The SMEM layout of a (1, rows, cols) e4m3 TMA box: swizzled, what wgmma reads."""
    return gl.NVMMASharedLayout.get_default_for([1, rows, cols], gl.float8e4nv)


def default_config(block_n: int) -> Config:
    """The tiles ``attention_fp8_gluon`` runs with no config, for K/V scales in blocks of
    ``block_n`` keys (a K/V tile must not straddle two scales): ``FASTEST`` (64 x 256, two
    stages; the fastest measured on an H100, with p_path "smem") where 256 divides
    ``block_n``, else ``FALLBACK`` (64 x 128, three stages) where 128 does."""
    for config in (FASTEST, FALLBACK):
        if isinstance(block_n, int) and block_n > 0 and block_n % config.BLOCK_N == 0:
            return config
    raise ValueError(f"{NAME}: with no config the kernel takes K/V scales in blocks of a "
                     f"multiple of 128 keys (of 256 for its fastest tiles); got block_n="
                     f"{block_n!r}. Quantize K and V in blocks of 128 or 256, or pass a config "
                     "whose BLOCK_N divides block_n.")


def _check_config(config, d: int, block_n: int, p_path: str = "regs") -> Config:
    if not isinstance(config, Config):
        raise ValueError(f"{NAME}: config must be a flashbook.fa3_planner.Config, got "
                         f"{type(config).__name__}.")
    c = config
    if c.CONSUMERS != 2 or c.BLOCK_M not in (64, 128) or c.BLOCK_N not in (64, 128, 256) \
            or c.STAGES < 1:
        raise ValueError(f"{NAME}: the kernel runs two consumers of BLOCK_M in (64, 128) rows "
                         f"on BLOCK_N in (64, 128, 256) keys with STAGES >= 1; got {c}.")
    if block_n % c.BLOCK_N:
        raise ValueError(f"{NAME}: BLOCK_N={c.BLOCK_N} must divide the K/V scale block "
                         f"block_n={block_n} (one scale per K/V tile).")
    if p_path not in P_PATHS:
        raise ValueError(f"{NAME}: p_path must be one of {P_PATHS}, got {p_path!r}.")
    smem = shared_memory(c, d, p_path)
    if smem > H100.smem_per_block:
        raise ValueError(f"{NAME}: config {c} needs {smem} bytes of shared memory at d={d}; an "
                         f"H100/H200 block has {H100.smem_per_block}.")
    return c.for_inputs(d, "float8_e4m3fn")


def _validate(q8, qs, k8, ks, vt8, vs, out_dtype, block_m, block_n, config, p_path,
              permuted=False):
    if (p_path in PERMUTED) != permuted:
        raise ValueError(f"{NAME}: p_path={p_path!r} takes vt8 as " + (
            "V^T itself, not permute_keys(V^T)." if permuted else
            "permute_keys(V^T) (its keys permuted within each 32), not V^T itself."))
    for label, t in (("q8", q8), ("k8", k8), ("vt8", vt8), ("qs", qs), ("ks", ks), ("vs", vs)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{NAME}: {label} must be a torch.Tensor, got {type(t).__name__}.")
    for label, t in (("q8", q8), ("k8", k8), ("vt8", vt8)):
        if t.dim() != 4 or t.dtype != E4M3:
            raise ValueError(f"{NAME}: {label} must be a 4-D float8_e4m3fn tensor; got {t.dtype} "
                             f"{tuple(t.shape)}.")
    B, H, N_q, d = q8.shape
    N_k = k8.shape[2]
    n_vt = cdiv(N_k, 32) * 32 if permuted else N_k
    if tuple(k8.shape) != (B, H, N_k, d) or tuple(vt8.shape) != (B, H, d, n_vt):
        what = "permute_keys(V^T)" if permuted else "V transposed"
        raise ValueError(f"{NAME}: k8 must be (B, H, N_k, d) and vt8 (B, H, d, {n_vt}) "
                         f"({what}) with q8 (B, H, N_q, d) = {tuple(q8.shape)}; got k8 "
                         f"{tuple(k8.shape)}, vt8 {tuple(vt8.shape)}.")
    if d not in HEAD_DIMS:
        raise ValueError(f"{NAME}: head dim d={d} is not supported; the kernel takes d in "
                         f"{HEAD_DIMS}.")
    for label, t in (("q8", q8), ("k8", k8), ("vt8", vt8)):
        if not t.is_contiguous() or (t.numel() and t.data_ptr() % 16):
            raise ValueError(f"{NAME}: {label} must be contiguous and 16-byte aligned (TMA); "
                             "pass a fresh .contiguous() copy.")
    if not isinstance(block_m, int) or not isinstance(block_n, int) or block_m < 1 \
            or block_n < 1:
        raise ValueError(f"{NAME}: block_m and block_n (the scales' blocks) must be positive "
                         f"ints; got {block_m!r}, {block_n!r}.")
    for label, t, n in (("qs", qs, cdiv(N_q, block_m)), ("ks", ks, cdiv(N_k, block_n)),
                        ("vs", vs, cdiv(N_k, block_n))):
        if t.dtype != torch.float32 or tuple(t.shape) != (B, H, n) or not t.is_contiguous():
            raise ValueError(f"{NAME}: {label} must be contiguous float32 of shape {(B, H, n)} "
                             f"(one scale per block); got {t.dtype} {tuple(t.shape)}.")
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"{NAME}: out_dtype must be torch.float16 or torch.bfloat16, got "
                         f"{out_dtype}.")
    if B * H > 65535:
        raise ValueError(f"{NAME}: B*H = {B * H} exceeds the grid's 65535 programs in y.")
    if config is None:
        config = default_config(block_n)
    config = _check_config(config, d, block_n, p_path)
    devices = {t.device for t in (q8, k8, vt8, qs, ks, vs)}
    if len(devices) != 1:
        raise ValueError(f"{NAME}: every tensor must be on one CUDA GPU, got "
                         f"{sorted(map(str, devices))}.")
    require_sm90(NAME, q8.device, "fp8 wgmma, TMA, setmaxnreg")
    return config


def kernel_constexprs(config: Config, block_m: int, block_n: int, p_path: str = "regs",
                      exp2_fma: bool | int = False) -> tuple[dict, dict]:
    """(the kernel's constexprs but CAUSAL, its launch options) for a checked ``config``."""
    budget = register_budget(config)
    return (dict(BLOCK_M=config.BLOCK_M, BLOCK_N=config.BLOCK_N, HEAD_DIM=config.HEAD_DIM,
                 STAGES=config.STAGES, OVERLAP=config.OVERLAP, Q_BLOCK=block_m,
                 KV_BLOCK=block_n, CONSUMER_REGS=budget["consumer"],
                 PRODUCER_REGS=budget["producer"], P_VIA=p_path, EXP2_FMA=exp2_fma),
            dict(num_warps=4, maxnreg=budget["launch"]))


_FP8_PLANS = Plans()
_NO_ROWS, _NO_KEYS = object(), object()     # plans that launch nothing


def attention_fp8_gluon(q8, qs, k8, ks, vt8, vs, causal: bool = False,
                        out_dtype=torch.float16, block_m: int = 64, block_n: int = 128,
                        config: Config | None = None, p_path: str = "smem",
                        exp2_fma: bool | int = False):
    """O ``(B, H, N_q, d)`` ``out_dtype`` of softmax(Q K^T / sqrt(d)) V from e4m3 inputs with
    their block scales (``attention_fp8``'s arguments; ``block_m``, ``block_n`` the scales'
    blocks, checked against qs's, ks's and vs's shapes), on an H100/H200. ``config``: the
    kernel's tiles (``fa3_planner.Config``: BLOCK_M rows per consumer, BLOCK_N keys per tile,
    STAGES, OVERLAP); by default ``default_config(block_n)``: 64 x 256 in two stages (the
    fastest measured on an H100) when 256 divides ``block_n``, 64 x 128 in three when 128 does,
    else a ValueError. ``p_path`` (``P_PATHS``): how P reaches PV's wgmma, by default "smem"
    (staged in shared memory); with "sperm" (staged four keys a store), "perm" and "perm4" vt8
    is ``permute_keys(V^T)``, made once on the way in. ``exp2_fma``: True (or 1) computes half
    the exponentials by a polynomial on the FMA pipe (``fa3_fp8_kernel.exp2_fma``,
    FlashAttention-4's trick), an int n in 1..3 one in 2^n (each slower on an H100). The
    checks, config, grid and TMA descriptors are remembered by the inputs' metadata
    (``plans``): a repeated call costs its output buffer and the launch."""
    permuted = isinstance(vt8, PermutedKeys)
    if permuted:
        vt8 = vt8.vt
    plan_key = key(q8, qs, k8, ks, vt8, permuted, vs, causal, out_dtype, block_m, block_n, config,
                   p_path, exp2_fma)
    plan = _FP8_PLANS.get(plan_key)
    if plan is None:
        plan = _FP8_PLANS.remember(plan_key, _plan(q8, qs, k8, ks, vt8, vs, causal, out_dtype,
                                                   block_m, block_n, config, p_path, exp2_fma,
                                                   permuted))
    o = torch.empty(q8.shape, dtype=out_dtype, device=q8.device)
    if plan is _NO_ROWS:
        return o
    if plan is _NO_KEYS:
        return o.zero_()
    launch, descriptors, padded_keys = plan
    if padded_keys:                      # V^T's rows 16-byte aligned for TMA: a zero-padded copy
        padded = torch.zeros((*vt8.shape[:-1], padded_keys), dtype=E4M3, device=q8.device)
        padded[..., :vt8.shape[-1]] = vt8
        vt8 = padded
    q_desc, k_desc, vt_desc = (rebased(d, t) for d, t in zip(descriptors, (q8, k8, vt8)))
    if q8.device.index == torch.cuda.current_device():
        launch(q_desc, k_desc, vt_desc, o, qs, ks, vs)
    else:
        with torch.cuda.device(q8.device):
            launch(q_desc, k_desc, vt_desc, o, qs, ks, vs)
    return o


def _plan(q8, qs, k8, ks, vt8, vs, causal, out_dtype, block_m, block_n, config, p_path,
          exp2_fma=False, permuted=False):
    """(the ``Launch``, the TMA descriptors of q8, k8 and V^T as templates for ``rebased``, the
    keys of V^T's zero-padded copy or 0), or ``_NO_ROWS`` / ``_NO_KEYS``."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    if not isinstance(exp2_fma, int) or not 0 <= exp2_fma <= 3:
        raise ValueError(f"{NAME}: exp2_fma must be True or False, or n in 0..3 (one "
                         f"exponential in 2^n on the FMA pipe), got {exp2_fma!r}.")
    config = _validate(q8, qs, k8, ks, vt8, vs, out_dtype, block_m, block_n, config, p_path,
                       permuted)
    B, H, N_q, d = q8.shape
    N_k = k8.shape[2]
    if N_q == 0 or B * H == 0:
        return _NO_ROWS
    if N_k == 0:
        return _NO_KEYS
    padded_keys = cdiv(N_k, 16) * 16 if N_k % 16 and not permuted else 0
    bm, bn = config.BLOCK_M, config.BLOCK_N
    vt3 = (torch.empty((B * H, d, padded_keys), dtype=E4M3, device=q8.device) if padded_keys
           else vt8.view(B * H, d, vt8.shape[-1]))
    descriptors = []
    for t3, box in ((q8.view(B * H, N_q, d), [1, bm, d]), (k8.view(B * H, N_k, d), [1, bn, d]),
                    (vt3, [1, d, bn])):
        descriptor = TensorDescriptor(t3, list(t3.shape), list(t3.stride()), box,
                                      _layout(*box[1:]))
        descriptor.base = None          # a template: the plan must not keep a tensor alive
        descriptors.append(descriptor)
    constexprs, options = kernel_constexprs(config, block_m, block_n, p_path, exp2_fma)
    launch = Launch(fp8_kernel, (cdiv(N_q, 2 * bm), B * H), (N_q, N_k, LOG2E / math.sqrt(d)),
                    dict(CAUSAL=bool(causal), **constexprs, **options))
    return launch, descriptors, padded_keys


def compile_for_sm90(config: Config | None = None, head_dim: int = 128, causal: bool = False,
                     block_m: int = 64, block_n: int = 128, out_dtype: str = "fp16",
                     p_path: str = "smem", exp2_fma: bool | int = False):
    """Compile ``fp8_kernel`` for sm_90a on any machine (no GPU), with
    ``attention_fp8_gluon``'s defaults: Triton's compiled kernel (``.asm["ptx"]``,
    ``.metadata.shared``)."""
    from triton.backends.compiler import GPUTarget
    if config is None:
        config = default_config(block_n)
    config = _check_config(config, head_dim, block_n, p_path)
    bm, bn, d = config.BLOCK_M, config.BLOCK_N, head_dim

    def desc(rows, cols):
        return f"tensordesc<fp8e4nv[1,{rows},{cols}],{_layout(rows, cols)!r}>"

    constexprs, options = kernel_constexprs(config, block_m, block_n, p_path, exp2_fma)
    constexprs["CAUSAL"] = bool(causal)
    signature = dict(q_desc=desc(bm, d), k_desc=desc(bn, d), vt_desc=desc(d, bn),
                     O=f"*{out_dtype}", QS="*fp32", KS="*fp32", VS="*fp32", N_Q="i32",
                     N_K="i32", qk_scale="fp32")
    signature.update({n: "constexpr" for n in constexprs})
    source = gluon_ast_source()(fn=fp8_kernel, signature=signature, constexprs=constexprs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
