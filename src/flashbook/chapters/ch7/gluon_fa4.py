"""Chapter 7's Blackwell kernel, host side: Exercise 4's five roles written in Triton Gluon for
sm_100a (the device code, ``fa4_kernel`` and its roles, is in ``fa4_kernel``, re-exported here;
the notebook's Section 8 walks through it). One CTA owns two Q tiles of ``BLOCK_M = 128`` rows of
one (batch, head) and forks into the correction (the default partition, 4 warps), softmax 0 and
1 (4 warps each), and the MMA, load and epilogue warps, with ``roles.make_barriers``' barriers.
Tensor memory, 32-bit columns: S0 at 0, S1 at ``BLOCK_N``, O0 and O1 after them (d each); P_t
is S_t's first ``BLOCK_N / 2`` columns, alpha its column ``BLOCK_N / 2``, the final row max and
sum the two after (``planner.tmem_map``).

Inputs ``(B, H, N, d)`` contiguous fp16/bf16, d in {64, 128}; returns O and the LSE ``(B, H,
N_q)`` (natural log); ``causal`` aligns bottom-right; a row with no key gets O = 0, LSE = -inf.
It needs an sm_100 GPU; ``compile_for_sm100`` builds it on any machine, and
``tests/test_ch7_gluon.py`` checks its PTX and resources against ``planner``. Written for
triton 3.9 and 3.6 (``SHIM`` names what differs).
"""
from __future__ import annotations

import math
from dataclasses import replace

import torch
import triton
from triton.experimental.gluon import language as gl

from flashbook.aot import compile_attention
from flashbook.gluon_kit import head_descriptors, validate_dense_qkv
from flashbook.tiles import LOG2E

from . import planner_model as planner    # the model only: planner's CLI compiles this module
from .fa4_kernel import SHIM, fa4_kernel, tmem_reg_layout   # the device code (re-exported)
from .planner_model import Config

__all__ = ["Config", "fa4_kernel", "kernel_args", "compile_for_sm100", "tile_layout",
           "TRITON_VERSION", "SHIM", "tmem_reg_layout", "attention_fa4", "DTYPES", "HEAD_DIMS"]

TRITON_VERSION = tuple(int(p) for p in triton.__version__.split(".")[:2])
HEAD_DIMS = (64, 128)
DTYPES = ("float16", "bfloat16")


def kernel_args(config: Config) -> dict:
    """The constexprs and launch options of a resolved ``config``, for the launcher and the
    ahead-of-time compile alike. ``num_warps`` is the correction's; Triton adds the workers'
    warps and computes ``.maxnreg``. ``CORRECTION_WARPS`` other than 4 is a planner what-if."""
    if config.CORRECTION_WARPS != planner.PARTITION_WARPS[0][1]:
        raise ValueError(f"kernel_args: CORRECTION_WARPS={config.CORRECTION_WARPS}, but the "
                         "kernel's correction is written for one warpgroup (4 warps); other "
                         "counts are what-ifs that only the planner answers.")
    return dict(constexprs=dict(BLOCK_M=config.BLOCK_M, BLOCK_N=config.BLOCK_N,
                                HEAD_DIM=config.HEAD_DIM, STAGES=config.STAGES,
                                CAUSAL=bool(config.CAUSAL), SOFTMAX_REGS=config.SOFTMAX_REGS,
                                SINGLE_WARP_REGS=config.SINGLE_WARP_REGS),
                options=dict(num_warps=config.CORRECTION_WARPS))


def tile_layout(rows: int, head_dim: int, dtype: str):
    """The shared layout of a (1, rows, d) TMA box: 128-byte swizzle, what tcgen05 reads."""
    return gl.NVMMASharedLayout.get_default_for([1, rows, head_dim], getattr(gl, dtype))


def compile_for_sm100(config: Config):
    """Compile ``fa4_kernel`` for sm_100a with a resolved ``config``: Triton's compiled kernel
    (``.asm``, ``.metadata.shared``, ``.metadata.tmem_size``). Works without a GPU."""
    if config.HEAD_DIM is None or config.DTYPE is None:
        raise ValueError("compile_for_sm100: resolve the config first (Config.for_inputs).")
    args = kernel_args(config)
    return compile_attention(fa4_kernel, 100, config.DTYPE, config.HEAD_DIM, config.BLOCK_M,
                             config.BLOCK_N, lambda rows: tile_layout(rows, config.HEAD_DIM,
                                                                      config.DTYPE),
                             args["constexprs"], args["options"])


def _validate(q, k, v, causal, softmax_scale, config):
    name = "attention_fa4"
    B, H, N_q, d = validate_dense_qkv(
        name, q, k, v, HEAD_DIMS,
        head_dim_note=" (tensor memory: 2 x 128 columns of S + 2 x d of O <= 512)")
    names = {getattr(torch, n): n for n in DTYPES}
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)
    if not scale > 0 or math.isinf(scale):
        raise ValueError(f"{name}: softmax_scale must be a positive finite number, got {scale}.")
    config = config or planner.best(d, names[q.dtype], bool(causal))
    if not isinstance(config, Config):
        raise ValueError(f"{name}: config must be a {__name__}.Config, got "
                         f"{type(config).__name__}.")
    if config.HEAD_DIM not in (None, d) or config.DTYPE not in (None, names[q.dtype]):
        raise ValueError(f"{name}: config is for d={config.HEAD_DIM}, {config.DTYPE}; the inputs "
                         f"are d={d}, {names[q.dtype]}.")
    config = replace(config.for_inputs(d, names[q.dtype]), CAUSAL=bool(causal))
    verdict = planner.feasible(config)
    if not verdict:
        raise ValueError(f"{name}: config {config} does not fit a B200: "
                         + "; ".join(verdict.reasons) + ".")
    for label, t in (("q", q), ("k", k), ("v", v)):
        if t.device.type != "cuda":
            raise ValueError(f"{name}: {label} is on {t.device.type}; this Gluon kernel runs only "
                             "on a CUDA GPU of compute capability 10.0 (B200, GB200). Gluon has no "
                             "CPU interpreter; compile_for_sm100 builds it ahead of time.")
    cap = tuple(torch.cuda.get_device_capability(q.device))
    if cap[0] != 10:
        raise ValueError(f"{name}: needs an sm_100 GPU (tensor memory, tcgen05); "
                         f"{torch.cuda.get_device_name(q.device)} is sm_{cap[0]}{cap[1]} (an "
                         "H100/H200 is sm_90: use Chapter 6's kernel there).")
    return config, scale


def attention_fa4(q, k, v, causal: bool = False, softmax_scale: float | None = None,
                  config: Config | None = None):
    """softmax(scale * Q K^T [+ causal mask]) V with the chapter's Gluon kernel on a B200: q
    ``(B, H, N_q, d)``, k, v ``(B, H, N_k, d)`` -> O, LSE (as the module docstring says). Never
    run by the book's tests: no sm_100 GPU was available."""
    from triton.experimental.gluon.nvidia.blackwell import TensorDescriptor
    config, scale = _validate(q, k, v, causal, softmax_scale, config)
    B, H, N_q, d = q.shape
    N_k = k.shape[2]
    o = torch.empty_like(q)
    lse = torch.empty((B, H, N_q), dtype=torch.float32, device=q.device)
    if N_q == 0 or B * H == 0:
        return o, lse
    if N_k == 0:                                   # no key at all: the empty-row convention
        return o.zero_(), lse.fill_(-float("inf"))
    bm, bn = config.BLOCK_M, config.BLOCK_N
    q_desc, k_desc, v_desc, o_desc = head_descriptors(
        TensorDescriptor, q, k, v, o, bm, bn, tile_layout(bm, d, config.DTYPE),
        tile_layout(bn, d, config.DTYPE))
    args = kernel_args(config)
    grid = (triton.cdiv(N_q, 2 * bm), B * H)
    with torch.cuda.device(q.device):
        fa4_kernel[grid](q_desc, k_desc, v_desc, o_desc, lse, N_q, N_k, scale * LOG2E,
                         **args["constexprs"], **args["options"])
    return o, lse
