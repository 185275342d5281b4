"""The device code of Chapter 7's Gluon Blackwell kernel (``gluon_fa4`` is its host side and
describes it): ``fa4_kernel``, its roles and the shim they call through. A module of its own:
Gluon resolves a jit function's globals in the module that defines it.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia import blackwell as _bw
from triton.experimental.gluon.language.nvidia.blackwell import (TensorMemoryLayout,
                                                                 allocate_tensor_memory,
                                                                 fence_async_shared, mbarrier,
                                                                 tcgen05_mma, tma)

from flashbook.gluon_kit import m_block as _m_block, smem_tile as _smem_tile, tma_load, \
    tma_store

__all__ = ["fa4_kernel", "SHIM", "tmem_reg_layout"]


# What differs between triton 3.6 (GPU images, Colab) and 3.9 (the CPU image), besides the TMA
# copies (flashbook.gluon_kit): the TMEM register layout (3.6 get_tmem_reg_layout; 3.9
# tensor_memory_descriptor_type(...).get_reg_layout) and TMEM reinterpret (3.6 _reinterpret).
# Both compile P (TMEM) V (SMEM) into tcgen05.mma's A-from-TMEM form (the tests compile both).
_HAS_GET_TMEM_REG_LAYOUT = hasattr(_bw, "get_tmem_reg_layout")
SHIM = dict(tma_load=tma_load.__name__, tma_store=tma_store.__name__,
            tmem_reg_layout="get_tmem_reg_layout" if _HAS_GET_TMEM_REG_LAYOUT
            else "tensor_memory_descriptor_type.get_reg_layout",
            tmem_reinterpret="reinterpret" if hasattr(_bw.tensor_memory_descriptor, "reinterpret")
            else "_reinterpret")


@gluon.constexpr_function
def tmem_reg_layout(dtype, shape, layout, num_warps):
    """The register layout of a tcgen05.ld/st of a TMEM buffer (32x32b: thread i of warp w holds
    row 32 w + i, so each thread owns whole rows: row max and sum need no shuffles)."""
    if _HAS_GET_TMEM_REG_LAYOUT:                                       # triton 3.6
        return _bw.get_tmem_reg_layout(dtype, shape, layout, num_warps)
    ty = _bw.tensor_memory_descriptor_type(dtype, shape, layout, shape)  # triton 3.9
    return ty.get_reg_layout(num_warps=num_warps)


@gluon.jit
def _tmem_view(buf, dtype: gl.constexpr, shape: gl.constexpr, layout: gl.constexpr):
    """``buf`` reinterpreted (same columns) as another dtype, shape and TMEM layout."""
    if hasattr(buf, "reinterpret"):
        return buf.reinterpret(dtype, shape, layout)
    else:
        return buf._reinterpret(dtype, shape, layout)


# --- Tile bookkeeping every role shares (they must agree on every count, or a barrier waits
# forever): the CTA's 2 * BLOCK_M rows walk the same K/V tiles.
@gluon.jit
def _cta_tiles(m_block, N_Q, N_K, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
               CAUSAL: gl.constexpr):
    """(tiles, full): the K/V tiles the CTA's rows read (at least 1: the host handles N_K = 0,
    and a tile fully masked for some rows is harmless), and how many of the first ones need no
    mask for any of its rows."""
    row0 = m_block * 2 * BLOCK_M
    if CAUSAL:
        off = N_K - N_Q                                  # bottom-right alignment
        hi = gl.maximum(gl.minimum(row0 + 2 * BLOCK_M + off, N_K), 0)
        lo = gl.maximum(gl.minimum(row0 + off + 1, N_K), 0)
        tiles = gl.maximum(gl.cdiv(hi, BLOCK_N), 1)
        full = lo // BLOCK_N
    else:
        tiles = gl.cdiv(N_K, BLOCK_N)
        full = N_K // BLOCK_N
    return tiles, full


# --- The load warp
@gluon.jit
def _load_role(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_full, k_full, k_free, v_full,
               v_free, N_Q, N_K, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
               STAGES: gl.constexpr, CAUSAL: gl.constexpr):
    m_block = _m_block()
    bh = gl.program_id(1)
    n_tiles, n_full = _cta_tiles(m_block, N_Q, N_K, BLOCK_M, BLOCK_N, CAUSAL)
    for t in gl.static_range(2):                          # Q0, Q1: once, one barrier each
        mbarrier.expect(q_full.index(t), q_desc.block_type.nbytes)
        tma_load(q_desc, [bh, m_block * 2 * BLOCK_M + t * BLOCK_M, 0], q_full.index(t),
                 q_smem.index(t))
    for j in range(n_tiles):
        s = j % STAGES
        ph = (j // STAGES) & 1
        # round r of a slot waits for the MMAs of round r - 1 (round 0: parity 1 passes at once)
        mbarrier.wait(k_free.index(s), ph ^ 1)
        mbarrier.expect(k_full.index(s), k_desc.block_type.nbytes)
        tma_load(k_desc, [bh, j * BLOCK_N, 0], k_full.index(s), k_smem.index(s))
        mbarrier.wait(v_free.index(s), ph ^ 1)
        mbarrier.expect(v_full.index(s), v_desc.block_type.nbytes)
        tma_load(v_desc, [bh, j * BLOCK_N, 0], v_full.index(s), v_smem.index(s))


# --- The MMA warp: one thread issues every tcgen05 MMA; each names the barriers its completion
# arrives on (tcgen05.commit), and the tensor core runs them in issue order.
@gluon.jit
def _pv(t: gl.constexpr, j, s_tmem, o_tmem, v_smem, p_ready, o_ready, o_done, v_free,
        release_v: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
        HEAD_DIM: gl.constexpr, STAGES: gl.constexpr):
    """O_t (+)= P_t V_j, with P_t read from S_t's tensor-memory columns (the A operand)."""
    p_layout: gl.constexpr = TensorMemoryLayout((BLOCK_M, BLOCK_N), col_stride=1)
    s = j % STAGES
    mbarrier.wait(p_ready.index(t), j & 1)                  # softmax t wrote P_t of step j
    mbarrier.wait(o_ready.index(t), (j - 1) & 1, pred=j > 0)  # the correction rescaled O_t
    p_cols = _tmem_view(s_tmem.index(t), v_smem.dtype, [BLOCK_M, BLOCK_N], p_layout)
    v_tile = _smem_tile(v_smem, s, BLOCK_N, HEAD_DIM)
    if release_v:                                           # tile 1 reads V_j last
        tcgen05_mma(p_cols, v_tile, o_tmem.index(t), use_acc=j > 0,
                    mbarriers=[o_done.index(t), v_free.index(s)])
    else:
        tcgen05_mma(p_cols, v_tile, o_tmem.index(t), use_acc=j > 0,
                    mbarriers=[o_done.index(t)])


@gluon.jit
def _mma_role(q_smem, k_smem, v_smem, s_tmem, o_tmem, q_full, k_full, k_free, v_full, v_free,
              s_ready, p_ready, o_ready, o_done, N_Q, N_K, BLOCK_M: gl.constexpr,
              BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
              CAUSAL: gl.constexpr):
    m_block = _m_block()
    n_tiles, n_full = _cta_tiles(m_block, N_Q, N_K, BLOCK_M, BLOCK_N, CAUSAL)
    q0 = _smem_tile(q_smem, 0, BLOCK_M, HEAD_DIM)
    q1 = _smem_tile(q_smem, 1, BLOCK_M, HEAD_DIM)
    mbarrier.wait(q_full.index(0), 0)
    mbarrier.wait(q_full.index(1), 0)
    for j in range(n_tiles):
        s = j % STAGES
        ph = (j // STAGES) & 1
        mbarrier.wait(k_full.index(s), ph)
        k_t = _smem_tile(k_smem, s, BLOCK_N, HEAD_DIM).permute((1, 0))   # (d, BLOCK_N) view
        # S0 = Q0 K_j^T: S0 (holding P0 of step j-1) is free, PV0(j-1) was issued before
        tcgen05_mma(q0, k_t, s_tmem.index(0), use_acc=False, mbarriers=[s_ready.index(0)])
        if j > 0:                                          # PV1(j-1): tile 1's softmax is done
            _pv(1, j - 1, s_tmem, o_tmem, v_smem, p_ready, o_ready, o_done, v_free, True,
                BLOCK_M, BLOCK_N, HEAD_DIM, STAGES)
        tcgen05_mma(q1, k_t, s_tmem.index(1), use_acc=False,
                    mbarriers=[s_ready.index(1), k_free.index(s)])   # both QKs read K_j
        mbarrier.wait(v_full.index(s), ph)
        _pv(0, j, s_tmem, o_tmem, v_smem, p_ready, o_ready, o_done, v_free, False,
            BLOCK_M, BLOCK_N, HEAD_DIM, STAGES)
    _pv(1, n_tiles - 1, s_tmem, o_tmem, v_smem, p_ready, o_ready, o_done, v_free, True,
        BLOCK_M, BLOCK_N, HEAD_DIM, STAGES)


# --- A softmax warpgroup (one per Q tile): one thread per query row
@gluon.jit
def _softmax_role(t: gl.constexpr, s_tmem, s_ready, p_ready, stats, l_ready, N_Q, N_K, qk_scale,
                  BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr,
                  dtype: gl.constexpr):
    s_layout: gl.constexpr = TensorMemoryLayout((BLOCK_M, BLOCK_N), col_stride=1)
    col_layout: gl.constexpr = TensorMemoryLayout((BLOCK_M, 1), col_stride=1)
    s_regs: gl.constexpr = tmem_reg_layout(gl.float32, [BLOCK_M, BLOCK_N], s_layout, 4)
    p_regs: gl.constexpr = tmem_reg_layout(dtype, [BLOCK_M, BLOCK_N], s_layout, 4)
    col_regs: gl.constexpr = tmem_reg_layout(gl.float32, [BLOCK_M, 1], col_layout, 4)
    rows_l: gl.constexpr = gl.SliceLayout(1, s_regs)
    cols_l: gl.constexpr = gl.SliceLayout(0, s_regs)

    m_block = _m_block()
    n_tiles, n_full = _cta_tiles(m_block, N_Q, N_K, BLOCK_M, BLOCK_N, CAUSAL)
    s_buf = s_tmem.index(t)
    p_buf = _tmem_view(s_buf, dtype, [BLOCK_M, BLOCK_N], s_layout)      # P: S's first columns
    stat_cols = _tmem_view(s_buf, gl.float32, [BLOCK_M, BLOCK_N], col_layout)
    alpha_buf = stat_cols.slice(BLOCK_N // 2, 1)                        # after P's columns
    m_buf = stat_cols.slice(BLOCK_N // 2 + 1, 1)
    l_buf = stat_cols.slice(BLOCK_N // 2 + 2, 1)

    rows = m_block * 2 * BLOCK_M + t * BLOCK_M + gl.arange(0, BLOCK_M, layout=rows_l)
    m_i = gl.full([BLOCK_M], -float("inf"), gl.float32, rows_l)
    l_i = gl.zeros([BLOCK_M], gl.float32, rows_l)
    for j in range(n_tiles):
        mbarrier.wait(s_ready.index(t), j & 1)              # QK_t(j) has finished
        s = s_buf.load(s_regs)                              # the whole row in one thread
        if j >= n_full:                                     # the diagonal / the tail
            cols = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=cols_l)
            keep = gl.expand_dims(cols < N_K, 0)
            if CAUSAL:
                keep = keep & (gl.expand_dims(cols, 0) <= gl.expand_dims(rows + (N_K - N_Q), 1))
            s = gl.where(keep, s, -float("inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
        m_use = gl.where(m_new == -float("inf"), 0.0, m_new)     # no key yet: no NaN
        alpha = gl.exp2(m_i - m_use)
        alpha_buf.store(gl.convert_layout(gl.expand_dims(alpha, 1), col_regs))
        mbarrier.arrive(stats.index(t))                     # the correction may rescale O_t
        p = gl.exp2(s * qk_scale - gl.expand_dims(m_use, 1))
        l_i = l_i * alpha + gl.sum(p, axis=1)
        p_buf.store(gl.convert_layout(p.to(dtype), p_regs))
        mbarrier.arrive(p_ready.index(t))                   # PV_t(j) may read P_t
        m_i = m_new
    m_buf.store(gl.convert_layout(gl.expand_dims(m_i, 1), col_regs))
    l_buf.store(gl.convert_layout(gl.expand_dims(l_i, 1), col_regs))
    mbarrier.arrive(l_ready.index(t))


# --- The correction warpgroup (the default partition)
@gluon.jit
def _correction_role(q_smem, s_tmem, o_tmem, stats, o_done, o_ready, l_ready, epi_ready, LSE,
                     N_Q, N_K, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                     HEAD_DIM: gl.constexpr, CAUSAL: gl.constexpr):
    # O goes through registers in column chunks (a whole row of O would not fit the
    # correction's registers): CHUNK columns for the rescale, EPI_CHUNK (one 128-byte swizzle
    # row of 16-bit values) for the output
    CHUNK: gl.constexpr = 32
    EPI_CHUNK: gl.constexpr = 64
    col_layout: gl.constexpr = TensorMemoryLayout((BLOCK_M, 1), col_stride=1)
    chunk_layout: gl.constexpr = TensorMemoryLayout((BLOCK_M, CHUNK), col_stride=1)
    epi_layout: gl.constexpr = TensorMemoryLayout((BLOCK_M, EPI_CHUNK), col_stride=1)
    col_regs: gl.constexpr = tmem_reg_layout(gl.float32, [BLOCK_M, 1], col_layout, 4)
    chunk_regs: gl.constexpr = tmem_reg_layout(gl.float32, [BLOCK_M, CHUNK], chunk_layout, 4)
    epi_regs: gl.constexpr = tmem_reg_layout(gl.float32, [BLOCK_M, EPI_CHUNK], epi_layout, 4)
    lse_l: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])

    m_block = _m_block()
    bh = gl.program_id(1)
    n_tiles, n_full = _cta_tiles(m_block, N_Q, N_K, BLOCK_M, BLOCK_N, CAUSAL)
    for j in range(n_tiles):
        for t in gl.static_range(2):
            mbarrier.wait(stats.index(t), j & 1)            # alpha of step j is in TMEM
            if j > 0:
                mbarrier.wait(o_done.index(t), (j - 1) & 1)  # PV_t(j-1) has finished
                cols = _tmem_view(s_tmem.index(t), gl.float32, [BLOCK_M, BLOCK_N], col_layout)
                alpha = cols.slice(BLOCK_N // 2, 1).load(col_regs)          # (BLOCK_M, 1)
                alpha = gl.convert_layout(gl.reshape(alpha, [BLOCK_M]),
                                          gl.SliceLayout(1, chunk_regs))
                for c in gl.static_range(HEAD_DIM // CHUNK):
                    o_part = o_tmem.index(t).slice(c * CHUNK, CHUNK)
                    o_part.store(o_part.load(chunk_regs) * gl.expand_dims(alpha, 1))
                mbarrier.arrive(o_ready.index(t))           # PV_t(j) may accumulate
    for t in gl.static_range(2):
        mbarrier.wait(l_ready.index(t), 0)                  # final row max and sum
        mbarrier.wait(o_done.index(t), (n_tiles - 1) & 1)   # the last PV_t has finished
        cols = _tmem_view(s_tmem.index(t), gl.float32, [BLOCK_M, BLOCK_N], col_layout)
        m_i = gl.reshape(cols.slice(BLOCK_N // 2 + 1, 1).load(col_regs), [BLOCK_M])
        l_i = gl.reshape(cols.slice(BLOCK_N // 2 + 2, 1).load(col_regs), [BLOCK_M])
        l_o = gl.convert_layout(l_i, gl.SliceLayout(1, epi_regs))
        inv = gl.expand_dims(gl.where(l_o > 0.0, 1.0 / l_o, 0.0), 1)
        # Q_t's tile is free: every QK_t finished before the last PV_t (issue order)
        o_smem = _smem_tile(q_smem, t, BLOCK_M, HEAD_DIM)
        for c in gl.static_range(HEAD_DIM // EPI_CHUNK):
            o = o_tmem.index(t).slice(c * EPI_CHUNK, EPI_CHUNK).load(epi_regs) * inv
            o_smem.slice(c * EPI_CHUNK, EPI_CHUNK, dim=1).store(o.to(q_smem.dtype))
        fence_async_shared()                                # generic writes -> the TMA store
        mbarrier.arrive(epi_ready.index(t))
        lse = gl.where(l_i > 0.0, (m_i + gl.log2(l_i)) * 0.6931471805599453, -float("inf"))
        rows = m_block * 2 * BLOCK_M + t * BLOCK_M + gl.arange(0, BLOCK_M, layout=lse_l)
        gl.store(LSE + bh * N_Q + rows, gl.convert_layout(lse, lse_l), mask=rows < N_Q)


# --- The epilogue warp
@gluon.jit
def _epilogue_role(o_desc, q_smem, epi_ready, BLOCK_M: gl.constexpr):
    m_block = _m_block()
    bh = gl.program_id(1)
    for t in gl.static_range(2):
        mbarrier.wait(epi_ready.index(t), 0)
        tma_store(o_desc, [bh, m_block * 2 * BLOCK_M + t * BLOCK_M, 0], q_smem.index(t))
    tma.store_wait(0)


# --- The kernel: allocate shared and tensor memory, initialise the barriers, fork the roles.
@gluon.jit(do_not_specialize=["N_Q", "N_K"])     # one binary for every length
def fa4_kernel(q_desc, k_desc, v_desc, o_desc, LSE, N_Q, N_K, qk_scale,
               BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
               STAGES: gl.constexpr, CAUSAL: gl.constexpr, SOFTMAX_REGS: gl.constexpr,
               SINGLE_WARP_REGS: gl.constexpr):
    dtype: gl.constexpr = q_desc.dtype
    # shared memory: Q0 and Q1 (reused for O), STAGES K tiles and STAGES V tiles, 128-byte
    # swizzled (what TMA writes and tcgen05 reads), then the mbarriers (8 bytes each)
    q_smem = gl.allocate_shared_memory(dtype, [2] + q_desc.block_type.shape, q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    bar_layout: gl.constexpr = mbarrier.MBarrierLayout()
    q_full = gl.allocate_shared_memory(gl.int64, [2, 1], bar_layout)
    k_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
    k_free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
    v_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
    v_free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
    s_ready = gl.allocate_shared_memory(gl.int64, [2, 1], bar_layout)
    p_ready = gl.allocate_shared_memory(gl.int64, [2, 1], bar_layout)
    stats = gl.allocate_shared_memory(gl.int64, [2, 1], bar_layout)
    o_done = gl.allocate_shared_memory(gl.int64, [2, 1], bar_layout)
    o_ready = gl.allocate_shared_memory(gl.int64, [2, 1], bar_layout)
    l_ready = gl.allocate_shared_memory(gl.int64, [2, 1], bar_layout)
    epi_ready = gl.allocate_shared_memory(gl.int64, [2, 1], bar_layout)
    for i in gl.static_range(2):
        mbarrier.init(q_full.index(i), count=1)             # the TMA's expect-tx arrival
        mbarrier.init(s_ready.index(i), count=1)            # one tcgen05.commit
        mbarrier.init(p_ready.index(i), count=1)            # softmax t (one arrive a warpgroup)
        mbarrier.init(stats.index(i), count=1)
        mbarrier.init(o_done.index(i), count=1)             # one tcgen05.commit
        mbarrier.init(o_ready.index(i), count=1)            # the correction
        mbarrier.init(l_ready.index(i), count=1)
        mbarrier.init(epi_ready.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_full.index(i), count=1)
        mbarrier.init(k_free.index(i), count=1)             # the commit after QK1
        mbarrier.init(v_full.index(i), count=1)
        mbarrier.init(v_free.index(i), count=1)             # the commit after PV1
    fence_async_shared()                                    # the inits, before TMA or MMA use

    # tensor memory: S0, S1 (fp32, BLOCK_N columns each; P and the row statistics alias them),
    # O0, O1 (fp32, HEAD_DIM columns each)
    s_tmem = allocate_tensor_memory(gl.float32, [2, BLOCK_M, BLOCK_N],
                                    TensorMemoryLayout((BLOCK_M, BLOCK_N), col_stride=1))
    o_tmem = allocate_tensor_memory(gl.float32, [2, BLOCK_M, HEAD_DIM],
                                    TensorMemoryLayout((BLOCK_M, HEAD_DIM), col_stride=1))

    gl.warp_specialize([
        (_correction_role, (q_smem, s_tmem, o_tmem, stats, o_done, o_ready, l_ready, epi_ready,
                            LSE, N_Q, N_K, BLOCK_M, BLOCK_N, HEAD_DIM, CAUSAL)),
        (_softmax_role, (0, s_tmem, s_ready, p_ready, stats, l_ready, N_Q, N_K, qk_scale,
                         BLOCK_M, BLOCK_N, CAUSAL, dtype)),
        (_softmax_role, (1, s_tmem, s_ready, p_ready, stats, l_ready, N_Q, N_K, qk_scale,
                         BLOCK_M, BLOCK_N, CAUSAL, dtype)),
        (_mma_role, (q_smem, k_smem, v_smem, s_tmem, o_tmem, q_full, k_full, k_free, v_full,
                     v_free, s_ready, p_ready, o_ready, o_done, N_Q, N_K, BLOCK_M, BLOCK_N,
                     HEAD_DIM, STAGES, CAUSAL)),
        (_load_role, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_full, k_full, k_free,
                      v_full, v_free, N_Q, N_K, BLOCK_M, BLOCK_N, STAGES, CAUSAL)),
        (_epilogue_role, (o_desc, q_smem, epi_ready, BLOCK_M)),
    ], [4, 4, 1, 1, 1], [SOFTMAX_REGS, SOFTMAX_REGS, SINGLE_WARP_REGS, SINGLE_WARP_REGS,
                         SINGLE_WARP_REGS])
