# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Chapter 9: The backward pass
#
# **What you will learn**
# - The FlashAttention-2 backward {cite}`dao2023flashattention2`: from the forward's saved
#   log-sum-exp (LSE) alone, recompute $P$ tile by tile and get $dQ$, $dK$, $dV$ without ever
#   storing the $N \times N$ matrices, and the one extra vector it needs, $D = \mathrm{rowsum}(dO \circ O)$.
# - Why the backward is two kernels: K/V-stationary for $dK, dV$ and Q-stationary for $dQ$,
#   against one kernel with atomic adds into $dQ$; what each costs and why the split is
#   deterministic.
# - Causal masks, packed batches (Chapter 4) and grouped-query attention (Chapter 5) in the
#   backward: each K/V head sums the gradients of the $G$ query heads that read it.
# - The memory saved against a backward that stores $P$, measured.
# - A `torch.autograd.Function` that makes the book's kernels trainable, checked with
#   `torch.autograd.gradcheck` and against SDPA's gradients, and a small model trained with it.
#
# **What you need**: Chapters 3-5 (the Triton forward that writes the LSE, masks, packed
# batches, GQA). Any runtime: on a CPU the kernels run in the Triton interpreter at small
# sizes; a GPU adds the benchmark. About 6-8 hours.
#
# **Exercises** (10 points): (1) the preprocessing $D$ (1) and the dK/dV kernel (3); (2) the dQ
# kernel (3); (3) the autograd Function (2); (4) the dense wrapper, trained against SDPA (1).

# %%
import flashbook as fb
backend = fb.setup()          # before triton is imported: on CPU it switches on the interpreter
import torch
import triton
import triton.language as tl
from flashbook import reference
from flashbook.cases import AttnCase
from flashbook.chapters import ch9

# %% [markdown]
# ## 1. The gradients of attention
#
# The forward of one head computes, with $s$ the scale (default $1/\sqrt{d}$, applied in fp32):
#
# $$S = s\,QK^\top, \qquad P = \mathrm{softmax}(S) \text{ (rows)}, \qquad O = PV,
# \qquad L_i = \log \textstyle\sum_j e^{S_{ij}}.$$
#
# Given $dO = \partial \mathcal{L}/\partial O$, the chain rule through each step gives
#
# $$dV = P^\top dO, \qquad dP = dO\,V^\top, \qquad dS_{ij} = P_{ij}\,(dP_{ij} - D_i),
# \qquad dQ = s\,dS\,K, \qquad dK = s\,dS^\top Q.$$
#
# The softmax's Jacobian gives $dS_{ij} = P_{ij}(dP_{ij} - \sum_l P_{il} dP_{il})$, and the
# sum is a per-row scalar that does not need $P$: $\sum_l P_{il} dP_{il} = \sum_l P_{il}
# (dO_i \cdot V_l) = dO_i \cdot O_i =: D_i$. So the backward first computes
# $D = \mathrm{rowsum}(dO \circ O)$, one fp32 value per row, from two $N \times d$ tensors.
#
# And $P$ itself need not be stored: the forward saved $L$ (natural log, the book's
# convention), so any tile of $P$ is $P_{ij} = \exp(S_{ij} - L_i)$, recomputed from a Q and a
# K tile, already normalised. Rows that see no key (a causal mask with $N_q > N_k$) have
# $L_i = -\infty$ and $P_{i\cdot} = 0$: the kernels must turn that into zeros, not NaN.
# Inside, the kernels work in base 2 as the forward did: $P = 2^{S\log_2 e - L \log_2 e}$.
#
# The FLOPs: the forward has two matmuls ($QK^\top$, $PV$); the backward has five
# ($QK^\top$ again, $dO V^\top$, $P^\top dO$, $dS K$, $dS^\top Q$), so it does 2.5 times the
# forward's work, the count the benchmark uses.
#
# ## 2. A PyTorch tiled backward
#
# The stepping stone is the whole algorithm in PyTorch, for one sequence: loop over K/V tiles
# (the outer loop, as the dK/dV kernel will), and for each over the Q tiles that see it. $dK$
# and $dV$ of a K/V tile accumulate in the inner loop and are written once; $dQ$ gets a
# contribution from every K/V tile, here a plain `+=`. On a GPU that `+=` would come from many
# programs at once.

# %%
def tiled_backward(q, k, v, o, lse, do, causal=False, scale=None, block=16):
    """One sequence: q, o, do (H_q, N_q, d); k, v (H_kv, N_k, d); lse (H_q, N_q) natural log.
    Returns dq, dk, dv in q's dtype. Never holds more than a block x block tile of S or P."""
    H_q, N_q, d = q.shape
    H_kv, N_k, _ = k.shape
    dtype = q.dtype
    G = H_q // H_kv
    scale = 1.0 / d ** 0.5 if scale is None else scale
    f = torch.float64 if q.dtype == torch.float64 else torch.float32
    q, k, v, o, do = (t.to(f) for t in (q, k, v, o, do))
    lse = torch.where(torch.isinf(lse), torch.full_like(lse, float("inf")), lse).to(f)
    D = (do * o).sum(-1)                                            # (H_q, N_q)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for n0 in range(0, N_k, block):                                 # K/V tiles: stationary
        cols = torch.arange(n0, min(n0 + block, N_k), device=q.device)
        for h in range(H_q):                                        # GQA: G heads per K/V head
            kv = h // G
            for m0 in range(0, N_q, block):
                rows = torch.arange(m0, min(m0 + block, N_q), device=q.device)
                s = q[h, rows] @ k[kv, cols].T * scale              # (BM, BN)
                p = torch.exp(s - lse[h, rows, None])               # recomputed, normalised
                if causal:                                          # bottom-right
                    p = p * (cols[None, :] <= rows[:, None] + N_k - N_q)
                dv[kv, cols] += p.T @ do[h, rows]
                ds = p * (do[h, rows] @ v[kv, cols].T - D[h, rows, None])
                dk[kv, cols] += ds.T @ q[h, rows] * scale
                dq[h, rows] += ds @ k[kv, cols] * scale             # the GPU needs atomics here
    return tuple(t.to(dtype) for t in (dq, dk, dv))


def tiled_backward_packed(q, k, v, o, lse, do, cu_seqlens_q, cu_seqlens_k, causal=False,
                          scale=None):
    """``tiled_backward`` on a packed batch: q, o, do (total_q, H_q, d); k, v (total_k, H_kv, d);
    lse (H_q, total_q)."""
    grads = [torch.zeros_like(t) for t in (q, k, v)]
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for (qs, qe), (ks, ke) in zip(zip(cq, cq[1:]), zip(ck, ck[1:])):
        if qe == qs or ke == ks:
            continue
        t = lambda x, a, b: x[a:b].transpose(0, 1)
        dq, dk, dv = tiled_backward(t(q, qs, qe), t(k, ks, ke), t(v, ks, ke), t(o, qs, qe),
                                    lse[:, qs:qe], t(do, qs, qe), causal, scale)
        for g, part, (a, b) in zip(grads, (dq, dk, dv), ((qs, qe), (ks, ke), (ks, ke))):
            g[a:b] = part.transpose(0, 1)
    return tuple(grads)

# %% [markdown]
# It agrees with float64 autograd on a causal GQA case where some rows see no key:

# %% tags=["demo"]
case = AttnCase("demo", seqlens=(40,), seqlens_k=(30,), H_q=4, H_kv=2, d=16, causal=True)
q, k, v, do, o, lse, want = ch9.backward_inputs(case, 0)
got = tiled_backward_packed(q, k, v, o, lse, do, case.cu_seqlens(), case.cu_seqlens(True), True)
for name, g, w in zip(("dQ", "dK", "dV"), got, want):
    print(f"{name}: max |tiled - autograd| = {(g.double() - w).abs().max():.2e}")

# %% [markdown]
# ## 3. Two kernels, no atomics
#
# A GPU kernel must pick what stays on chip. Put a **K/V tile stationary** (FlashAttention-2's
# choice): a program loads $K_j, V_j$ once, keeps $dK_j, dV_j$ in fp32 registers, and streams
# every Q tile that sees them ($Q_i$, $dO_i$, $L_i$, $D_i$). $dK$ and $dV$ are then written once,
# by one program, with no conflict. But $dQ_i$ gets a contribution from every K/V program: in
# one kernel that is an `atomic_add` of fp32 tiles into $dQ$ from $N_k/B_N$ programs, which (a)
# adds $N_k/B_N$ read-modify-writes of each $dQ$ tile to the memory traffic, and (b) makes the
# result depend on the order in which the adds land: floating-point addition does not
# associate, so two runs differ in the last bits. FlashAttention-2 and FlashAttention-3
# {cite}`shah2024flashattention3` accumulate $dQ$ that way, in fp32, with a slower deterministic
# mode; JAX's Pallas FA3 kernels {cite}`jax2025pallasfa3` take the alternative used here: **a
# second kernel, Q-stationary**, that recomputes $S$ and $P$ once more and accumulates $dQ_i$ in
# registers. It costs one extra $QK^\top$ and $dO V^\top$
# (7 matmuls in place of 5: the 2.5x count above is what the benchmark credits, as cuDNN's and
# flash-attn's reports do) and buys a deterministic result with no atomics.
#
# ```
#   preprocess   D = rowsum(dO * O)                 grid (tokens / BLOCK, h_q)
#   dK/dV        for each K/V tile:  for g in G:  for each Q tile that sees it:
#                    P^T = exp(K Q^T s - L);  dV += P^T dO;  dS^T = P^T (V dO^T - D);  dK += dS^T Q
#   dQ           for each Q tile:  for each K/V tile it sees:
#                    P = exp(Q K^T s - L);  dS = P (dO V^T - D);  dQ += dS K
# ```
#
# Causal tiles: a K/V tile starting at key $n_0$ is seen only by rows $i \ge n_0 - (N_k - N_q)$,
# so the dK/dV loop starts there and masks only the tiles that cross the diagonal; the dQ loop
# stops at the last row's diagonal, as the forward did. With GQA the dK/dV program loops over the
# $G$ query heads of its K/V head, summing their gradients in its fp32 accumulators (K and V
# are loaded once for all $G$, the M-fold's saving of Chapter 5, here for the backward).
#
# **Exercise 1 (1 + 3 points).** Three pieces, the dK/dV side, graded in two parts (the
# preprocessing alone, then the step and the kernel, with D computed by the check):
#
# 1. `bwd_preprocess_kernel`: $D$ for `BLOCK_M` tokens of one head (`program_id(1)`), masked at
#    `total_q`, stored at `Delta + h * total_q + t` (about 8 lines).
# 2. `dkdv_step`: one Q tile past the stationary K/V tile, transposed so keys are rows: load the
#    Q and dO tile (rows `m0 ..`, masked at `seqlen_q`, zeros), LSE (`other=inf`: padding rows get
#    $P = 0$) and D; turn LSE into base 2 (a $-\infty$ LSE into $+\infty$); $P^\top$ =
#    `exp2(K Q^T * qk_scale - lse2)`, masked (`MASKED`) where `cols > rows + diag`; then
#    $dV$, $dP^\top$, $dS^\top$, $dK$ as above, $P^\top$ and $dS^\top$ cast to the inputs' dtype
#    for `tl.dot` (about 20 lines).
# 3. `bwd_dkdv_kernel`: the program's K/V tile and (sequence, K/V head) from `program_id`; the
#    causal bounds (`lo`, the first Q tile that sees the keys; `full_lo`, the first that sees
#    all of them); for each of the `GROUP` heads the masked then the unmasked loop; then
#    $dK \mathrel{*}= s$ once and the stores (about 35 lines).
#
# `ch9.launch_preprocess` and `ch9.launch_dkdv` launch them (their docstrings give the grids);
# the check gives your kernels O and LSE from the float64 reference, so only the backward is
# graded. Both kernels' checks end with seeded random packed shapes run with the H200's tiles
# (in CPU mode too): lengths next to the tiles' edges, G 1-8, causal or not.

# %% nbgrader={"grade": false, "grade_id": "ch9_preprocess", "locked": false, "schema_version": 3, "solution": true, "task": false}
@triton.jit
def bwd_preprocess_kernel(O, DO, Delta, stride_ot, stride_oh, stride_dot, stride_doh, total_q,
                          HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr):
    """Delta (H, total_q) float32 = rowsum(dO * O) for BLOCK_M tokens of head program_id(1)."""
    ### BEGIN SOLUTION
    t = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    h = tl.program_id(1)
    offs_d = tl.arange(0, HEAD_DIM)
    ok = (t < total_q)[:, None]
    o = tl.load(O + t[:, None] * stride_ot + h * stride_oh + offs_d[None, :], mask=ok, other=0.0)
    do = tl.load(DO + t[:, None] * stride_dot + h * stride_doh + offs_d[None, :], mask=ok,
                 other=0.0)                                            # read 2 * BLOCK_M * d
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(Delta + h * total_q + t, delta, mask=t < total_q)         # write BLOCK_M
    ### END SOLUTION

# %% nbgrader={"grade": true, "grade_id": "ch9_preprocess_test", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
ch9.check_preprocess(bwd_preprocess_kernel)
### BEGIN HIDDEN TESTS
ch9.check_preprocess(bwd_preprocess_kernel, hidden=True)
### END HIDDEN TESTS

# %% nbgrader={"grade": false, "grade_id": "ch9_dkdv_step", "locked": false, "schema_version": 3, "solution": true, "task": false}
@triton.jit
def dkdv_step(dk, dv, k, v, Q, DO, LSE, Delta, q_start, m0, seqlen_q, cols, diag, head,
              stride_qt, stride_qh, stride_dot, stride_doh, total_q, qk_scale,
              MASKED: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
              DOT_PRECISION: tl.constexpr):
    """One Q tile past a stationary K/V tile, transposed (keys are rows): P^T = exp(K Q^T)."""
    ### BEGIN SOLUTION
    rows = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    ok = rows < seqlen_q
    tokens = q_start + rows
    q = tl.load(Q + tokens[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                mask=ok[:, None], other=0.0)                           # read BLOCK_M*d
    do = tl.load(DO + tokens[:, None] * stride_dot + head * stride_doh + offs_d[None, :],
                 mask=ok[:, None], other=0.0)                          # read BLOCK_M*d
    lse = tl.load(LSE + head * total_q + tokens, mask=ok, other=float("inf"))
    Di = tl.load(Delta + head * total_q + tokens, mask=ok, other=0.0)
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)  # base 2
    sT = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)        # (BLOCK_N, BLOCK_M)
    pT = tl.math.exp2(sT * qk_scale - lse2[None, :])
    if MASKED:
        pT = tl.where(cols[:, None] <= rows[None, :] + diag, pT, 0.0)
    dv += tl.dot(pT.to(do.dtype), do, input_precision=DOT_PRECISION)  # dV += P^T dO
    dpT = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)      # dP^T = V dO^T
    dsT = pT * (dpT - Di[None, :])                                     # dS = P (dP - D)
    dk += tl.dot(dsT.to(q.dtype), q, input_precision=DOT_PRECISION)   # dK += dS^T Q
    return dk, dv
    ### END SOLUTION

# %% nbgrader={"grade": false, "grade_id": "ch9_dkdv_kernel", "locked": false, "schema_version": 3, "solution": true, "task": false}
@triton.jit
def bwd_dkdv_kernel(Q, K, V, DO, LSE, Delta, DK, DV, CU_Q, CU_K,
                    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                    stride_dot, stride_doh, stride_dkt, stride_dkh, stride_dvt, stride_dvh,
                    H_KV, total_q, sm_scale, qk_scale, CAUSAL: tl.constexpr,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """dK, dV of one K/V tile (BLOCK_N keys of K/V head pid % H_KV of sequence pid // H_KV),
    summed over the GROUP query heads that read it; every Q tile that sees these keys once."""
    ### BEGIN SOLUTION
    n0 = tl.program_id(0) * BLOCK_N
    seq = tl.program_id(1) // H_KV
    kv_head = tl.program_id(1) % H_KV
    k_start = tl.load(CU_K + seq)
    seqlen_k = tl.load(CU_K + seq + 1) - k_start
    if n0 >= seqlen_k:
        return
    q_start = tl.load(CU_Q + seq)
    seqlen_q = tl.load(CU_Q + seq + 1) - q_start
    cols = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    kv_ok = (cols < seqlen_k)[:, None]
    k = tl.load(K + (k_start + cols)[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :],
                mask=kv_ok, other=0.0)                                 # read BLOCK_N*d, once
    v = tl.load(V + (k_start + cols)[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :],
                mask=kv_ok, other=0.0)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    diag = seqlen_k - seqlen_q               # bottom-right: row i sees key j iff j <= i + diag
    lo = 0
    full_lo = 0
    if CAUSAL:                               # rows before n0 - diag see none of these keys
        lo = tl.maximum(n0 - diag, 0) // BLOCK_M * BLOCK_M
        full_lo = tl.minimum(tl.maximum(tl.cdiv(n0 + BLOCK_N - 1 - diag, BLOCK_M) * BLOCK_M, lo),
                             seqlen_q)
    for g in range(GROUP):                   # GQA: the query heads sharing this K/V head
        head = kv_head * GROUP + g
        for m0 in range(lo, full_lo, BLOCK_M):          # tiles across the diagonal: masked
            dk, dv = dkdv_step(dk, dv, k, v, Q, DO, LSE, Delta, q_start, m0, seqlen_q, cols,
                               diag, head, stride_qt, stride_qh, stride_dot, stride_doh,
                               total_q, qk_scale, True, HEAD_DIM, BLOCK_M, DOT_PRECISION)
        for m0 in range(full_lo, seqlen_q, BLOCK_M):    # every key visible: no mask
            dk, dv = dkdv_step(dk, dv, k, v, Q, DO, LSE, Delta, q_start, m0, seqlen_q, cols,
                               diag, head, stride_qt, stride_qh, stride_dot, stride_doh,
                               total_q, qk_scale, False, HEAD_DIM, BLOCK_M, DOT_PRECISION)
    dk = dk * sm_scale                       # dK = dS^T Q * scale: S was Q K^T * scale
    tl.store(DK + (k_start + cols)[:, None] * stride_dkt + kv_head * stride_dkh + offs_d[None, :],
             dk.to(DK.dtype.element_ty), mask=kv_ok)                  # write BLOCK_N*d
    tl.store(DV + (k_start + cols)[:, None] * stride_dvt + kv_head * stride_dvh + offs_d[None, :],
             dv.to(DV.dtype.element_ty), mask=kv_ok)
    ### END SOLUTION

# %% nbgrader={"grade": true, "grade_id": "ch9_dkdv_test", "locked": true, "points": 3, "schema_version": 3, "solution": false, "task": false}
ch9.check_dkdv(dkdv_step, bwd_dkdv_kernel)
### BEGIN HIDDEN TESTS
ch9.check_dkdv(dkdv_step, bwd_dkdv_kernel, hidden=True)
### END HIDDEN TESTS

# %% [markdown]
# **Exercise 2 (3 points).** The dQ side, Q-stationary: `dq_step` recomputes $P$ for one K/V
# tile (rows are queries now, keys masked at `seqlen_k` and, when `MASKED`, past each row's
# diagonal `rows + diag`), then $dP = dO V^\top$, $dS = P \circ (dP - D)$ and `dq += dS K`,
# accumulated in **fp32** (about 15 lines); `bwd_dq_kernel` loads the Q tile, dO, LSE and D once,
# runs the unmasked key tiles `[0, full_hi)` then the masked `[full_hi, hi)` (for a causal mask
# `hi` is the last row's diagonal + 1; without one `diag = seqlen_k` makes every key visible),
# scales by $s$ once and stores $dQ$ in q's dtype (about 30 lines). The check computes $D$ itself.

# %% nbgrader={"grade": false, "grade_id": "ch9_dq_step", "locked": false, "schema_version": 3, "solution": true, "task": false}
@triton.jit
def dq_step(dq, q, do, lse2, Di, K, V, k_start, n0, seqlen_k, rows, diag, kv_head,
            stride_kt, stride_kh, stride_vt, stride_vh, qk_scale, MASKED: tl.constexpr,
            HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One K/V tile past a stationary Q tile: recompute P, then dQ += dS K."""
    ### BEGIN SOLUTION
    cols = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    kv_ok = cols < seqlen_k
    k = tl.load(K + (k_start + cols)[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :],
                mask=kv_ok[:, None], other=0.0)                        # read BLOCK_N*d
    v = tl.load(V + (k_start + cols)[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :],
                mask=kv_ok[:, None], other=0.0)                        # read BLOCK_N*d
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)         # (BLOCK_M, BLOCK_N)
    p = tl.math.exp2(s * qk_scale - lse2[:, None])
    if MASKED:
        p = tl.where((cols[None, :] <= rows[:, None] + diag) & kv_ok[None, :], p, 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)       # dP = dO V^T
    ds = p * (dp - Di[:, None])
    dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION)     # dQ += dS K (fp32)
    return dq
    ### END SOLUTION

# %% nbgrader={"grade": false, "grade_id": "ch9_dq_kernel", "locked": false, "schema_version": 3, "solution": true, "task": false}
@triton.jit
def bwd_dq_kernel(Q, K, V, DO, LSE, Delta, DQ, CU_Q, CU_K,
                  stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                  stride_dot, stride_doh, stride_dqt, stride_dqh, H_Q, total_q, sm_scale,
                  qk_scale, CAUSAL: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """dQ of one Q tile (BLOCK_M rows of query head pid % H_Q of sequence pid // H_Q)."""
    ### BEGIN SOLUTION
    m0 = tl.program_id(0) * BLOCK_M
    seq = tl.program_id(1) // H_Q
    head = tl.program_id(1) % H_Q
    kv_head = head // GROUP
    q_start = tl.load(CU_Q + seq)
    seqlen_q = tl.load(CU_Q + seq + 1) - q_start
    if m0 >= seqlen_q:
        return
    k_start = tl.load(CU_K + seq)
    seqlen_k = tl.load(CU_K + seq + 1) - k_start
    rows = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    ok = rows < seqlen_q
    tokens = q_start + rows
    q = tl.load(Q + tokens[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                mask=ok[:, None], other=0.0)                           # read BLOCK_M*d, once
    do = tl.load(DO + tokens[:, None] * stride_dot + head * stride_doh + offs_d[None, :],
                 mask=ok[:, None], other=0.0)
    lse = tl.load(LSE + head * total_q + tokens, mask=ok, other=float("inf"))
    Di = tl.load(Delta + head * total_q + tokens, mask=ok, other=0.0)
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    diag = seqlen_k - seqlen_q               # bottom-right: row i sees key j iff j <= i + diag
    hi = seqlen_k
    full_hi = seqlen_k // BLOCK_N * BLOCK_N            # the partial last tile is masked
    if not CAUSAL:
        diag = seqlen_k                                # every row sees every key
    else:                                         # keys past the last row's diagonal
        hi = tl.maximum(tl.minimum(m0 + BLOCK_M + diag, seqlen_k), 0)
        full_hi = tl.minimum(tl.maximum(m0 + diag + 1, 0) // BLOCK_N * BLOCK_N, full_hi)
    for n0 in range(0, full_hi, BLOCK_N):              # every key visible to every row
        dq = dq_step(dq, q, do, lse2, Di, K, V, k_start, n0, seqlen_k, rows, diag, kv_head,
                     stride_kt, stride_kh, stride_vt, stride_vh, qk_scale, False, HEAD_DIM,
                     BLOCK_N, DOT_PRECISION)
    for n0 in range(full_hi, hi, BLOCK_N):             # the diagonal band and the tail: masked
        dq = dq_step(dq, q, do, lse2, Di, K, V, k_start, n0, seqlen_k, rows, diag, kv_head,
                     stride_kt, stride_kh, stride_vt, stride_vh, qk_scale, True, HEAD_DIM,
                     BLOCK_N, DOT_PRECISION)
    dq = dq * sm_scale                                 # dQ = dS K * scale
    tl.store(DQ + tokens[:, None] * stride_dqt + head * stride_dqh + offs_d[None, :],
             dq.to(DQ.dtype.element_ty), mask=ok[:, None])            # write BLOCK_M*d
    ### END SOLUTION

# %% nbgrader={"grade": true, "grade_id": "ch9_dq_test", "locked": true, "points": 3, "schema_version": 3, "solution": false, "task": false}
ch9.check_dq(dq_step, bwd_dq_kernel)
### BEGIN HIDDEN TESTS
ch9.check_dq(dq_step, bwd_dq_kernel, hidden=True)
### END HIDDEN TESTS

# %% [markdown]
# The three launches make the backward. `attention_backward` is what the autograd Function will
# call:

# %%
def attention_backward(q, k, v, o, lse, do, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                       max_seqlen_k, causal=False, softmax_scale=None):
    """dQ, dK, dV of packed attention from the forward's O and LSE (h_q, total_q)."""
    delta = ch9.launch_preprocess(bwd_preprocess_kernel, o, do)          # (h_q, total_q) fp32
    dk, dv = ch9.launch_dkdv(bwd_dkdv_kernel, q, k, v, do, lse, delta, cu_seqlens_q,
                             cu_seqlens_k, max_seqlen_k, causal=causal, scale=softmax_scale)
    dq = ch9.launch_dq(bwd_dq_kernel, q, k, v, do, lse, delta, cu_seqlens_q, cu_seqlens_k,
                       max_seqlen_q, causal=causal, scale=softmax_scale)
    return dq, dk, dv

# %% [markdown]
# For comparison, the one-kernel design: the dK/dV program also computes the share of $dQ$ of
# the Q tile it just streamed, and adds it into an fp32 buffer that every K/V program of the
# sequence adds into. After `dk += ...` in `dkdv_step`, two more lines:
#
# ```python
# dq = tl.dot(tl.trans(dsT), k) * sm_scale        # (BLOCK_M, d): this K/V tile's share of dQ
# tl.atomic_add(DQ + q_offsets, dq, mask=rows_ok)   # read + write BLOCK_M * d fp32 in memory
# ```
#
# It saves the dQ kernel's recomputation of $S$ and $dP$ and pays with $N_k / B_N$ atomic
# read-modify-writes of every dQ tile, in an order no one controls. The benchmark of Section 7
# times this design twice, from the course's reference kernel (not printed here: its dK/dV
# half is Exercise 1): with scalar atomics as above (`ch9_bwd_atomic`) and with each tile
# added by one TMA reduce (`ch9_bwd_fused`).

# %% [markdown]
# **Determinism.** In the two-kernel backward no program adds into memory another program
# writes, and every accumulator sums its tiles in a fixed loop order, so two runs give the same
# bits. The one-kernel design does not: on a GPU the benchmark runs it twice and its note says
# whether the bits matched.

# %% tags=["demo"]
case = AttnCase("determinism", seqlens=(33, 20), H_q=4, H_kv=2, d=16, causal=True)
q, k, v, do, o, lse, _ = ch9.backward_inputs(case, 1)
cu_q, cu_k = case.cu_seqlens().to(q.device), case.cu_seqlens(True).to(q.device)
args = (q, k, v, o, lse, do, cu_q, cu_k, 33, 33, True)
runs = ch9.when_solved(lambda: [attention_backward(*args) for _ in range(2)], "Exercises 1-2")
if runs:
    print("two kernels, two runs: bitwise identical:",
          all(torch.equal(a, b) for a, b in zip(*runs)))

# %% [markdown]
# ## 4. An autograd Function
#
# `torch.autograd.Function` joins the two passes: `forward(ctx, ...)` runs the forward kernel
# and saves what the backward needs with `ctx.save_for_backward` (q, k, v, O, LSE and the
# offsets: $O(N d)$ memory, never $O(N^2)$), non-tensor arguments on `ctx`; `backward(ctx, dO)`
# returns one gradient per input of `forward`, `None` for the non-differentiable ones.
#
# The forward is Chapter 5's packed GQA kernel (`ch9.forward` runs its two-tile form, which
# the package holds). `torch.autograd.gradcheck` compares the analytic gradients with finite
# differences and needs float64. The Triton interpreter multiplies float64 tiles correctly, but
# Chapter 5's forward and the GPU configurations take fp16, bf16 and fp32 only; so in float64
# your Function runs the float64 reference forward (`reference.attention_varlen`, which also
# returns the LSE) and the tiled PyTorch backward of Section 2. The same `ctx` plumbing is then
# graded by gradcheck, and the kernel path by fp32 and fp16 comparisons with SDPA's gradients.
#
# **Exercise 3 (2 points).** Write `FlashAttentionFn.forward` and `.backward` (about 15 lines):
# forward validates the scale (`ch9.validate_scale(softmax_scale, d)`), picks the float64 or
# the kernel path, saves, and returns O and the LSE `(h_q, total_q)`, as flash-attn's Function
# does (a caller merging partial results, Chapter 8's split-KV or ring, needs it), the LSE
# marked non-differentiable (`ctx.mark_non_differentiable(lse)`: no gradient flows through
# it); backward gets one gradient per output, `do` and the LSE's (unused), and returns
# `dq, dk, dv` and six `None`. In the fp32 and fp16 cases the check makes the float64 path
# (`reference`, `tiled_backward_packed`) raise: those must run your kernels.

# %% nbgrader={"grade": false, "grade_id": "ch9_autograd", "locked": false, "schema_version": 3, "solution": true, "task": false}
class FlashAttentionFn(torch.autograd.Function):
    """Packed attention, differentiable in q (total_q, h_q, d), k and v (total_k, h_kv, d)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                causal=False, softmax_scale=None):
        ### BEGIN SOLUTION
        scale = ch9.validate_scale(softmax_scale, q.shape[-1])
        if q.dtype == torch.float64:
            o, lse = reference.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, scale,
                                                causal)
        else:
            o, lse = ch9.forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                 max_seqlen_k, causal=causal, softmax_scale=scale)
        ctx.save_for_backward(q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k)
        ctx.meta = (max_seqlen_q, max_seqlen_k, causal, scale)
        ctx.mark_non_differentiable(lse)
        return o, lse
        ### END SOLUTION

    @staticmethod
    def backward(ctx, do, dlse):
        ### BEGIN SOLUTION
        q, k, v, o, lse, cu_q, cu_k = ctx.saved_tensors
        max_q, max_k, causal, scale = ctx.meta
        if q.dtype == torch.float64:
            dq, dk, dv = tiled_backward_packed(q, k, v, o, lse, do, cu_q, cu_k, causal, scale)
        else:
            dq, dk, dv = attention_backward(q, k, v, o, lse, do.contiguous(), cu_q, cu_k, max_q,
                                            max_k, causal, scale)
        return dq, dk, dv, None, None, None, None, None, None
        ### END SOLUTION

# %% nbgrader={"grade": true, "grade_id": "ch9_autograd_test", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
ch9.check_autograd(FlashAttentionFn)
### BEGIN HIDDEN TESTS
ch9.check_autograd(FlashAttentionFn, hidden=True)
### END HIDDEN TESTS

# %% [markdown]
# **Exercise 4 (1 point).** The dense API a model calls, `flash_attention(q, k, v, causal,
# softmax_scale, layout="bhnd", return_lse=False)`, takes `(B, H, N, d)` tensors, or with
# `layout="bnhd"` flash-attn's `(B, N, H, d)` (`flash_attn_func`), and returns O in the same
# layout, with `return_lse=True` also the LSE `(B, h_q, N_q)`. It is a Function of its own, as
# flash-attn's dense `FlashAttnFunc` stands beside its varlen one, for a reason of speed: every
# view of q, k and v made *outside* a Function is an op autograd records, and a model's
# forward then spends more host time on the reshapes than on the launch. Inside `forward` and
# `backward` autograd records nothing.
#
# A dense batch is a packed batch, seen through strides with no copy, in one of two ways:
# $B$ sequences of $N$ tokens, `(B*N, H, d)`, where one token stride also steps across the
# batch (flash-attn's layout as allocated), or one sequence of $N$ tokens with $B \cdot H$ heads,
# `(N, B*H, d)`, where one head stride steps across the batch (`(B, H, N, d)` as allocated; the
# kernels find query head $j$'s K/V head as $j / G$, so GQA survives).
#
# * `forward(ctx, q, k, v, causal, softmax_scale, layout)`: `ch9.dense_forward(q, k, v, causal,
#   softmax_scale, layout, return_lse=True)` packs, launches Chapter 5's forward and gives O and
#   the LSE back in the caller's layout (its launch is remembered by the inputs' shapes and
#   strides, and made again on your tensors). Save q, k, v, O and the LSE, keep the rest on
#   `ctx`, mark the LSE non-differentiable.
# * `backward(ctx, do, dlse)`: `q, k, v, S = ch9.packed_views(q, k, v, layout)` picks the way the
#   three tensors' strides allow and returns them packed with $S$, the number of sequences ($B$
#   or 1; where neither way fits it copies); `ch9.to_packed(t, layout, S)` packs O and dO the same
#   way and `ch9.lse_to_packed(lse, S)` the LSE. The int32 offsets are `arange(S + 1) * N_q` for
#   the queries and `* N_k` for the keys: `ch9.dense_offsets(S, N, device)` (made once per
#   shape). Run your `attention_backward` (float64, gradcheck's dtype: Section 2's
#   `tiled_backward_packed`, as in Exercise 3) and give each gradient back in the caller's layout
#   with `ch9.from_packed(g, B, layout, S)`.
# * `flash_attention`: a call autograd records nothing of (`torch.no_grad()`, or inputs that
#   need no gradient: `ch9.forward_only(q, k, v)`) needs no Function: return
#   `ch9.dense_forward(...)` there; else apply the Function.
#
# The check compares O, the LSE and the gradients with float64 autograd in both layouts, then
# trains the tiny transformer of Section 6 for a few steps with your function and with SDPA:
# the losses must agree. It also checks the design: O must come out of one autograd node whose
# inputs are q, k and v themselves (a view made outside the Function fails it).

# %% nbgrader={"grade": false, "grade_id": "ch9_dense", "locked": false, "schema_version": 3, "solution": true, "task": false}
class DenseFlashAttentionFn(torch.autograd.Function):
    """Dense attention, differentiable in q (B, h_q, N_q, d), k and v (B, h_kv, N_k, d)
    (layout="bnhd": (B, N, h, d)); returns O like q and the LSE (B, h_q, N_q)."""

    @staticmethod
    def forward(ctx, q, k, v, causal, softmax_scale, layout):
        ### BEGIN SOLUTION
        o, lse = ch9.dense_forward(q, k, v, causal, softmax_scale, layout, return_lse=True)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.meta = (causal, ch9.validate_scale(softmax_scale, q.shape[-1]), layout)
        ctx.mark_non_differentiable(lse)
        return o, lse
        ### END SOLUTION

    @staticmethod
    def backward(ctx, do, dlse):
        ### BEGIN SOLUTION
        q, k, v, o, lse = ctx.saved_tensors
        causal, scale, layout = ctx.meta
        seq = 2 if layout == "bhnd" else 1          # the sequence axis (packed_views checks layout)
        B, N_q, N_k = q.shape[0], q.shape[seq], k.shape[seq]
        q_p, k_p, v_p, S = ch9.packed_views(q, k, v, layout)   # views: S = B sequences, or 1
        o_p, do_p = ch9.to_packed(o, layout, S), ch9.to_packed(do, layout, S)
        lse_p = ch9.lse_to_packed(lse, S)
        cu_q, cu_k = ch9.dense_offsets(S, N_q, q.device), ch9.dense_offsets(S, N_k, q.device)
        if q.dtype == torch.float64:
            grads = tiled_backward_packed(q_p, k_p, v_p, o_p, lse_p, do_p, cu_q, cu_k, causal,
                                          scale)
        else:
            grads = attention_backward(q_p, k_p, v_p, o_p, lse_p, do_p.contiguous(), cu_q, cu_k,
                                       N_q, N_k, causal, scale)
        dq, dk, dv = (ch9.from_packed(g, B, layout, S) for g in grads)
        return dq, dk, dv, None, None, None
        ### END SOLUTION


def flash_attention(q, k, v, causal=False, softmax_scale=None, layout="bhnd", return_lse=False):
    """q (B, h_q, N_q, d), k and v (B, h_kv, N_k, d) (layout="bnhd": (B, N, h, d)) -> O like q,
    differentiable; return_lse: (O, LSE (B, h_q, N_q) float32, natural log)."""
    ### BEGIN SOLUTION
    if ch9.forward_only(q, k, v):               # autograd records nothing: no Function
        return ch9.dense_forward(q, k, v, causal, softmax_scale, layout, return_lse)
    o, lse = DenseFlashAttentionFn.apply(q, k, v, causal, softmax_scale, layout)
    return (o, lse) if return_lse else o
    ### END SOLUTION

# %% nbgrader={"grade": true, "grade_id": "ch9_training_test", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
ch9.check_training(flash_attention)
### BEGIN HIDDEN TESTS
ch9.check_training(flash_attention, hidden=True)
### END HIDDEN TESTS

# %% [markdown]
# ## 5. The memory saved, measured
#
# A backward written as plain PyTorch ops lets autograd keep what each op needs: for attention
# that includes $S$ or $P$, $B \cdot H \cdot N_q \cdot N_k$ values, quadratic in the length. The
# Function keeps q, k, v, O and the LSE. `torch.autograd.graph.saved_tensors_hooks` sees every
# tensor autograd saves, so we can count the bytes (float64 on the CPU here; both sides in the
# same dtype):

# %% tags=["demo"]
print(ch9.when_solved(lambda: ch9.saved_bytes_table(flash_attention, lengths=(256, 1024, 2048)),
                     "Exercise 3") or "")

# %% [markdown]
# ## 6. Training with the book's kernels
#
# The last test is the one that matters to a user: train a model. `ch9.train` trains a tiny
# causal transformer (one block, two heads of 16, sequences of 32 tokens that repeat a random
# pattern, so attention must copy from earlier positions) from the same initial weights twice:
# with `flash_attention` (our forward and backward kernels) and with SDPA. Same data, same
# optimiser: the curves differ only by the kernels' rounding. In CPU mode the kernels run in the
# interpreter, so the run is short (the step count is printed); on a GPU it runs 300 steps.

# %% tags=["demo"]
steps, batch = (300, 16) if backend.gpu else (15, 2)      # the interpreter: a short run
train = dict(batch=batch, device=backend.device)
ours = ch9.when_solved(lambda: ch9.train(lambda q, k, v: flash_attention(q, k, v, causal=True),
                                         steps, **train), "Exercises 1-3")
if ours:
    sdpa = ch9.train(ch9.sdpa_attention, steps, **train)
    print(f"{steps} steps of {batch} sequences: final loss {ours[-1]:.4f} (ours) vs "
          f"{sdpa[-1]:.4f} (SDPA), largest difference "
          f"{max(abs(a - b) for a, b in zip(ours, sdpa)):.2e}")
    ch9.plot_losses(ours, sdpa)

# %% tags=["remove-cell"]
# The figures the prose quotes, from the recorded H200 data: the book pastes each into its
# glue:text role (myst-nb's glue); elsewhere this does nothing.
from flashbook import quoted
quoted.glue(ch9.CHAPTER)

# %% [markdown]
# ## 7. Performance
#
# `flashbook bench ch9` measures, on a GPU, forward + backward (`ch9_fwdbwd`) and the backward
# alone (`ch9_bwd`) against cuDNN's and FlashAttention-2's SDPA backends (`sdpa_cudnn_bwd`,
# `sdpa_flash_bwd`, ...) at $(B, H, N, d) = (1, 16, 16384, 128)$ fp16, causal and not,
# crediting the backward with 2.5x the forward's FLOPs (the book's kernels replayed from CUDA
# graphs; the SDPA rows, cuDNN's and FlashAttention-2's, called directly, without graphs: the
# ratios below compare those), and the configuration of the public
# CS336 (2025) leaderboard: forward + backward, $B = 1$, 16 heads of 64, $N = 16384$, bf16, causal.
# It also times the two one-kernel designs of Section 3: scalar atomics (`ch9_bwd_atomic`) and
# each $dQ$ tile added by one TMA reduce (`cp.reduce.async.bulk`, `ch9_bwd_fused`), the way
# FlashAttention-3 does it, and the same design written in Gluon (`ch9_bwd_gluon`, below).
#
# ### Measured on an H200
#
# The record below (`python -m flashbook.chapters.ch9.tune`, which checks the gradients at full
# size against cuDNN's, can sweep the tile configs, then runs `flashbook bench ch9`) puts your
# two-kernel backward at {glue:text}`ch9_bwd_tflops_noncausal:.0f` TFLOP/s non-causal:
# {glue:text}`ch9_bwd_vs_cudnn_noncausal:.2f`x cuDNN ({glue:text}`ch9_cudnn_tflops_noncausal:.0f`)
# and {glue:text}`ch9_bwd_vs_fa2_noncausal:.2f`x FlashAttention-2
# ({glue:text}`ch9_fa2_tflops_noncausal:.0f`), and at {glue:text}`ch9_bwd_tflops_causal:.0f`
# TFLOP/s causal: {glue:text}`ch9_bwd_vs_cudnn_causal:.2f`x cuDNN
# ({glue:text}`ch9_cudnn_tflops_causal:.0f`) and {glue:text}`ch9_bwd_vs_fa2_causal:.2f`x
# FlashAttention-2 ({glue:text}`ch9_fa2_tflops_causal:.0f`). On the CS336
# configuration, forward + backward as you write the training step (`flash_attention(q, k, v,
# causal)`, then `torch.autograd.grad`: checks and autograd included, launched) takes
# {glue:text}`ch9_fwdbwd_ms:.2f` ms (cuDNN {glue:text}`ch9_cudnn_fwdbwd_ms:.2f` ms,
# FlashAttention-2 {glue:text}`ch9_fa2_fwdbwd_ms:.2f` ms) on
# the H200; the leaderboard's best, 5.364 ms, was measured on an H100, whose HBM3 moves 3.35
# TB/s against the H200's 4.8 (the tensor cores are the same): not a like-for-like race.
#
# **Where the time goes.** The dK/dV kernel takes about two thirds of the backward (`tune`
# times each kernel alone in its sweep). The split runs 7 GEMMs where 5 are credited, so at
# equal efficiency per GEMM it cannot pass 5/7 of its kernels' raw speed: closing the gap to
# cuDNN needs the five-GEMM design. The one-kernel variants say what that design costs in
# Triton:
# {glue:text}`ch9_atomic_ms:.1f` ms with scalar atomics, {glue:text}`ch9_fused_ms:.1f` ms with TMA
# reduces, {glue:text}`ch9_two_kernels_ms:.1f` ms for the two kernels.
# Scalar atomics issue a read-modify-write per element (8192 per 64 x 128 tile); the TMA
# reduce moves the whole 32 KB tile into L2 in one instruction and is more than twice as fast,
# yet only draws level with the split. Its PTX shows the reduce overlapping the next tile's
# work (the one wait per tile is for the previous reduce to have read its buffer), so the
# reduce itself is not the stall. The likelier cost is what the same eight warps now also do
# every step: a fifth GEMM that needs $dS$ transposed as its first operand, and dQ's fp32 tile
# written to shared memory. Triton's automatic warp specialization
# (`tl.range(..., warp_specialize=True)` on the Q-tile loop, Triton 3.6) changed nothing with
# eight warps and did not compile with four, in both kernels; loading Q and dO by the TMA made
# the one-kernel form slower.
#
# **The same design in Gluon.** The course's `solutions/extras/ch9_gluon_bwd.py` writes the
# one-kernel backward the way Chapter 6 wrote the forward: TMA loads of Q, dO, LSE and $D$ into
# a ring of shared-memory slots a tile ahead, `warpgroup_mma` issued asynchronously so that
# $dP^T$ runs under the exponentials of $P^T$ and $dS^T$ is computed under $dV$'s GEMM, $P^T$
# and $dS^T$ fed to the tensor cores from registers for $dV$ and $dK$ (feeding $dS^T$ from
# shared memory was slower), and $dQ^T = K^T dS^T$ (the transposed product lets a
# step take 32 query rows, where wgmma's rows are 64 a warpgroup; 64-row steps spilled
# registers). It reaches
# {glue:text}`ch9_gluon_tflops_noncausal:.0f` TFLOP/s non-causal and
# {glue:text}`ch9_gluon_tflops_causal:.0f` causal: {glue:text}`ch9_gluon_vs_cudnn_noncausal:.2f`x
# and {glue:text}`ch9_gluon_vs_cudnn_causal:.2f`x cuDNN,
# the fastest backward of the chapter, still far from cuDNN. Nsight Compute says why
# (`src/flashbook/data/profiles/ch9_gluon_bwd_h200_ncu.txt`, at the headline shape; its header
# gives the command): it finds
# the tensor cores busy {glue:text}`ch9_profile_tensor:.0f`% of the time, the shared memory
# {glue:text}`ch9_profile_shared:.0f`%, and no warp ready to issue in
# {glue:text}`ch9_profile_no_eligible:.0f`% of the schedulers' cycles
# ({glue:text}`ch9_profile_warps:.0f` warps each, {glue:text}`ch9_profile_registers:.0f`
# registers a thread).
# Neither the tensor cores nor the shared memory is the limit: waiting is. The eight warps run
# one chain of dependent steps (two GEMMs, the exponentials, $dV$'s GEMM, $dS^T$, a barrier,
# two GEMMs, $dQ$ out through shared memory) and meet at a CTA barrier four times a step, so
# while they wait for a GEMM or for each other, the schedulers have nothing else to issue.
# That is the problem Chapter 6's forward solved with warp specialization: cuDNN and
# FlashAttention-3 give the loads and the $dQ$ reduces their own warps and keep the consumer
# warpgroups' chains out of step, so one's exponentials run under another's GEMMs (next
# section). Every one-kernel row also shows the price of atomics in its note: "two runs differ
# in dQ bits".

# %% tags=["demo"]
import matplotlib.pyplot as plt
from flashbook import results
found = results.recorded("ch9")
if found:
    print(ch9.recorded.summary(found.rows))
    fig = ch9.recorded.plot_recorded(found.rows)
    fig.suptitle("Chapter 9 on an H200 (" + results.describe(found.provenance) + ")", fontsize=9)
    fig.tight_layout()
    plt.show()

# %% [markdown]
# ### Warp specialization, measured on an H100
#
# The course's `solutions/extras/ch9_gluon_ws_bwd.py` gives the jobs their own warps, as
# FlashAttention-3 does. A program owns 128 keys of one (batch, K/V head), in three roles:
#
# - a **producer warp** (24 registers a thread after `setmaxnreg`) TMA-loads the K and V tiles
#   once, then streams the query tiles (Q, dO, LSE, $D$) through a ring of shared-memory slots,
#   each with a *full* barrier (the TMA's bytes) and an *empty* one (both consumers arrive);
# - **two consumer warpgroups** (240 registers) each own 64 of the keys, with a chain of their
#   own: $S^T$ and $dP^T$, the exponentials, $dV$'s GEMM, $dS^T$, $dK$'s GEMM. One
#   warpgroup's exponentials can run under the other's GEMMs;
# - they meet once a step, at $dQ$, which needs every key's $dS$: each writes its $dS^T$ to
#   shared memory, then computes a column half of $dQ$ from both halves and sends it out by a
#   TMA reduce-add of its own, waiting for that reduce to have read its buffer only a step later.
#
# With grouped-query attention one program walks the query tiles of every query head of its
# group, so $dK$ and $dV$ are summed over the group in a fixed order: deterministic.
#
# `ch9_ws_bwd_bench.py --ablation` times it at (1, 16, 16384, 128) fp16 on the
# {glue:text}`ch9_ws_gpu`, each variant's gradients checked against fp32 before it is timed,
# each design switch flipped in turn, all in one run. TFLOP/s (x cuDNN's backward):
#
# | variant | non-causal | causal |
# |---|---|---|
# | **the default: every feature on, head-major launch** | {glue:text}`ch9_ws_default_noncausal:.0f` ({glue:text}`ch9_ws_default_vs_cudnn_noncausal:.2f`x) | {glue:text}`ch9_ws_default_causal:.0f` ({glue:text}`ch9_ws_default_vs_cudnn_causal:.2f`x) |
# | longest-first launch instead | {glue:text}`ch9_ws_longest_first_on_noncausal:.0f` ({glue:text}`ch9_ws_longest_first_on_vs_cudnn_noncausal:.2f`x) | {glue:text}`ch9_ws_longest_first_on_causal:.0f` ({glue:text}`ch9_ws_longest_first_on_vs_cudnn_causal:.2f`x) |
# | dQ's reduce waited for at once | {glue:text}`ch9_ws_dq_wait_late_off_noncausal:.0f` ({glue:text}`ch9_ws_dq_wait_late_off_vs_cudnn_noncausal:.2f`x) | {glue:text}`ch9_ws_dq_wait_late_off_causal:.0f` ({glue:text}`ch9_ws_dq_wait_late_off_vs_cudnn_causal:.2f`x) |
# | no `setmaxnreg` (168 registers each) | {glue:text}`ch9_ws_setmaxnreg_off_noncausal:.0f` ({glue:text}`ch9_ws_setmaxnreg_off_vs_cudnn_noncausal:.2f`x) | {glue:text}`ch9_ws_setmaxnreg_off_causal:.0f` ({glue:text}`ch9_ws_setmaxnreg_off_vs_cudnn_causal:.2f`x) |
# | the one-kernel Gluon backward (no roles) | {glue:text}`ch9_ws_one_kernel_noncausal:.0f` ({glue:text}`ch9_ws_one_kernel_vs_cudnn_noncausal:.2f`x) | {glue:text}`ch9_ws_one_kernel_causal:.0f` ({glue:text}`ch9_ws_one_kernel_vs_cudnn_causal:.2f`x) |
# | cuDNN's backward | {glue:text}`ch9_ws_cudnn_noncausal:.0f` | {glue:text}`ch9_ws_cudnn_causal:.0f` |
#
# - **Head-major launch order wins.** Launching every head's first key tiles first (the
#   longest programs under the causal mask, as Chapter 4 teaches for the forward) loses in both
#   cases, most without the mask, where every program is equally long and the order buys
#   nothing. Our reading, not yet profiled: head by head, the programs running at once share one
#   or two heads' Q and dO (8 MB a head) in the 50 MB L2; sixteen heads at once ask it for
#   128 MB.
# - **The registers are the design.** Without `setmaxnreg` every warp keeps the launch's 168
#   registers, the consumers' dK and dV accumulators spill, and the kernel loses about two
#   thirds of its speed.
# - **Waiting for dQ's reduce a step later** pays: waiting at once holds each consumer until
#   its own TMA reduce has read the buffer, every step. (In an earlier run in the longest-first
#   order the early wait was the faster one; we have not profiled why.)
#
# **The profile.** Nsight Compute at the same shape on the same H100
# (`src/flashbook/data/profiles/ch9_ws_bwd_h100_noncausal_ncu.txt`, its causal twin, and
# Chapter 6's forward's beside them; each header gives its command) finds the tensor-dominated
# pipeline busy {glue:text}`ch9_profile_ws_pipe_noncausal:.0f`% of the time non-causal and
# {glue:text}`ch9_profile_ws_pipe_causal:.0f`% causal, where Chapter 6's forward keeps it
# {glue:text}`ch9_profile_fwd_pipe_noncausal:.0f`% busy, and no warp ready to issue in
# {glue:text}`ch9_profile_ws_no_eligible_noncausal:.0f`% of the schedulers' cycles (the
# forward: {glue:text}`ch9_profile_fwd_no_eligible_noncausal:.0f`%). The consumers spill a few
# scalars ({glue:text}`ch9_profile_ws_spills_noncausal:.0f` million local-memory requests a
# launch, about four a warp a step, nearly all served by L1); the forward spills none. Our
# reading, not yet tested: a backward step is a longer chain than a forward one (five GEMMs and
# the meeting at $dQ$ against two GEMMs), and with one chain per consumer warpgroup, three warps
# a scheduler, one consumer's exponentials do not cover the other's GEMMs as well as in the
# forward. The next design to try is two query tiles in flight per consumer, which needs
# registers that 240 a thread do not leave.
#
# These are an H100's figures; the record above is an H200's, and the kernel's row in
# `flashbook bench ch9` (`ch9_bwd_gluon_ws`, its gradients checked at full size against cuDNN's
# before it is timed) is not in it yet.

# %% [markdown]
# On a GPU, the next cell runs the same benchmark on your kernels (a few minutes).

# %% tags=["demo"]
if backend.gpu:
    rows = ch9.when_solved(lambda: ch9.benchmark.run(ns=globals()), "Exercises 1-3")
    print(ch9.benchmark.table(rows) if rows else "")
else:
    print("CPU mode: the benchmark needs a GPU (the interpreter's timings say nothing about one).")

# %% [markdown]
# ## Further reading
#
# - FlashAttention-2 {cite}`dao2023flashattention2`, Section 3.2 and Algorithm 2: the backward
#   this chapter builds, with $D$ and the recomputation from the LSE.
# - FlashAttention {cite}`dao2022flashattention`, Appendix B: the derivation of the gradients.
# - FlashAttention-3 {cite}`shah2024flashattention3`: the Hopper backward, one K/V-stationary
#   kernel whose dQ tiles are added into fp32 by TMA reduce-adds (Section 3's one-kernel design).
# - Triton's fused-attention tutorial {cite}`triton2025tutorials`: a backward in Triton.
