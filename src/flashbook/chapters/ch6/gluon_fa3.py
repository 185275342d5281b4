"""Chapter 6's fastest Hopper kernel: FlashAttention-3's structure written in Triton Gluon.

One program (CTA) owns ``2 * BLOCK_M`` query rows of one (batch, head) and runs three roles, each
in its own warps (``gl.warp_specialize``):

* **producer** (1 warp, 24 registers a thread): TMA-loads the two Q tiles once, then streams the
  K and V tiles of the head through a ring of ``STAGES`` shared-memory slots. Each slot has a
  *full* mbarrier (the TMA arrives with the tile's byte count) and an *empty* one (both
  consumers arrive when they no longer read it).
* **two consumers** (one warpgroup each, 240 registers a thread): each owns its own BLOCK_M-row
  Q tile and runs ``S = Q K^T`` and ``O += P V`` on the tensor cores with ``warpgroup_mma``
  (wgmma, asynchronous, waited with ``warpgroup_mma_wait``) and the online softmax in the log2
  domain between them.
* **ping-pong**: a token passed between the consumers through two mbarriers lets one warpgroup
  issue its GEMMs (``QK^T`` of this tile, ``PV`` of the previous one) while the other runs its
  softmax, so the tensor cores stay busy. ``OVERLAP`` writes FlashAttention-3's
  intra-warpgroup order: ``QK^T`` is waited for alone (K released at once) and the ``PV`` wait
  comes after the softmax in the source. ptxas (12.8 and 13.x) still schedules that PV wait at
  the top of the softmax block (seen in the SASS), so the softmax does not really run under the
  warpgroup's own PV; on an H200 the order was still a little faster than one wait for both.

Registers are moved from the producer to the consumers with ``setmaxnreg``: the compiler emits
it from the per-partition requests (``planner.register_budget``).

Inputs ``(B, H, N, d)`` contiguous, fp16 or bf16, d in {64, 128}; K and V may have another
length than Q. Outputs O (like q) and the LSE ``(B, H, N_q)`` float32 in natural log.
``causal`` masks bottom-right (key j is visible to query i when ``j <= i + N_k - N_q``, the usual
mask when ``N_q == N_k``); a row that sees no key gets O = 0 and LSE = -inf. Any length works:
the TMA descriptors are 3-D ``(B*H, N, d)``, so tiles past the end of a head read zeros and
stores past it are clipped.

The kernel itself is device code: its entry ``fa3_kernel`` (in ``fa3_kernel``) runs the
toolkit's roles (``flashbook.fa3_roles``); this module is its host side and re-exports it.

Gluon has no CPU interpreter: the kernel runs only on an sm_90 GPU. ``tests/test_ch6.py``
compiles it ahead of time for sm_90a on a CPU machine and checks the PTX and the shared memory
against the planner.
"""
from __future__ import annotations

import functools
import math

import torch
import triton
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from flashbook.aot import gluon_ast_source
from flashbook.cases import cdiv
from flashbook.fa3_roles import exp2_mufu, fa3_hooked_kernel, move_max, rescale_o
from flashbook.gluon_kit import head_descriptors, rebased, tma_load, tma_store, \
    validate_dense_qkv
from flashbook.plans import Launch, Plans, key

from . import planner
from .fa3_kernel import fa3_kernel                     # the device code
from .planner import Config

__all__ = ["attention_fa3", "Config", "fa3_kernel", "pick_config", "kernel_args", "tile_layout",
           "TRITON_VERSION", "tma_load", "tma_store", "DTYPES", "HEAD_DIMS",
           "compile_for_sm90"]

TRITON_VERSION = tuple(int(p) for p in triton.__version__.split(".")[:2])

# The names that differ between triton 3.6 and 3.9 (TMA copies) are in flashbook.gluon_kit;
# everything else the kernel (fa3_kernel) uses is spelled the same in both (positional
# ``mbarrier.expect(bar, nbytes)``, ``gl.warp_specialize(pairs, warps, regs)``,
# ``warpgroup_mma(..., is_async=True)``).
LOG2E = 1.4426950408889634          # log2(e): the kernel's exponentials are exp2
LN2 = 0.6931471805599453            # ln(2): LSE back to natural log (written out in the kernel)
DTYPES = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16}
HEAD_DIMS = (64, 128)
HOOKS = dict(EXP2=exp2_mufu, MOVE_MAX=move_max, RESCALE=rescale_o)   # FlashAttention-3's


# ---------------------------------------------------------------------------------------------
# The launcher
# ---------------------------------------------------------------------------------------------
_TORCH_DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16"}


@functools.lru_cache(maxsize=256)
def pick_config(head_dim: int, dtype: torch.dtype = torch.float16, causal: bool = False,
                B: int = 1, H: int = 16, N_q: int = 16384, N_k: int | None = None) -> Config:
    """The planner's fastest feasible config for this problem (``planner.best``), cached by the
    arguments (the planner takes milliseconds of Python; a call of ``attention_fa3`` without a
    config would otherwise pay them every time). ``Config`` is frozen: sharing it is safe."""
    return planner.best(head_dim, _TORCH_DTYPE_NAMES[dtype], B=B, H=H, N_q=N_q, N_k=N_k,
                        causal=causal)


@functools.lru_cache(maxsize=256)
def kernel_args(config: Config) -> dict:
    """The kernel's constexprs and launch options for a resolved ``config`` (the launcher and
    the ahead-of-time tests build the same kernel from this). Cached by its argument: callers
    unpack it and must not change it."""
    budget = planner.register_budget(config)
    return dict(constexprs=dict(BLOCK_M=config.BLOCK_M, BLOCK_N=config.BLOCK_N,
                                HEAD_DIM=config.HEAD_DIM, STAGES=config.STAGES,
                                OVERLAP=config.OVERLAP, CONSUMER_REGS=budget["consumer"],
                                PRODUCER_REGS=budget["producer"]),
                options=dict(num_warps=4, maxnreg=budget["launch"]))


@functools.lru_cache(maxsize=64)
def tile_layout(rows: int, head_dim: int, dtype: torch.dtype):
    """The shared-memory layout of one (1, rows, d) TMA box: 128-byte swizzle, what wgmma reads.
    Cached: building it takes about 10 µs of Python, twice per launch otherwise."""
    return gl.NVMMASharedLayout.get_default_for([1, rows, head_dim], DTYPES[dtype])


@functools.lru_cache(maxsize=256)
def _resolved(config: Config, d: int, dtype_name: str) -> Config:
    """``config`` for these inputs, checked against the kernel and the H100/H200 (the planner's
    verdict takes about 10 µs of Python: cached by the frozen config)."""
    name = "attention_fa3"
    config = config.for_inputs(d, dtype_name)
    if config.CONSUMERS != 2:
        raise ValueError(f"{name}: the kernel has two consumer warpgroups; got "
                         f"CONSUMERS={config.CONSUMERS}.")
    verdict = planner.feasible(config)
    if not verdict:
        raise ValueError(f"{name}: config {config} does not fit an H100/H200: "
                         + "; ".join(verdict.reasons) + ".")
    return config


@functools.lru_cache(maxsize=16)
def _capability(device: torch.device) -> tuple:
    return tuple(torch.cuda.get_device_capability(device))


def _validate(q, k, v, causal, softmax_scale, config):
    name = "attention_fa3"
    B, H, N_q, d = validate_dense_qkv(
        name, q, k, v, HEAD_DIMS, heads_note=" (no grouped-query heads)",
        head_dim_note=" (its tile configurations are made for these two; for another d, zero-pad "
                      "q, k and v to 64 or 128, pass softmax_scale=1/sqrt(d) and slice O back)")
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(d)
    softmax_scale = float(softmax_scale)
    if not softmax_scale > 0 or math.isinf(softmax_scale):
        raise ValueError(f"{name}: softmax_scale must be a positive finite number, got "
                         f"{softmax_scale}.")
    dtype_name = _TORCH_DTYPE_NAMES[q.dtype]
    if config is None:
        config = pick_config(d, q.dtype, causal, B, H, max(N_q, 1), max(k.shape[2], 1))
    if not isinstance(config, Config):
        raise ValueError(f"{name}: config must be a {__name__}.Config, got "
                         f"{type(config).__name__}.")
    if config.HEAD_DIM not in (None, d) or config.DTYPE not in (None, dtype_name):
        raise ValueError(f"{name}: config is for d={config.HEAD_DIM}, {config.DTYPE}; the inputs "
                         f"are d={d}, {dtype_name}.")
    config = _resolved(config, d, dtype_name)
    for label, t in (("q", q), ("k", k), ("v", v)):
        if t.device.type != "cuda":
            raise ValueError(f"{name}: {label} is on {t.device.type}; this Gluon kernel runs only "
                             "on a CUDA GPU of compute capability 9.0 (H100/H200). Gluon has no "
                             "CPU interpreter.")
    if not (q.device == k.device == v.device):
        raise ValueError(f"{name}: q, k and v must be on one device, got {q.device}, {k.device}, "
                         f"{v.device}.")
    cap = _capability(q.device)
    if cap != (9, 0):
        raise ValueError(f"{name}: needs an sm_90 GPU (H100/H200: wgmma, TMA, setmaxnreg); "
                         f"{torch.cuda.get_device_name(q.device)} is sm_{cap[0]}{cap[1]}.")
    return config, softmax_scale


_FA3_PLANS = Plans()


def attention_fa3(q, k, v, causal: bool = False, softmax_scale: float | None = None,
                  config: Config | None = None, hooks: dict | None = None):
    """softmax(scale * Q K^T [+ causal mask]) V with the Gluon FA3 kernel on an H100/H200.

    q ``(B, H, N_q, d)``, k and v ``(B, H, N_k, d)``, contiguous, fp16 or bf16, d in {64, 128}.
    ``causal`` aligns bottom-right (key j visible to query i when j <= i + N_k - N_q).
    ``softmax_scale`` defaults to 1/sqrt(d). ``config``: a ``Config`` (None: ``pick_config``).
    Returns O (like q) and the LSE ``(B, H, N_q)`` float32 in natural log (-inf, with O = 0,
    for a row that sees no key). ``hooks``: other softmax hooks of the same roles
    (``flashbook.fa3_roles``: ``EXP2``, ``MOVE_MAX``, ``RESCALE``), launched through the
    toolkit's ``fa3_hooked_kernel`` (Chapter 7's benchmark times its tricks so). The checks, the config, the
    grid and the TMA descriptors' shapes are remembered by the inputs' metadata (``plans``)."""
    hooks = tuple(sorted((hooks or {}).items()))
    plan_key = key(q, k, v, causal, softmax_scale, config, hooks)
    plan = _FA3_PLANS.get(plan_key)
    if plan is None:
        plan = _FA3_PLANS.remember(plan_key, _fa3_plan(q, k, v, causal, softmax_scale, config,
                                                       hooks))
    o = torch.empty_like(q)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    if plan is _NO_ROWS:
        return o, lse
    if plan is _NO_KEYS:                           # no key at all: the empty-row convention
        return o.zero_(), lse.fill_(-float("inf"))
    launch, descriptors = plan
    q_desc, k_desc, v_desc, o_desc = (rebased(d, t) for d, t in zip(descriptors, (q, k, v, o)))
    if q.device.index == torch.cuda.current_device():
        launch(q_desc, k_desc, v_desc, o_desc, lse)
    else:
        with torch.cuda.device(q.device):
            launch(q_desc, k_desc, v_desc, o_desc, lse)
    return o, lse


_NO_ROWS, _NO_KEYS = object(), object()     # plans that launch nothing


def _fa3_plan(q, k, v, causal, softmax_scale, config, hooks):
    """attention_fa3's checks, config and grid: (the ``Launch``, the four TMA descriptors of q,
    k, v and o, as templates for ``rebased``), or ``_NO_ROWS``/``_NO_KEYS``."""
    if {name for name, _ in hooks} - set(HOOKS):
        raise ValueError(f"attention_fa3: hooks are {', '.join(HOOKS)}, got "
                         f"{', '.join(name for name, _ in hooks)}.")
    config, scale = _validate(q, k, v, causal, softmax_scale, config)
    B, H, N_q, d = q.shape
    N_k = k.shape[2]
    if N_q == 0 or B * H == 0:
        return _NO_ROWS
    if N_k == 0:
        return _NO_KEYS
    bm, bn = config.BLOCK_M, config.BLOCK_N
    descriptors = head_descriptors(TensorDescriptor, q, k, v, torch.empty_like(q), bm, bn,
                                   tile_layout(bm, d, q.dtype), tile_layout(bn, d, q.dtype))
    for descriptor in descriptors:      # templates: the plan must not keep these tensors alive
        descriptor.base = None
    args = kernel_args(config)
    kernel, hooks = _entry(hooks)
    launch = Launch(kernel, (cdiv(N_q, 2 * bm), B * H), (N_q, N_k, scale * LOG2E),
                    dict(CAUSAL=bool(causal), **args["constexprs"], **hooks, **args["options"]))
    return launch, descriptors


# ---------------------------------------------------------------------------------------------
# Ahead of time: compile for sm_90a on any machine (no GPU needed)
# ---------------------------------------------------------------------------------------------
def _entry(hooks) -> tuple:
    """(the kernel entry, its hooks' constexprs): ``fa3_kernel``, or the toolkit's
    ``fa3_hooked_kernel`` with every hook FlashAttention-3's unless ``hooks`` names it."""
    if not hooks:
        return fa3_kernel, {}
    return fa3_hooked_kernel, {**HOOKS, **dict(hooks)}


def compile_for_sm90(config: Config, causal: bool = False, hooks: dict | None = None):
    """Compile ``fa3_kernel`` for sm_90a (``GPUTarget("cuda", 90, 32)``) with a resolved
    ``config`` (``Config.for_inputs``); returns Triton's compiled kernel (``.asm["ptx"]``,
    ``.asm["cubin"]``, ``.metadata.shared``). Works without a GPU. ``hooks`` as in
    ``attention_fa3``."""
    from triton.backends.compiler import GPUTarget
    if config.HEAD_DIM is None or config.DTYPE is None:
        raise ValueError("compile_for_sm90: resolve the config first (Config.for_inputs).")
    dtype = {"float16": torch.float16, "bfloat16": torch.bfloat16}[config.DTYPE]
    short = {"float16": "fp16", "bfloat16": "bf16"}[config.DTYPE]
    d = config.HEAD_DIM

    def desc(rows):
        return f"tensordesc<{short}[1,{rows},{d}],{tile_layout(rows, d, dtype)!r}>"

    args = kernel_args(config)
    kernel, hooks = _entry(tuple(sorted((hooks or {}).items())))
    constexprs = dict(args["constexprs"], CAUSAL=bool(causal), **hooks)
    signature = dict(q_desc=desc(config.BLOCK_M), k_desc=desc(config.BLOCK_N),
                     v_desc=desc(config.BLOCK_N), o_desc=desc(config.BLOCK_M), LSE="*fp32",
                     N_Q="i32", N_K="i32", qk_scale="fp32")
    signature.update({n: "constexpr" for n in constexprs})
    source = gluon_ast_source()(fn=kernel, signature=signature, constexprs=constexprs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=args["options"])
