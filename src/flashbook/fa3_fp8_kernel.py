"""The device code of Chapter 6's FP8 forward in Gluon: the FA3 kernel's roles (the toolkit's
``fa3_roles``: the same producer warp, tile counts and ping-pong token) with consumers whose two
GEMMs are e4m3 wgmma, and ``fa3_fp8_launch`` its host side (``attention_fp8_gluon``).

The scale bookkeeping is Chapter 6's Triton ``fp8_attention_kernel``'s, so the two agree within
rounding:

* S = (Q8 K8^T) sq sk in fp32: Q's scale is per row (its block of ``QS_BLOCK`` rows), K's one
  per tile (``KV_BLOCK``, a multiple of ``BLOCK_N``); c = sq sk softmax_scale log2(e) > 0 per
  row, so max(S) c is the max of S c;
* P = 2^8 exp2(S c - m), in [0, 256], cast to e4m3 and handed to wgmma as its A operand; l
  carries the 2^8. The constexpr ``P_VIA`` picks the path (``p_operand``): "regs", registers
  (fp8 from registers needs ``k_width=4``, four consecutive keys a 32-bit register; Triton
  moves P from S's accumulator layout with warp shuffles and byte permutes); "smem", P stored
  to shared memory and read from there; "perm", FlashAttention-3's way: V^T's keys come
  permuted within each 32 (``fa3_fp8_launch.PERM_32``) so that the keys a thread holds in S
  are the k indices it holds in the A layout, and the conversion is a relabelling Gluon
  asserts trivial; "perm4" as "perm", with P carried as float32 and cast just before its PV,
  two cvt a register (``to_e4m3_x4``), no bytes unpacked across the loop; "sperm" as "smem"
  with P in "perm"'s key order, so that the four keys of each 32-bit register of the A layout
  are four adjacent bytes of P's tile: stored by ``stmatrix`` (8 instructions a thread for a
  64 x 256 tile instead of 64 16-bit stores);
* P stays out of ``warpgroup_mma_wait``'s deps: Triton's lowering of the wait takes no 8-bit
  operands ("Unexpected bitwidth in WGMMAWaitGroupOp: 8", 3.6 and 3.9). ptxas keeps the
  registers an in-flight wgmma reads until its wait (the SASS of 64 x 128 x 3 "regs" writes none
  of the QGMMA's A registers before its ``WARPGROUP.DEPBAR``), and the new P is made after it;
* O is held in units of the V scale of the last tile whose PV was issued: before the PV of tile
  j it is rescaled by alpha_j * sv_{j-1} / sv_j, and the epilogue multiplies by sv_last / l;
* the constexpr ``EXP2_FMA`` = n > 0 computes one exponential in 2^n by a polynomial on the
  FMA pipe (``exp2_fma``, FlashAttention-4's trick) instead of MUFU (``exp2_split``): off by
  default; slower at n = 1, 2 and 3 on an H100 (Chapter 6, Section 8, says why).

V travels transposed, V^T (B*H, d, N) with the keys contiguous: wgmma reads an fp8 B operand
only K-major (FlashAttention-3 transposes V in the kernel instead). The producer (``V_T``) loads
(1, d, BLOCK_N) boxes; the consumer hands wgmma their (BLOCK_N, d) view.

FA3's pipelined order: tile j issues S_j = Q K_j^T, then O += P_{j-1} V_{j-1}, in one turn at
the tensor cores; the softmax of tile j runs while the other consumer takes its turn. O (fp16 or
bf16) is stored from registers with a masked ``gl.store`` (no TMA: O is twice as wide as the Q
tile it would reuse). Importing this module needs Triton's Gluon dialect, not a GPU.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier,
                                                              warpgroup_mma, warpgroup_mma_wait)

from flashbook.fa3_roles import cta_tiles, kv_tiles, producer, token_acquire, token_release
from flashbook.gluon_kit import cta_barrier as _cta_barrier, m_block as _m_block, \
    smem_tile as _tile_2d

__all__ = ["fp8_kernel", "fp8_tile", "fp8_consumer", "P_SHIFT"]

P_SHIFT = gl.constexpr(8.0)      # P = 2^8 exp2(S c - m) <= 256 < 448: clear of e4m3's subnormals


@gluon.jit
def keys_in_register_order(p8, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """P (BLOCK_M, BLOCK_N) with its keys reordered within each group of 32 so that column k
    holds key PERM_32[k] (``fa3_fp8_launch.PERM_32``, k = 16h + 4q + 2j + e <- key 16h + 8j +
    2q + e): the key each thread already holds in S's layout where wgmma's k_width=4 A layout
    wants column k. A relabelling, no data moves; V^T's keys come permuted the same way."""
    x = p8.reshape([BLOCK_M, BLOCK_N // 32, 2, 2, 4, 2])     # key = 32c + 16h + 8j + 2q + e
    x = x.permute((0, 1, 2, 4, 3, 5))                         # k = 32c + 16h + 4q + 2j + e
    return x.reshape([BLOCK_M, BLOCK_N])


@gluon.jit
def to_e4m3_x4(x):
    """float32 -> e4m3 (round to nearest, saturating: ``.to(gl.float8e4nv)``'s rounding), four
    consecutive registers of x into one 32-bit register, lowest byte first: the packing wgmma's
    fp8 A operand reads, with no byte moves in between."""
    return gl.inline_asm_elementwise(
        "{ .reg .b16 lo, hi;\n"
        "cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1;\n"      # a to the upper byte, b the lower
        "cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3;\n"
        "mov.b32 $0, {lo, hi}; }", "=r,r,r,r,r", [x], dtype=gl.float8e4nv, is_pure=True,
        pack=4)


@gluon.jit
def exp2_fma(x):
    """2^x on the FMA pipe, no MUFU (FlashAttention-4's trick): x = j + f with j = round(x) and
    f in [-0.5, 0.5]; 2^f by its cubic Taylor polynomial (relative error < 1e-3, far below e4m3's
    2^-4 steps), 2^j added into the exponent bits. x is clamped at -127 (2^-127 is 0 in e4m3)."""
    x = gl.maximum(x, -127.0)
    t = x + 12582912.0                          # 1.5 * 2^23: t's low mantissa bits are round(x)
    f = x - (t - 12582912.0)
    p = gl.fma(gl.fma(gl.fma(f, 0.0555041, 0.2402265), f, 0.6931472), f, 1.0)
    bits = p.to(gl.int32, bitcast=True) + (t.to(gl.int32, bitcast=True) << 23)
    return bits.to(gl.float32, bitcast=True)


@gluon.jit
def _halves(x, BLOCK_M: gl.constexpr, N: gl.constexpr):
    """x (BLOCK_M, N) -> its keys below N/2 and from N/2 on: a thread holds keys of both
    halves, so the split stays in its registers."""
    return x.reshape([BLOCK_M, 2, N // 2]).permute((0, 2, 1)).split()


@gluon.jit
def _joined(lo, hi, like, BLOCK_M: gl.constexpr, N: gl.constexpr):
    """``_halves``' inverse, in ``like``'s layout (asserted to move no data)."""
    return gl.convert_layout(gl.join(lo, hi).permute((0, 2, 1)).reshape([BLOCK_M, N]),
                             like.type.layout, assert_trivial=True)


@gluon.jit
def exp2_split(x, EXP2_FMA: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """exp2 of S's tile, with EXP2_FMA = n > 0 one key in 2^n on the FMA pipe (``exp2_fma``):
    the last half of the keys, of that half, ... n times (n <= 3)."""
    if EXP2_FMA == 0:
        out = gl.exp2(x)
    else:
        a, b = _halves(x, BLOCK_M, BLOCK_N)
        if EXP2_FMA == 1:
            b = exp2_fma(b)
        else:
            b1, b2 = _halves(b, BLOCK_M, BLOCK_N // 2)
            if EXP2_FMA == 2:
                b2 = exp2_fma(b2)
            else:
                c1, c2 = _halves(b2, BLOCK_M, BLOCK_N // 4)
                b2 = _joined(gl.exp2(c1), exp2_fma(c2), b2, BLOCK_M, BLOCK_N // 4)
            b = _joined(gl.exp2(b1), b2, b, BLOCK_M, BLOCK_N // 2)
        out = _joined(gl.exp2(a), b, x, BLOCK_M, BLOCK_N)
    return out


@gluon.jit
def p_operand(p8, p, p_smem, P_VIA: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              p_layout: gl.constexpr):
    """P (e4m3, S's accumulator layout) made into PV's A operand, ``P_VIA``:

    * "regs": ``p_layout`` registers by ``convert_layout`` (warp shuffles and byte permutes);
    * "smem": stored to this consumer's ``p_smem`` (wgmma reads A from there), fenced for the
      async proxy, then a barrier of the warpgroup so every warp's rows are in; returns ``p``;
    * "perm": ``keys_in_register_order`` then a conversion asserted trivial (thread-local);
    * "perm4": the same on P in float32 (p8 is float32 here): the tile of its PV casts it with
      ``to_e4m3_x4``."""
    if P_VIA == "smem" or P_VIA == "sperm":
        if P_VIA == "sperm":                    # four adjacent bytes a register: stmatrix
            p8 = keys_in_register_order(p8, BLOCK_M, BLOCK_N)
        p_smem.store(p8)
        fence_async_shared()
        _cta_barrier()                          # the consumer's 4 warps (a named barrier)
        out = p
    elif P_VIA == "perm" or P_VIA == "perm4":
        out = gl.convert_layout(keys_in_register_order(p8, BLOCK_M, BLOCK_N), p_layout,
                                assert_trivial=True)
    else:
        out = gl.convert_layout(p8, p_layout)
    return out


@gluon.jit
def pv_mma(p, p_smem, v_t, o, P_VIA: gl.constexpr):
    """Issue O += P V^T' (async): A from ``p_smem`` for "smem" and "sperm", else the registers
    ``p``."""
    if P_VIA == "smem" or P_VIA == "sperm":
        tok = warpgroup_mma(p_smem, v_t, o, is_async=True)
    else:
        tok = warpgroup_mma(p, v_t, o, is_async=True)
    return tok


@gluon.jit
def fp8_tile(j, q_tile, k_smem, v_smem, k_full, k_empty, v_full, v_empty, sched, o, m_i, l_i,
             p, p_smem, alpha, sv, c_row, KS, VS, row0, N_Q, N_K, n_full, WG: gl.constexpr,
             FIRST: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
             HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
             OVERLAP: gl.constexpr, KV_BLOCK: gl.constexpr, P_VIA: gl.constexpr,
             EXP2_FMA: gl.constexpr):
    """Tile j of one consumer (``fa3_roles.tile``'s order). In: o = sum over tiles < j-1 in
    units of sv_{j-2}; alpha = alpha_{j-1} sv_{j-2} / sv_{j-1}; sv = sv_{j-1}. Out: o in units
    of sv_{j-1}, and m_i, l_i, p, alpha, sv of tile j. KS, VS: this head's block scales."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 32])
    s_rows: gl.constexpr = gl.SliceLayout(1, s_layout)
    s_cols: gl.constexpr = gl.SliceLayout(0, s_layout)
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 32])
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4)

    s = j % STAGES
    ph = (j // STAGES) & 1
    jp = gl.maximum(j - 1, 0)
    sp = jp % STAGES
    php = (jp // STAGES) & 1
    if P_VIA == "perm4" and not FIRST:         # P_{j-1} cast in the iteration of its PV: no
        p = to_e4m3_x4(p)                      # loop-carried bytes to unpack and repack
    blk = (j * BLOCK_N) // KV_BLOCK            # tile j's K and V scales: loads issued first,
    sk = gl.load(KS + blk)                     # their latency hides under the waits
    sv_new = gl.load(VS + blk)

    mbarrier.wait(k_full.index(s), ph)
    if not FIRST:
        mbarrier.wait(v_full.index(sp), php)
    token_acquire(sched, j, WG)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    k_t = _tile_2d(k_smem, s, BLOCK_N, HEAD_DIM).permute((1, 0))      # (d, BLOCK_N), K-major
    s_tok = warpgroup_mma(q_tile, k_t, s_zero, use_acc=False, is_async=True)
    if not FIRST:
        o = o * gl.expand_dims(gl.convert_layout(alpha, o_rows), 1)
        v_t = _tile_2d(v_smem, sp, HEAD_DIM, BLOCK_N).permute((1, 0))  # (BLOCK_N, d), K-major
        o_tok = pv_mma(p, p_smem, v_t, o, P_VIA)
    token_release(sched, WG, 2)
    if FIRST:
        s_acc = warpgroup_mma_wait(0, deps=(s_tok, ))
    elif OVERLAP:
        s_acc = warpgroup_mma_wait(1, deps=(s_tok, ))
    else:
        s_acc, o = warpgroup_mma_wait(0, deps=(s_tok, o_tok))
        mbarrier.arrive(v_empty.index(sp))
    mbarrier.arrive(k_empty.index(s))

    # ---- online softmax of tile j in log2 units, S scaled per row by c = sq sk scale log2(e)
    if j >= n_full:                            # the diagonal / the tail only
        cols = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=s_cols)
        keep = gl.expand_dims(cols < N_K, 0)
        if CAUSAL:
            rows = row0 + gl.arange(0, BLOCK_M, layout=s_rows) + (N_K - N_Q)
            keep = keep & (gl.expand_dims(cols, 0) <= gl.expand_dims(rows, 1))
        s_acc = gl.where(keep, s_acc, -float("inf"))
    c = c_row * sk
    m_new = gl.maximum(m_i, gl.max(s_acc, axis=1) * c)
    m_use = gl.where(m_new == -float("inf"), 0.0, m_new)           # a row with no key yet
    alpha_j = gl.exp2(m_i - m_use)
    p_f32 = exp2_split(s_acc * gl.expand_dims(c, 1) - gl.expand_dims(m_use - P_SHIFT, 1),
                       EXP2_FMA, BLOCK_M, BLOCK_N)
    l_i = l_i * alpha_j + gl.sum(p_f32, axis=1)
    # P_j's stores and registers wait for PV_{j-1}. (A second P tile, the softmax then under
    # PV_{j-1} and the wait after P's stores, measured no faster on an H100.)
    if OVERLAP:
        if not FIRST:
            o = warpgroup_mma_wait(0, deps=(o_tok, ))
            mbarrier.arrive(v_empty.index(sp))
    if P_VIA == "perm4":                       # cast after the (free) move to p_layout
        p = p_operand(p_f32, p, p_smem, P_VIA, BLOCK_M, BLOCK_N, p_layout)
    else:
        p = p_operand(p_f32.to(gl.float8e4nv), p, p_smem, P_VIA, BLOCK_M, BLOCK_N, p_layout)
    alpha = alpha_j * (sv / sv_new)            # applied to O before this tile's PV
    return o, m_new, l_i, p, alpha, sv_new


@gluon.jit
def fp8_consumer(q_smem, k_smem, v_smem, p_smem, q_bars, k_full, k_empty, v_full, v_empty,
                 sched, O, QS, KS, VS, N_Q, N_K, qk_scale, WG: gl.constexpr,
                 BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                 STAGES: gl.constexpr, CAUSAL: gl.constexpr, OVERLAP: gl.constexpr,
                 Q_BLOCK: gl.constexpr, KV_BLOCK: gl.constexpr, P_VIA: gl.constexpr,
                 EXP2_FMA: gl.constexpr):
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 32])
    s_rows: gl.constexpr = gl.SliceLayout(1, s_layout)
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 32])
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    o_cols: gl.constexpr = gl.SliceLayout(0, o_layout)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4)

    m_block = _m_block()
    bh = gl.program_id(1)
    row0 = m_block * 2 * BLOCK_M + WG * BLOCK_M
    n_tiles, n_full = kv_tiles(row0, N_Q, N_K, BLOCK_M, BLOCK_N, CAUSAL)
    n_cta = cta_tiles(m_block, N_Q, N_K, BLOCK_M, BLOCK_N, CAUSAL, 2)
    KS = KS + bh * gl.cdiv(N_K, KV_BLOCK)      # this head's scales
    VS = VS + bh * gl.cdiv(N_K, KV_BLOCK)

    q_tile = q_smem.index(WG).reshape([BLOCK_M, HEAD_DIM])
    if P_VIA == "smem" or P_VIA == "sperm":
        p_smem = p_smem.index(WG)              # this consumer's (BLOCK_M, BLOCK_N) P
    rows = row0 + gl.arange(0, BLOCK_M, layout=s_rows)
    sq = gl.load(QS + bh * gl.cdiv(N_Q, Q_BLOCK) + rows // Q_BLOCK, mask=rows < N_Q, other=1.0)
    c_row = sq * qk_scale

    o = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)
    m_i = gl.full([BLOCK_M], -float("inf"), gl.float32, s_rows)
    l_i = gl.zeros([BLOCK_M], gl.float32, s_rows)
    alpha = gl.zeros([BLOCK_M], gl.float32, s_rows)
    p = gl.zeros([BLOCK_M, BLOCK_N], gl.float32 if P_VIA == "perm4" else gl.float8e4nv, p_layout)
    sv = gl.max(l_i, axis=0) + 1.0             # a scalar 1.0: O's units before any tile

    mbarrier.wait(q_bars.index(WG), 0)
    if n_tiles > 0:
        o, m_i, l_i, p, alpha, sv = fp8_tile(
            0, q_tile, k_smem, v_smem, k_full, k_empty, v_full, v_empty, sched, o, m_i, l_i, p,
            p_smem, alpha, sv, c_row, KS, VS, row0, N_Q, N_K, n_full, WG, True, BLOCK_M,
            BLOCK_N, HEAD_DIM, STAGES, CAUSAL, OVERLAP, KV_BLOCK, P_VIA, EXP2_FMA)
    for j in range(1, n_tiles):
        o, m_i, l_i, p, alpha, sv = fp8_tile(
            j, q_tile, k_smem, v_smem, k_full, k_empty, v_full, v_empty, sched, o, m_i, l_i, p,
            p_smem, alpha, sv, c_row, KS, VS, row0, N_Q, N_K, n_full, WG, False, BLOCK_M,
            BLOCK_N, HEAD_DIM, STAGES, CAUSAL, OVERLAP, KV_BLOCK, P_VIA, EXP2_FMA)

    # the last PV, in turn n_tiles (taken even with no tile: both consumers take as many turns)
    jl = gl.maximum(n_tiles - 1, 0)
    sl = jl % STAGES
    if P_VIA == "perm4":
        p = to_e4m3_x4(p)
    mbarrier.wait(v_full.index(sl), (jl // STAGES) & 1, pred=n_tiles > 0)
    token_acquire(sched, n_tiles, WG)
    if n_tiles > 0:
        o = o * gl.expand_dims(gl.convert_layout(alpha, o_rows), 1)
        v_t = _tile_2d(v_smem, sl, HEAD_DIM, BLOCK_N).permute((1, 0))
        o_tok = pv_mma(p, p_smem, v_t, o, P_VIA)
        token_release(sched, WG, 2)
        o = warpgroup_mma_wait(0, deps=(o_tok, ))
        mbarrier.arrive(v_empty.index(sl))
    else:
        token_release(sched, WG, 2)

    # flush the tiles only the other consumer reads (``fa3_roles.consumer``'s)
    for j in range(n_tiles, n_cta):
        s = j % STAGES
        ph = (j // STAGES) & 1
        mbarrier.wait(k_full.index(s), ph)
        mbarrier.wait(v_full.index(s), ph)
        mbarrier.arrive(k_empty.index(s))
        mbarrier.arrive(v_empty.index(s))
        token_acquire(sched, j + 1, WG)
        token_release(sched, WG, 2)

    # ---- epilogue: O = acc sv / l (l carries P's 2^8), stored from registers, rows < N_Q
    l_o = gl.convert_layout(l_i, o_rows)
    inv = gl.where(l_o > 0.0, sv / l_o, 0.0)
    o = o * gl.expand_dims(inv, 1)
    o_r = row0 + gl.arange(0, BLOCK_M, layout=o_rows)
    o_c = gl.arange(0, HEAD_DIM, layout=o_cols)
    offs = (bh.to(gl.int64) * N_Q + gl.expand_dims(o_r, 1)) * HEAD_DIM + gl.expand_dims(o_c, 0)
    gl.store(O + offs, o.to(O.dtype.element_ty), mask=gl.expand_dims(o_r < N_Q, 1))


@gluon.jit(do_not_specialize=["N_Q", "N_K"])     # one binary for every length
def fp8_kernel(q_desc, k_desc, vt_desc, O, QS, KS, VS, N_Q, N_K, qk_scale,
               BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
               STAGES: gl.constexpr, CAUSAL: gl.constexpr, OVERLAP: gl.constexpr,
               Q_BLOCK: gl.constexpr, KV_BLOCK: gl.constexpr, CONSUMER_REGS: gl.constexpr,
               PRODUCER_REGS: gl.constexpr, P_VIA: gl.constexpr, EXP2_FMA: gl.constexpr):
    """O of one (2*BLOCK_M rows, batch*head) block: q_desc (B*H, N_Q, d) and k_desc (B*H, N_K,
    d) e4m3 in boxes of (1, BLOCK_M | BLOCK_N, d), vt_desc V^T (B*H, d, N_K') in (1, d,
    BLOCK_N); QS (B*H, cdiv(N_Q, Q_BLOCK)), KS and VS (B*H, cdiv(N_K, KV_BLOCK)) float32."""
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [2] + q_desc.block_type.shape, q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES] + vt_desc.block_type.shape,
                                       vt_desc.layout)
    if P_VIA == "smem" or P_VIA == "sperm":     # one P tile per consumer, rows swizzled
        SWIZZLE: gl.constexpr = 128 if BLOCK_N >= 128 else BLOCK_N      # bytes, <= a row
        p_smem = gl.allocate_shared_memory(gl.float8e4nv, [2, BLOCK_M, BLOCK_N],
                                           gl.NVMMASharedLayout(SWIZZLE, 8))
    else:
        p_smem = v_smem                         # unread: warp_specialize takes no None
    q_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    sched = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(q_bars.index(i), count=1)
        mbarrier.init(sched.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_full.index(i), count=1)
        mbarrier.init(v_full.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)
        mbarrier.init(v_empty.index(i), count=2)
    fence_async_shared()

    gl.warp_specialize([
        (fp8_consumer, (q_smem, k_smem, v_smem, p_smem, q_bars, k_full, k_empty, v_full,
                        v_empty, sched, O, QS, KS, VS, N_Q, N_K, qk_scale, 0, BLOCK_M,
                        BLOCK_N, HEAD_DIM, STAGES, CAUSAL, OVERLAP, Q_BLOCK, KV_BLOCK, P_VIA,
                        EXP2_FMA)),
        (fp8_consumer, (q_smem, k_smem, v_smem, p_smem, q_bars, k_full, k_empty, v_full,
                        v_empty, sched, O, QS, KS, VS, N_Q, N_K, qk_scale, 1, BLOCK_M,
                        BLOCK_N, HEAD_DIM, STAGES, CAUSAL, OVERLAP, Q_BLOCK, KV_BLOCK, P_VIA,
                        EXP2_FMA)),
        (producer, (q_desc, k_desc, vt_desc, q_smem, k_smem, v_smem, q_bars, k_full, k_empty,
                    v_full, v_empty, N_Q, N_K, BLOCK_M, BLOCK_N, STAGES, CAUSAL, True, 2)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
