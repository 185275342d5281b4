# Generated from solutions/ch7_blackwell.py by `flashbook release` (make release): do not edit.
# Edit the cells tagged export:flashbook.lazy_kernels there and release again
# (tests/test_given.py fails while this file differs from them):
#   hw_exp2: a given code cell
#   attn_fwd_lazy: a given code cell
"""Chapter 7's kernel of Exercise 2 (lazy rescaling): Chapter 3's forward (one query tile a
program, unmasked full key tiles, one masked tail tile, deferred normalisation) with its
online-softmax step handed in as ``UPDATE`` (the student's ``lazy_update``) and its
exponential as ``EXP2`` (``hw_exp2``, or Exercise 3's polynomial); it counts, per program,
the steps that moved the reference max. ``ch7.launch_lazy`` launches it. Import this
module after ``flashbook.setup()``: it imports Triton.
"""
import triton
import triton.language as tl


@triton.jit
def hw_exp2(x):
    """2^x on the special-function unit (MUFU.EX2 on NVIDIA GPUs)."""
    return tl.math.exp2(x)


@triton.jit
def attn_fwd_lazy(Q, K, V, O, LSE, RESCALES,
                  stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
                  stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_on,
                  H, N_q, N_k, qk_scale, tau,
                  UPDATE: tl.constexpr, EXP2: tl.constexpr, HEAD_DIM: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Chapter 3's forward kernel with the online-softmax step ``UPDATE``. Q, O: (B, H, N_q, d);
    K, V: (B, H, N_k, d); LSE: (B*H, N_q) float32, natural log; RESCALES: (B*H, cdiv(N_q,
    BLOCK_M)) int32, the steps of each program that moved its reference max.
    Grid: (cdiv(N_q, BLOCK_M), B*H)."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < N_q
    q = tl.load(Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qn + offs_d[None, :],
                mask=row_ok[:, None], other=0.0)                      # read BLOCK_M*d, once
    k_ptrs = K + b * stride_kb + h * stride_kh + offs_n[None, :] * stride_kn + offs_d[:, None]
    v_ptrs = V + b * stride_vb + h * stride_vh + offs_n[:, None] * stride_vn + offs_d[None, :]
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)               # the reference max
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    n_rescaled = 0
    n_full = (N_k // BLOCK_N) * BLOCK_N
    for start_n in range(0, n_full, BLOCK_N):                         # full tiles: no masks
        s = tl.dot(q, tl.load(k_ptrs + start_n * stride_kn), input_precision=DOT_PRECISION)
        v = tl.load(v_ptrs + start_n * stride_vn)                     # read 2*BLOCK_N*d
        acc, l_i, m_i, rescaled = UPDATE(acc, l_i, m_i, s, v, qk_scale, tau, EXP2,
                                         DOT_PRECISION)
        n_rescaled += rescaled
    if n_full < N_k:                                                  # the one tail tile
        kv_ok = (n_full + offs_n) < N_k
        kT = tl.load(k_ptrs + n_full * stride_kn, mask=kv_ok[None, :], other=0.0)
        s = tl.dot(q, kT, input_precision=DOT_PRECISION)
        s = tl.where(kv_ok[None, :], s, float("-inf"))
        v = tl.load(v_ptrs + n_full * stride_vn, mask=kv_ok[:, None], other=0.0)
        acc, l_i, m_i, rescaled = UPDATE(acc, l_i, m_i, s, v, qk_scale, tau, EXP2,
                                         DOT_PRECISION)
        n_rescaled += rescaled
    # acc and l share the reference max m_i, whatever it lags behind: O = acc / l is exact,
    # and LSE = m_i + log2(l) (base 2) is the log of the sum whatever m_i is.
    has_key = l_i > 0.0
    o = acc / tl.where(has_key, l_i, 1.0)[:, None]
    lse = tl.where(has_key, (m_i + tl.math.log2(l_i)) * 0.6931471805599453, float("-inf"))
    tl.store(O + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_on + offs_d[None, :],
             o.to(O.dtype.element_ty), mask=row_ok[:, None])          # write BLOCK_M*d
    tl.store(LSE + pid_bh * N_q + offs_m, lse, mask=row_ok)
    tl.store(RESCALES + pid_bh * tl.num_programs(0) + pid_m, n_rescaled)
