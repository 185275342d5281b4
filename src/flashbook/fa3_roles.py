"""The Hopper FlashAttention-3 kernel's roles in Triton Gluon, which Chapter 6's kernel
(``fa3_kernel``) runs as it is and Chapter 7's benchmark runs with its tricks: the producer, the
consumers (two, or three at d = 64, as FA3's) and their round of the tensor-core token, and the
tile bookkeeping they share; ``fa3_body`` is the body a kernel entry runs (allocate, initialise
the barriers, fork the roles). ``fa3_launch`` describes the kernel. Chapter 6's FP8 kernel
(``fa3_fp8_kernel``) runs the same producer (its ``V_T``: V transposed), tile counts and token
with consumers of its own.

The consumers' online softmax takes three hooks, ``@gluon.jit`` functions passed as constexprs:
the exponential of P, where the row maxima move, and how O is rescaled; ``exp2_mufu``,
``move_max`` and ``rescale_o`` are FlashAttention-3's. Gluon resolves a jit function's globals
in the module that defines it, so every helper a role reads is defined or imported here.
Importing this module needs Triton's Gluon dialect, not a GPU.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                              warpgroup_mma, warpgroup_mma_wait)

from flashbook.gluon_kit import m_block as _m_block, smem_tile as _tile_2d, tma_load, tma_store

__all__ = ["exp2_mufu", "move_max", "rescale_o", "producer",
           "consumer", "consumer_work", "tile", "kv_tiles", "cta_tiles", "token_acquire",
           "token_release", "work_tile", "producer_persistent", "consumer_persistent"]


# ---------------------------------------------------------------------------------------------
# Tile bookkeeping shared by the three roles (they must agree on every count, or a barrier
# waits forever).
# ---------------------------------------------------------------------------------------------
@gluon.jit
def kv_tiles(row0, N_Q, N_K, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
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
def cta_tiles(m_block, N_Q, N_K, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
               CAUSAL: gl.constexpr, CONSUMERS: gl.constexpr):
    """The K/V tiles the producer streams for the CTA: the most any consumer reads, which is
    the last one's (a causal row sees more keys the lower it is)."""
    rows = m_block * CONSUMERS * BLOCK_M + (CONSUMERS - 1) * BLOCK_M
    tiles, full = kv_tiles(rows, N_Q, N_K, BLOCK_M, BLOCK_N, CAUSAL)
    return tiles


# ---------------------------------------------------------------------------------------------
# The producer: one warp that only issues TMA copies.
# ---------------------------------------------------------------------------------------------
@gluon.jit
def producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bars, k_full, k_empty, v_full,
              v_empty, N_Q, N_K, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              STAGES: gl.constexpr, CAUSAL: gl.constexpr, V_T: gl.constexpr,
              CONSUMERS: gl.constexpr):
    """Q's tiles (one a consumer), then the K/V ring. ``V_T``: v_desc holds V transposed, (B*H,
    d, N) in boxes of (1, d, BLOCK_N) (the FP8 kernel's K-major V), so tile j starts at column
    j*BLOCK_N."""
    m_block = _m_block()
    bh = gl.program_id(1)
    n_tiles = cta_tiles(m_block, N_Q, N_K, BLOCK_M, BLOCK_N, CAUSAL, CONSUMERS)

    # Q: one tile per consumer, one barrier each (phase 0 completes once, when the bytes land)
    for w in gl.static_range(CONSUMERS):
        mbarrier.expect(q_bars.index(w), q_desc.block_type.nbytes)
        tma_load(q_desc, [bh, m_block * CONSUMERS * BLOCK_M + w * BLOCK_M, 0], q_bars.index(w),
                 q_smem.index(w))

    # K/V ring. Use u of slot s (u = j // STAGES) waits for the empty barrier's phase u - 1 (every
    # consumer released tile j - STAGES); a fresh one, in phase 0, passes a parity-1 wait.
    for j in range(n_tiles):
        s = j % STAGES
        ph = (j // STAGES) & 1
        mbarrier.wait(k_empty.index(s), ph ^ 1)
        mbarrier.expect(k_full.index(s), k_desc.block_type.nbytes)   # the whole box, always
        tma_load(k_desc, [bh, j * BLOCK_N, 0], k_full.index(s), k_smem.index(s))
        mbarrier.wait(v_empty.index(s), ph ^ 1)
        mbarrier.expect(v_full.index(s), v_desc.block_type.nbytes)
        if V_T:
            tma_load(v_desc, [bh, 0, j * BLOCK_N], v_full.index(s), v_smem.index(s))
        else:
            tma_load(v_desc, [bh, j * BLOCK_N, 0], v_full.index(s), v_smem.index(s))


# ---------------------------------------------------------------------------------------------
# The softmax's hooks (constexpr arguments of the consumers), and the ones FlashAttention-3 uses:
#   EXP2(x)                               2^x of every score of P (x <= 0)
#   MOVE_MAX(m_i, m_new, rescaled)        where the row maxima P is taken against go, given the
#                                         old ones and the new tile's: (m_new, rescaled), with
#                                         ``rescaled`` a flag carried from tile to tile
#   RESCALE(o, alpha, rescaled, o_rows)   O rescaled by alpha (its rows in layout o_rows)
# ---------------------------------------------------------------------------------------------
@gluon.jit
def exp2_mufu(x):
    """2^x on the special-function unit (MUFU.EX2)."""
    return gl.exp2(x)


@gluon.jit
def move_max(m_i, m_new, rescaled):
    """The maxima move with every tile (the flag is not used)."""
    return m_new, rescaled


@gluon.jit
def rescale_o(o, alpha, rescaled, o_rows: gl.constexpr):
    """O * alpha per row, every tile."""
    return o * gl.expand_dims(gl.convert_layout(alpha, o_rows), 1)


# ---------------------------------------------------------------------------------------------
# The consumers: the tensor-core token (ping-pong, a round of three) and one K/V tile of work.
# ---------------------------------------------------------------------------------------------
@gluon.jit
def token_acquire(sched, t, WG: gl.constexpr):
    """Wait for my t-th turn at the tensor cores; the turns go round the consumers in order.
    Warpgroup 0's turn t needs the last warpgroup's (t-1)-th release on sched[0] (t = 0 passes:
    parity 1 on a fresh barrier); warpgroup w > 0's turn t needs warpgroup w-1's t-th release on
    sched[w]. No warpgroup releases turn t+1 before the next took turn t, so a barrier is never
    more than one phase ahead of its waiter and parities cannot alias."""
    if WG == 0:
        mbarrier.wait(sched.index(0), (t & 1) ^ 1)
    else:
        mbarrier.wait(sched.index(WG), t & 1)


@gluon.jit
def token_release(sched, WG: gl.constexpr, CONSUMERS: gl.constexpr):
    mbarrier.arrive(sched.index((WG + 1) % CONSUMERS))


@gluon.jit
def tile(j, rb, tb, q_tile, k_smem, v_smem, k_full, k_empty, v_full, v_empty, sched, o, m_i, l_i, p,
          alpha, rescaled, row0, N_Q, N_K, n_full, qk_scale, WG: gl.constexpr,
          FIRST: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
          HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
          OVERLAP: gl.constexpr, EXP2: gl.constexpr, MOVE_MAX: gl.constexpr,
          RESCALE: gl.constexpr, CONSUMERS: gl.constexpr):
    """Tile j of one consumer. In one turn at the tensor cores: issue S = Q K_j^T, rescale O by
    tile j-1's alpha, issue O += P_{j-1} V_{j-1}. Then the online softmax of tile j.

    In: o = sum over tiles < j-1 of P V, relative to the maxima m_{j-2}; m_i, l_i, p, alpha of
    tile j-1. Out: o = sum over tiles < j (relative to m_{j-1}), and m_i, l_i, p, alpha of tile j.
    O is rescaled before its PV is issued, so nothing touches o or P between the two waits
    (FlashAttention-3's order). ``rb`` and ``tb``: the ring's and the token's counts before this
    work tile's first (0 in a CTA of one work tile; a persistent CTA's go on across its tiles)."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    s_rows: gl.constexpr = gl.SliceLayout(1, s_layout)
    s_cols: gl.constexpr = gl.SliceLayout(0, s_layout)
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)

    r = rb + j                                 # this K/V tile's use of the ring
    s = r % STAGES
    ph = (r // STAGES) & 1
    rp = rb + gl.maximum(j - 1, 0)             # the previous tile (unused when FIRST)
    sp = rp % STAGES
    php = (rp // STAGES) & 1

    # data first, then the turn: never hold the token while waiting for a TMA
    mbarrier.wait(k_full.index(s), ph)
    if not FIRST:
        mbarrier.wait(v_full.index(sp), php)
    token_acquire(sched, tb + j, WG)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    k_t = _tile_2d(k_smem, s, BLOCK_N, HEAD_DIM).permute((1, 0))   # (d, BLOCK_N) view of K
    s_tok = warpgroup_mma(q_tile, k_t, s_zero, use_acc=False, is_async=True)
    if not FIRST:
        o = RESCALE(o, alpha, rescaled, o_rows)
        o_tok = warpgroup_mma(p, _tile_2d(v_smem, sp, BLOCK_N, HEAD_DIM), o, is_async=True)
    token_release(sched, WG, CONSUMERS)
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
    m_new, rescaled = MOVE_MAX(m_i, m_new, rescaled)
    m_use = gl.where(m_new == -float("inf"), 0.0, m_new)      # a row with no key yet: no NaN
    alpha = gl.exp2(m_i - m_use)
    p_f32 = EXP2(s_acc * qk_scale - gl.expand_dims(m_use, 1))  # FMA + exp2 each
    l_i = l_i * alpha + gl.sum(p_f32, axis=1)
    if OVERLAP:
        if not FIRST:
            o, p = warpgroup_mma_wait(0, deps=(o_tok, p))         # PV of tile j-1 done
            mbarrier.arrive(v_empty.index(sp))
    # P to 16 bits after that wait: the PV of tile j-1 reads the old P until then. ptxas gives
    # the new P the same registers and converts each exponential as it comes, so it hoists the
    # wait above the exponentials (tests/test_ch6.py checks the SASS). Alternate tiles' P in
    # registers of their own (the loop unrolled by two, each new P made before the wait) did
    # not move it: at 64 x 128 ptxas spilled and waited after every wgmma; at 64 x 64 it fit
    # and the wait still came first.
    p = gl.convert_layout(p_f32.to(q_tile.dtype), p_layout)      # registers only
    return o, m_new, l_i, p, alpha, rescaled


@gluon.jit
def consumer(q_smem, k_smem, v_smem, q_bars, k_full, k_empty, v_full, v_empty, sched, o_desc,
              LSE, N_Q, N_K, qk_scale, WG: gl.constexpr, BLOCK_M: gl.constexpr,
              BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
              CAUSAL: gl.constexpr, OVERLAP: gl.constexpr, EXP2: gl.constexpr,
              MOVE_MAX: gl.constexpr, RESCALE: gl.constexpr, CONSUMERS: gl.constexpr):
    """Consumer WG of the CTA's one work tile (its Q barrier's phase 0; O leaves through its
    Q tile, and ``q_bars`` stands in for the Q-free barriers a persistent CTA has)."""
    consumer_work(_m_block(), gl.program_id(1), 0, 0, 0, q_smem, k_smem, v_smem, q_smem, q_bars,
                  q_bars, k_full, k_empty, v_full, v_empty, sched, o_desc, LSE, N_Q, N_K,
                  qk_scale, WG, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, CAUSAL, OVERLAP, EXP2,
                  MOVE_MAX, RESCALE, False, CONSUMERS)


@gluon.jit
def consumer_work(m_block, bh, rb, tb, q_phase, q_smem, k_smem, v_smem, o_smem, q_bars, q_free,
                  k_full, k_empty, v_full, v_empty, sched, o_desc, LSE, N_Q, N_K, qk_scale,
                  WG: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                  HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                  OVERLAP: gl.constexpr, EXP2: gl.constexpr, MOVE_MAX: gl.constexpr,
                  RESCALE: gl.constexpr, PERSISTENT: gl.constexpr, CONSUMERS: gl.constexpr):
    """One work tile (m_block, bh) of consumer WG: its Q tile's phase ``q_phase``, the ring's
    and the token's counts ``rb`` and ``tb`` before it. It takes ``cta_tiles + 1`` turns and
    releases ``cta_tiles`` ring slots, which it returns. O leaves through ``o_smem``'s tile WG
    by a TMA store. ``PERSISTENT`` (``o_smem`` O's own tiles): it frees its Q tile (``q_free``)
    as soon as its last QK^T is done, so the next tile's Q loads during the last PV and the
    epilogue, and it waits for the previous tile's O store only before reusing O's tile
    (FlashAttention-3's order); otherwise ``o_smem`` is ``q_smem``, free after the last PV."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    s_rows: gl.constexpr = gl.SliceLayout(1, s_layout)
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)

    row0 = m_block * CONSUMERS * BLOCK_M + WG * BLOCK_M
    n_tiles, n_full = kv_tiles(row0, N_Q, N_K, BLOCK_M, BLOCK_N, CAUSAL)
    n_cta = cta_tiles(m_block, N_Q, N_K, BLOCK_M, BLOCK_N, CAUSAL, CONSUMERS)

    q_view = q_smem.index(WG)                                    # (1, BLOCK_M, d): TMA's box
    q_tile = q_view.reshape([BLOCK_M, HEAD_DIM])                 # (BLOCK_M, d): wgmma's A

    o = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)
    m_i = gl.full([BLOCK_M], -float("inf"), gl.float32, s_rows)
    l_i = gl.zeros([BLOCK_M], gl.float32, s_rows)
    alpha = gl.zeros([BLOCK_M], gl.float32, s_rows)
    p = gl.zeros([BLOCK_M, BLOCK_N], q_tile.dtype, p_layout)
    rescaled = gl.max(l_i, axis=0) == 0.0          # a scalar flag (True) for the hooks

    mbarrier.wait(q_bars.index(WG), q_phase)
    if n_tiles > 0:
        o, m_i, l_i, p, alpha, rescaled = tile(
            0, rb, tb, q_tile, k_smem, v_smem, k_full, k_empty, v_full, v_empty, sched, o, m_i,
            l_i, p, alpha, rescaled, row0, N_Q, N_K, n_full, qk_scale, WG, True, BLOCK_M,
            BLOCK_N, HEAD_DIM, STAGES, CAUSAL, OVERLAP, EXP2, MOVE_MAX, RESCALE, CONSUMERS)
    for j in range(1, n_tiles):
        o, m_i, l_i, p, alpha, rescaled = tile(
            j, rb, tb, q_tile, k_smem, v_smem, k_full, k_empty, v_full, v_empty, sched, o, m_i,
            l_i, p, alpha, rescaled, row0, N_Q, N_K, n_full, qk_scale, WG, False, BLOCK_M,
            BLOCK_N, HEAD_DIM, STAGES, CAUSAL, OVERLAP, EXP2, MOVE_MAX, RESCALE, CONSUMERS)

    if PERSISTENT:
        mbarrier.arrive(q_free.index(WG))      # every QK^T has been waited: Q is read no more

    # the last PV, in turn n_tiles (taken even with no tile, so all consumers take as many turns)
    jl = rb + gl.maximum(n_tiles - 1, 0)
    sl = jl % STAGES
    mbarrier.wait(v_full.index(sl), (jl // STAGES) & 1, pred=n_tiles > 0)
    token_acquire(sched, tb + n_tiles, WG)
    if n_tiles > 0:
        o = RESCALE(o, alpha, rescaled, o_rows)
        o_tok = warpgroup_mma(p, _tile_2d(v_smem, sl, BLOCK_N, HEAD_DIM), o, is_async=True)
        token_release(sched, WG, CONSUMERS)
        o, p = warpgroup_mma_wait(0, deps=(o_tok, p))
        mbarrier.arrive(v_empty.index(sl))
    else:
        token_release(sched, WG, CONSUMERS)

    # flush: tiles another consumer reads but this one does not (causal, BLOCK_N < 2*BLOCK_M):
    # release them in order (waiting for each to land keeps the empty barriers' phases exact)
    # and take the matching turns.
    for j in range(n_tiles, n_cta):
        s = (rb + j) % STAGES
        ph = ((rb + j) // STAGES) & 1
        mbarrier.wait(k_full.index(s), ph)
        mbarrier.wait(v_full.index(s), ph)
        mbarrier.arrive(k_empty.index(s))
        mbarrier.arrive(v_empty.index(s))
        token_acquire(sched, tb + j + 1, WG)
        token_release(sched, WG, CONSUMERS)

    # ---- epilogue: O = acc / l through O's tile, LSE in natural log ----
    l_o = gl.convert_layout(l_i, o_rows)
    inv = gl.where(l_o > 0.0, 1.0 / l_o, 0.0)
    o = o * gl.expand_dims(inv, 1)
    o_view = o_smem.index(WG)                  # (1, BLOCK_M, d): TMA's box
    if PERSISTENT:
        tma.store_wait(0)                      # the previous tile's O store has read the tile
    o_view.reshape([BLOCK_M, HEAD_DIM]).store(o.to(q_tile.dtype))
    fence_async_shared()                       # generic-proxy writes -> the TMA store's reads
    tma_store(o_desc, [bh, row0, 0], o_view)
    rows = row0 + gl.arange(0, BLOCK_M, layout=s_rows)
    lse = gl.where(l_i > 0.0, (m_i + gl.log2(l_i)) * 0.6931471805599453, -float("inf"))
    gl.store(LSE + bh * N_Q + rows, lse, mask=rows < N_Q)
    if not PERSISTENT:
        tma.store_wait(0)                      # the store has read the tile before the CTA ends
    return n_cta


# ---------------------------------------------------------------------------------------------
# The persistent roles (two or three consumers): one CTA per SM runs one work tile a round of a
# static schedule (``work_index``: pid, then 2*grid - 1 - pid, ...); the ring's and the token's
# phases go on from tile to tile (after i tiles the token has gone round rb + i times:
# cta_tiles + 1 turns a tile), Q's barriers complete once a tile (phase i & 1), and a consumer
# frees its Q tile after its last QK^T: the producer loads the next Q while the consumer runs
# its last PV and stores O from a tile of its own.
# ---------------------------------------------------------------------------------------------
@gluon.jit
def work_tile(t, n_m, n_bh, GROUP: gl.constexpr):
    """(m_block, bh) of work tile t of n_m * n_bh. The heads go in sections of GROUP (0: one
    section of all), section after section; in a section the last query blocks (causal: the
    longest) come first, its heads interleaved, so a section's K/V stay in L2 while it runs."""
    if GROUP == 0:
        group = n_bh
    else:
        group = gl.minimum(n_bh, GROUP)
    per = n_m * group
    section = t // per
    base = section * group
    g = gl.minimum(group, n_bh - base)           # the last section may be short
    r = t - section * per
    return n_m - 1 - r // g, base + r % g


@gluon.jit
def work_index(i):
    """This CTA's work tile in round i of the schedule: rounds run in alternate directions (a
    snake), so a CTA that drew a long causal tile in one round draws a short one in the next."""
    pid = gl.program_id(0)
    return i * gl.num_programs(0) + pid + (i & 1) * (gl.num_programs(0) - 1 - 2 * pid)


@gluon.jit
def load_q(q_desc, q_smem, q_bars, q_free, m_block, bh, i, BLOCK_M: gl.constexpr,
           CONSUMERS: gl.constexpr):
    """Work tile i's Q tiles, one a consumer, each once its consumer freed the slot (after
    tile i - 1's last QK^T)."""
    for w in gl.static_range(CONSUMERS):
        mbarrier.wait(q_free.index(w), (i & 1) ^ 1)
        mbarrier.expect(q_bars.index(w), q_desc.block_type.nbytes)
        tma_load(q_desc, [bh, (m_block * CONSUMERS + w) * BLOCK_M, 0], q_bars.index(w),
                 q_smem.index(w))


@gluon.jit
def producer_persistent(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bars, q_free, k_full,
                        k_empty, v_full, v_empty, N_Q, N_K, BLOCK_M: gl.constexpr,
                        BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                        GROUP: gl.constexpr, CONSUMERS: gl.constexpr):
    """The producer of a persistent CTA: per work tile K_0, then Q (which waits for the
    previous tile's last QK^T), then the rest; K/V of the next tile stream into the slots the
    consumers free while they still finish this one."""
    n_m = gl.cdiv(N_Q, CONSUMERS * BLOCK_M)
    n_bh = q_desc.shape[0]
    rb = gl.to_tensor(0)                         # ring uses before this work tile
    for i in range(gl.cdiv(n_m * n_bh, gl.num_programs(0))):
        t = work_index(i)
        if t < n_m * n_bh:                       # the last round may have no tile for this CTA
            m_block, bh = work_tile(t, n_m, n_bh, GROUP)
            rb = _produce(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bars, q_free,
                          k_full, k_empty, v_full, v_empty, m_block, bh, i, rb, N_Q, N_K,
                          BLOCK_M, BLOCK_N, STAGES, CAUSAL, CONSUMERS)


@gluon.jit
def _produce(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bars, q_free, k_full, k_empty,
             v_full, v_empty, m_block, bh, i, rb, N_Q, N_K, BLOCK_M: gl.constexpr,
             BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
             CONSUMERS: gl.constexpr):
    """The loads of work tile i (m_block, bh), the ring used rb times before; returns rb after."""
    n_tiles = cta_tiles(m_block, N_Q, N_K, BLOCK_M, BLOCK_N, CAUSAL, CONSUMERS)
    for j in range(n_tiles):
        r = rb + j
        s = r % STAGES
        ph = (r // STAGES) & 1
        mbarrier.wait(k_empty.index(s), ph ^ 1)
        mbarrier.expect(k_full.index(s), k_desc.block_type.nbytes)
        tma_load(k_desc, [bh, j * BLOCK_N, 0], k_full.index(s), k_smem.index(s))
        if j == 0:
            load_q(q_desc, q_smem, q_bars, q_free, m_block, bh, i, BLOCK_M, CONSUMERS)
        mbarrier.wait(v_empty.index(s), ph ^ 1)
        mbarrier.expect(v_full.index(s), v_desc.block_type.nbytes)
        tma_load(v_desc, [bh, j * BLOCK_N, 0], v_full.index(s), v_smem.index(s))
    if n_tiles == 0:
        load_q(q_desc, q_smem, q_bars, q_free, m_block, bh, i, BLOCK_M, CONSUMERS)
    return rb + n_tiles


@gluon.jit
def consumer_persistent(q_smem, k_smem, v_smem, o_smem, q_bars, q_free, k_full, k_empty,
                        v_full, v_empty, sched, o_desc, LSE, N_Q, N_K, qk_scale, WG: gl.constexpr,
                        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                        STAGES: gl.constexpr, CAUSAL: gl.constexpr, OVERLAP: gl.constexpr,
                        EXP2: gl.constexpr, MOVE_MAX: gl.constexpr, RESCALE: gl.constexpr,
                        GROUP: gl.constexpr, CONSUMERS: gl.constexpr):
    n_m = gl.cdiv(N_Q, CONSUMERS * BLOCK_M)
    n_bh = o_desc.shape[0]
    rb = gl.to_tensor(0)                         # ring uses before this work tile
    for i in range(gl.cdiv(n_m * n_bh, gl.num_programs(0))):
        t = work_index(i)
        if t < n_m * n_bh:                       # i tiles before this one: rb + i turns
            m_block, bh = work_tile(t, n_m, n_bh, GROUP)
            rb += consumer_work(m_block, bh, rb, rb + i, i & 1, q_smem, k_smem, v_smem, o_smem,
                                q_bars, q_free, k_full, k_empty, v_full, v_empty, sched, o_desc,
                                LSE, N_Q, N_K, qk_scale, WG, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES,
                                CAUSAL, OVERLAP, EXP2, MOVE_MAX, RESCALE, True, CONSUMERS)
    tma.store_wait(0)                            # the last O store has read its tile
