"""Chapter 6's fastest Hopper kernel, FlashAttention-3's structure in Triton Gluon: the host side
(configs, launch arguments, ``attention_fa3``, the ahead-of-time compile) of ``fa3_kernel``, the
entry that runs the toolkit's roles (``flashbook.fa3_roles``). In the toolkit because Chapter 7's
benchmark runs it with its tricks as hooks; Chapter 6 re-exports ``attention_fa3``.

One program owns ``CONSUMERS * BLOCK_M`` query rows of one (batch, head), in three roles
(``gl.warp_specialize``, ``fa3_body``): a producer warp (24 registers a thread, ``setmaxnreg``)
TMA-loads the Q tiles, then streams K and V through a ring of ``STAGES`` SMEM slots, each with a
*full* mbarrier (the TMA's byte count) and an *empty* one (every consumer arrives); two consumer
warpgroups (240 registers) each run ``S = Q K^T`` and ``O += P V`` with async wgmma and the
online softmax in log2 between; a token passed through two mbarriers (the ping-pong) lets one
issue its GEMMs while the other runs its softmax. At d = 64 the planner picks three consumers
(160 registers each; the token goes round the three), as FlashAttention-3 does there: the
softmax is as long as at d = 128 but the GEMMs are half as long, and two consumers' GEMMs
cover one softmax where one consumer's cannot. ``OVERLAP`` writes FA3's intra-warpgroup
order (QK^T waited alone, K released at once, the PV wait after the softmax); ptxas (12.8,
13.x) still schedules that wait at the top of the softmax, yet on an H200 it was a little faster.

``Config(PERSISTENT=True)`` launches one CTA per SM instead (the planner's choice for causal
problems with N_q <= 4096 and non-causal ones up to 4096 rows at d = 128, 1024 at d = 64,
``planner.prefers_persistent``); each loops over work tiles (m_block, batch*head) of a static
schedule (``fa3_roles.work_tile``: sections of ``GROUP`` heads, the longest causal blocks first
in each, rounds in alternate directions), the ring's and the token's phases carried from tile
to tile, the next tile's K/V loaded while the consumers finish this one, and its Q as soon as
each consumer's last QK^T is done (O leaves through a tile of its own). Wave arithmetic: (1, 16, 2048, 128) has 16 x 16 = 256 work tiles of 16 K/V tiles each on
132 SMs, 1.94 waves, so each SM runs two chains of 16 tiles and pays two fills and drains;
(1, 16, 16384, 128), 2048 tiles, 15.5 waves, pays them 16 times over chains of 128. Causal, the
default grid's CTAs differ in work and a short problem's few waves end unevenly, which the snake
schedule evens out: on an H100 the persistent kernel won at every causal problem measured with
N_q <= 4096 and lost at N_q = 16384, where the many short waves already balance
(``fa3_planner.predict`` models both grids, but balances the default one's causal CTAs
perfectly: the choice is the planner's measured rule). Non-causal, a short problem's grid CTA
of a few K/V tiles waits for its Q at the start and its O store at the end, which the
persistent kernel overlaps with the neighbouring work tiles.

Inputs ``(B, H, N, d)`` contiguous, fp16 or bf16, d in {64, 128}, any lengths (3-D TMA
descriptors ``(B*H, N, d)``: reads past a head are zeros, stores are clipped); O like q and the
LSE ``(B, H, N_q)`` float32 in natural log; causal bottom-right, a row with no key O = 0 and
LSE = -inf. Gluon has no CPU interpreter: it runs on sm_90 only; ``tests/test_ch6.py`` compiles
it for sm_90a on a CPU and checks the PTX and the shared memory against the planner.
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
from flashbook.fa3_body import fa3_hooked_kernel
from flashbook.fa3_roles import exp2_mufu, move_max, rescale_o
from flashbook.gluon_kit import head_descriptors, rebased, require_sm90, validate_dense_qkv
from flashbook.plans import Launch, Plans, key
from flashbook.tiles import LOG2E

from . import fa3_planner as planner
from .fa3_kernel import fa3_kernel                     # the device code
from .fa3_planner import Config

__all__ = ["attention_fa3", "Config", "fa3_kernel", "pick_config", "kernel_args", "tile_layout",
           "grid", "DTYPES", "HEAD_DIMS", "compile_for_sm90"]

DTYPES = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16}
HEAD_DIMS = (64, 128)
HOOKS = dict(EXP2=exp2_mufu, MOVE_MAX=move_max, RESCALE=rescale_o)   # FlashAttention-3's


_TORCH_DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16"}


@functools.lru_cache(maxsize=256)
def pick_config(head_dim: int, dtype: torch.dtype = torch.float16, causal: bool = False,
                B: int = 1, H: int = 16, N_q: int = 16384, N_k: int | None = None) -> Config:
    """The planner's choice (``planner.best``: the model's fastest feasible tiles, persistent
    for short problems, ``planner.prefers_persistent``), cached: planning takes milliseconds
    of Python (``Config`` is frozen: sharing it is safe)."""
    return planner.best(head_dim, _TORCH_DTYPE_NAMES[dtype], B=B, H=H, N_q=N_q, N_k=N_k,
                        causal=causal)


@functools.lru_cache(maxsize=256)
def kernel_args(config: Config) -> dict:
    """The kernel's constexprs and launch options for a resolved ``config`` (launcher and
    ahead-of-time compile alike). Cached: callers must not change it."""
    budget = planner.register_budget(config)
    return dict(constexprs=dict(BLOCK_M=config.BLOCK_M, BLOCK_N=config.BLOCK_N,
                                HEAD_DIM=config.HEAD_DIM, STAGES=config.STAGES,
                                OVERLAP=config.OVERLAP, CONSUMER_REGS=budget["consumer"],
                                PRODUCER_REGS=budget["producer"],
                                PERSISTENT=bool(config.PERSISTENT), GROUP=int(config.GROUP),
                                CONSUMERS=int(config.CONSUMERS)),
                options=dict(num_warps=4, maxnreg=budget["launch"]))


@functools.lru_cache(maxsize=64)
def tile_layout(rows: int, head_dim: int, dtype: torch.dtype):
    """The SMEM layout of one (1, rows, d) TMA box: 128-byte swizzle, what wgmma reads (cached:
    about 10 µs of Python)."""
    return gl.NVMMASharedLayout.get_default_for([1, rows, head_dim], DTYPES[dtype])


@functools.lru_cache(maxsize=256)
def _resolved(config: Config, d: int, dtype_name: str) -> Config:
    """``config`` for these inputs, checked against the kernel and the H100/H200 (cached)."""
    name = "attention_fa3"
    config = config.for_inputs(d, dtype_name)
    verdict = planner.feasible(config)
    if not verdict:
        raise ValueError(f"{name}: config {config} does not fit an H100/H200: "
                         + "; ".join(verdict.reasons) + ".")
    return config


@functools.lru_cache(maxsize=16)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def grid(config: Config, B: int, H: int, N_q: int, sms: int) -> tuple[int, int]:
    """The launch grid: a CTA per (CONSUMERS*BLOCK_M query rows, batch*head), or,
    ``PERSISTENT``, one per SM (``sms``; fewer when there are fewer work tiles), each looping
    over its tiles."""
    m_blocks = cdiv(N_q, config.rows_per_cta)
    if config.PERSISTENT:
        return min(sms, m_blocks * B * H), 1
    return m_blocks, B * H


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
    require_sm90(name, q.device, "wgmma, TMA, setmaxnreg")
    return config, softmax_scale


_FA3_PLANS = Plans()


def attention_fa3(q, k, v, causal: bool = False, softmax_scale: float | None = None,
                  config: Config | None = None, hooks: dict | None = None):
    """softmax(scale * Q K^T [+ causal mask]) V with the Gluon FA3 kernel on an H100/H200.

    q ``(B, H, N_q, d)``, k and v ``(B, H, N_k, d)``, contiguous, fp16 or bf16, d in {64, 128};
    causal bottom-right; ``softmax_scale`` default 1/sqrt(d); ``config`` default
    ``pick_config``. Returns O (like q) and the LSE ``(B, H, N_q)`` float32, natural log (-inf,
    O = 0, where a row sees no key). ``hooks``: other softmax hooks of the same roles
    (``fa3_roles``: ``EXP2``, ``MOVE_MAX``, ``RESCALE``), launched through
    ``fa3_hooked_kernel``. Checks, config, grid and descriptors are remembered by the inputs'
    metadata (``plans``)."""
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
    """(the ``Launch``, the TMA descriptors of q, k, v, o as templates for ``rebased``), or
    ``_NO_ROWS``/``_NO_KEYS``."""
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
    sms = _sm_count(q.device) if config.PERSISTENT else 0
    launch = Launch(kernel, grid(config, B, H, N_q, sms), (N_q, N_k, scale * LOG2E),   # exp2
                    dict(CAUSAL=bool(causal), **args["constexprs"], **hooks, **args["options"]))
    return launch, descriptors


def _entry(hooks) -> tuple:
    """(the kernel entry, its hooks' constexprs): ``fa3_kernel``, or the toolkit's
    ``fa3_hooked_kernel`` with every hook FlashAttention-3's unless ``hooks`` names it."""
    if not hooks:
        return fa3_kernel, {}
    return fa3_hooked_kernel, {**HOOKS, **dict(hooks)}


def compile_for_sm90(config: Config, causal: bool = False, hooks: dict | None = None):
    """Compile ``fa3_kernel`` for sm_90a with a resolved ``config``, on any machine (no GPU);
    returns Triton's compiled kernel (``.asm["ptx"]``, ``.asm["cubin"]``, ``.metadata.shared``).
    ``hooks`` as in ``attention_fa3``."""
    from triton.backends.compiler import GPUTarget
    if config.HEAD_DIM is None or config.DTYPE is None:
        raise ValueError("compile_for_sm90: resolve the config first (Config.for_inputs).")
    dtype = getattr(torch, config.DTYPE)
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
