"""Chapter 7's Blackwell kernel: the example's five roles written in Triton Gluon for sm_100a.

One program (CTA) owns ``2 * BLOCK_M`` query rows of one (batch, head), as two Q tiles of
``BLOCK_M = 128`` rows, and forks into the roles of Exercise 4's schedule
(``flashbook.chapters.ch7.roles``), each in its own warps (``gl.warp_specialize``):

* **correction** (the default partition, 4 warps): between two PV MMAs of a tile it rescales
  O_t in tensor memory by ``alpha = exp2(m_old - m_new)``; after the last one it divides O_t by
  the row sum, writes it to shared memory (into Q_t's tile, free by then) and the LSE (natural
  log) to global memory;
* **softmax 0** and **softmax 1** (4 warps each, one thread per query row): S_t from TMEM, the
  row max, alpha into a TMEM column for the correction, ``P = exp2(S * scale - m)`` in 16 bits
  written back **into S_t's own columns** (P aliases S), the row sum kept in registers;
* **MMA** (1 warp; one thread issues): ``tcgen05_mma`` with accumulators in TMEM,
  ``S_t = Q_t K_j^T`` (A and B from shared memory) and ``O_t (+)= P_t V_j`` (A = P from tensor
  memory), in the issue order ``QK0(j), PV1(j-1), QK1(j), PV0(j)`` so that one tile's softmax
  runs under the other tile's MMAs. Each MMA names the barriers its completion arrives on
  (``tcgen05.commit``);
* **load** (1 warp): TMA copies of Q0 and Q1, then K and V of each key step into two rings of
  ``STAGES`` slots;
* **epilogue** (1 warp): the TMA stores of the two O tiles.

The barriers are Exercise 4's (``roles.make_barriers``): ``q_full``, ``k_full``/``k_free`` and
``v_full``/``v_free`` per slot, and per tile ``s_ready`` (QK done), ``p_ready`` (P written),
``stats`` (alpha written), ``o_done`` (PV done), ``o_ready`` (O rescaled), ``l_ready`` (final
row max and sum written) and ``epi_ready`` (O in shared memory). Tensor memory, 32-bit columns
of 128 lanes (one lane a query row): S0 at 0, S1 at ``BLOCK_N``, O0 and O1 after them (``d``
columns each); P_t is S_t's first ``BLOCK_N / 2`` columns (two 16-bit values a column), alpha
lives in S_t's column ``BLOCK_N / 2``, the final row max and sum in the two after it. With d =
128 that is all 512 columns of an SM's tensor memory.

Inputs ``(B, H, N, d)`` contiguous, fp16 or bf16, d in {64, 128}; outputs O (like q) and the
LSE ``(B, H, N_q)`` float32 in natural log; ``causal`` masks bottom-right (key j is visible to
query i when ``j <= i + N_k - N_q``); a row that sees no key gets O = 0 and LSE = -inf.

**This kernel cannot run here, nor on the lent H200** (sm_90 has no tensor memory and no
tcgen05): it needs an sm_100 GPU (B200, GB200). Gluon has no CPU interpreter. The correctness
argument is the structure — the same protocol as Exercise 4's simulated schedule, which is
checked for hazards and deadlock — plus ahead-of-time compilation: ``compile_for_sm100`` builds
it for ``GPUTarget("cuda", 100, 32)`` on any machine, and ``tests/test_ch7_gluon.py`` checks the
PTX (tcgen05.mma, tcgen05.alloc, TMA, mbarriers, setmaxnreg) and compares the shared memory,
tensor-memory columns and registers with ``planner``.

The kernel itself (``fa4_kernel`` and its roles) is device code in ``fa4_kernel``; this module
is its host side and re-exports those names.

Written for triton 3.9 (the CPU image) and 3.6 (the GPU images, Colab); the names that differ
are in ``fa4_kernel``'s shim (``SHIM``, re-exported here).
"""
from __future__ import annotations

import math

import triton
from triton.experimental.gluon import language as gl

from flashbook.aot import gluon_ast_source
from flashbook.gluon_kit import head_descriptors, validate_dense_qkv

from . import planner_model as planner    # the model only: planner's CLI compiles this module
from .fa4_kernel import SHIM, fa4_kernel, tmem_reg_layout   # the device code (re-exported)
from .planner_model import Config

__all__ = ["Config", "fa4_kernel", "kernel_args", "compile_for_sm100", "tile_layout",
           "TRITON_VERSION", "SHIM", "attention_fa4", "DTYPES", "HEAD_DIMS"]

TRITON_VERSION = tuple(int(p) for p in triton.__version__.split(".")[:2])
HEAD_DIMS = (64, 128)

LOG2E = 1.4426950408889634          # log2(e): the kernel's exponentials are exp2
LN2 = 0.6931471805599453            # ln(2): the LSE back to natural log


# ---------------------------------------------------------------------------------------------
# Launch arguments, the launcher, and the ahead-of-time compile
# ---------------------------------------------------------------------------------------------
_GL_DTYPES = {"float16": gl.float16, "bfloat16": gl.bfloat16}
_SHORT = {"float16": "fp16", "bfloat16": "bf16"}


def kernel_args(config: Config) -> dict:
    """The kernel's constexprs and launch options for a resolved ``config`` (the launcher and
    the ahead-of-time compile build the same kernel from this). ``num_warps`` is the default
    partition's (the correction); Triton adds the workers' warps and computes ``.maxnreg``.
    The correction is written for one warpgroup: ``CORRECTION_WARPS`` other than 4 is a what-if
    of the planner only."""
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
    """The shared-memory layout of one (1, rows, d) TMA box: 128-byte swizzle, what tcgen05
    reads."""
    return gl.NVMMASharedLayout.get_default_for([1, rows, head_dim], _GL_DTYPES[dtype])


def compile_for_sm100(config: Config):
    """Compile ``fa4_kernel`` for sm_100a (``GPUTarget("cuda", 100, 32)``) with a resolved
    ``config``; returns Triton's compiled kernel (``.asm["ptx"]``, ``.asm["cubin"]``,
    ``.metadata.shared``, ``.metadata.tmem_size``). Works without a GPU."""
    from triton.backends.compiler import GPUTarget
    if config.HEAD_DIM is None or config.DTYPE is None:
        raise ValueError("compile_for_sm100: resolve the config first (Config.for_inputs).")
    d, short = config.HEAD_DIM, _SHORT[config.DTYPE]

    def desc(rows):
        return f"tensordesc<{short}[1,{rows},{d}],{tile_layout(rows, d, config.DTYPE)!r}>"

    args = kernel_args(config)
    constexprs = args["constexprs"]
    signature = dict(q_desc=desc(config.BLOCK_M), k_desc=desc(config.BLOCK_N),
                     v_desc=desc(config.BLOCK_N), o_desc=desc(config.BLOCK_M), LSE="*fp32",
                     N_Q="i32", N_K="i32", qk_scale="fp32")
    signature.update({n: "constexpr" for n in constexprs})
    source = gluon_ast_source()(fn=fa4_kernel, signature=signature, constexprs=constexprs)
    return triton.compile(source, target=GPUTarget("cuda", 100, 32), options=args["options"])


def _torch_dtypes():
    import torch
    return {torch.float16: "float16", torch.bfloat16: "bfloat16"}


DTYPES = ("float16", "bfloat16")


def _validate(q, k, v, causal, softmax_scale, config):
    import torch
    name = "attention_fa4"
    B, H, N_q, d = validate_dense_qkv(
        name, q, k, v, HEAD_DIMS,
        head_dim_note=" (tensor memory: 2 x 128 columns of S + 2 x d of O <= 512)")
    names = _torch_dtypes()
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
    from dataclasses import replace
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
    """softmax(scale * Q K^T [+ causal mask]) V with the chapter's Gluon kernel on a B200.

    q ``(B, H, N_q, d)``, k and v ``(B, H, N_k, d)``, contiguous, fp16 or bf16, d in {64, 128}.
    ``causal`` aligns bottom-right. Returns O (like q) and the LSE ``(B, H, N_q)`` float32 in
    natural log (-inf, with O = 0, for a row that sees no key). Never run by the book's tests:
    no sm_100 GPU was available (see the module docstring)."""
    import torch
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
