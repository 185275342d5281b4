"""Chapter 9's fastest backward so far: FlashAttention-3's one-kernel backward written in
Triton Gluon for an H100/H200 (sm_90), without FlashAttention-3's warp specialization.

Course material, not package material: it is Exercises 1 and 2's algorithm in another
language, so it lives beside the solutions (``sources.course_module``) and ``flashbook bench
ch9`` times it as ``ch9_bwd_gluon`` where the course's checkout is present.

One program (CTA) owns ``BLOCK_N`` keys of one (batch, head), 16 a warp (``BLOCK_N`` = 128:
two warpgroups; 64: one, and two CTAs share an SM): it TMA-loads its K and V tiles once and
keeps dK and dV ``(BLOCK_N, d)`` in fp32 registers. It then walks the query tiles that see its keys; a tile
is ``BLOCK_M`` rows of Q, dO, LSE and D, TMA-loaded ``STAGES - 1`` tiles ahead into a ring of
shared-memory slots (one mbarrier a slot, which the TMA completes with the bytes). Per tile,
five GEMMs on the tensor cores (``warpgroup_mma``, asynchronous):

    S^T  = K Q^T          (BLOCK_N, BLOCK_M)   A = K from smem, B = Q^T (a transposed view)
    dP^T = V dO^T         (BLOCK_N, BLOCK_M)   issued with S^T: it runs under P's exponentials
    P^T  = exp2(S^T * scale * log2 e - LSE * log2 e)                 (registers)
    dV  += P^T dO         (BLOCK_N, d)         A = P^T from registers
    dS^T = P^T * (dP^T - D)                    (runs under dV's GEMM)
    dK  += dS^T Q         (BLOCK_N, d)         A = dS^T from registers (and stored to smem)
    dQ^T = K^T dS^T       (d, BLOCK_M)         A = K^T (a transposed view): M = d, so a tile
                                               of 32 query rows is possible (wgmma's M is 64
                                               a warpgroup); d = 64 splits BLOCK_M instead

dQ^T (times the softmax scale) goes to shared memory, transposed back, and one TMA reduce-add
(``cp.reduce.async.bulk.tensor``) adds it into an fp32 buffer ``dq_acc (B*H, N_q, d)`` in L2:
every K/V program adds into the same rows, so dQ's last bits depend on the order the programs
finish (not deterministic, like FlashAttention-3's default). Two staging buffers let a reduce
finish reading while the next tile computes. Afterwards ``dq_acc`` is cast to q's dtype.

Against the chapter's two kernels this runs five GEMMs a tile pair in place of seven, and
against ``ch9_one_kernel.py`` (Triton) it overlaps explicitly: the two GEMMs of a step that do
not depend on each other are in flight together, and the exponentials and dS run while the
tensor cores work on the GEMM before them. All the warps still do every job in turn, meeting
at a CTA barrier four times a step; FlashAttention-3 gives the loads and the dQ reduces their
own warps. Chapter 9's Section 7 quotes what it measured and where the time goes.

Inputs dense ``(B, H, N, d)`` contiguous, fp16 or bf16, d in {64, 128}, K and V as long as Q
or not; ``causal`` aligns bottom-right like every kernel of the book. LSE ``(B, H, N_q)`` fp32 in
natural log (the forward's). Gluon has no CPU interpreter: this runs only on sm_90.
"""
from __future__ import annotations

import dataclasses

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                              warpgroup_mma, warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from flashbook.aot import gluon_ast_source
from flashbook.cases import validate_scale
from flashbook.gluon_kit import cta_barrier, lse_and_delta_rows, smem_reinterpret, tma_load, \
    require_sm90, tma_reduce_add, tma_store, validate_backward_inputs, validate_dense_qkv

__all__ = ["gluon_backward", "bwd_kernel", "GluonBwdConfig", "gluon_bwd_config",
           "compile_for_sm90"]

LOG2E = 1.4426950408889634
DTYPES = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16}
HEAD_DIMS = (64, 128)


@dataclasses.dataclass(frozen=True)
class GluonBwdConfig:
    """Query rows a step, keys a program (16 a warp: 64 or 128), slots in the Q/dO ring."""
    BLOCK_M: int
    BLOCK_N: int
    STAGES: int


def gluon_bwd_config(d: int) -> GluonBwdConfig:
    """The fastest of the configs measured on the H200 at d = 128: (32, 128, 2) (the 64-row
    tile spills registers; a third slot did not help; 64 keys a CTA, two CTAs an SM, was
    slower: twice the dQ reduces); (64, 128, 3) at d = 64. Shared memory at d = 128: K, V
    64 KB; two slots of Q, dO 32 KB; dS^T 8 KB; two fp32 dQ staging tiles 32 KB: 137 KB of 227."""
    return GluonBwdConfig(32, 128, 2) if d > 64 else GluonBwdConfig(64, 128, 3)


def _check_config(cfg) -> GluonBwdConfig:
    if not isinstance(cfg, GluonBwdConfig):
        raise ValueError("gluon_backward: config must be a GluonBwdConfig, got "
                         f"{type(cfg).__name__}.")
    if cfg.BLOCK_N not in (64, 128) or cfg.BLOCK_M not in (32, 64) or not 2 <= cfg.STAGES <= 4:
        raise ValueError(f"gluon_backward: {cfg} is not supported: BLOCK_N in (64, 128) (one "
                         "or two warpgroups of 64 keys), BLOCK_M in (32, 64), STAGES in 2..4.")
    return cfg


# ---------------------------------------------------------------------------------------------
# The kernel
# ---------------------------------------------------------------------------------------------
@gluon.jit
def _load_rows(t, n_iter, tile0, bh, q_desc, do_desc, lse_desc, dl_desc, q_ring, do_ring,
               lse_ring, dl_ring, ready, BLOCK_M: gl.constexpr, STAGES: gl.constexpr):
    """TMA-load step t's query tile (rows of Q, dO, LSE, D) into slot t % STAGES, if step t
    exists. The barrier's expected bytes are whole boxes: rows past N_q arrive as zeros."""
    if t < n_iter:
        s = t % STAGES
        row = (tile0 + t) * BLOCK_M
        bar = ready.index(s)
        mbarrier.expect(bar, 2 * q_desc.block_type.nbytes + 2 * lse_desc.block_type.nbytes)
        tma_load(q_desc, [bh, row, 0], bar, q_ring.index(s))
        tma_load(do_desc, [bh, row, 0], bar, do_ring.index(s))
        tma_load(lse_desc, [bh, row], bar, lse_ring.index(s))
        tma_load(dl_desc, [bh, row], bar, dl_ring.index(s))


@gluon.constexpr_function
def _layouts_of(BLOCK_M, BLOCK_N, HEAD_DIM):
    """The register layouts, for BLOCK_N / 16 warps (each owns 16 keys): S^T and dP^T
    (BLOCK_N, BLOCK_M) and dK, dV (BLOCK_N, d) split by rows; dQ^T (d, BLOCK_M) by rows when d
    has 16 for every warp, else by columns too (a warpgroup's wgmma is 64 rows)."""
    warps = BLOCK_N // 16
    s_layout = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps, 1],
                                         instr_shape=[16, BLOCK_M, 16])
    kv_layout = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps, 1],
                                          instr_shape=[16, HEAD_DIM, 16])
    split = 1 if HEAD_DIM >= 16 * warps else warps // 4
    dq_layout = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps // split, split],
                                          instr_shape=[16, BLOCK_M // split, 16])
    return s_layout, kv_layout, dq_layout


@gluon.jit
def _step(t, dk, dv, tile0, n_iter, bh, n0, N_Q, diag, qk_scale, sm_scale, k_tile, v_tile,
          q_ring, do_ring, lse_ring, dl_ring, ready, ds_smem, dq_ring, q_desc, do_desc,
          lse_desc, dl_desc, dq_desc, MASKED: gl.constexpr, CAUSAL: gl.constexpr,
          BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
          STAGES: gl.constexpr):
    """Step t: the five GEMMs of query tile t past the program's keys; dK and dV
    accumulated, dQ's share reduced into dq_acc. ``MASKED``: the tile crosses the causal
    diagonal or N_q."""
    dtype: gl.constexpr = q_desc.dtype
    s_layout: gl.constexpr = _layouts_of(BLOCK_M, BLOCK_N, HEAD_DIM)[0]
    kv_layout: gl.constexpr = _layouts_of(BLOCK_M, BLOCK_N, HEAD_DIM)[1]
    dq_layout: gl.constexpr = _layouts_of(BLOCK_M, BLOCK_N, HEAD_DIM)[2]
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_layout, k_width=2)
    q_cols: gl.constexpr = gl.SliceLayout(0, s_layout)      # one value per query row
    k_rows: gl.constexpr = gl.SliceLayout(1, s_layout)      # one value per key
    vec: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])   # a (1, BLOCK_M) box as a vector

    s = t % STAGES
    # every warp is past step t - 1 (its wgmmas waited, its LSE/D reads done): the slot it
    # used may be refilled, STAGES - 1 tiles ahead, and dS^T's buffer rewritten
    cta_barrier()
    _load_rows(t + STAGES - 1, n_iter, tile0, bh, q_desc, do_desc, lse_desc, dl_desc, q_ring,
               do_ring, lse_ring, dl_ring, ready, BLOCK_M, STAGES)
    mbarrier.wait(ready.index(s), (t // STAGES) & 1)
    q_tile = q_ring.index(s).reshape([BLOCK_M, HEAD_DIM])
    do_tile = do_ring.index(s).reshape([BLOCK_M, HEAD_DIM])
    zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, s_layout)
    sT = warpgroup_mma(k_tile, q_tile.permute((1, 0)), zero, use_acc=False, is_async=True)
    dpT = warpgroup_mma(v_tile, do_tile.permute((1, 0)), zero, use_acc=False, is_async=True)

    lse2 = smem_reinterpret(lse_ring.index(s), gl.float32, [BLOCK_M], vec).load(q_cols)
    lse2 = lse2 * 1.4426950408889634                      # log2(e): the LSE in base 2
    sT = warpgroup_mma_wait(1, deps=[sT])                  # dP^T may still run
    pT = gl.exp2(sT * qk_scale - gl.expand_dims(lse2, 0))
    if MASKED:
        rows = (tile0 + t) * BLOCK_M + gl.arange(0, BLOCK_M, layout=q_cols)
        ok = gl.expand_dims(rows < N_Q, 0)
        if CAUSAL:
            keys = n0 + gl.arange(0, BLOCK_N, layout=k_rows)
            ok = ok & (gl.expand_dims(keys, 1) <= gl.expand_dims(rows, 0) + diag)
        pT = gl.where(ok, pT, 0.0)
    dv = warpgroup_mma(gl.convert_layout(pT.to(dtype), a_layout), do_tile, dv, is_async=True)
    delta = smem_reinterpret(dl_ring.index(s), gl.float32, [BLOCK_M], vec).load(q_cols)
    dpT = warpgroup_mma_wait(1, deps=[dpT])                # dV's GEMM may still run

    # dK's GEMM takes dS^T from registers; dQ's reads it from shared memory, transposed and
    # across both warpgroups' rows
    ds16 = (pT * (dpT - gl.expand_dims(delta, 0))).to(dtype)
    ds_smem.store(ds16)
    dk = warpgroup_mma(gl.convert_layout(ds16, a_layout), q_tile, dk, is_async=True)
    fence_async_shared()          # generic-proxy stores -> the wgmma's (async-proxy) reads
    cta_barrier()
    zero_q = gl.zeros([HEAD_DIM, BLOCK_M], gl.float32, dq_layout)
    dq = warpgroup_mma(k_tile.permute((1, 0)), ds_smem, zero_q, use_acc=False, is_async=True)
    dv, dk, dq = warpgroup_mma_wait(0, deps=[dv, dk, dq])

    # dQ^T's share -> staging buffer t % 2 (the reduce issued from it two steps ago has
    # finished reading once at most one reduce is pending) -> one TMA reduce-add
    dq_buf = dq_ring.index(t % 2)
    tma.store_wait(1)
    cta_barrier()
    dq_buf.reshape([BLOCK_M, HEAD_DIM]).permute((1, 0)).store(dq * sm_scale)
    fence_async_shared()
    cta_barrier()
    tma_reduce_add(dq_desc, [bh, (tile0 + t) * BLOCK_M, 0], dq_buf)
    return dk, dv


@gluon.jit(do_not_specialize=["N_Q", "N_K"])
def bwd_kernel(q_desc, k_desc, v_desc, do_desc, lse_desc, dl_desc, dq_desc, dk_desc, dv_desc,
               N_Q, N_K, qk_scale, sm_scale, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
               HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr):
    """Grid (cdiv(N_k, BLOCK_N), B*H), BLOCK_N / 16 warps. Descriptors: q, do (B*H, N_q, d) boxes
    (1, BLOCK_M, d); k, v, dk, dv (B*H, N_k, d) boxes (1, BLOCK_N, d); lse, D (B*H, N_q padded
    to 4) fp32 boxes (1, BLOCK_M); dq_acc (B*H, N_q, d) fp32 boxes (1, BLOCK_M, d)."""
    dtype: gl.constexpr = q_desc.dtype
    kv_layout: gl.constexpr = _layouts_of(BLOCK_M, BLOCK_N, HEAD_DIM)[1]
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], dtype)

    n0 = gl.program_id(0) * BLOCK_N
    bh = gl.program_id(1)

    k_smem = gl.allocate_shared_memory(dtype, k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, v_desc.block_type.shape, v_desc.layout)
    q_ring = gl.allocate_shared_memory(dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
    do_ring = gl.allocate_shared_memory(dtype, [STAGES] + do_desc.block_type.shape,
                                        do_desc.layout)
    lse_ring = gl.allocate_shared_memory(gl.float32, [STAGES] + lse_desc.block_type.shape,
                                         lse_desc.layout)
    dl_ring = gl.allocate_shared_memory(gl.float32, [STAGES] + dl_desc.block_type.shape,
                                        dl_desc.layout)
    ds_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, BLOCK_M], ds_layout)
    dq_ring = gl.allocate_shared_memory(gl.float32, [2] + dq_desc.block_type.shape,
                                        dq_desc.layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar.index(0), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
    fence_async_shared()

    # the query tiles that see keys [n0, n0 + BLOCK_N): row i sees key j iff j <= i + diag
    diag = N_K - N_Q
    hi = gl.cdiv(N_Q, BLOCK_M)
    full_hi = N_Q // BLOCK_M                       # tiles below have no row past N_q
    if CAUSAL:
        lo = gl.minimum(gl.maximum(n0 - diag, 0) // BLOCK_M, hi)
        mid = gl.minimum(gl.maximum(gl.cdiv(n0 + BLOCK_N - 1 - diag, BLOCK_M), lo), hi)
    else:
        lo = 0
        mid = 0
    tail = gl.maximum(mid, full_hi)
    n_iter = hi - lo

    bar = kv_bar.index(0)
    mbarrier.expect(bar, 2 * k_desc.block_type.nbytes)
    tma_load(k_desc, [bh, n0, 0], bar, k_smem)
    tma_load(v_desc, [bh, n0, 0], bar, v_smem)
    for t in gl.static_range(STAGES - 1):
        _load_rows(t, n_iter, lo, bh, q_desc, do_desc, lse_desc, dl_desc, q_ring, do_ring,
                   lse_ring, dl_ring, ready, BLOCK_M, STAGES)
    k_tile = k_smem.reshape([BLOCK_N, HEAD_DIM])
    v_tile = v_smem.reshape([BLOCK_N, HEAD_DIM])
    dk = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, kv_layout)
    dv = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, kv_layout)
    mbarrier.wait(bar, 0)

    for tile in range(lo, mid):                   # across the causal diagonal
        dk, dv = _step(tile - lo, dk, dv, lo, n_iter, bh, n0, N_Q, diag, qk_scale,
                           sm_scale, k_tile, v_tile, q_ring, do_ring, lse_ring, dl_ring, ready,
                           ds_smem, dq_ring, q_desc, do_desc, lse_desc, dl_desc, dq_desc,
                           True, CAUSAL, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES)
    for tile in range(mid, tail):                 # every key visible, every row real
        dk, dv = _step(tile - lo, dk, dv, lo, n_iter, bh, n0, N_Q, diag, qk_scale,
                           sm_scale, k_tile, v_tile, q_ring, do_ring, lse_ring, dl_ring, ready,
                           ds_smem, dq_ring, q_desc, do_desc, lse_desc, dl_desc, dq_desc,
                           False, CAUSAL, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES)
    for tile in range(tail, hi):                  # the last tile, rows past N_q
        dk, dv = _step(tile - lo, dk, dv, lo, n_iter, bh, n0, N_Q, diag, qk_scale,
                           sm_scale, k_tile, v_tile, q_ring, do_ring, lse_ring, dl_ring, ready,
                           ds_smem, dq_ring, q_desc, do_desc, lse_desc, dl_desc, dq_desc,
                           True, CAUSAL, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES)

    # dK (times the scale: S = scale * Q K^T) and dV through the K and V tiles, clipped at N_k
    cta_barrier()
    k_tile.store((dk * sm_scale).to(dtype))
    v_tile.store(dv.to(dtype))
    fence_async_shared()
    cta_barrier()
    tma_store(dk_desc, [bh, n0, 0], k_smem)
    tma_store(dv_desc, [bh, n0, 0], v_smem)
    tma.store_wait(0)


# ---------------------------------------------------------------------------------------------
# The launcher
# ---------------------------------------------------------------------------------------------
def _layouts(dtype, config: GluonBwdConfig, d: int):
    gdt = DTYPES[dtype]
    return dict(
        q=gl.NVMMASharedLayout.get_default_for([1, config.BLOCK_M, d], gdt),
        k=gl.NVMMASharedLayout.get_default_for([1, config.BLOCK_N, d], gdt),
        vec=gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2),
        dq=gl.NVMMASharedLayout.get_default_for([1, config.BLOCK_M, d], gl.float32))


def _check(q, k, v, o, lse, do, softmax_scale, config):
    name = "gluon_backward"
    B, H, N_q, d = validate_dense_qkv(name, q, k, v, HEAD_DIMS,
                                      heads_note=" (no grouped-query heads)")
    validate_backward_inputs(name, q, o, lse, do)
    config = _check_config(config or gluon_bwd_config(d))
    scale = validate_scale(softmax_scale, d, name)
    require_sm90(name, q.device, "wgmma, TMA reduce")
    return B, H, N_q, d, scale, config


def gluon_backward(q, k, v, o, lse, do, causal: bool = False,
                   softmax_scale: float | None = None, config: GluonBwdConfig | None = None):
    """(dQ, dK, dV) of softmax(scale * Q K^T [+ causal mask]) V for dense ``(B, H, N, d)``
    fp16/bf16 tensors on an sm_90 GPU; ``lse`` is the forward's ``(B, H, N_q)`` natural-log
    LSE. Runs D = rowsum(dO * O) (Triton), the Gluon kernel, and dQ's cast from fp32."""
    B, H, N_q, d, scale, cfg = _check(q, k, v, o, lse, do, softmax_scale, config)
    N_k = k.shape[2]
    dq_acc = torch.zeros((B * H, N_q, d), dtype=torch.float32, device=q.device)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    if B * H == 0 or N_q == 0 or N_k == 0:
        return dq_acc.view(B, H, N_q, d).to(q.dtype), dk.zero_(), dv.zero_()
    lse2, delta = lse_and_delta_rows(o, do, lse)     # (B*H, N_pad) fp32, for the TMA

    lay = _layouts(q.dtype, cfg, d)
    bm, bn = cfg.BLOCK_M, cfg.BLOCK_N

    def desc3(t, rows, layout):
        t3 = t.view(B * H, t.shape[2], d)
        return TensorDescriptor(t3, list(t3.shape), list(t3.stride()), [1, rows, d], layout)

    def desc2(t):
        return TensorDescriptor(t, [B * H, N_q], list(t.stride()), [1, bm], lay["vec"])

    grid = (triton.cdiv(N_k, bn), B * H)
    with torch.cuda.device(q.device):
        bwd_kernel[grid](desc3(q, bm, lay["q"]), desc3(k, bn, lay["k"]), desc3(v, bn, lay["k"]),
                         desc3(do, bm, lay["q"]), desc2(lse2), desc2(delta),
                         desc3(dq_acc.view(B, H, N_q, d), bm, lay["dq"]),
                         desc3(dk, bn, lay["k"]), desc3(dv, bn, lay["k"]), N_q, N_k,
                         scale * LOG2E, scale, BLOCK_M=bm, BLOCK_N=bn, HEAD_DIM=d,
                         STAGES=cfg.STAGES, CAUSAL=bool(causal), num_warps=bn // 16)
    return dq_acc.view(B, H, N_q, d).to(q.dtype), dk, dv


# ---------------------------------------------------------------------------------------------
# Ahead of time: compile for sm_90a without a GPU
# ---------------------------------------------------------------------------------------------
def compile_for_sm90(d: int = 128, dtype: torch.dtype = torch.float16, causal: bool = False,
                     config: GluonBwdConfig | None = None, **options):
    """Compile ``bwd_kernel`` for sm_90a; returns Triton's compiled kernel (``.asm``,
    ``.metadata``). Works without a GPU."""
    from triton.backends.compiler import GPUTarget
    cfg = config or gluon_bwd_config(d)
    lay = _layouts(dtype, cfg, d)
    short = {torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]

    def desc(kind, rows, layout, dt=short):
        shape = f"[1,{rows},{d}]" if kind == 3 else f"[1,{rows}]"
        return f"tensordesc<{dt}{shape},{layout!r}>"

    constexprs = dict(BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, HEAD_DIM=d, STAGES=cfg.STAGES,
                      CAUSAL=bool(causal))
    signature = dict(q_desc=desc(3, cfg.BLOCK_M, lay["q"]), k_desc=desc(3, cfg.BLOCK_N, lay["k"]),
                     v_desc=desc(3, cfg.BLOCK_N, lay["k"]), do_desc=desc(3, cfg.BLOCK_M, lay["q"]),
                     lse_desc=desc(2, cfg.BLOCK_M, lay["vec"], "fp32"),
                     dl_desc=desc(2, cfg.BLOCK_M, lay["vec"], "fp32"),
                     dq_desc=desc(3, cfg.BLOCK_M, lay["dq"], "fp32"),
                     dk_desc=desc(3, cfg.BLOCK_N, lay["k"]), dv_desc=desc(3, cfg.BLOCK_N, lay["k"]),
                     N_Q="i32", N_K="i32", qk_scale="fp32", sm_scale="fp32")
    signature.update({n: "constexpr" for n in constexprs})
    source = gluon_ast_source()(fn=bwd_kernel, signature=signature, constexprs=constexprs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=cfg.BLOCK_N // 16, **options))
