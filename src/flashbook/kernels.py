# Generated from solutions/ch4_masks_varlen.py by `flashbook release` (make release): do not edit.
# Edit the cells tagged export:flashbook.kernels there and release again
# (tests/test_given.py fails while this file differs from them):
#   program_tile: a given code cell
#   attn_scores: a given code cell
#   attn_update: a given code cell
#   attn_step: a given code cell
#   visible_pairs: solution cell ch4_masks
#   key_tiles: solution cell ch4_masks
#   attn_two_tile_step: a given code cell
"""Triton building blocks that Chapters 3 and 4 derive as exercises, solved, for the
later chapters to build on (import this module after ``flashbook.setup()``: it imports
Triton).

* ``program_tile``: which query tile and which (sequence, head) pair a program takes,
  walking sections of pairs with their longest rows first (Chapter 4, Section 4).
* ``attn_scores``, ``attn_update``, ``attn_step``: one K/V tile of the online softmax,
  with or without a mask (Chapter 3's loop body, Chapter 4's masked version);
  ``attn_two_tile_step``: the same for two query tiles, ordered so each softmax
  overlaps the other's matmul.
* ``visible_pairs``, ``key_tiles``: the bottom-right causal / sliding-window mask of a
  tile, and the key tiles a program visits with the full ones among them (Chapter 4,
  Exercise 2a).
"""
import triton
import triton.language as tl


@triton.jit
def program_tile(heads_per_section):
    """(m_block, pid_bh) of this program: its query tile and its sequence * H + head. The grid is
    (n_tiles * heads_per_section, n_bh // heads_per_section): the first axis walks the query
    tiles of a section of heads_per_section (sequence, head) pairs, the last tile first."""
    pid = tl.program_id(0)
    n_tiles = tl.num_programs(0) // heads_per_section
    pid_bh = tl.program_id(1) * heads_per_section + pid % heads_per_section
    return n_tiles - 1 - pid // heads_per_section, pid_bh


@triton.jit
def attn_scores(q, k_ptrs, kv_ok, visible, MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Raw scores of one K tile: q (BLOCK_M, d) times the keys k_ptrs (d, BLOCK_N) point at.
    kv_ok (BLOCK_N,): keys inside the sequence; visible (BLOCK_M, BLOCK_N): the mask (used
    only when MASKED). Returns S (BLOCK_M, BLOCK_N) fp32, -inf where not visible."""
    if MASKED:
        kT = tl.load(k_ptrs, mask=kv_ok[None, :], other=0.0)           # read BLOCK_N*d
        s = tl.dot(q, kT, input_precision=DOT_PRECISION)
        s = tl.where(visible, s, float("-inf"))
    else:
        s = tl.dot(q, tl.load(k_ptrs), input_precision=DOT_PRECISION)
    return s


@triton.jit
def attn_update(acc, l_i, m_i, s, v_ptrs, kv_ok, qk_scale, MASKED: tl.constexpr,
                DOT_PRECISION: tl.constexpr):
    """One online-softmax step (m in base 2, qk_scale = scale * log2(e)). A masked row that has
    seen no visible key keeps m = -inf: its exponents are taken from 0, so p = 0, not NaN."""
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    if MASKED:
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        v = tl.load(v_ptrs, mask=kv_ok[:, None], other=0.0)            # read BLOCK_N*d
    else:
        m_ref = m_new
        v = tl.load(v_ptrs)
    p = tl.math.exp2(s * qk_scale - m_ref[:, None])
    alpha = tl.math.exp2(m_i - m_ref)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return acc, l_i, m_new


@triton.jit
def attn_step(acc, l_i, m_i, q, k_ptrs, v_ptrs, kv_ok, visible, qk_scale,
              MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One K/V tile: scores, then the update."""
    s = attn_scores(q, k_ptrs, kv_ok, visible, MASKED, DOT_PRECISION)
    return attn_update(acc, l_i, m_i, s, v_ptrs, kv_ok, qk_scale, MASKED, DOT_PRECISION)


@triton.jit
def visible_pairs(rows, cols, seqlen_q, seqlen_k, window_left, window_right):
    """(BLOCK_M, BLOCK_N) bool: may query row rows[i] see key cols[j]? (bottom-right aligned)"""
    diag = rows[:, None] + (seqlen_k - seqlen_q)                      # the row's own position
    return (cols[None, :] < seqlen_k) & (cols[None, :] >= diag - window_left) \
        & (cols[None, :] <= diag + window_right)


@triton.jit
def key_tiles(m0, seqlen_q, seqlen_k, window_left, window_right, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr):
    """(lo, full_lo, full_hi, hi): the key tiles rows m0 .. m0 + BLOCK_M - 1 visit, and the
    full ones among them."""
    diag = seqlen_k - seqlen_q
    lo = tl.maximum(m0 + diag - window_left, 0) // BLOCK_N * BLOCK_N     # first row's left edge
    hi = tl.minimum(m0 + BLOCK_M + diag + window_right, seqlen_k)       # last row's right edge
    # full: inside the last row's left edge and the first row's right edge (and inside seqlen_k)
    first_full = tl.maximum(lo, tl.cdiv(m0 + BLOCK_M - 1 + diag - window_left, BLOCK_N) * BLOCK_N)
    end_full = tl.minimum(m0 + diag + window_right + 1, seqlen_k) // BLOCK_N * BLOCK_N
    any_full = first_full < end_full
    full_lo = tl.where(any_full, first_full, lo)
    full_hi = tl.where(any_full, end_full, lo)
    return lo, full_lo, full_hi, hi


@triton.jit
def attn_two_tile_step(acc_a, l_a, m_a, q_a, acc_b, l_b, m_b, q_b, k_ptrs, v_ptrs, kv_ok,
                       vis_a, vis_b, qk_scale, MASKED: tl.constexpr,
                       DOT_PRECISION: tl.constexpr):
    """One K/V tile for two query tiles, ordered so each softmax overlaps the other's matmul."""
    s_a = attn_scores(q_a, k_ptrs, kv_ok, vis_a, MASKED, DOT_PRECISION)
    s_b = attn_scores(q_b, k_ptrs, kv_ok, vis_b, MASKED, DOT_PRECISION)
    acc_a, l_a, m_a = attn_update(acc_a, l_a, m_a, s_a, v_ptrs, kv_ok, qk_scale, MASKED,
                                  DOT_PRECISION)
    acc_b, l_b, m_b = attn_update(acc_b, l_b, m_b, s_b, v_ptrs, kv_ok, qk_scale, MASKED,
                                  DOT_PRECISION)
    return acc_a, l_a, m_a, acc_b, l_b, m_b
