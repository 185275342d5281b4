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
# # Chapter 5: Grouped-query attention
#
# **What you will learn**
# - MHA, GQA and MQA: $h_q = G \cdot h_{kv}$ query heads share $h_{kv}$ K/V heads, and what that
#   saves in KV-cache memory and bandwidth for real models.
# - Prefill with the **M-fold**: the G query heads that share a K/V head fill the rows of one
#   tile, so every K/V tile is loaded once for all of them, for any G (FlashAttention-3's
#   PackGQA: G = 7 or 71 as well as 4 or 8), and why materialising the repeated K/V
#   (`repeat_interleave`) is the mistake to avoid.
# - Decode against a KV cache: why it is memory-bound (its arithmetic intensity on the
#   roofline), and a kernel that reads the cache exactly once, with per-sequence lengths.
# - Paged KV caches as serving systems keep them: a `block_table` of pages and `cache_seqlens`,
#   much as flash-attn's `flash_attn_with_kvcache` defines them (`decode`'s docstring says where
#   it differs); what paging buys and what it costs.
# - Smaller caches still: MLA's latent cache (DeepSeek-V2/V3) and FP8 KV caches, in bytes per
#   token.
#
# **What you need**: Chapter 4 (packed batches, masks, `key_tiles`); torch >= 2.11 and
# triton >= 3.6. Any runtime: on a CPU the kernels run in the Triton interpreter at small sizes,
# and the checks count the K/V tiles your kernels load; a GPU adds the benchmark. About 3-4 hours.
#
# **Exercises** (11 points): (1) the M-fold prefill kernel (3) and, optional, its two-tile
# form (1); (2) the row lookup of a contiguous and a paged cache (2); (3) the decode kernel, on
# both caches (3); (4) the decode wrapper's argument checks (2).

# %%
import flashbook as fb
backend = fb.setup()          # before triton is imported: on CPU it switches on the interpreter
import torch
import triton
import triton.language as tl
from flashbook import reference
from flashbook.cases import host_values, validate_tensor
from flashbook.chapters import ch4, ch5
from flashbook.kernels import attn_step, attn_two_tile_step, key_tiles, program_tile, \
    visible_pairs

# %% [markdown]
# ## 1. Fewer K/V heads
#
# Multi-head attention (MHA) gives every query head its own K and V heads. At inference time the
# K and V of every past token are kept in a **KV cache**, and its size, not the FLOPs, limits the
# batch a GPU can serve: `2 (K and V) x layers x h_kv x d x tokens x 2 bytes` per sequence.
# Grouped-query attention (GQA) {cite}`ainslie2023gqa` lets $G$ query heads share one K/V head,
# $h_q = G \cdot h_{kv}$; multi-query attention (MQA) {cite}`shazeer2019mqa` is the extreme
# $h_{kv} = 1$. Query head $h$ reads K/V head $h \,//\, G$. The table gives the cache of a batch
# of 32 sequences of 8192 tokens for a few open models (their published configurations), beside
# what MHA with the same query heads would need.

# %% tags=["demo"]
print(ch5.kv_table_markdown(tokens=8192, batch=32))

# %% [markdown]
# GQA cuts the cache, and so the bytes a decode step reads, by $G$. The kernel must keep that
# saving: "repeat each K/V head G times and run MHA" (`k.repeat_interleave(G, dim=1)`) gives the
# right numbers but writes and reads G copies of K and V.
#
# ## 2. Prefill: the M-fold
#
# One program per query head would load every K/V tile G times (from L2 if lucky). Instead, one
# program takes one K/V head of one sequence and **folds** the G query heads that share it into
# the rows of its tile. Number the (position, head) pairs of the group position-major, the
# *folded row* `f = position * G + head`, `head` from 0 to G - 1: a sequence of `seqlen_q`
# positions has `seqlen_q * G` of them, and tile `m_block` takes the `BLOCK_M` consecutive ones
# from `f0 = m_block * BLOCK_M`. Row $r$ of the tile is folded row `f = f0 + r`: query head
# `kv_head * G + f % G` at position `f // G`. The scores `tl.dot(q, kT)` then use each K tile
# for G heads at once, and everything of Chapter 4 carries over, row by row: each row loads and
# stores through its own (token, head) pointer, `visible_pairs` masks each row by its own
# position, and the rows past `seqlen_q * G`, the last tile's tail, are the rows whose position
# is past `seqlen_q` (`f < seqlen_q * G` exactly when `f // G < seqlen_q`), masked as in
# Chapter 4. The grid has `cdiv(seqlen_q * G, BLOCK_M)` tiles per (sequence, K/V head).
# FlashAttention-3 calls this **PackGQA** {cite}`shah2024flashattention3`.
#
# Nothing here needs G to divide `BLOCK_M`. When it does (G = 2, 4 or 8, tiles of 16 to 128
# rows), every tile starts at head 0 and holds `BLOCK_M // G` whole positions: the picture
# below. When it does not (Qwen2.5-7B has G = 7, Falcon-7B G = 71, both in the table above), a
# tile may start part-way into a position. The cell after the picture lists the rows for G = 3
# and `BLOCK_M = 8`: tile 0 holds positions 0 and 1 and heads 0 and 1 of position 2; tile 1
# starts at `f0 = 8`, head 2 of position 2 (8 // 3 = 2, 8 % 3 = 2), then holds positions 3
# and 4; its last row, `f = 15`, would be position 5, past the sequence: the tail.
# Position 2 is split between two programs, and nothing needs merging: a row's softmax runs
# over all of its keys inside its one program, whichever tile holds its neighbours. What
# changes is how many positions a tile touches, which `key_tiles` takes as a constant: exactly
# `BLOCK_M // G` when G divides `BLOCK_M`, else at most `(BLOCK_M + G - 2) // G + 1` (4 for
# the example: tile 1's rows run from position 2 to 5, tile 0's from 0 to 2). The kernels take
# that bound as `POS` and `key_tiles` the tile's first position, `m0 = f0 // G`; a tile that
# touches one position fewer may visit one more key tile on its diagonal, whose pairs its
# masks hide.
# Every G runs with no copy of K and V: with Falcon-7B's 71 heads, a tile of 16 rows holds
# part of one position or parts of two.

# %% tags=["demo"]
fig = ch5.plot_mfold(G=4, rows_per_head=4, block_m=16)

# %% tags=["demo"]
# PackGQA for G = 3, BLOCK_M = 8, a sequence of 5 positions: (position, head) of each row of
# each tile, from its folded row f = m_block * BLOCK_M + r; "tail" rows (f >= 5 * 3) are masked
G, BLOCK_M, seqlen = 3, 8, 5
for m_block in range(-(-seqlen * G // BLOCK_M)):
    f = [m_block * BLOCK_M + r for r in range(BLOCK_M)]
    print(f"tile {m_block} (f0 = {f[0]}):", " ".join(
        f"({i // G},{i % G})" if i < seqlen * G else "tail " for i in f))

# %% [markdown]
# The public wrapper checks its arguments first: `validate_gqa` is Chapter 4's `validate_varlen`
# (your Exercise 3 there) with `h_q` a multiple of `h_kv`, taking a `window_size` of NumPy or
# torch integers as well, and bfloat16 on a GPU of compute capability 8.0 or newer
# (`ch5.prefill_dtypes()`: the kernel casts P to V's dtype, so the same code runs in bf16; the
# CPU interpreter's bf16 `tl.dot` is wrong, so the checks grade fp16 and fp32).

# %%
def validate_gqa(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                 window_size=(-1, -1)):
    """Chapter 4's argument checks for a packed batch, with h_q a multiple of h_kv."""
    ch5.validate_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                        window_size, name="attention_gqa")

# %% [markdown]
# **Exercise 1 (3 points).** Write `attn_gqa_kernel`, Chapter 4's masked kernel with the M-fold
# (Chapter 4's pieces are imported from `flashbook.kernels`):
#
# 1. `m_block, pid_bh = program_tile(heads_per_section)`; sequence `pid_bh // H_KV`, K/V head
#    `pid_bh % H_KV`; the tile's folded rows start at `f0 = m_block * BLOCK_M`, its first
#    position is `m0 = f0 // GROUP` (a program whose `m0` is past the sequence returns), and
#    its first head in the group `c = f0 % GROUP`. Write `c` as the constant 0 when `GROUP`
#    divides `BLOCK_M` (`0 if BLOCK_M % GROUP == 0 else f0 % GROUP`): then `r // GROUP` and
#    `r % GROUP` below are known when the kernel compiles, which saves registers.
# 2. Row `r` of the Q tile is folded row `f0 + r = m0 * GROUP + c + r`: position
#    `m0 + (c + r) // GROUP`, query head `kv_head * GROUP + (c + r) % GROUP`. Load Q with
#    those, K and V from the K/V head (token `t` of head `h` of K is at
#    `K + t * stride_kt + h * stride_kh`).
# 3. Chapter 4's three loops over `key_tiles(m0, seqlen_q, seqlen_k, window_left, window_right,
#    POS, BLOCK_N)` (`POS`, the most positions a tile touches, is given), the partial tiles
#    masked with `visible_pairs` of the row positions.
# 4. Store O at (token, query head) and the LSE at `LSE + head * total_q + token`
#    (`(h_q, total_q)`, natural log), rows inside the sequence only; rows without a visible key
#    give O = 0, LSE = -inf.
#
# Then `attention_gqa`, the wrapper (2 lines): the window as the kernel takes it,
# `ch4.window_bounds(window_size, causal, max_seqlen_q, max_seqlen_k)`, and
# `ch5.launch_gqa(attn_gqa_kernel, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
# max_seqlen_k, window=..., scale=softmax_scale, config=config, sections=sections,
# validate=validate_gqa, validate_args=(window_size,))`: the launcher runs `validate_gqa` (given
# above) as Chapter 4's runs your checks, when it meets new metadata. The check runs
# G = 1, 2, 4, 8 and MQA with Chapter 4's causal, windowed and packed cases, and G = 3, whose
# tiles start part-way into a position (the hidden cases add G = 5, 7 and 71), then seeded
# random shapes (G from 1 to 8, lengths next to the edges of the H200's 128-row tile, in CPU
# mode too), and counts the K tiles loaded in CPU mode: each K/V head's tiles exactly once.
# About 40 lines.

# %% nbgrader={"grade": false, "grade_id": "ch5_mfold_kernel", "locked": false, "schema_version": 3, "solution": true, "task": false}
@triton.jit
def attn_gqa_kernel(Q, K, V, O, LSE, CU_Q, CU_K,
                    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                    stride_ot, stride_oh, H_KV, total_q, qk_scale, window_left, window_right,
                    heads_per_section, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """GQA forward with the M-fold. Q, O: (total_q, H_KV * GROUP, HEAD_DIM); K, V: (total_k,
    H_KV, HEAD_DIM); CU_Q, CU_K: int32 (batch + 1,); LSE: (H_KV * GROUP, total_q) float32."""
    # A tile's BLOCK_M rows are BLOCK_M consecutive (position, head) pairs (PackGQA): they
    # touch BLOCK_M // GROUP positions when GROUP divides BLOCK_M, else at most this many (a
    # tile may start part-way into a position's GROUP rows).
    POS: tl.constexpr = BLOCK_M // GROUP if BLOCK_M % GROUP == 0 else \
        (BLOCK_M + GROUP - 2) // GROUP + 1
    ### BEGIN SOLUTION
    m_block, pid_bh = program_tile(heads_per_section)
    seq = pid_bh // H_KV
    kv_head = pid_bh % H_KV
    f0 = m_block * BLOCK_M                                # the tile's first folded row:
    m0 = f0 // GROUP                                      # its position
    # and its head in the group: 0 whenever GROUP divides BLOCK_M, a constant then, which
    # keeps r // GROUP and r % GROUP compile-time values per thread (fewer registers)
    c = 0 if BLOCK_M % GROUP == 0 else f0 % GROUP
    q_start = tl.load(CU_Q + seq)
    seqlen_q = tl.load(CU_Q + seq + 1) - q_start
    if m0 >= seqlen_q:
        return
    k_start = tl.load(CU_K + seq)
    seqlen_k = tl.load(CU_K + seq + 1) - k_start
    r = tl.arange(0, BLOCK_M)                             # folded row f0 + r = m0 * G + c + r
    rows = m0 + (c + r) // GROUP                          # each row's position
    heads = kv_head * GROUP + (c + r) % GROUP             # each row's query head
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + (q_start + rows)[:, None] * stride_qt + heads[:, None] * stride_qh
                + offs_d[None, :], mask=(rows < seqlen_q)[:, None], other=0.0)
    k_ptrs = K + (k_start + offs_n)[None, :] * stride_kt + kv_head * stride_kh + offs_d[:, None]
    v_ptrs = V + (k_start + offs_n)[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :]
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    lo, full_lo, full_hi, hi = key_tiles(m0, seqlen_q, seqlen_k, window_left, window_right,
                                         POS, BLOCK_N)
    for start_n in range(lo, full_lo, BLOCK_N):                       # left band (windows)
        cols = start_n + offs_n
        acc, l_i, m_i = attn_step(acc, l_i, m_i, q, k_ptrs + start_n * stride_kt,
                                  v_ptrs + start_n * stride_vt, cols < seqlen_k,
                                  visible_pairs(rows, cols, seqlen_q, seqlen_k, window_left,
                                                window_right), qk_scale, True, DOT_PRECISION)
    all_keys = offs_n < BLOCK_N
    for start_n in range(full_lo, full_hi, BLOCK_N):                  # full tiles: no masks
        acc, l_i, m_i = attn_step(acc, l_i, m_i, q, k_ptrs + start_n * stride_kt,
                                  v_ptrs + start_n * stride_vt, all_keys, all_keys[None, :],
                                  qk_scale, False, DOT_PRECISION)
    for start_n in range(full_hi, hi, BLOCK_N):                       # diagonal band and tail
        cols = start_n + offs_n
        acc, l_i, m_i = attn_step(acc, l_i, m_i, q, k_ptrs + start_n * stride_kt,
                                  v_ptrs + start_n * stride_vt, cols < seqlen_k,
                                  visible_pairs(rows, cols, seqlen_q, seqlen_k, window_left,
                                                window_right), qk_scale, True, DOT_PRECISION)
    ok = rows < seqlen_q
    has_key = l_i > 0.0
    o = acc / tl.where(has_key, l_i, 1.0)[:, None]
    lse = tl.where(has_key, (m_i + tl.math.log2(l_i)) * 0.6931471805599453, float("-inf"))
    tokens = q_start + rows
    tl.store(O + tokens[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
             o.to(O.dtype.element_ty), mask=ok[:, None])              # write BLOCK_M*d
    tl.store(LSE + heads * total_q + tokens, lse, mask=ok)
    ### END SOLUTION


def attention_gqa(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                  causal=False, window_size=(-1, -1), softmax_scale=None, config=None,
                  sections=None):
    """Packed GQA forward: q (total_q, h_q, d), k and v (total_k, h_kv, d), h_q = G * h_kv.
    Returns O (total_q, h_q, d) and LSE (h_q, total_q)."""
    ### BEGIN SOLUTION
    window = ch4.window_bounds(window_size, causal, max_seqlen_q, max_seqlen_k)
    return ch5.launch_gqa(attn_gqa_kernel, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                          max_seqlen_k, window=window, scale=softmax_scale, config=config,
                          sections=sections, validate=validate_gqa,
                          validate_args=(window_size,))
    ### END SOLUTION

# %% nbgrader={"grade": true, "grade_id": "ch5_mfold_test", "locked": true, "points": 3, "schema_version": 3, "solution": false, "task": false}
ch5.check_gqa_prefill(attention_gqa)
### BEGIN HIDDEN TESTS
ch5.check_gqa_prefill(attention_gqa, hidden=True)
### END HIDDEN TESTS

# %% [markdown]
# For comparison (the benchmark measures it), `attention_gqa_per_head` does what the M-fold
# avoids: it materialises G copies of each K/V head and runs the same kernel with G = 1.

# %%
def attention_gqa_per_head(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           causal=False, window_size=(-1, -1), softmax_scale=None):
    """The same attention with K and V repeated per query head (G times the K/V traffic)."""
    G = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(G, dim=1) for t in (k, v))
    return attention_gqa(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                         causal=causal, window_size=window_size, softmax_scale=softmax_scale)

# %% [markdown]
# **Two query tiles per program.** Chapter 4's fastest kernel gave each program two query tiles
# so that one tile's softmax runs while the other's matmul is on the tensor cores. The M-fold
# combines with it: tile A holds the first half of the program's folded rows, tile B the
# second half. `attention_gqa_two_tiles` runs that kernel, and the benchmark
# measures it beside your one-tile kernel.
#
# Two tiles of 128 rows keep two accumulators of 128 x 128 fp32 values in registers, and an
# H200 thread has at most 255 of them: this kernel lives at the limit, and two details of it
# decide whether it spills to local memory (a compiled kernel's `n_spills` tells). First, it
# keeps only scalar K and V base pointers across the loops and rebuilds each tile's
# `(d, BLOCK_N)` pointer tensor inside them: kept live, the two pointer tensors cost 64
# registers each. Second, `WINDOWED` (a `tl.constexpr` the launcher sets) compiles the masked
# left band out when there is no causal mask and no window, and masks the last tile on its keys
# alone, a `(1, BLOCK_N)` mask instead of two `(BLOCK_M / 2, BLOCK_N)` ones. FlashAttention-2's
# CUDA code makes the same choice with its `Is_causal` and `Is_local` template flags. On an
# H200, the two together took the non-causal kernel from `n_spills` = 22 to 2.
#
# **Exercise 1b (optional, 1 point).** Write `store_folded_rows`, the last step of your
# `attn_gqa_kernel` as a function of the rows' positions and query heads, and
# `attn_gqa_two_tiles`, that kernel with two query tiles of `HALF = BLOCK_M // 2` rows. The
# program takes the `BLOCK_M` folded rows from `f0 = m_block * BLOCK_M`, as your kernel does:
# tile A the first `HALF` of them, tile B the next `HALF` (B's heads are A's only when `GROUP`
# divides `HALF`). Call `key_tiles` once for all `POS` positions from `m0 = f0 // GROUP` and run
# Chapter 4's three loops with `attn_two_tile_step` (imported from `flashbook.kernels`), each
# tile's partial key tiles masked with `visible_pairs` of its own positions; keep the two
# details above (scalar K and V bases; with `WINDOWED` False, the full tiles from key 0 and the
# last tile masked on its keys alone). The check launches your kernel with
# `ch5.launch_gqa(..., two_tiles=True)` on Exercise 1's cases and random shapes, with tiles of
# 2 x 16 and 2 x 32 rows (2 x 64 for the random shapes), and counts the K tiles loaded in CPU
# mode: each K/V head's visible tiles, once for each query tile. Until you write it,
# `attention_gqa_two_tiles` runs your one-tile kernel instead, and says so once. (Chapter 9
# differentiates this kernel from the package's copy of it: it does not need yours.) About 75
# lines, most of them Exercise 1's.

# %% nbgrader={"grade": false, "grade_id": "ch5_two_tiles", "locked": false, "schema_version": 3, "solution": true, "task": false} tags=["export:flashbook.gqa_kernels"]
@triton.jit
def store_folded_rows(O, LSE, acc, l_i, m_i, q_start, rows, heads, seqlen_q, stride_ot,
                      stride_oh, total_q, offs_d):
    """O = acc / l and the LSE of folded rows (position rows[r], query head heads[r])."""
    ### BEGIN SOLUTION
    ok = rows < seqlen_q
    has_key = l_i > 0.0
    o = acc / tl.where(has_key, l_i, 1.0)[:, None]
    lse = tl.where(has_key, (m_i + tl.math.log2(l_i)) * 0.6931471805599453, float("-inf"))
    tokens = q_start + rows
    tl.store(O + tokens[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
             o.to(O.dtype.element_ty), mask=ok[:, None])
    tl.store(LSE + heads * total_q + tokens, lse, mask=ok)
    ### END SOLUTION


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
    ### BEGIN SOLUTION
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
    ### END SOLUTION

# %% nbgrader={"grade": true, "grade_id": "ch5_two_tiles_test", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
ch5.check_gqa_two_tiles(attn_gqa_two_tiles)
### BEGIN HIDDEN TESTS
ch5.check_gqa_two_tiles(attn_gqa_two_tiles, hidden=True)
### END HIDDEN TESTS

# %%
def attention_gqa_two_tiles(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                            causal=False, window_size=(-1, -1), softmax_scale=None, config=None,
                            sections=None):
    """attention_gqa with the two-tile kernel (the one-tile kernel while the two-tile one is
    still a stub)."""
    window = ch4.window_bounds(window_size, causal, max_seqlen_q, max_seqlen_k)
    kernel, two_tiles = ch4.pick_kernel(attn_gqa_two_tiles, attn_gqa_kernel,
                                        "attention_gqa_two_tiles")
    return ch5.launch_gqa(kernel, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                          max_seqlen_k, window=window, scale=softmax_scale, config=config,
                          sections=sections, two_tiles=two_tiles, validate=validate_gqa,
                          validate_args=(window_size,))

# %% [markdown]
# ## 3. Decode: one new token against the cache
#
# At every step of generation each sequence adds one token (or a few, with speculative
# decoding) and attends to its whole cache. Count a decode step for one K/V head: `G x n_new`
# query rows, `context` keys: $4 \cdot G \cdot n_{new} \cdot \text{context} \cdot d$ FLOPs for
# $2 \cdot \text{context} \cdot d \cdot 2$ bytes of K and V. Its arithmetic intensity is
# $G \cdot n_{new}$ FLOPs per byte: 1 for MHA, 4 for G = 4, far left of the ridge point of an
# H200 (about 206 FLOP/byte), so the time is the bytes of the cache over the memory bandwidth.
# The best a decode kernel can do is read the cache once, at the GPU's read bandwidth.

# %% tags=["demo"]
peak = fb.bench.PEAKS["H200"]
fig = ch5.plot_roofline(peak[0], peak[2], ch5.example_points(), gpu="H200 (datasheet)")

# %% [markdown]
# The M-fold is what makes decode use the tensor cores well: with one new token per query head,
# a program's tile would hold one real row of the 16 that `tl.dot` needs (15 rows of padding
# per tile, or a loop of vector products instead). Folding the G heads (times
# the new tokens) gives `G x n_new` rows, padded to 16 (`ch5.decode_block_m`). One program
# takes one (sequence, K/V head) and walks its cache from key 0 to `cache_seqlens[b]`; new
# tokens sit at the end of the cache, so the causal mask is Chapter 4's bottom-right one with
# `N_q = n_new`, `N_k = cache_seqlens[b]`.
#
# **Paged caches.** A serving system does not keep one contiguous `(max_len, h_kv, d)` buffer
# per sequence: it would reserve memory for the longest possible output of every request. It
# keeps a pool of fixed-size **pages** (16 to 256 tokens) and, per sequence, a row of the
# `block_table` `(B, max_pages)` that lists its pages in order {cite}`kwon2023vllm`: no
# fragmentation, memory grows a page at a time, and sequences with a common prefix can share its
# pages. The kernel pays one indirection: key `j` of sequence `b` lives in page
# `block_table[b, j // page_size]`, row `j % page_size` of it. Looking the page up once per
# tile would tie the tile size to the page size (a tile of 128 keys cannot sit in a page of
# 16); looking it up per key lets a tile span pages, and costs little, because the keys of one
# page read the same table entry, from cache. Each tile's loads wait for its lookup, so larger
# tiles pay that wait less often (`ch5.decode_config` takes 128-key tiles on an H200).

# %% tags=["demo"]
table = torch.tensor([[5, 2, 7], [0, 6, -1], [3, 1, 4]], dtype=torch.int32)
fig = ch5.plot_paged_cache(table, torch.tensor([40, 20, 33]), page_size=16, num_pages=8)

# %% [markdown]
# **Exercise 2 (2 points).** Write `cache_rows`: the rows of the cache, viewed as
# `(rows, h_kv, d)`, that hold keys `keys` (a `(BLOCK_N,)` tile of positions) of sequence `b`.
# A contiguous cache `(B, max_len, h_kv, d)` has `rows_per_seq = max_len` rows per sequence; a
# paged cache `(num_pages, page_size, h_kv, d)` has `rows_per_seq = page_size`, and each key's
# page comes from `BLOCK_TABLE` (int32, row stride `stride_bt`). A tile may span several pages
# (128 keys over pages of 16), so look the page up per key, and only for keys below
# `cache_len`: the table's entries past a sequence's last page may be garbage or past its end.
# About 6 lines.

# %% nbgrader={"grade": false, "grade_id": "ch5_cache_rows", "locked": false, "schema_version": 3, "solution": true, "task": false}
@triton.jit
def cache_rows(BLOCK_TABLE, b, keys, cache_len, rows_per_seq, stride_bt, PAGED: tl.constexpr):
    """(BLOCK_N,) rows of the cache holding keys `keys` of sequence b (any row in range for
    keys >= cache_len: the caller masks them)."""
    ### BEGIN SOLUTION
    if PAGED:
        # one table entry per key; keys of a page share it, so these loads hit the cache
        page = tl.load(BLOCK_TABLE + b * stride_bt + keys // rows_per_seq,
                       mask=keys < cache_len, other=0)
        return page * rows_per_seq + keys % rows_per_seq
    else:
        return b * rows_per_seq + keys
    ### END SOLUTION

# %% nbgrader={"grade": true, "grade_id": "ch5_cache_rows_test", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
ch5.check_cache_rows(cache_rows)
### BEGIN HIDDEN TESTS
ch5.check_cache_rows(cache_rows, hidden=True)
### END HIDDEN TESTS

# %% [markdown]
# **Exercise 3 (3 points).** Write `decode_kernel`: program `pid` takes sequence
# `pid // H_KV`, K/V head `pid % H_KV`; row `r` of its tile is query head
# `kv_head * GROUP + r % GROUP` of new token `t = r // GROUP` (rows with `t >= n_new` are
# padding). Q is `(B, n_new, h_q, d)` with strides `stride_qb, stride_qt, stride_qh`; O likewise;
# LSE is `(B, h_q, n_new)`. The cache length is `CACHE_SEQLENS[b]`; run Chapter 4's full and
# partial loops over `key_tiles(0, n_new, cache_len, window_left, window_right, BLOCK_M // GROUP,
# BLOCK_N)` (the left band is empty: decode has no left window here), with the K and V pointers
# from `cache_rows` (`K + rows[None, :] * stride_kt + kv_head * stride_kh + offs_d[:, None]`).
# The check runs a contiguous cache and paged caches with shuffled page tables, pages of 16 to
# 64 keys, tiles that span pages, and NaN in every cache slot past a sequence's length, then
# seeded random problems with the H200's 128-key tile (in CPU mode too; G 1-8, lengths next to
# its edges, contiguous or paged). About 40 lines.

# %% nbgrader={"grade": false, "grade_id": "ch5_decode_kernel", "locked": false, "schema_version": 3, "solution": true, "task": false}
@triton.jit
def decode_kernel(Q, K, V, O, LSE, CACHE_SEQLENS, BLOCK_TABLE,
                  stride_qb, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                  stride_ob, stride_ot, stride_oh, stride_bt, rows_per_seq, H_KV, n_new,
                  qk_scale, window_left, window_right, GROUP: tl.constexpr,
                  PAGED: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Decode with the M-fold: one program per (sequence, K/V head). K, V: the cache as rows
    (rows, H_KV, HEAD_DIM); grid (B * H_KV,)."""
    ### BEGIN SOLUTION
    pid = tl.program_id(0)
    b = pid // H_KV
    kv_head = pid % H_KV
    cache_len = tl.load(CACHE_SEQLENS + b)
    r = tl.arange(0, BLOCK_M)
    t = r // GROUP                                        # new token of each row
    heads = kv_head * GROUP + r % GROUP
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + b * stride_qb + t[:, None] * stride_qt + heads[:, None] * stride_qh
                + offs_d[None, :], mask=(t < n_new)[:, None], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    lo, full_lo, full_hi, hi = key_tiles(0, n_new, cache_len, window_left, window_right,
                                         BLOCK_M // GROUP, BLOCK_N)
    for start_n in range(lo, full_lo, BLOCK_N):                       # left band (windows)
        cols = start_n + offs_n
        rows = cache_rows(BLOCK_TABLE, b, cols, cache_len, rows_per_seq, stride_bt, PAGED)
        acc, l_i, m_i = attn_step(
            acc, l_i, m_i, q, K + rows[None, :] * stride_kt + kv_head * stride_kh + offs_d[:, None],
            V + rows[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :],
            cols < cache_len, visible_pairs(t, cols, n_new, cache_len, window_left, window_right),
            qk_scale, True, DOT_PRECISION)
    all_keys = offs_n < BLOCK_N
    for start_n in range(full_lo, full_hi, BLOCK_N):                  # read the cache once
        rows = cache_rows(BLOCK_TABLE, b, start_n + offs_n, cache_len, rows_per_seq, stride_bt,
                          PAGED)
        acc, l_i, m_i = attn_step(
            acc, l_i, m_i, q, K + rows[None, :] * stride_kt + kv_head * stride_kh + offs_d[:, None],
            V + rows[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :],
            all_keys, all_keys[None, :], qk_scale, False, DOT_PRECISION)
    for start_n in range(full_hi, hi, BLOCK_N):                       # the new tokens' band
        cols = start_n + offs_n
        rows = cache_rows(BLOCK_TABLE, b, cols, cache_len, rows_per_seq, stride_bt, PAGED)
        acc, l_i, m_i = attn_step(
            acc, l_i, m_i, q, K + rows[None, :] * stride_kt + kv_head * stride_kh + offs_d[:, None],
            V + rows[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :],
            cols < cache_len, visible_pairs(t, cols, n_new, cache_len, window_left, window_right),
            qk_scale, True, DOT_PRECISION)
    ok = t < n_new
    has_key = l_i > 0.0
    o = acc / tl.where(has_key, l_i, 1.0)[:, None]
    lse = tl.where(has_key, (m_i + tl.math.log2(l_i)) * 0.6931471805599453, float("-inf"))
    tl.store(O + b * stride_ob + t[:, None] * stride_ot + heads[:, None] * stride_oh
             + offs_d[None, :], o.to(O.dtype.element_ty), mask=ok[:, None])
    tl.store(LSE + (b * H_KV * GROUP + heads) * n_new + t, lse, mask=ok)
    ### END SOLUTION

# %% nbgrader={"grade": true, "grade_id": "ch5_decode_test", "locked": true, "points": 3, "schema_version": 3, "solution": false, "task": false}
ch5.check_decode_kernel(decode_kernel)
### BEGIN HIDDEN TESTS
ch5.check_decode_kernel(decode_kernel, hidden=True)
### END HIDDEN TESTS

# %% [markdown]
# **Exercise 4 (2 points).** Write `validate_decode(q, k_cache, v_cache, cache_seqlens,
# block_table=None)`, the checks of the public `decode` wrapper: return `None` for a valid call
# and raise a `ValueError` that names the offending argument (`q`, `k_cache`, `v_cache`,
# `cache_seqlens` or `block_table`; a message that names more than three arguments does not say
# which one is wrong, and loses the case) for: q not a 4-d `(B, n_new, h_q, d)` tensor, k_cache
# and v_cache of different shapes, or a cache not
# 4-d, of another dtype or device, or with a contiguous last dimension missing (use
# `validate_tensor(label, t, dims=4, dtypes=ch5.DTYPES, name="decode")` for each); `h_q` not a
# multiple of the cache's `h_kv`, or another head dimension, or one not in `ch5.HEAD_DIMS`;
# `cache_seqlens` not a 1-d int32 tensor of B lengths on q's device, or a length below
# `n_new` or above what the cache holds (`max_len`, or `max_pages * page_size`); for a
# contiguous cache, another batch size; for a paged cache, a `block_table` that is not a 2-d
# int32 `(B, max_pages)` tensor, a page size that is not a multiple of 16, or an entry a
# sequence uses (its first `cdiv(length, page_size)` pages) outside `[0, num_pages)` (entries
# past those are not read: serving engines leave them -1, a valid call). Read the
# values of `cache_seqlens` and `block_table` with `host_values(t)`, as in Chapter 4's Exercise
# 3: once per tensor, and `None` while a CUDA graph is captured or on a GPU's hot path outside
# the graded checks and `flashbook.check_values()` (skip those checks then; the check calls
# your function once as if capturing). About 30 lines.

# %% nbgrader={"grade": false, "grade_id": "ch5_validate", "locked": false, "schema_version": 3, "solution": true, "task": false}
def validate_decode(q, k_cache, v_cache, cache_seqlens, block_table=None):
    """Raise a ValueError naming the argument if these do not describe a decode step."""
    ### BEGIN SOLUTION
    name = "decode"
    for label, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        validate_tensor(label, t, dims=4, dtypes=ch5.DTYPES, name=name)
    if not q.dtype == k_cache.dtype == v_cache.dtype or \
            not q.device == k_cache.device == v_cache.device:
        raise ValueError(f"{name}: q, k_cache and v_cache must share a dtype and a device.")
    B, n_new, h_q, d = q.shape
    rows_per_seq, h_kv = k_cache.shape[1], k_cache.shape[2]
    if d not in ch5.HEAD_DIMS:
        raise ValueError(f"{name}: q's head dimension d={d} is not one of {ch5.HEAD_DIMS}: "
                         f"{ch5.HEAD_DIMS_WHY}.")
    if v_cache.shape != k_cache.shape or k_cache.shape[3] != d or h_q % h_kv:
        raise ValueError(f"{name}: k_cache {tuple(k_cache.shape)} and v_cache "
                         f"{tuple(v_cache.shape)} must match, with q's head dimension d={d} and "
                         f"h_kv dividing h_q={h_q}.")
    if not isinstance(cache_seqlens, torch.Tensor) or cache_seqlens.dtype != torch.int32 or \
            tuple(cache_seqlens.shape) != (B,) or cache_seqlens.device != q.device:
        raise ValueError(f"{name}: cache_seqlens must be a ({B},) torch.int32 tensor on "
                         f"{q.device}.")
    if block_table is None:
        if k_cache.shape[0] != B:
            raise ValueError(f"{name}: k_cache holds {k_cache.shape[0]} sequences, q {B}.")
        capacity = rows_per_seq
    else:
        if not isinstance(block_table, torch.Tensor) or block_table.dtype != torch.int32 or \
                block_table.dim() != 2 or block_table.shape[0] != B or \
                block_table.device != q.device:
            raise ValueError(f"{name}: block_table must be a 2-d torch.int32 (B={B}, max_pages) "
                             f"tensor on {q.device}.")
        if rows_per_seq % 16:
            raise ValueError(f"{name}: the page size (k_cache.shape[1] = {rows_per_seq}) must be "
                             "a multiple of 16.")
        capacity = block_table.shape[1] * rows_per_seq
    lengths = host_values(cache_seqlens)    # None while captured, or on a GPU's hot path
    if lengths is None:
        return
    if min(lengths, default=n_new) < n_new or max(lengths, default=0) > capacity:
        raise ValueError(f"{name}: cache_seqlens must lie in [n_new={n_new}, {capacity}] (the "
                         f"cache's capacity), got {list(lengths[:8])}.")
    if block_table is not None:
        for b, (row, n) in enumerate(zip(host_values(block_table), lengths)):
            used = row[:-(-n // rows_per_seq)]
            if any(not 0 <= p < k_cache.shape[0] for p in used):
                raise ValueError(f"{name}: block_table row {b} uses pages {used}, outside "
                                 f"[0, {k_cache.shape[0]}).")
    ### END SOLUTION

# %% nbgrader={"grade": true, "grade_id": "ch5_validate_test", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
ch5.check_validate_decode(validate_decode)
### BEGIN HIDDEN TESTS
ch5.check_validate_decode(validate_decode, hidden=True)
### END HIDDEN TESTS

# %%
def decode(q, k_cache, v_cache, cache_seqlens, block_table=None, softmax_scale=None,
           causal=True):
    """Decode: the new tokens q (B, n_new, h_q, d) attend to the first cache_seqlens[b] keys of
    a contiguous (B, max_len, h_kv, d) or paged (pages, page_size, h_kv, d) cache. Returns O
    (B, n_new, h_q, d) and LSE (B, h_q, n_new).

    Where it differs from flash-attn's flash_attn_with_kvcache: the new tokens' keys and values
    must already be in the cache (it appends nothing), so cache_seqlens counts them
    (cache_seqlens[b] >= n_new; flash-attn's counts the keys before the new tokens), and causal
    defaults to True (flash-attn's to False; with one new token it changes nothing)."""
    return ch5.launch_decode(decode_kernel, q, k_cache, v_cache, cache_seqlens, block_table,
                             causal=causal, scale=softmax_scale, validate=validate_decode)

# %% tags=["demo"]
# Paged and contiguous caches give the same answer; a page table entry out of range is refused.
B, n_new, h_q, h_kv, d, page = 3, 2, 8, 2, 32, 16
lengths = torch.tensor([40, 2, 33], dtype=torch.int32, device=backend.device)
q = torch.randn(B, n_new, h_q, d, device=backend.device)
k_cache, v_cache = (torch.randn(B, 48, h_kv, d, device=backend.device) for _ in range(2))
try:
    o, _ = decode(q, k_cache, v_cache, lengths)
    k_pages, v_pages, table = ch5.paged_cache(k_cache, v_cache, page)
    o_paged, _ = decode(q, k_pages, v_pages, lengths, table.to(backend.device))
    print(f"max |O_paged - O_contiguous| = {(o_paged - o).abs().max().item():.1e}")
    with fb.check_values():     # a GPU checks the table's values only on request (a sync)
        decode(q, k_pages, v_pages, lengths, table.to(backend.device) + 100)
except ValueError as e:
    print(f"ValueError: {e}")
except NotImplementedError:
    print("Finish Exercises 2-4 to run the decode wrapper.")

# %% [markdown]
# **Batch 1.** One program per (sequence, K/V head) gives a batch of one long sequence only
# `h_kv` programs, 8 of an H200's 132 SMs: a decode step then uses a few percent of the GPU's
# bandwidth. The cure is to split each sequence's keys across programs and merge the partial
# softmax states (Chapter 3's merge), which is Chapter 8's split-KV.

# %% [markdown]
# ## 4. Benchmark
#
# `flashbook bench ch5` measures the chapter's solution on an H200: the prefill at
# `(1, h_q=32, h_kv=8, N=16384, d=128)` against SDPA with `enable_gqa=True` on every backend that
# takes it, cuDNN on K/V expanded to 32 heads and FlexAttention with GQA; and the decode step of
# 32 sequences of 8192 cached tokens against cuDNN, FlashAttention-2 and FlexAttention, with the
# GPU's read ceiling (`hbm_read`, a large `x.sum()`) and a device-to-device copy measured in the
# same run. Decode rows report the bytes of K and V read per second.

# %% tags=["demo"]
from flashbook import results
recorded = results.recorded("ch5", "h200")
if recorded:
    print(ch5.summary(recorded.rows))
    fig = ch5.plot_recorded(recorded.rows)
    fig = ch5.plot_roofline(peak[0], peak[2], ch5.measured_points(recorded.rows),
                            gpu="H200: measured kernels (stars)")
else:
    print("No recorded H200 benchmark found.")

# %% tags=["remove-cell"]
# The figures the prose quotes, from the recorded H200 data: the book pastes each into its
# glue:text role (myst-nb's glue); elsewhere this does nothing.
from flashbook import quoted
quoted.glue(ch5.CHAPTER)

# %% [markdown]
# ## 5. Smaller caches still: MLA's latent cache and FP8
#
# GQA shrinks the cache by sharing K/V heads. Multi-head latent attention (MLA), DeepSeek-V2's
# and DeepSeek-V3's attention {cite}`deepseek2024v2,deepseek2024v3`, shrinks it by caching
# something smaller than any head: per token and layer, one compressed **latent** $c$ of 512
# values, shared by all 128 query heads, and one **decoupled RoPE key** $k^R$ of 64 values,
# also shared. Each head's key and value are up-projections of the latent,
# $k_h = W^{UK}_h c$ and $v_h = W^{UV}_h c$ (128 values each, plus the RoPE part for the key),
# but decode never forms them. The up-projection is absorbed into the query: a score
# $q_h^\top k_h = (W^{UK\top}_h q_h)^\top c$, so each head's query becomes a 512-value latent
# query, and with its 64 RoPE values the score is one dot product of 576 values against the
# cached $[c, k^R]$. The values are the latents themselves (the first 512 of those 576), and
# $W^{UV}_h$ is applied to each head's output after attention (folded into the output
# projection). Decode is then MQA with G = 128 query heads (fewer per GPU when heads are split
# across GPUs), keys of d = 576 and values of 512: this chapter's M-fold decode with one K/V
# head, wider heads, and V a slice of K. (The chapter's kernels take head dimensions that are
# powers of two, and 576 is not one: a kernel for it tiles the head dimension in pieces, 512
# and 64 say; DeepSeek's FlashMLA is such a decode kernel.) The cell computes the cache per
# token and layer at DeepSeek-V3's shapes (61 layers, 128 heads; its heads' keys are 128 + 64
# values wide, its values 128) in bf16, beside MHA with the same heads and a GQA of 8 K/V heads
# of 128.

# %% tags=["demo"]
# KV cache per token: values per layer, bytes per layer (bf16: 2 bytes a value; FP8: 1), and
# over DeepSeek-V3's 61 layers
layers, heads, nope, rope, v_dim, latent = 61, 128, 128, 64, 128, 512
caches = [("MHA, 128 heads (K 128 + 64, V 128)", heads * (nope + rope + v_dim), 2),
          ("GQA, 8 K/V heads of 128", 2 * 8 * 128, 2),
          ("MLA, latent 512 + RoPE key 64", latent + rope, 2),
          ("MLA in FP8 (e4m3)", latent + rope, 1)]
mha = caches[0][1] * caches[0][2]
print(f"{'cache':36} {'values':>7} {'bytes/layer':>12} {'KiB/token':>10} {'vs MHA':>7}")
for name, values, nbytes in caches:
    per_layer = values * nbytes
    print(f"{name:36} {values:7d} {per_layer:12,d} {per_layer * layers / 1024:10.1f} "
          f"{mha / per_layer:6.0f}x")

# %% [markdown]
# **FP8 KV caches.** The other lever is the bytes per value. A serving engine can store K and V
# (or MLA's latent) in float8 `e4m3` (4 exponent bits, 3 mantissa bits, largest value 448)
# with a scale per tensor or per K/V head, set by calibration or from the values' running
# maximum: the kernel loads the FP8 tile, converts it and multiplies by the scale (or folds
# the scale into the scores and the output), and the rest is this chapter's decode. That halves
# the cache again against bf16 (the last row above), and so, decode being memory-bound, about
# halves a decode step, at the cost of precision (3 mantissa bits against bf16's 7). vLLM's
# `kv_cache_dtype="fp8"` and FlashAttention-3's FP8 forward with per-(sequence, K/V head)
# descaling factors are two implementations. GQA, MLA and FP8 multiply: what a decode step
# reads is the cache, and each of them shrinks it.

# %% [markdown]
# ## What was measured, and what is left
#
# One run of `flashbook bench ch5` on an H200 (provenance in
# `src/flashbook/data/bench/ch5/h200.json`), every kernel row timed from a CUDA graph. Beside
# each of the chapter's functions, `attention_gqa_two_tiles` and `decode`, a row times the call
# as you make it (its checks on, no config, launched), and the figures quoted for them are those
# calls'. **Decode** is where GQA pays: `decode(q, k_cache, v_cache, cache_seqlens)`
# reads K and V at {glue:text}`ch5_decode_gbps:.0f` GB/s, {glue:text}`ch5_decode_vs_cudnn:.2f`x
# cuDNN ({glue:text}`ch5_cudnn_gbps:.0f`) for 32 sequences of 8192 keys,
# {glue:text}`ch5_decode_pct_datasheet:.0f` % of the H200's 4.8 TB/s datasheet figure (its kernel
# alone, replayed from a CUDA graph, {glue:text}`ch5_decode_kernel_gbps:.0f` GB/s).
# The step is a quarter of a millisecond, and the difference is the launch, not the checks:
# launched without them (`python -m flashbook.overhead`) the kernel takes as long as the call.
# A CUDA graph of the model's whole decode step removes it. For comparison,
# `x.sum()` over 4 GiB reaches {glue:text}`ch5_hbm_read_gbps:.0f` GB/s
# in the same run, so a reduction is not the ceiling it was meant to be: an attention decode
# that streams K and V through shared memory reads faster. Paged caches with
# pages of 256 and 64 keys read at {glue:text}`ch5_paged_256_gbps:.0f` and
# {glue:text}`ch5_paged_64_gbps:.0f` GB/s, {glue:text}`ch5_paged_256_vs_contiguous:.2f`x and
# {glue:text}`ch5_paged_64_vs_contiguous:.2f`x
# the contiguous cache: with a page lookup per key and 128-key tiles, paging costs almost
# nothing. **Prefill**: `attention_gqa_two_tiles` reaches {glue:text}`ch5_tflops_causal:.0f`
# TFLOP/s causal and {glue:text}`ch5_tflops_noncausal:.0f` non-causal,
# {glue:text}`ch5_vs_best_causal:.2f`x and {glue:text}`ch5_vs_best_noncausal:.2f`x the fastest
# baseline (cuDNN, on K/V expanded to 32 heads, a little ahead of cuDNN with `enable_gqa`), well
# ahead of the FlashAttention-2 backend ({glue:text}`ch5_flash_tflops:.0f` causal) and
# FlexAttention ({glue:text}`ch5_flex_tflops:.0f`); the one-tile kernel of Exercise 1 reaches
# {glue:text}`ch5_mfold_tflops_causal:.0f` and {glue:text}`ch5_mfold_tflops_noncausal:.0f`.
# Against that one-tile kernel on K/V repeated per query head, the M-fold's saving in prefill
# time is modest, because prefill is bound by the tensor cores, not by memory: the repeated
# heads are read G times, but neighbouring programs read the same copy, mostly from L2, and
# materialising the repeated K/V costs {glue:text}`ch5_repeat_cost:.2f`x
# in time here, and G times the memory. In decode, where memory is the bound, the M-fold is
# the whole game. **Batch 1**: one program per (sequence, K/V head) is 8 programs for a single
# sequence, and one sequence of 131072 keys reads at {glue:text}`ch5_b1_gbps:.0f` GB/s, where
# cuDNN reaches {glue:text}`ch5_b1_cudnn_gbps:.0f`
# by splitting the keys across programs: Chapter 8's split-KV.
#
# **Further reading**
# * GQA {cite}`ainslie2023gqa` and MQA {cite}`shazeer2019mqa`.
# * PagedAttention and vLLM {cite}`kwon2023vllm`: the paged KV cache.
# * FlashAttention-3 {cite}`shah2024flashattention3`: PackGQA, the fold of Section 2 for any G.
# * DeepSeek-V2 {cite}`deepseek2024v2` and DeepSeek-V3 {cite}`deepseek2024v3`: multi-head
#   latent attention and its cache.
# * FlashAttention-2 {cite}`dao2023flashattention2`: `flash_attn_with_kvcache`, the decode
#   interface this chapter follows (with the new tokens already in the cache).
