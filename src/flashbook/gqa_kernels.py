# Generated from solutions/ch5_gqa.py by `flashbook release` (make release): do not edit.
# Edit the cells tagged export:flashbook.gqa_kernels there and release again
# (tests/test_given.py fails while this file differs from them):
#   store_folded_rows: solution cell ch5_two_tiles
#   attn_gqa_two_tiles: solution cell ch5_two_tiles
"""Chapter 5's packed GQA forward in its two-tile form, the forward Chapter 9
differentiates (``ch9.forward``): the answer to Chapter 5's optional Exercise 1b, the one
answer of that chapter the package holds (Exercise 1's one-tile kernel stays out of it).
Launch it with ``flashbook.gqa.launch_gqa(..., two_tiles=True)``. Import this module after
``flashbook.setup()``: it imports Triton.
"""
import triton
import triton.language as tl

from flashbook.kernels import attn_two_tile_step, key_tiles, program_tile, visible_pairs


@triton.jit
def store_folded_rows(O, LSE, acc, l_i, m_i, q_start, rows, heads, seqlen_q, stride_ot,
                      stride_oh, total_q, offs_d):
    """O = acc / l and the LSE of folded rows (position rows[r], query head heads[r])."""
    ok = rows < seqlen_q
    has_key = l_i > 0.0
    o = acc / tl.where(has_key, l_i, 1.0)[:, None]
    lse = tl.where(has_key, (m_i + tl.math.log2(l_i)) * 0.6931471805599453, float("-inf"))
    tokens = q_start + rows
    tl.store(O + tokens[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
             o.to(O.dtype.element_ty), mask=ok[:, None])
    tl.store(LSE + heads * total_q + tokens, lse, mask=ok)


@triton.jit
def attn_gqa_two_tiles(Q, K, V, O, LSE, CU_Q, CU_K,
                       stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                       stride_ot, stride_oh, H_KV, total_q, qk_scale, window_left, window_right,
                       heads_per_section, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
                       WINDOWED: tl.constexpr):
    """attn_gqa_kernel with two query tiles of BLOCK_M // 2 rows: A holds the program's first
    BLOCK_M // 2 folded (position, head) rows, B the next ones. WINDOWED False
    (no causal mask, no window): every row sees every key, so only the last tile needs a mask,
    and only on the keys."""
    # The program's BLOCK_M rows are BLOCK_M consecutive (position, head) pairs (PackGQA): they
    # touch BLOCK_M // GROUP positions when GROUP divides BLOCK_M, else at most this many (a
    # tile may start part-way into a position's GROUP rows).
    POS: tl.constexpr = BLOCK_M // GROUP if BLOCK_M % GROUP == 0 else \
        (BLOCK_M + GROUP - 2) // GROUP + 1
    HALF: tl.constexpr = BLOCK_M // 2
    m_block, pid_bh = program_tile(heads_per_section)
    seq = pid_bh // H_KV
    kv_head = pid_bh % H_KV
    f0 = m_block * BLOCK_M                                # the program's first folded row
    m0 = f0 // GROUP
    c = 0 if BLOCK_M % GROUP == 0 else f0 % GROUP         # as in attn_gqa_kernel
    q_start = tl.load(CU_Q + seq)
    seqlen_q = tl.load(CU_Q + seq + 1) - q_start
    if m0 >= seqlen_q:
        return
    k_start = tl.load(CU_K + seq)
    seqlen_k = tl.load(CU_K + seq + 1) - k_start
    r = tl.arange(0, HALF)
    rows_a = m0 + (c + r) // GROUP                        # tile A: folded rows f0 + r
    rows_b = m0 + (c + HALF + r) // GROUP                 # tile B: the next HALF
    heads_a = kv_head * GROUP + (c + r) % GROUP           # the same heads when GROUP | HALF
    heads_b = kv_head * GROUP + (c + HALF + r) % GROUP
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    # Q through a per-head base, then the rows (this form spilled least on sm_90)
    q_ha = Q + q_start * stride_qt + heads_a[:, None] * stride_qh + offs_d[None, :]
    q_hb = Q + q_start * stride_qt + heads_b[:, None] * stride_qh + offs_d[None, :]
    q_a = tl.load(q_ha + rows_a[:, None] * stride_qt, mask=(rows_a < seqlen_q)[:, None], other=0.0)
    q_b = tl.load(q_hb + rows_b[:, None] * stride_qt, mask=(rows_b < seqlen_q)[:, None], other=0.0)
    # Scalar bases; each tile's (d x BLOCK_N) pointers are rebuilt from them inside the loop.
    # Kept live across the loops, the two pointer tensors cost 128 registers a thread, and the
    # compiler spilled (sm_90: 22 spills against 2).
    k_base = K + k_start * stride_kt + kv_head * stride_kh
    v_base = V + k_start * stride_vt + kv_head * stride_vh
    m_a = tl.full([HALF], float("-inf"), tl.float32)
    l_a = tl.zeros([HALF], tl.float32)
    acc_a = tl.zeros([HALF, HEAD_DIM], tl.float32)
    m_b = tl.full([HALF], float("-inf"), tl.float32)
    l_b = tl.zeros([HALF], tl.float32)
    acc_b = tl.zeros([HALF, HEAD_DIM], tl.float32)
    if WINDOWED:
        lo, full_lo, full_hi, hi = key_tiles(m0, seqlen_q, seqlen_k, window_left, window_right,
                                             POS, BLOCK_N)
    else:
        # Every row sees every key: full tiles from key 0, then the last tile, masked on the
        # keys. (key_tiles would take the tile's padding rows past seqlen_q for rows, whose left
        # edge can fall past key 0: a left band that only the windowed loop visits.)
        lo, full_lo, full_hi, hi = 0, 0, seqlen_k // BLOCK_N * BLOCK_N, seqlen_k
    if WINDOWED:                                          # the left band (windows only)
        for start_n in range(lo, full_lo, BLOCK_N):
            cols = start_n + offs_n
            acc_a, l_a, m_a, acc_b, l_b, m_b = attn_two_tile_step(
                acc_a, l_a, m_a, q_a, acc_b, l_b, m_b, q_b,
                k_base + cols[None, :] * stride_kt + offs_d[:, None],
                v_base + cols[:, None] * stride_vt + offs_d[None, :], cols < seqlen_k,
                visible_pairs(rows_a, cols, seqlen_q, seqlen_k, window_left, window_right),
                visible_pairs(rows_b, cols, seqlen_q, seqlen_k, window_left, window_right),
                qk_scale, True, DOT_PRECISION)
    all_keys = offs_n < BLOCK_N
    for start_n in range(full_lo, full_hi, BLOCK_N):
        cols = start_n + offs_n
        acc_a, l_a, m_a, acc_b, l_b, m_b = attn_two_tile_step(
            acc_a, l_a, m_a, q_a, acc_b, l_b, m_b, q_b,
            k_base + cols[None, :] * stride_kt + offs_d[:, None],
            v_base + cols[:, None] * stride_vt + offs_d[None, :], all_keys, all_keys[None, :],
            all_keys[None, :], qk_scale, False, DOT_PRECISION)
    for start_n in range(full_hi, hi, BLOCK_N):           # the diagonal band, or the last tile
        cols = start_n + offs_n
        if WINDOWED:
            vis_a = visible_pairs(rows_a, cols, seqlen_q, seqlen_k, window_left, window_right)
            vis_b = visible_pairs(rows_b, cols, seqlen_q, seqlen_k, window_left, window_right)
        else:                                             # a (1, BLOCK_N) mask: fewer registers
            vis_a = (cols < seqlen_k)[None, :]
            vis_b = vis_a
        acc_a, l_a, m_a, acc_b, l_b, m_b = attn_two_tile_step(
            acc_a, l_a, m_a, q_a, acc_b, l_b, m_b, q_b,
            k_base + cols[None, :] * stride_kt + offs_d[:, None],
            v_base + cols[:, None] * stride_vt + offs_d[None, :], cols < seqlen_k, vis_a, vis_b,
            qk_scale, True, DOT_PRECISION)
    store_folded_rows(O, LSE, acc_a, l_a, m_a, q_start, rows_a, heads_a, seqlen_q, stride_ot,
                      stride_oh, total_q, offs_d)
    store_folded_rows(O, LSE, acc_b, l_b, m_b, q_start, rows_b, heads_b, seqlen_q, stride_ot,
                      stride_oh, total_q, offs_d)
