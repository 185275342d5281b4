"""The device code of Chapter 6's Gluon FA3 kernel: ``fa3_kernel`` and the ``@gluon.jit``
functions its three roles are made of (the producer, the two consumers and their ping-pong
token, the tile bookkeeping they share), with the globals they read: Chapter 7's exp2
experiments (``EXP2_MODES``, and ``EXP2_CUBIC``'s coefficients as constexprs).

The host side (configs, launch arguments, the ``attention_fa3`` wrapper, the ahead-of-time
compile) is ``gluon_fa3``, which re-exports these names; its docstring describes the kernel.
They live in a module of their own because Gluon resolves a jit function's globals in the
module that defines it, so every helper and constexpr a role reads is kept next to it here.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                              warpgroup_mma, warpgroup_mma_wait)

from flashbook.gluon_kit import m_block as _m_block, smem_tile as _tile_2d, tma_load, tma_store

__all__ = ["fa3_kernel", "EXP2_MODES", "EXP2_CUBIC"]


# ---------------------------------------------------------------------------------------------
# Tile bookkeeping shared by the three roles (they must agree on every count, or a barrier
# waits forever).
# ---------------------------------------------------------------------------------------------
@gluon.jit
def _kv_tiles(row0, N_Q, N_K, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              CAUSAL: gl.constexpr):
    """For the query rows [row0, row0 + BLOCK_M): (tiles, full) — the K/V tiles they read, and
    how many of the first ones need no mask (every key visible to every row, none past N_K)."""
    if CAUSAL:
        off = N_K - N_Q                                  # bottom-right alignment
        hi = gl.minimum(row0 + BLOCK_M + off, N_K)       # keys < hi are visible to the last row
        hi = gl.maximum(hi, 0)
        lo = gl.minimum(row0 + off + 1, N_K)             # keys < lo are visible to the first row
        lo = gl.maximum(lo, 0)
        tiles = gl.cdiv(hi, BLOCK_N)
        full = lo // BLOCK_N
    else:
        tiles = gl.cdiv(N_K, BLOCK_N)
        full = N_K // BLOCK_N
    return tiles, full


@gluon.jit
def _cta_tiles(m_block, N_Q, N_K, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
               CAUSAL: gl.constexpr):
    """The K/V tiles the producer streams for the CTA: the most either consumer reads."""
    t0, f0 = _kv_tiles(m_block * 2 * BLOCK_M, N_Q, N_K, BLOCK_M, BLOCK_N, CAUSAL)
    t1, f1 = _kv_tiles(m_block * 2 * BLOCK_M + BLOCK_M, N_Q, N_K, BLOCK_M, BLOCK_N, CAUSAL)
    return gl.maximum(t0, t1)


# ---------------------------------------------------------------------------------------------
# The producer: one warp that only issues TMA copies.
# ---------------------------------------------------------------------------------------------
@gluon.jit
def _producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bars, k_full, k_empty, v_full,
              v_empty, N_Q, N_K, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              STAGES: gl.constexpr, CAUSAL: gl.constexpr):
    m_block = _m_block()
    bh = gl.program_id(1)
    n_tiles = _cta_tiles(m_block, N_Q, N_K, BLOCK_M, BLOCK_N, CAUSAL)

    # Q: one tile per consumer, one barrier each (phase 0 completes once, when the bytes land)
    for w in gl.static_range(2):
        mbarrier.expect(q_bars.index(w), q_desc.block_type.nbytes)
        tma_load(q_desc, [bh, m_block * 2 * BLOCK_M + w * BLOCK_M, 0], q_bars.index(w),
                 q_smem.index(w))

    # K/V ring. Use u of slot s (u = j // STAGES) waits for the empty barrier to have completed
    # phase u - 1 (both consumers released tile j - STAGES); a fresh barrier passes the first
    # wait because waiting for parity 1 on a barrier still in phase 0 returns at once.
    for j in range(n_tiles):
        s = j % STAGES
        ph = (j // STAGES) & 1
        mbarrier.wait(k_empty.index(s), ph ^ 1)
        mbarrier.expect(k_full.index(s), k_desc.block_type.nbytes)   # BLOCK_N*d*2 bytes, always
        tma_load(k_desc, [bh, j * BLOCK_N, 0], k_full.index(s), k_smem.index(s))
        mbarrier.wait(v_empty.index(s), ph ^ 1)
        mbarrier.expect(v_full.index(s), v_desc.block_type.nbytes)
        tma_load(v_desc, [bh, j * BLOCK_N, 0], v_full.index(s), v_smem.index(s))


# ---------------------------------------------------------------------------------------------
# Chapter 7's experiments on this kernel (constexprs; the defaults compile the kernel above):
#   EXP2_MODE 0: exp2 on the special-function unit (MUFU.EX2), the kernel as Chapter 6 ships it;
#             1: exp2 by a cubic on the FMA units (Chapter 7, Exercise 3: C0..C3 below);
#             2: each exponential computed twice (two MUFU ops, same value): a timing probe;
#             3: no exponential at all (a clamp on the FMA units): a timing probe, O is wrong.
#   LAZY, TAU: FlashAttention-4's conditional rescaling (Chapter 7, Exercise 2): the reference
#             max moves, and O and l are rescaled, only when some row's max grew by more than
#             TAU (base 2) since the last move; otherwise alpha = 1 and O's multiply is skipped.
# ---------------------------------------------------------------------------------------------
EXP2_MODES = {"hw": 0, "poly": 1, "doubled": 2, "removed": 3}
# the cubic for 2^f on [-1/2, 1/2] (max relative error 7.5e-5): Chapter 7's fit_exp2(3) in
# float32 (tests/test_ch7_bench.py compares them)
EXP2_CUBIC = (0.9999280571937561, 0.6932609677314758, 0.2426111251115799, 0.0551716648042202)
_C0, _C1, _C2, _C3 = (gl.constexpr(c) for c in EXP2_CUBIC)


@gluon.jit
def _exp2(x, EXP2_MODE: gl.constexpr):
    if EXP2_MODE == 0:
        y = gl.exp2(x)
    elif EXP2_MODE == 1:
        x = gl.maximum(x, -126.0)
        n = gl.floor(x + 0.5)                     # f in [-1/2, 1/2]
        f = x - n
        p = ((_C3 * f + _C2) * f + _C1) * f + _C0     # three FMAs
        y = p * ((n.to(gl.int32) + 127) << 23).to(gl.float32, bitcast=True)
    elif EXP2_MODE == 2:
        # two exponentials whose product is 2^(x (1 + 2^-24)); distinct, so neither is folded
        y = gl.exp2(x * 0.5) * gl.exp2(x * 0.50000006)
    else:
        y = gl.maximum(x * 0.125 + 1.0, 0.0)
    return y


# ---------------------------------------------------------------------------------------------
# The consumers: the tensor-core token (ping-pong) and one K/V tile of work.
# ---------------------------------------------------------------------------------------------
@gluon.jit
def _token_acquire(sched, t, WG: gl.constexpr):
    """Wait for my t-th turn at the tensor cores. Warpgroup 0's turn t needs warpgroup 1's
    (t-1)-th release on sched[0] (t = 0 passes: parity 1 on a fresh barrier); warpgroup 1's turn
    t needs warpgroup 0's t-th release on sched[1]. A barrier is never more than one phase
    ahead of its waiter, so parities cannot alias."""
    if WG == 0:
        mbarrier.wait(sched.index(0), (t & 1) ^ 1)
    else:
        mbarrier.wait(sched.index(1), t & 1)


@gluon.jit
def _token_release(sched, WG: gl.constexpr):
    mbarrier.arrive(sched.index(1 - WG))


@gluon.jit
def _tile(j, q_tile, k_smem, v_smem, k_full, k_empty, v_full, v_empty, sched, o, m_i, l_i, p,
          alpha, rescaled, row0, N_Q, N_K, n_full, qk_scale, WG: gl.constexpr,
          FIRST: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
          HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
          OVERLAP: gl.constexpr, EXP2_MODE: gl.constexpr, LAZY: gl.constexpr,
          TAU: gl.constexpr):
    """Tile j of one consumer. In one turn at the tensor cores: issue S = Q K_j^T, rescale O by
    tile j-1's alpha, issue O += P_{j-1} V_{j-1}. Then the online softmax of tile j.

    In: o = sum over tiles < j-1 of P V, relative to the maxima m_{j-2}; m_i, l_i, p, alpha of
    tile j-1. Out: o = sum over tiles < j (relative to m_{j-1}), and m_i, l_i, p, alpha of tile j.
    O is rescaled before its PV is issued, so nothing touches o or P between the two waits
    (FlashAttention-3's order)."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    s_rows: gl.constexpr = gl.SliceLayout(1, s_layout)
    s_cols: gl.constexpr = gl.SliceLayout(0, s_layout)
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)

    s = j % STAGES
    ph = (j // STAGES) & 1
    jp = gl.maximum(j - 1, 0)                  # the previous tile (unused when FIRST)
    sp = jp % STAGES
    php = (jp // STAGES) & 1

    # data first, then the turn: never hold the token while waiting for a TMA
    mbarrier.wait(k_full.index(s), ph)
    if not FIRST:
        mbarrier.wait(v_full.index(sp), php)
    _token_acquire(sched, j, WG)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    k_t = _tile_2d(k_smem, s, BLOCK_N, HEAD_DIM).permute((1, 0))   # (d, BLOCK_N) view of K
    s_tok = warpgroup_mma(q_tile, k_t, s_zero, use_acc=False, is_async=True)
    if not FIRST:
        o = _rescale(o, alpha, rescaled, o_rows, LAZY)
        o_tok = warpgroup_mma(p, _tile_2d(v_smem, sp, BLOCK_N, HEAD_DIM), o, is_async=True)
    _token_release(sched, WG)
    if FIRST:
        s_acc = warpgroup_mma_wait(0, deps=(s_tok, ))
    elif OVERLAP:
        s_acc = warpgroup_mma_wait(1, deps=(s_tok, ))        # S is in; PV may still run
    else:
        s_acc, o, p = warpgroup_mma_wait(0, deps=(s_tok, o_tok, p))
        mbarrier.arrive(v_empty.index(sp))
    mbarrier.arrive(k_empty.index(s))          # K of tile j is free as soon as S is in registers

    # ---- online softmax of tile j, in log2 units: m is max(S) * scale * log2(e) ----
    if j >= n_full:                            # the diagonal / the tail: mask (uniform branch)
        cols = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=s_cols)
        keep = gl.expand_dims(cols < N_K, 0)
        if CAUSAL:
            rows = row0 + gl.arange(0, BLOCK_M, layout=s_rows) + (N_K - N_Q)
            keep = keep & (gl.expand_dims(cols, 0) <= gl.expand_dims(rows, 1))
        s_acc = gl.where(keep, s_acc, -float("inf"))
    m_new = gl.maximum(m_i, gl.max(s_acc, axis=1) * qk_scale)
    if LAZY:                                   # move the reference only past TAU (whole tile)
        grow = gl.max(gl.where(m_new == -float("inf"), 0.0, m_new - m_i), axis=0)
        rescaled = grow > TAU
        m_new = gl.where(rescaled, m_new, m_i)
    m_use = gl.where(m_new == -float("inf"), 0.0, m_new)      # a row with no key yet: no NaN
    alpha = gl.exp2(m_i - m_use)
    p_f32 = _exp2(s_acc * qk_scale - gl.expand_dims(m_use, 1), EXP2_MODE)  # FMA + exp2 each
    l_i = l_i * alpha + gl.sum(p_f32, axis=1)
    if OVERLAP:
        if not FIRST:
            o, p = warpgroup_mma_wait(0, deps=(o_tok, p))         # PV of tile j-1 done
            mbarrier.arrive(v_empty.index(sp))
    # P to 16 bits after that wait: the PV of tile j-1 reads the old P until then (ptxas gives
    # the new P the same registers)
    p = gl.convert_layout(p_f32.to(q_tile.dtype), p_layout)      # registers only
    return o, m_new, l_i, p, alpha, rescaled


@gluon.jit
def _rescale(o, alpha, rescaled, o_rows: gl.constexpr, LAZY: gl.constexpr):
    """O * alpha per row; with LAZY, only when the last tile moved the reference."""
    if LAZY:
        if rescaled:
            o = o * gl.expand_dims(gl.convert_layout(alpha, o_rows), 1)
    else:
        o = o * gl.expand_dims(gl.convert_layout(alpha, o_rows), 1)
    return o


@gluon.jit
def _consumer(q_smem, k_smem, v_smem, q_bars, k_full, k_empty, v_full, v_empty, sched, o_desc,
              LSE, N_Q, N_K, qk_scale, WG: gl.constexpr, BLOCK_M: gl.constexpr,
              BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
              CAUSAL: gl.constexpr, OVERLAP: gl.constexpr, EXP2_MODE: gl.constexpr,
              LAZY: gl.constexpr, TAU: gl.constexpr):
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    s_rows: gl.constexpr = gl.SliceLayout(1, s_layout)
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)

    m_block = _m_block()
    bh = gl.program_id(1)
    row0 = m_block * 2 * BLOCK_M + WG * BLOCK_M
    n_tiles, n_full = _kv_tiles(row0, N_Q, N_K, BLOCK_M, BLOCK_N, CAUSAL)
    n_cta = _cta_tiles(m_block, N_Q, N_K, BLOCK_M, BLOCK_N, CAUSAL)

    q_view = q_smem.index(WG)                                    # (1, BLOCK_M, d): TMA's box
    q_tile = q_view.reshape([BLOCK_M, HEAD_DIM])                 # (BLOCK_M, d): wgmma's A

    o = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)
    m_i = gl.full([BLOCK_M], -float("inf"), gl.float32, s_rows)
    l_i = gl.zeros([BLOCK_M], gl.float32, s_rows)
    alpha = gl.zeros([BLOCK_M], gl.float32, s_rows)
    p = gl.zeros([BLOCK_M, BLOCK_N], q_tile.dtype, p_layout)
    rescaled = gl.max(l_i, axis=0) == 0.0          # a scalar flag (True); used with LAZY only

    mbarrier.wait(q_bars.index(WG), 0)
    if n_tiles > 0:
        o, m_i, l_i, p, alpha, rescaled = _tile(
            0, q_tile, k_smem, v_smem, k_full, k_empty, v_full, v_empty, sched, o, m_i, l_i, p,
            alpha, rescaled, row0, N_Q, N_K, n_full, qk_scale, WG, True, BLOCK_M, BLOCK_N,
            HEAD_DIM, STAGES, CAUSAL, OVERLAP, EXP2_MODE, LAZY, TAU)
    for j in range(1, n_tiles):
        o, m_i, l_i, p, alpha, rescaled = _tile(
            j, q_tile, k_smem, v_smem, k_full, k_empty, v_full, v_empty, sched, o, m_i, l_i, p,
            alpha, rescaled, row0, N_Q, N_K, n_full, qk_scale, WG, False, BLOCK_M, BLOCK_N,
            HEAD_DIM, STAGES, CAUSAL, OVERLAP, EXP2_MODE, LAZY, TAU)

    # the last PV, in turn n_tiles (taken even with no tile, so both consumers take as many turns)
    jl = gl.maximum(n_tiles - 1, 0)
    sl = jl % STAGES
    mbarrier.wait(v_full.index(sl), (jl // STAGES) & 1, pred=n_tiles > 0)
    _token_acquire(sched, n_tiles, WG)
    if n_tiles > 0:
        o = _rescale(o, alpha, rescaled, o_rows, LAZY)
        o_tok = warpgroup_mma(p, _tile_2d(v_smem, sl, BLOCK_N, HEAD_DIM), o, is_async=True)
        _token_release(sched, WG)
        o, p = warpgroup_mma_wait(0, deps=(o_tok, p))
        mbarrier.arrive(v_empty.index(sl))
    else:
        _token_release(sched, WG)

    # flush: tiles the other consumer reads but this one does not (causal, BLOCK_N < 2*BLOCK_M):
    # release them in order (waiting for each to land keeps the empty barriers' phases exact)
    # and take the matching turns.
    for j in range(n_tiles, n_cta):
        s = j % STAGES
        ph = (j // STAGES) & 1
        mbarrier.wait(k_full.index(s), ph)
        mbarrier.wait(v_full.index(s), ph)
        mbarrier.arrive(k_empty.index(s))
        mbarrier.arrive(v_empty.index(s))
        _token_acquire(sched, j + 1, WG)
        _token_release(sched, WG)

    # ---- epilogue: O = acc / l through this consumer's Q tile (free now), LSE in natural log ----
    l_o = gl.convert_layout(l_i, o_rows)
    inv = gl.where(l_o > 0.0, 1.0 / l_o, 0.0)
    o = o * gl.expand_dims(inv, 1)
    q_tile.store(o.to(q_tile.dtype))
    fence_async_shared()                       # generic-proxy writes -> the TMA store's reads
    tma_store(o_desc, [bh, row0, 0], q_view)
    rows = row0 + gl.arange(0, BLOCK_M, layout=s_rows)
    lse = gl.where(l_i > 0.0, (m_i + gl.log2(l_i)) * 0.6931471805599453, -float("inf"))
    gl.store(LSE + bh * N_Q + rows, lse, mask=rows < N_Q)
    tma.store_wait(0)


# ---------------------------------------------------------------------------------------------
# The kernel: allocate, initialise the barriers, fork the three roles.
# ---------------------------------------------------------------------------------------------
@gluon.jit(do_not_specialize=["N_Q", "N_K"])     # one binary for every length
def fa3_kernel(q_desc, k_desc, v_desc, o_desc, LSE, N_Q, N_K, qk_scale,
               BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
               STAGES: gl.constexpr, CAUSAL: gl.constexpr, OVERLAP: gl.constexpr,
               CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
               EXP2_MODE: gl.constexpr, LAZY: gl.constexpr, TAU: gl.constexpr):
    dtype: gl.constexpr = q_desc.dtype
    # shared memory: two Q tiles (reused for O), STAGES K tiles and STAGES V tiles, 128-byte
    # swizzled (NVMMA layouts, what TMA writes and wgmma reads), then 8-byte mbarriers
    q_smem = gl.allocate_shared_memory(dtype, [2] + q_desc.block_type.shape, q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    q_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    sched = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(q_bars.index(i), count=1)      # the producer's expect-tx arrival
        mbarrier.init(sched.index(i), count=1)       # the other consumer's release
    for i in gl.static_range(STAGES):
        mbarrier.init(k_full.index(i), count=1)
        mbarrier.init(v_full.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)     # both consumers
        mbarrier.init(v_empty.index(i), count=2)
    fence_async_shared()                             # the inits, before any TMA completes on them

    gl.warp_specialize([
        (_consumer, (q_smem, k_smem, v_smem, q_bars, k_full, k_empty, v_full, v_empty, sched,
                     o_desc, LSE, N_Q, N_K, qk_scale, 0, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES,
                     CAUSAL, OVERLAP, EXP2_MODE, LAZY, TAU)),
        (_consumer, (q_smem, k_smem, v_smem, q_bars, k_full, k_empty, v_full, v_empty, sched,
                     o_desc, LSE, N_Q, N_K, qk_scale, 1, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES,
                     CAUSAL, OVERLAP, EXP2_MODE, LAZY, TAU)),
        (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bars, k_full, k_empty,
                     v_full, v_empty, N_Q, N_K, BLOCK_M, BLOCK_N, STAGES, CAUSAL)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
