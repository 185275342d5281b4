"""FlashAttention-3's warp-specialized backward in Triton Gluon for an H100/H200 (sm_90):
``ch9_gluon_bwd.py``'s five GEMMs a step, with the jobs given to warps of their own.

Course material beside ``ch9_gluon_bwd.py`` (same inputs and outputs, so one can replace the
other); Chapter 9's benchmark times it (``ch9_bwd_gluon_ws``), and its section "Warp
specialization, measured on an H100" teaches it with this script's ablation. One
program (CTA) owns 128 keys of one (batch, kv head) and walks every query tile of every query
head of the group that sees them (GQA: dK and dV summed over the group in a fixed order, so
they are deterministic); causal, the programs with the most tiles are launched first (every
head's first key tiles). Three roles (``gl.warp_specialize``):

* a producer warp (24 registers a thread, ``setmaxnreg``) TMA-loads the two K and V tiles once,
  then streams the query tiles (``BLOCK_M`` rows of Q, dO, LSE, D) into a ring of ``STAGES``
  shared-memory slots: a *full* mbarrier a slot (the TMA's bytes) and an *empty* one (both
  consumers arrive when they are done with the slot);
* two consumer warpgroups (240 registers), warpgroup w owning keys [64 w, 64 w + 64) with dK
  and dV ``(64, d)`` in fp32 registers. Per tile, with async ``warpgroup_mma``:

      S^T  = K_w Q^T, dP^T = V_w dO^T   (64, BLOCK_M)  both in flight, P's exp2 under dP^T
      dV_w += P^T dO                    (64, d)        A = P^T from registers
      dK_w += dS^T Q                    (64, d)        A = dS^T from registers, dS^T -> smem
      dQ[:, half w] = dS K[:, half w]   (BLOCK_M, d/2) A = dS (both warpgroups' halves, smem),
                                                       B = the column half w of both K tiles

  dQ needs every key's dS, so this is the one point the warpgroups meet: each stores its dS^T
  into slot t % 2 of its own buffer and arrives on that slot's *ds_full* barrier (count 2); it
  waits for both before dQ's GEMMs and arrives on *ds_empty* once they have read. Splitting dQ
  by columns keeps its accumulator at BLOCK_M * d / 256 registers a thread; otherwise the
  warpgroups run out of step (one's exponentials under the other's GEMMs);
* dQ's share leaves through a staging buffer per warpgroup, ``(BLOCK_M, d/2)`` fp32, with one
  TMA reduce-add (``cp.reduce.async.bulk.tensor``) into ``dq_acc (B*H_q, N_q, d)`` fp32 in L2,
  asynchronous: the warpgroup waits for it to have read the buffer only a step later. As in
  ``ch9_gluon_bwd.py`` dQ's last bits depend on the order the programs finish.

Memory traffic per program: K and V once (128 d 2 bytes each); per query tile Q and dO
(BLOCK_M d 2 bytes each) and LSE, D (BLOCK_M 4 bytes each) loaded, BLOCK_M d 4 bytes reduced
into dQ's accumulator; dK and dV stored once. Causal: the tiles crossing the diagonal (and the
last one, past N_q) are masked, the rest not; bottom-right aligned like every kernel of the book.

Shared memory at d = 128, BLOCK_M = 64, STAGES = 2: K, V 64 KB; ring 64 KB; dS^T 2 x 2 x 8 KB;
dQ staging 2 x 16 KB: 192 KB of 227. At d = 64 the K and V tiles use a 64-byte swizzle so that
the column half (32 elements) starts on a swizzle atom.

Compiled for sm_90a by triton 3.6's ptxas: no local memory at d = 64; at d = 128 and 240
registers, an unmasked step has 0 / 3 spill stores and 3 / 12 loads (non-causal / causal), the
rest (51 / 101 stores in all) sits in the masked loop and at the loops' edges.

Inputs dense ``(B, H, N, d)`` contiguous, fp16 or bf16, d in {64, 128}; k and v may have fewer
heads (H_q a multiple of H_kv). LSE ``(B, H_q, N_q)`` fp32 in natural log. Runs only on sm_90.
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

__all__ = ["ws_backward", "ws_bwd_kernel", "WsBwdConfig", "ws_bwd_config", "compile_for_sm90"]

LOG2E = 1.4426950408889634
DTYPES = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16}
HEAD_DIMS = (64, 128)
KEYS = 64                   # keys a consumer warpgroup owns; a program owns 2 * KEYS
CONSUMER_REGS, PRODUCER_REGS, LAUNCH_REGS = 240, 24, 168   # 384 threads (3 warpgroups' worth)


@dataclasses.dataclass(frozen=True)
class WsBwdConfig:
    """Query rows a tile and slots in the Q/dO ring; the switches change one design feature
    each (for an ablation): launch order, when dQ's reduce is waited for, the registers moved
    from the producer to the consumers. Longest-first is off by default: on an H100 it lost
    (ch9_ws_bwd_bench.py --ablation at dcd46b8: 442 vs 487 TFLOP/s causal, 347 vs 529 not)."""
    BLOCK_M: int
    STAGES: int
    longest_first: bool = False   # every head's first key tiles (causal: the most work) first
    dq_wait_late: bool = True     # dQ's staging buffer waited for a step later, not at once
    setmaxnreg: bool = True       # 240 / 24 registers; off: every warp keeps the launch's 168


def ws_bwd_config(d: int, causal: bool = False) -> WsBwdConfig:
    """(64, 2) at d = 128 (a third slot does not fit shared memory). At d = 64, (64, 2)
    without the mask and (64, 4) with it: the fastest on an H100 at (4, 16, 4096, 64) fp16 and
    (1, 16, 16384, 64) bf16, three interleaved rounds each (0.93x / 0.91x cuDNN's backward
    non-causal, 0.96x / 0.92x causal); the three-slot ring these replaced was the slowest of the
    three in all four cases (0.87x-0.90x)."""
    if d > 64:
        return WsBwdConfig(64, 2)
    return WsBwdConfig(64, 4) if causal else WsBwdConfig(64, 2)


def _check_config(cfg, d) -> WsBwdConfig:
    if not isinstance(cfg, WsBwdConfig):
        raise ValueError(f"ws_backward: config must be a WsBwdConfig, got {type(cfg).__name__}.")
    if cfg.BLOCK_M not in (64, 128) or not 2 <= cfg.STAGES <= 4 \
            or (d > 64 and (cfg.BLOCK_M > 64 or cfg.STAGES > 2)) \
            or (cfg.BLOCK_M > 64 and cfg.STAGES > 2):
        raise ValueError(f"ws_backward: {cfg} is not supported at d={d}: BLOCK_M in (64, 128) "
                         "(a warpgroup's wgmma rows), STAGES in 2..4, 128-row tiles with two "
                         "slots only (a third overflows shared memory); at d = 128 only (64, 2) "
                         "fits registers and shared memory.")
    return cfg


# ---------------------------------------------------------------------------------------------
# Tile bookkeeping both roles share (they must agree on every count)
# ---------------------------------------------------------------------------------------------
@gluon.jit
def _tile_range(n0, N_Q, N_K, BLOCK_M: gl.constexpr, CAUSAL: gl.constexpr):
    """(lo, mid, tail, hi): the query tiles [lo, hi) see keys [n0, n0 + 2 KEYS); [lo, mid) cross
    the causal diagonal, [tail, hi) has rows past N_q: both masked. Row i sees key j iff
    j <= i + N_k - N_q."""
    diag = N_K - N_Q
    hi = gl.cdiv(N_Q, BLOCK_M)
    full_hi = N_Q // BLOCK_M
    if CAUSAL:
        lo = gl.minimum(gl.maximum(n0 - diag, 0) // BLOCK_M, hi)
        mid = gl.minimum(gl.maximum(gl.cdiv(n0 + 2 * 64 - 1 - diag, BLOCK_M), lo), hi)
    else:
        lo = 0
        mid = 0
    return lo, mid, gl.maximum(mid, full_hi), hi


@gluon.jit
def _program(LONGEST_FIRST: gl.constexpr):
    """(first key n0, row of (B*H_kv)) of this program. LONGEST_FIRST: grid (B*H_kv, key
    tiles), so the GPU starts every head's first key tiles (causal: the most query tiles) before
    any later one and the short programs fill the last wave; else (key tiles, B*H_kv)."""
    if LONGEST_FIRST:
        return gl.program_id(1) * 2 * 64, gl.program_id(0)
    else:
        return gl.program_id(0) * 2 * 64, gl.program_id(1)


@gluon.jit
def _item(i, lo, mid, tail, hi, bkv, GROUP: gl.constexpr, H_Q, BLOCK_M: gl.constexpr):
    """Item i of the program's walk, group head i // (hi - lo); within a head the unmasked tiles
    [mid, tail) first, then the masked ones, [lo, mid) and [tail, hi): (row of (B*H_q) in the
    descriptors, first query row). Two copies of the step, not three: ptxas spilled in the
    second and third loops (at d = 128, 20-30 spill stores an item), never in the first."""
    n_iter = hi - lo
    g = i // n_iter
    p = i - g * n_iter
    n_full = tail - mid
    n_open = n_full + mid - lo
    tile = gl.where(p < n_full, mid + p, gl.where(p < n_open, lo + p - n_full, tail + p - n_open))
    h_kv = H_Q // GROUP
    bh = (bkv // h_kv) * H_Q + (bkv % h_kv) * GROUP + g
    return bh, tile * BLOCK_M


# ---------------------------------------------------------------------------------------------
# The producer: one warp issuing TMA loads
# ---------------------------------------------------------------------------------------------
@gluon.jit
def _producer(q_desc, do_desc, lse_desc, dl_desc, k_desc, v_desc, k_smem, v_smem, q_ring,
              do_ring, lse_ring, dl_ring, kv_bar, full, empty, N_Q, N_K, H_Q,
              BLOCK_M: gl.constexpr, STAGES: gl.constexpr, GROUP: gl.constexpr,
              CAUSAL: gl.constexpr, LONGEST_FIRST: gl.constexpr):
    n0, bkv = _program(LONGEST_FIRST)
    mbarrier.expect(kv_bar.index(0), 4 * k_desc.block_type.nbytes)
    for w in gl.static_range(2):
        tma_load(k_desc, [bkv, n0 + w * 64, 0], kv_bar.index(0), k_smem.index(w))
        tma_load(v_desc, [bkv, n0 + w * 64, 0], kv_bar.index(0), v_smem.index(w))
    lo, mid, tail, hi = _tile_range(n0, N_Q, N_K, BLOCK_M, CAUSAL)
    nbytes: gl.constexpr = 2 * q_desc.block_type.nbytes + 2 * lse_desc.block_type.nbytes
    for i in range(GROUP * (hi - lo)):
        s = i % STAGES
        bh, row = _item(i, lo, mid, tail, hi, bkv, GROUP, H_Q, BLOCK_M)
        # use u = i // STAGES of slot s waits for both consumers' release of use u - 1 (a fresh
        # barrier passes parity 1 at once)
        mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)
        bar = full.index(s)
        mbarrier.expect(bar, nbytes)      # whole boxes: rows past N_q arrive as zeros
        tma_load(q_desc, [bh, row, 0], bar, q_ring.index(s))
        tma_load(do_desc, [bh, row, 0], bar, do_ring.index(s))
        tma_load(lse_desc, [bh, row], bar, lse_ring.index(s))
        tma_load(dl_desc, [bh, row], bar, dl_ring.index(s))


# ---------------------------------------------------------------------------------------------
# The consumers: one warpgroup a K/V tile of 64 keys
# ---------------------------------------------------------------------------------------------
@gluon.constexpr_function
def _layouts_of(BLOCK_M, HEAD_DIM):
    """Register layouts of one warpgroup: S^T, dP^T (64, BLOCK_M); dK, dV (64, d); dQ's column
    half (BLOCK_M, d / 2)."""
    def mma(n):
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                         instr_shape=[16, n, 16])
    return mma(BLOCK_M), mma(HEAD_DIM), mma(HEAD_DIM // 2)


@gluon.jit
def _step(i, dk, dv, lo, mid, tail, hi, n0, bkv, N_Q, N_K, H_Q, qk_scale, sm_scale, k_smem,
          v_smem, q_ring, do_ring, lse_ring, dl_ring, full, empty, ds_smem, ds_full, ds_empty,
          dq_stage, dq_desc, WG: gl.constexpr, MASKED: gl.constexpr, CAUSAL: gl.constexpr,
          GROUP: gl.constexpr, BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr,
          STAGES: gl.constexpr, DQ_WAIT_LATE: gl.constexpr):
    """Item i for warpgroup WG: dK, dV accumulated, dQ's column half WG reduced into dq_acc."""
    dtype: gl.constexpr = q_ring.dtype
    s_layout: gl.constexpr = _layouts_of(BLOCK_M, HEAD_DIM)[0]
    kv_layout: gl.constexpr = _layouts_of(BLOCK_M, HEAD_DIM)[1]
    dq_layout: gl.constexpr = _layouts_of(BLOCK_M, HEAD_DIM)[2]
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_layout, k_width=2)
    q_cols: gl.constexpr = gl.SliceLayout(0, s_layout)      # one value per query row
    k_rows: gl.constexpr = gl.SliceLayout(1, s_layout)      # one value per key
    vec: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    HALF: gl.constexpr = HEAD_DIM // 2

    s = i % STAGES
    bh, row0 = _item(i, lo, mid, tail, hi, bkv, GROUP, H_Q, BLOCK_M)
    k_tile = k_smem.index(WG).reshape([64, HEAD_DIM])
    v_tile = v_smem.index(WG).reshape([64, HEAD_DIM])
    mbarrier.wait(full.index(s), (i // STAGES) & 1)
    q_tile = q_ring.index(s).reshape([BLOCK_M, HEAD_DIM])
    do_tile = do_ring.index(s).reshape([BLOCK_M, HEAD_DIM])
    zero = gl.zeros([64, BLOCK_M], gl.float32, s_layout)
    sT = warpgroup_mma(k_tile, q_tile.permute((1, 0)), zero, use_acc=False, is_async=True)
    dpT = warpgroup_mma(v_tile, do_tile.permute((1, 0)), zero, use_acc=False, is_async=True)

    lse2 = smem_reinterpret(lse_ring.index(s), gl.float32, [BLOCK_M], vec).load(q_cols)
    lse2 = lse2 * 1.4426950408889634                      # the LSE in base 2
    sT = warpgroup_mma_wait(1, deps=[sT])                  # dP^T may still run
    pT = gl.exp2(sT * qk_scale - gl.expand_dims(lse2, 0))
    if MASKED:
        rows = row0 + gl.arange(0, BLOCK_M, layout=q_cols)
        ok = gl.expand_dims(rows < N_Q, 0)
        if CAUSAL:
            keys = n0 + WG * 64 + gl.arange(0, 64, layout=k_rows)
            ok = ok & (gl.expand_dims(keys, 1) <= gl.expand_dims(rows, 0) + (N_K - N_Q))
        pT = gl.where(ok, pT, 0.0)
    dv = warpgroup_mma(gl.convert_layout(pT.to(dtype), a_layout), do_tile, dv, is_async=True)
    delta = smem_reinterpret(dl_ring.index(s), gl.float32, [BLOCK_M], vec).load(q_cols)
    dpT = warpgroup_mma_wait(1, deps=[dpT])                # dV's GEMM may still run
    ds16 = (pT * (dpT - gl.expand_dims(delta, 0))).to(dtype)
    dk = warpgroup_mma(gl.convert_layout(ds16, a_layout), q_tile, dk, is_async=True)

    # dS^T -> my buffer of slot i % 2, once both warpgroups' dQ GEMMs of item i - 2 read it
    p = i % 2
    mbarrier.wait(ds_empty.index(p), ((i // 2) & 1) ^ 1)
    ds_smem.index(2 * WG + p).store(ds16)
    fence_async_shared()          # generic-proxy stores -> the wgmmas' (async-proxy) reads
    cta_barrier()                 # this warpgroup's stores all done before one thread arrives
    mbarrier.arrive(ds_full.index(p))
    dv = warpgroup_mma_wait(1, deps=[dv])                  # P^T's registers free for dQ
    mbarrier.wait(ds_full.index(p), (i // 2) & 1)
    zero_q = gl.zeros([BLOCK_M, HALF], gl.float32, dq_layout)
    dq = warpgroup_mma(ds_smem.index(p).permute((1, 0)),
                       k_smem.index(0).reshape([64, HEAD_DIM]).slice(WG * HALF, HALF, 1),
                       zero_q, use_acc=False, is_async=True)
    dq = warpgroup_mma(ds_smem.index(2 + p).permute((1, 0)),
                       k_smem.index(1).reshape([64, HEAD_DIM]).slice(WG * HALF, HALF, 1),
                       dq, is_async=True)
    dk, dq = warpgroup_mma_wait(0, deps=[dk, dq])
    mbarrier.arrive(ds_empty.index(p))
    mbarrier.arrive(empty.index(s))                        # Q, dO read; LSE, D in registers

    # dQ's half -> staging (the reduce issued from it a step ago has read it) -> TMA reduce-add
    tma.store_wait(0)
    cta_barrier()
    dq_stage.index(WG).reshape([BLOCK_M, HALF]).store(dq * sm_scale)
    fence_async_shared()
    cta_barrier()
    tma_reduce_add(dq_desc, [bh, row0, WG * HALF], dq_stage.index(WG))
    if not DQ_WAIT_LATE:
        tma.store_wait(0)         # the ablation: the buffer's reduce waited for at once
    return dk, dv


@gluon.jit
def _consumer(k_smem, v_smem, q_ring, do_ring, lse_ring, dl_ring, kv_bar, full, empty, ds_smem,
              ds_full, ds_empty, fin, dq_stage, dq_desc, dk_desc, dv_desc, N_Q, N_K, H_Q,
              qk_scale, sm_scale, WG: gl.constexpr, BLOCK_M: gl.constexpr,
              HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, GROUP: gl.constexpr,
              CAUSAL: gl.constexpr, LONGEST_FIRST: gl.constexpr, DQ_WAIT_LATE: gl.constexpr):
    dtype: gl.constexpr = q_ring.dtype
    kv_layout: gl.constexpr = _layouts_of(BLOCK_M, HEAD_DIM)[1]
    n0, bkv = _program(LONGEST_FIRST)
    lo, mid, tail, hi = _tile_range(n0, N_Q, N_K, BLOCK_M, CAUSAL)
    n_iter = hi - lo
    n_full = tail - mid                          # the walk's unmasked tiles come first (_item)
    dk = gl.zeros([64, HEAD_DIM], gl.float32, kv_layout)
    dv = gl.zeros([64, HEAD_DIM], gl.float32, kv_layout)
    mbarrier.wait(kv_bar.index(0), 0)
    for g in range(GROUP):
        for p in range(g * n_iter, g * n_iter + n_full):        # every key visible, rows real
            dk, dv = _step(p, dk, dv, lo, mid, tail, hi, n0, bkv, N_Q, N_K, H_Q, qk_scale,
                           sm_scale, k_smem, v_smem, q_ring, do_ring, lse_ring, dl_ring, full,
                           empty, ds_smem, ds_full, ds_empty, dq_stage, dq_desc, WG, False,
                           CAUSAL, GROUP, BLOCK_M, HEAD_DIM, STAGES, DQ_WAIT_LATE)
        for p in range(g * n_iter + n_full, (g + 1) * n_iter):  # diagonal, rows past N_q
            dk, dv = _step(p, dk, dv, lo, mid, tail, hi, n0, bkv, N_Q, N_K, H_Q, qk_scale,
                           sm_scale, k_smem, v_smem, q_ring, do_ring, lse_ring, dl_ring, full,
                           empty, ds_smem, ds_full, ds_empty, dq_stage, dq_desc, WG, True,
                           CAUSAL, GROUP, BLOCK_M, HEAD_DIM, STAGES, DQ_WAIT_LATE)

    # dK (times the scale: S = scale Q K^T) and dV through my K and V tiles, clipped at N_k;
    # K is overwritten only once the other warpgroup's last dQ GEMM has read it
    v_smem.index(WG).reshape([64, HEAD_DIM]).store(dv.to(dtype))
    mbarrier.arrive(fin.index(0))
    mbarrier.wait(fin.index(0), 0)
    k_smem.index(WG).reshape([64, HEAD_DIM]).store((dk * sm_scale).to(dtype))
    fence_async_shared()
    cta_barrier()
    tma_store(dk_desc, [bkv, n0 + WG * 64, 0], k_smem.index(WG))
    tma_store(dv_desc, [bkv, n0 + WG * 64, 0], v_smem.index(WG))
    tma.store_wait(0)


@gluon.jit(do_not_specialize=["N_Q", "N_K", "H_Q"])
def ws_bwd_kernel(q_desc, k_desc, v_desc, do_desc, lse_desc, dl_desc, dq_desc, dk_desc, dv_desc,
                  N_Q, N_K, H_Q, qk_scale, sm_scale, BLOCK_M: gl.constexpr,
                  HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, GROUP: gl.constexpr,
                  CAUSAL: gl.constexpr, LONGEST_FIRST: gl.constexpr,
                  DQ_WAIT_LATE: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                  PRODUCER_REGS: gl.constexpr):
    """Grid (B*H_kv, cdiv(N_k, 128)) if LONGEST_FIRST else its transpose, 4 warps (+ a
    warpgroup and a warp). Descriptors: q, do (B*H_q, N_q, d) boxes (1, BLOCK_M, d); k, v, dk,
    dv (B*H_kv, N_k, d) boxes (1, 64, d); lse, D (B*H_q, N_q padded to 4) fp32 boxes
    (1, BLOCK_M); dq_acc (B*H_q, N_q, d) fp32 boxes (1, BLOCK_M, d / 2)."""
    dtype: gl.constexpr = q_desc.dtype
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, BLOCK_M], dtype)
    k_smem = gl.allocate_shared_memory(dtype, [2] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [2] + v_desc.block_type.shape, v_desc.layout)
    q_ring = gl.allocate_shared_memory(dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
    do_ring = gl.allocate_shared_memory(dtype, [STAGES] + do_desc.block_type.shape,
                                        do_desc.layout)
    lse_ring = gl.allocate_shared_memory(gl.float32, [STAGES] + lse_desc.block_type.shape,
                                         lse_desc.layout)
    dl_ring = gl.allocate_shared_memory(gl.float32, [STAGES] + dl_desc.block_type.shape,
                                        dl_desc.layout)
    ds_smem = gl.allocate_shared_memory(dtype, [4, 64, BLOCK_M], ds_layout)   # (warpgroup, slot)
    dq_stage = gl.allocate_shared_memory(gl.float32, [2] + dq_desc.block_type.shape,
                                         dq_desc.layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    fin = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    ds_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    ds_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar.index(0), count=1)
    mbarrier.init(fin.index(0), count=2)
    for j in gl.static_range(STAGES):
        mbarrier.init(full.index(j), count=1)       # the producer's expect-tx arrival
        mbarrier.init(empty.index(j), count=2)      # both consumers
    for j in gl.static_range(2):
        mbarrier.init(ds_full.index(j), count=2)
        mbarrier.init(ds_empty.index(j), count=2)
    fence_async_shared()                            # the inits, before any TMA completes on them

    gl.warp_specialize([
        (_consumer, (k_smem, v_smem, q_ring, do_ring, lse_ring, dl_ring, kv_bar, full, empty,
                     ds_smem, ds_full, ds_empty, fin, dq_stage, dq_desc, dk_desc, dv_desc, N_Q,
                     N_K, H_Q, qk_scale, sm_scale, 0, BLOCK_M, HEAD_DIM, STAGES, GROUP, CAUSAL,
                     LONGEST_FIRST, DQ_WAIT_LATE)),
        (_consumer, (k_smem, v_smem, q_ring, do_ring, lse_ring, dl_ring, kv_bar, full, empty,
                     ds_smem, ds_full, ds_empty, fin, dq_stage, dq_desc, dk_desc, dv_desc, N_Q,
                     N_K, H_Q, qk_scale, sm_scale, 1, BLOCK_M, HEAD_DIM, STAGES, GROUP, CAUSAL,
                     LONGEST_FIRST, DQ_WAIT_LATE)),
        (_producer, (q_desc, do_desc, lse_desc, dl_desc, k_desc, v_desc, k_smem, v_smem, q_ring,
                     do_ring, lse_ring, dl_ring, kv_bar, full, empty, N_Q, N_K, H_Q, BLOCK_M,
                     STAGES, GROUP, CAUSAL, LONGEST_FIRST)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# ---------------------------------------------------------------------------------------------
# The launcher
# ---------------------------------------------------------------------------------------------
def _layouts(dtype, config: WsBwdConfig, d: int):
    """Shared layouts of the TMA boxes. K and V at d = 64 take a 64-byte swizzle: dQ's GEMM
    reads a column half of 32 elements, which must start on a swizzle atom."""
    gdt = DTYPES[dtype]
    kv = gl.NVMMASharedLayout.get_default_for([1, KEYS, d], gdt) if d > 64 else \
        gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=16, rank=3)
    return dict(q=gl.NVMMASharedLayout.get_default_for([1, config.BLOCK_M, d], gdt), k=kv,
                vec=gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2),
                dq=gl.NVMMASharedLayout.get_default_for([1, config.BLOCK_M, d // 2], gl.float32))


def _constexprs(cfg: WsBwdConfig, d: int) -> dict:
    regs = (CONSUMER_REGS, PRODUCER_REGS) if cfg.setmaxnreg else (LAUNCH_REGS, LAUNCH_REGS)
    return dict(BLOCK_M=cfg.BLOCK_M, HEAD_DIM=d, STAGES=cfg.STAGES,
                LONGEST_FIRST=cfg.longest_first, DQ_WAIT_LATE=cfg.dq_wait_late,
                CONSUMER_REGS=regs[0], PRODUCER_REGS=regs[1])


def _check(q, k, v, o, lse, do, softmax_scale, config, causal):
    name = "ws_backward"
    B, H, N_q, d = validate_dense_qkv(name, q, q, q, HEAD_DIMS)
    validate_dense_qkv(name, k, k, v, HEAD_DIMS)
    if k.dtype != q.dtype or k.shape[0] != B or k.shape[3] != d or H % k.shape[1]:
        raise ValueError(f"{name}: k and v must be (B, H_kv, N_k, d) = ({B}, H_kv, N_k, {d}) "
                         f"{q.dtype} with H_kv dividing q's {H} heads; got k {tuple(k.shape)} "
                         f"{k.dtype}.")
    validate_backward_inputs(name, q, o, lse, do)
    config = _check_config(config or ws_bwd_config(d, causal), d)
    scale = validate_scale(softmax_scale, d, name)
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"{name}: q, k and v must be on one device, got {q.device}, "
                         f"{k.device}, {v.device}.")
    require_sm90(name, q.device, "wgmma, TMA reduce, setmaxnreg")
    return B, H, N_q, d, scale, config


def ws_backward(q, k, v, o, lse, do, causal: bool = False, softmax_scale: float | None = None,
                config: WsBwdConfig | None = None):
    """(dQ, dK, dV) of softmax(scale * Q K^T [+ causal mask]) V for dense ``(B, H, N, d)``
    fp16/bf16 tensors on an sm_90 GPU (k, v may have H_kv heads, H_q a multiple); ``lse`` is the
    forward's ``(B, H_q, N_q)`` natural-log LSE. Runs D = rowsum(dO * O) (Triton), the
    warp-specialized Gluon kernel, and dQ's cast from fp32."""
    B, H, N_q, d, scale, cfg = _check(q, k, v, o, lse, do, softmax_scale, config, causal)
    H_kv, N_k = k.shape[1], k.shape[2]
    dq_acc = torch.zeros((B * H, N_q, d), dtype=torch.float32, device=q.device)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    if B * H == 0 or N_q == 0 or N_k == 0:
        return dq_acc.view(B, H, N_q, d).to(q.dtype), dk.zero_(), dv.zero_()
    lse2, delta = lse_and_delta_rows(o, do, lse)     # (B*H, N_pad) fp32, for the TMA

    lay = _layouts(q.dtype, cfg, d)
    bm = cfg.BLOCK_M

    def desc3(t, rows, layout, cols=d):
        t3 = t.view(t.shape[0] * t.shape[1], t.shape[2], d)
        return TensorDescriptor(t3, list(t3.shape), list(t3.stride()), [1, rows, cols], layout)

    def desc2(t):
        return TensorDescriptor(t, [B * H, N_q], list(t.stride()), [1, bm], lay["vec"])

    grid = (triton.cdiv(N_k, 2 * KEYS), B * H_kv)
    grid = grid[::-1] if cfg.longest_first else grid
    with torch.cuda.device(q.device):
        ws_bwd_kernel[grid](
            desc3(q, bm, lay["q"]), desc3(k, KEYS, lay["k"]), desc3(v, KEYS, lay["k"]),
            desc3(do, bm, lay["q"]), desc2(lse2), desc2(delta),
            desc3(dq_acc.view(B, H, N_q, d), bm, lay["dq"], d // 2),
            desc3(dk, KEYS, lay["k"]), desc3(dv, KEYS, lay["k"]), N_q, N_k, H,
            scale * LOG2E, scale, GROUP=H // H_kv, CAUSAL=bool(causal), **_constexprs(cfg, d),
            num_warps=4, maxnreg=LAUNCH_REGS)
    return dq_acc.view(B, H, N_q, d).to(q.dtype), dk, dv


# ---------------------------------------------------------------------------------------------
# Ahead of time: compile for sm_90a without a GPU
# ---------------------------------------------------------------------------------------------
def compile_for_sm90(d: int = 128, dtype: torch.dtype = torch.float16, causal: bool = False,
                     config: WsBwdConfig | None = None, group: int = 1, **options):
    """Compile ``ws_bwd_kernel`` for sm_90a; returns Triton's compiled kernel (``.asm``,
    ``.metadata``). Works without a GPU."""
    from triton.backends.compiler import GPUTarget
    cfg = _check_config(config or ws_bwd_config(d, causal), d)
    lay = _layouts(dtype, cfg, d)
    short = {torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]

    def desc(rows, layout, cols=d, dt=short):
        shape = f"[1,{rows},{cols}]" if cols else f"[1,{rows}]"
        return f"tensordesc<{dt}{shape},{layout!r}>"

    constexprs = dict(GROUP=group, CAUSAL=bool(causal), **_constexprs(cfg, d))
    bm = cfg.BLOCK_M
    signature = dict(q_desc=desc(bm, lay["q"]), k_desc=desc(KEYS, lay["k"]),
                     v_desc=desc(KEYS, lay["k"]), do_desc=desc(bm, lay["q"]),
                     lse_desc=desc(bm, lay["vec"], 0, "fp32"),
                     dl_desc=desc(bm, lay["vec"], 0, "fp32"),
                     dq_desc=desc(bm, lay["dq"], d // 2, "fp32"),
                     dk_desc=desc(KEYS, lay["k"]), dv_desc=desc(KEYS, lay["k"]),
                     N_Q="i32", N_K="i32", H_Q="i32", qk_scale="fp32", sm_scale="fp32")
    signature.update({n: "constexpr" for n in constexprs})
    source = gluon_ast_source()(fn=ws_bwd_kernel, signature=signature, constexprs=constexprs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=4, maxnreg=LAUNCH_REGS, **options))
