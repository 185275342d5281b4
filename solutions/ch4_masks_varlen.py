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
# # Chapter 4: Varlen and causal masking
#
# **What you will learn**
# - Why real batches are *packed*: sequences of different lengths laid end to end in one
#   `(total_tokens, H, d)` tensor, described by `cu_seqlens` (flash-attn's "varlen" layout),
#   and how much work padding every sequence to the longest one wastes.
# - How a program of a FlashAttention kernel finds its sequence and its tile in a packed batch.
# - Causal masking with the book's convention: aligned **bottom-right** when `N_q != N_k`, and a
#   row that sees no key gives `O = 0`, `LSE = -inf`, never NaN (the log of an empty sum;
#   flash-attn stores `+inf` there instead, so that its backward's `exp(S - LSE)` is 0, and
#   Chapter 9 turns `-inf` into `+inf` where it needs that). Sliding-window (local)
#   attention, `window_size = (left, right)`, as the same mechanism.
# - **Block skipping**: tiles that are wholly masked are never loaded, tiles that are wholly
#   visible run without any mask arithmetic, and only the diagonal band pays for the mask. The
#   same full / partial classification that PyTorch's FlexAttention stores in its `BlockMask`.
# - Causal load balance: launching the longest rows first.
#
# **What you need**: Chapter 3 (the Triton forward, `attn_scores` / `attn_update`);
# torch >= 2.11 and triton >= 3.6. Any runtime: on a CPU the kernels run in the Triton
# interpreter at small sizes, and the checks *count* the tiles your kernel loads; a GPU adds the
# benchmark. About 3-4 hours.
#
# **Exercises** (11 points): (1) the varlen forward: each program finds its sequence in a packed
# batch (3); (2) causal and windowed masks with block skipping, in two cells: the mask and the
# tile range, checked on their own (2), and the kernel, whose loads are counted (3); (3) the
# public wrapper's argument checks, so a bad `cu_seqlens` is a clear `ValueError`, never a
# crash or a silent wrong answer (2); (4), optional, the fast form of the masked kernel, with
# two query tiles per program (1).

# %%
import flashbook as fb
backend = fb.setup()          # before triton is imported: on CPU it switches on the interpreter
import torch
import triton
import triton.language as tl
from flashbook import reference
from flashbook.cases import as_window, host_values, validate_tensor
from flashbook.chapters import ch4

# %% [markdown]
# ## 1. Padded and packed batches
#
# A batch of chat requests or documents never has one length. The simple layout pads every
# sequence to the longest, `(B, H, N_max, d)`, and masks the padding. Attention costs
# $O(N^2)$ per sequence, so padding wastes *pairs*, not just tokens: a batch with one sequence of
# 16384 tokens and many of a few hundred computes $B \cdot N_{\max}^2$ scores where
# $\sum_b N_b^2$ are real. The cell below draws a fixed-seed, long-tailed (lognormal) mix of
# lengths that adds up to 65536 tokens, the mix this chapter's benchmark uses.

# %% tags=["demo"]
lengths = ch4.lognormal_lengths(65536, seed=0)
stats = ch4.padding_stats(lengths)
print({k: (round(v, 2) if isinstance(v, float) else v) for k, v in stats.items()})
fig = ch4.plot_padding(lengths)

# %% [markdown]
# The **packed** ("varlen") layout removes the padding. flash-attn's `flash_attn_varlen_func`
# defines it, and this chapter keeps its names:
#
# * `q` is `(total_q, H, d)`: the sequences' query tokens end to end; `k`, `v` are
#   `(total_k, H, d)`.
# * `cu_seqlens_q` is int32, of length `batch + 1`, starting at 0: sequence `b` owns rows
#   `cu_seqlens_q[b] : cu_seqlens_q[b+1]` (the cumulative sum of the lengths, hence "cu").
#   `cu_seqlens_k` does the same for the keys; a sequence may have `N_q != N_k` (a chunk of new
#   queries attending to a longer cache), and a length may be 0.
# * `max_seqlen_q`, `max_seqlen_k` are the longest lengths, as plain ints. The kernel's grid
#   needs `max_seqlen_q` *before* it runs, and reading it from a GPU tensor would stall the
#   CPU, so the caller, who knows it, passes it.
# * O comes back as `(total_q, H, d)` and LSE as `(H, total_q)`, float32, natural log.
#
# A dense batch `(B, N, H, d)` is the packed batch `q.view(B * N, H, d)` with
# `cu_seqlens = [0, N, 2N, ...]`: one kernel serves both.
#
# **Finding the work.** The grid has one program per (query tile, sequence and head), and the
# given `program_tile` tells a program which: `m_block, pid_bh = program_tile(heads_per_section)`
# (what `heads_per_section` is for, and why tiles are counted from the end, is Section 4's
# subject). A program reads its sequence's start and length from `cu_seqlens` (two loads), and a
# program whose tile starts past its sequence's end simply returns; those programs cost a few
# hundred cycles each. The picture below shows which (program, key tile) pairs a packed batch visits and
# what padding would add.

# %% tags=["demo"]
fig = ch4.plot_varlen_tiles([300, 40, 180, 96], block_m=32, block_n=32, causal=True)

# %% [markdown]
# ## 2. Chapter 3's loop body, with a mask
#
# The loop body is Chapter 3's `attn_scores` and `attn_update`, with one change: a masked tile
# takes a `visible` block, `(BLOCK_M, BLOCK_N)` booleans, instead of assuming that every key
# before `N_k` is visible. That brings a case Chapter 3 never met: a row can see *no* key in a
# tile while its running maximum is still $-\infty$ (the first tiles of a sliding window's band
# are like that for most of their rows). Then $m' = -\infty$, and $e^{s - m'}$ would be
# $e^{-\infty - (-\infty)} = $ NaN. The update takes its exponents from 0 in that case: every
# $p$ is $e^{-\infty} = 0$, and the row stays at $(m, l) = (-\infty, 0)$, as it should. The full
# tiles (`MASKED=False`) need none of this: the compiler drops every mask operation.

# %% tags=["export:flashbook.kernels"]
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

# %% [markdown]
# **Exercise 1 (3 points).** Write `attn_varlen_kernel`, the varlen forward without masks
# (every key of a sequence is visible to every query of the same sequence), and
# `attn_store_rows`, its last step, which the kernels of Exercise 2 reuse:
#
# 1. `m_block, pid_bh = program_tile(heads_per_section)`: the program takes sequence
#    `pid_bh // H`, head `pid_bh % H`, query rows `m0 + [0, BLOCK_M)` of that sequence with
#    `m0 = m_block * BLOCK_M`.
#    Read the sequence's start and length of queries from `CU_Q` and of keys from `CU_K`;
#    return at once if `m0` is past the end.
# 2. Token `t` of head `h` of `Q` is at `Q + t * stride_qt + h * stride_qh` (the last dimension
#    is contiguous; likewise K, V, O, each with its own strides: the check passes K and V as
#    the two halves of one `(total_k, 2, H, d)` tensor, as a fused KV projection makes them,
#    and a case whose every score is -96000, below any finite start of the running max).
#    Load the Q tile (masked to the sequence), then run
#    `attn_step` over the full K/V tiles and the one masked tail tile, exactly as Chapter 3's
#    loop did, but with the sequence's start and length.
# 3. `attn_store_rows` writes `O = acc / l` and the LSE (natural log) of the rows inside the
#    sequence: O at token `q_start + row`, LSE at `LSE + h * total_q + q_start + row` (`LSE` is a
#    contiguous `(H, total_q)` float32 buffer). A row with `l = 0` (a sequence with no keys)
#    gives `O = 0` and `LSE = -inf`.
#
# The check packs sequences of lengths 0, 1, tile multiples and not, with `N_q != N_k`, and puts
# a *canary* sequence of NaN between every two real ones: a kernel that reads one key past its
# sequence reads NaN, and the check says which sequence leaked. It then runs seeded random
# shapes with the H200's tile of 128 x 64 (in CPU mode too), lengths next to its edges: a few
# queries against many keys in a tall tile is where tile-range bugs hide. About 35 lines.

# %% nbgrader={"grade": false, "grade_id": "ch4_varlen_kernel", "locked": false, "schema_version": 3, "solution": true, "task": false}
@triton.jit
def attn_store_rows(O, LSE, acc, l_i, m_i, q_start, rows, seqlen_q, h, stride_ot, stride_oh,
                    total_q, offs_d):
    """Write O = acc / l and LSE = (m + log2 l) * ln 2 for the rows < seqlen_q of one tile."""
    ### BEGIN SOLUTION
    ok = rows < seqlen_q
    has_key = l_i > 0.0
    o = acc / tl.where(has_key, l_i, 1.0)[:, None]
    lse = tl.where(has_key, (m_i + tl.math.log2(l_i)) * 0.6931471805599453, float("-inf"))
    tokens = q_start + rows
    tl.store(O + tokens[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
             o.to(O.dtype.element_ty), mask=ok[:, None])              # write BLOCK_M*d
    tl.store(LSE + h * total_q + tokens, lse, mask=ok)
    ### END SOLUTION


@triton.jit
def attn_varlen_kernel(Q, K, V, O, LSE, CU_Q, CU_K,
                       stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                       stride_ot, stride_oh, H, total_q, qk_scale, heads_per_section,
                       HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       DOT_PRECISION: tl.constexpr):
    """Varlen forward, no mask. Q, O: (total_q, H, HEAD_DIM); K, V: (total_k, H, HEAD_DIM);
    CU_Q, CU_K: int32 (batch + 1,); LSE: (H, total_q) float32.
    Grid: (cdiv(max_seqlen_q, BLOCK_M), batch * H)."""
    ### BEGIN SOLUTION
    m_block, pid_bh = program_tile(heads_per_section)
    seq = pid_bh // H
    h = pid_bh % H
    m0 = m_block * BLOCK_M
    q_start = tl.load(CU_Q + seq)
    seqlen_q = tl.load(CU_Q + seq + 1) - q_start
    if m0 >= seqlen_q:                                                # past this sequence
        return
    k_start = tl.load(CU_K + seq)
    seqlen_k = tl.load(CU_K + seq + 1) - k_start
    rows = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + (q_start + rows)[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                mask=(rows < seqlen_q)[:, None], other=0.0)           # read BLOCK_M*d, once
    k_ptrs = K + (k_start + offs_n)[None, :] * stride_kt + h * stride_kh + offs_d[:, None]
    v_ptrs = V + (k_start + offs_n)[:, None] * stride_vt + h * stride_vh + offs_d[None, :]
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    all_keys = offs_n < BLOCK_N
    n_full = (seqlen_k // BLOCK_N) * BLOCK_N
    for start_n in range(0, n_full, BLOCK_N):                         # full tiles: no masks
        acc, l_i, m_i = attn_step(acc, l_i, m_i, q, k_ptrs + start_n * stride_kt,
                                  v_ptrs + start_n * stride_vt, all_keys, all_keys[None, :],
                                  qk_scale, False, DOT_PRECISION)
    if n_full < seqlen_k:                                             # the one tail tile
        kv_ok = n_full + offs_n < seqlen_k
        acc, l_i, m_i = attn_step(acc, l_i, m_i, q, k_ptrs + n_full * stride_kt,
                                  v_ptrs + n_full * stride_vt, kv_ok, kv_ok[None, :],
                                  qk_scale, True, DOT_PRECISION)
    attn_store_rows(O, LSE, acc, l_i, m_i, q_start, rows, seqlen_q, h, stride_ot, stride_oh,
                    total_q, offs_d)
    ### END SOLUTION

# %% nbgrader={"grade": true, "grade_id": "ch4_varlen_test", "locked": true, "points": 3, "schema_version": 3, "solution": false, "task": false}
ch4.check_varlen_kernel(attn_varlen_kernel)
### BEGIN HIDDEN TESTS
ch4.check_varlen_kernel(attn_varlen_kernel, hidden=True)
### END HIDDEN TESTS

# %% [markdown]
# ## 3. Causal masks, bottom-right, and sliding windows
#
# A causal mask lets query $i$ see key $j$ only if $j$ is not in its future. When $N_q = N_k$
# that is $j \le i$. When they differ, the question is where the queries sit in time. The book
# follows flash-attn (since 2.1) and `torch.nn.attention.bias.causal_lower_right`: the queries
# are the **last** $N_q$ positions of the key sequence, so the mask is aligned to the
# bottom-right corner:
#
# $$\text{query } i \text{ sees key } j \iff j \le i + (N_k - N_q).$$
#
# With $N_q = 2$, $N_k = 5$ (two new tokens after a cache of three), query 0 is position 3 and
# sees keys 0..3; query 1 sees all five. Aligned top-left, query 0 would see only key 0: the
# wrong answer for every decoding step. With $N_q > N_k$ the first $N_q - N_k$ queries see no
# key at all, and by the book's convention give $O = 0$, $\text{LSE} = -\infty$.
#
# A **sliding window** `window_size = (left, right)` (flash-attn's definition; negative means
# unlimited) keeps the keys within `left` positions before and `right` after the query's
# diagonal position $i + N_k - N_q$:
#
# $$i + N_k - N_q - \text{left} \;\le\; j \;\le\; i + N_k - N_q + \text{right}.$$
#
# Causal is the window $(\infty, 0)$, no mask is $(\infty, \infty)$: the kernels take one
# `(window_left, window_right)` pair of non-negative ints, with "unlimited" replaced by a bound
# no sequence reaches (`ch4.window_bounds`).

# %% tags=["demo"]
print("causal, N_q=2, N_k=5, bottom-right:\n", reference.visible_mask(2, 5, causal=True).int())
print("window (2, 0), N_q=N_k=6:\n", reference.visible_mask(6, 6, window=(2, 0)).int())

# %% [markdown]
# ## 4. Skipping what is masked
#
# A masked kernel could simply apply the mask to every tile. For a long causal sequence half of
# those tiles are entirely in the future: loading and multiplying them is wasted work, half of
# the kernel's time. Sort the key tiles of one program (query rows `m0 .. m0 + BLOCK_M - 1`)
# into three kinds:
#
# * **skipped**: no (row, key) pair is visible. Never loaded.
# * **full**: every pair is visible. No mask arithmetic at all (`MASKED=False`).
# * **partial**: some pairs are visible. Loaded, and masked with `visible`.
#
# For a window the visible keys of row $i$ are one interval, and both of its ends move right by
# one key per row, so the tiles a program visits are one range `[lo, hi)`, with the full tiles
# a range `[full_lo, full_hi)` inside it: a band of partial tiles on the left (windows only),
# the full tiles, and a band of partial tiles on the right (the diagonal, and the tail of the
# sequence). The program's first row fixes `lo`; its last row fixes `hi`; a tile is full when it
# is visible to the *last* row's left edge and the *first* row's right edge. FlexAttention's
# `BlockMask` stores exactly this classification per (query block, key block), computed once
# from a `mask_mod`; here it is three integers computed in the kernel.
#
# **Load balance, and the L2 cache.** Under a causal mask the last query tile of a sequence
# visits every key tile and the first visits one. Launched in order, the long programs would
# start last and the GPU would end the kernel waiting for a few of them, so the kernels walk the
# tiles from the end: the longest rows start first and the shortest end the kernel
# (longest-processing-time-first scheduling). But *which* programs run at the same time also
# decides what the L2 cache holds. If every head's last tile ran first, the 132 programs in
# flight on an H200 would read the K and V of all 16 heads at once, 128 MB at N = 16384, far
# more than the H200's 60 MiB of L2, and each program would fetch them from HBM again. So the grid
# walks **sections**: `heads_per_section` (sequence, head) pairs whose K and V fit in half the
# L2 (`ch4.heads_per_section` picks the number), all their tiles from the longest to the
# shortest, then the next section. `program_tile` decodes the program id: the grid is
# `(n_tiles * heads_per_section, batch * H // heads_per_section)`, and its first axis varies
# fastest in launch order. With one pair per section the order favours L2 alone, with every
# pair in one section it is pure longest-first; the benchmark measures both.

# %% tags=["demo"]
fig = ch4.plot_tile_visits([
    dict(title="causal, N=1024", seqlen_q=1024, seqlen_k=1024, causal=True),
    dict(title="causal, N_q=2, N_k=5 (tiles of 1)", seqlen_q=2, seqlen_k=5, causal=True,
         block_m=1, block_n=1),
    dict(title="window (256, 0), N=2048", seqlen_q=2048, seqlen_k=2048, window=(256, 0),
         block_m=128, block_n=128),
    dict(title="varlen, causal", seqlen_q=[300, 40, 180, 96], seqlen_k=[300, 40, 180, 96],
         causal=True, block_m=32, block_n=32),
], block_m=64, block_n=64)

# %% [markdown]
# **Exercise 2a (2 points).** Write the two functions every masked kernel is built on:
#
# * `visible_pairs(rows, cols, seqlen_q, seqlen_k, window_left, window_right)`: the
#   `(BLOCK_M, BLOCK_N)` mask of Section 3 for query rows `rows` and keys `cols` (indices within
#   the sequence), with keys past `seqlen_k` invisible.
# * `key_tiles(m0, seqlen_q, seqlen_k, window_left, window_right, BLOCK_M, BLOCK_N)` returns
#   `(lo, full_lo, full_hi, hi)` for the rows `m0 .. m0 + BLOCK_M - 1`: the program visits the
#   tiles starting at `lo, lo + BLOCK_N, ...` up to `hi` (exclusive, not a multiple of
#   `BLOCK_N` in general); the tiles starting in `[full_lo, full_hi)` are full; the others are
#   partial. `lo`, `full_lo` and `full_hi` are multiples of `BLOCK_N` with
#   `lo <= full_lo <= full_hi <= max(lo, hi)`; with no full tile, return `full_lo = full_hi =
#   lo`; with nothing visible, `hi <= lo`. Every tile you return must contain a visible pair
#   of a row `< seqlen_q` (the check counts them). `tl.maximum`, `tl.minimum`, `tl.where` and
#   integer `//` work on these scalars. About 15 lines in all.

# %% nbgrader={"grade": false, "grade_id": "ch4_masks", "locked": false, "schema_version": 3, "solution": true, "task": false} tags=["export:flashbook.kernels"]
@triton.jit
def visible_pairs(rows, cols, seqlen_q, seqlen_k, window_left, window_right):
    """(BLOCK_M, BLOCK_N) bool: may query row rows[i] see key cols[j]? (bottom-right aligned)"""
    ### BEGIN SOLUTION
    diag = rows[:, None] + (seqlen_k - seqlen_q)                      # the row's own position
    return (cols[None, :] < seqlen_k) & (cols[None, :] >= diag - window_left) \
        & (cols[None, :] <= diag + window_right)
    ### END SOLUTION


@triton.jit
def key_tiles(m0, seqlen_q, seqlen_k, window_left, window_right, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr):
    """(lo, full_lo, full_hi, hi): the key tiles rows m0 .. m0 + BLOCK_M - 1 visit, and the
    full ones among them."""
    ### BEGIN SOLUTION
    diag = seqlen_k - seqlen_q
    lo = tl.maximum(m0 + diag - window_left, 0) // BLOCK_N * BLOCK_N     # first row's left edge
    hi = tl.minimum(m0 + BLOCK_M + diag + window_right, seqlen_k)       # last row's right edge
    # full: inside the last row's left edge and the first row's right edge (and inside seqlen_k)
    first_full = tl.maximum(lo, tl.cdiv(m0 + BLOCK_M - 1 + diag - window_left, BLOCK_N) * BLOCK_N)
    end_full = tl.minimum(m0 + diag + window_right + 1, seqlen_k) // BLOCK_N * BLOCK_N
    any_full = first_full < end_full
    full_lo = tl.where(any_full, first_full, lo)
    full_hi = tl.where(any_full, end_full, lo)
    ### END SOLUTION
    return lo, full_lo, full_hi, hi

# %% nbgrader={"grade": true, "grade_id": "ch4_masks_test", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
ch4.check_mask_helpers(visible_pairs, key_tiles)
### BEGIN HIDDEN TESTS
ch4.check_mask_helpers(visible_pairs, key_tiles, hidden=True)
### END HIDDEN TESTS

# %% [markdown]
# **Exercise 2b (3 points).** Write `attn_masked_kernel`: `attn_varlen_kernel` with the mask.
# It takes two more arguments, `window_left` and `window_right` (non-negative; causal is
# `(unlimited, 0)`), and replaces the loop over all key tiles with three loops over
# `key_tiles`' ranges: partial tiles `[lo, full_lo)`, full tiles `[full_lo, full_hi)` with
# `MASKED=False`, partial tiles `[full_hi, hi)`. A partial tile's `visible` is
# `visible_pairs(...)` of the tile's keys, and its `kv_ok` the keys `< seqlen_k`. The check
# counts, in CPU mode, the K tiles each program loads and compares them with the tiles that
# hold a visible pair (a kernel that masks but does not skip loads about twice as many for a
# long causal sequence), and the tiles it runs through `attn_scores` with `MASKED=True`: only
# the partial ones may. Keep the left band's loop even without a window: a short sequence in a
# tall tile (its padding rows count as queries) has one too, and the random shapes find it.
# About 45 lines (most of them Exercise 1's).

# %% nbgrader={"grade": false, "grade_id": "ch4_masked_kernel", "locked": false, "schema_version": 3, "solution": true, "task": false}
@triton.jit
def attn_masked_kernel(Q, K, V, O, LSE, CU_Q, CU_K,
                       stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                       stride_ot, stride_oh, H, total_q, qk_scale, window_left, window_right,
                       heads_per_section, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Varlen forward with a causal / sliding-window mask and block skipping.
    Same layout and grid as attn_varlen_kernel."""
    ### BEGIN SOLUTION
    m_block, pid_bh = program_tile(heads_per_section)                # longest rows first
    seq = pid_bh // H
    h = pid_bh % H
    m0 = m_block * BLOCK_M
    q_start = tl.load(CU_Q + seq)
    seqlen_q = tl.load(CU_Q + seq + 1) - q_start
    if m0 >= seqlen_q:
        return
    k_start = tl.load(CU_K + seq)
    seqlen_k = tl.load(CU_K + seq + 1) - k_start
    rows = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + (q_start + rows)[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                mask=(rows < seqlen_q)[:, None], other=0.0)
    k_ptrs = K + (k_start + offs_n)[None, :] * stride_kt + h * stride_kh + offs_d[:, None]
    v_ptrs = V + (k_start + offs_n)[:, None] * stride_vt + h * stride_vh + offs_d[None, :]
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    lo, full_lo, full_hi, hi = key_tiles(m0, seqlen_q, seqlen_k, window_left, window_right,
                                         BLOCK_M, BLOCK_N)
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
    attn_store_rows(O, LSE, acc, l_i, m_i, q_start, rows, seqlen_q, h, stride_ot, stride_oh,
                    total_q, offs_d)
    ### END SOLUTION

# %% nbgrader={"grade": true, "grade_id": "ch4_masked_test", "locked": true, "points": 3, "schema_version": 3, "solution": false, "task": false}
ch4.check_masked_kernel(attn_masked_kernel)
### BEGIN HIDDEN TESTS
ch4.check_masked_kernel(attn_masked_kernel, hidden=True)
### END HIDDEN TESTS

# %% [markdown]
# ## 5. The public wrapper: bad input is a clear error
#
# The kernels trust `cu_seqlens`. A `cu_seqlens_q` that decreases gives a negative length (the
# program returns, the rows are never written: uninitialised memory comes back as O); one that
# ends past `total_q` reads and writes out of bounds; an int64 tensor is read as int32 halves
# (the little-endian offsets `[0, 5, 8]` of two sequences read as `0, 0, 5`: sequence 0 gets
# length 0 and sequence 1 the rows of sequence 0; the rest of the buffer is never read); a
# `max_seqlen_q` shorter than the longest sequence launches too
# few programs and leaves rows unwritten. None of these crashes: they return wrong numbers. The
# wrapper users call must refuse them, with a message that names the argument.
#
# **Exercise 3 (2 points).** Write `validate_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k,
# max_seqlen_q, max_seqlen_k, window_size)`: return `None` for a valid call, and raise a
# `ValueError` whose message names the offending argument (`q`, `k`, `v`, `cu_seqlens_q`,
# `cu_seqlens_k`, `max_seqlen_q`, `max_seqlen_k` or `window_size`; a message that names more
# than three of them does not say which one is wrong, and loses the case) for each of:
# q, k, v not 3-d tensors of one float dtype (float16 or float32) on this runtime's device with a
# contiguous last dimension (`validate_tensor(label, t, dims=3, dtypes=ch4.DTYPES,
# name="attention_varlen")` checks one tensor: use it); k and v of different shapes, or a head
# count or head dimension that differs from q's, or a head dimension not in `ch4.HEAD_DIMS`;
# a `cu_seqlens` that is not a 1-d `torch.int32` tensor on q's device, whose two lengths differ
# or are below 2, that does not start at 0, that decreases, or whose last entry is not the
# tensor's token count; a `max_seqlen` that is not an int or is shorter than the longest
# sequence; a `window_size` that is not two ints each `>= -1`.
#
# The checks of `cu_seqlens`' *values* need them on the host: a copy from the GPU, which waits
# for the GPU (a sync) and which a stream that is capturing a CUDA graph refuses (the benchmark
# below times the wrapper replayed from a graph). Read them with `host_values(cu)` (from
# `flashbook.cases`), never `.tolist()` or `.item()`: it returns them as a tuple, read once per
# tensor (a second call with the same, unchanged tensor copies nothing), and returns `None`
# where the values are not to be read: while a graph is being captured (the call made before
# the capture checked them), and on a GPU outside the graded checks, so that the hot path never
# waits for the device (wrap a call in `with flashbook.check_values():` to check them there
# too). Then skip the value checks. In CPU mode and in every graded check they run. The check
# calls your function once more as if a graph were being captured. About 30 lines.

# %% nbgrader={"grade": false, "grade_id": "ch4_validate", "locked": false, "schema_version": 3, "solution": true, "task": false}
def validate_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                    window_size=(-1, -1)):
    """Raise a ValueError naming the argument if these do not describe a packed batch."""
    ### BEGIN SOLUTION
    name = "attention_varlen"
    for label, t in (("q", q), ("k", k), ("v", v)):
        validate_tensor(label, t, dims=3, dtypes=ch4.DTYPES, name=name)
    if not q.dtype == k.dtype == v.dtype or k.device != q.device or v.device != q.device:
        raise ValueError(f"{name}: q, k, v must share a dtype and a device, got q {q.dtype} on "
                         f"{q.device}, k {k.dtype} on {k.device}, v {v.dtype} on {v.device}.")
    if k.shape != v.shape or k.shape[1:] != q.shape[1:]:
        raise ValueError(f"{name}: k {tuple(k.shape)} and v {tuple(v.shape)} must be "
                         f"(total_k, H, d) with q's H and d (q is {tuple(q.shape)}).")
    if q.shape[2] not in ch4.HEAD_DIMS:
        raise ValueError(f"{name}: q's head dimension {q.shape[2]} is not one of "
                         f"{ch4.HEAD_DIMS}: {ch4.HEAD_DIMS_WHY}.")
    for label, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.dtype != torch.int32:
            raise ValueError(f"{name}: {label} must be a 1-d torch.int32 tensor, got "
                             f"{getattr(cu, 'dtype', type(cu).__name__)} "
                             f"{tuple(getattr(cu, 'shape', ()))}.")
        if cu.device != q.device:
            raise ValueError(f"{name}: {label} is on {cu.device}, q on {q.device}.")
    for label, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name}: {label} must be an int, got {value!r}.")
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or not all(isinstance(w, int) and not isinstance(w, bool) and w >= -1
                       for w in window_size)):
        raise ValueError(f"{name}: window_size must be two ints >= -1 (left, right; -1 is "
                         f"unlimited), got {window_size!r}.")
    # The values: read once per tensor; None while a CUDA graph is captured (checked before)
    # and on a GPU's hot path (graded checks and flashbook.check_values() read them).
    offsets_q, offsets_k = host_values(cu_seqlens_q), host_values(cu_seqlens_k)
    if offsets_q is None or offsets_k is None:
        return
    lengths = {}
    for label, offsets, total in (("cu_seqlens_q", offsets_q, q.shape[0]),
                                  ("cu_seqlens_k", offsets_k, k.shape[0])):
        if len(offsets) < 2 or offsets[0] != 0 or offsets[-1] != total:
            raise ValueError(f"{name}: {label} must start at 0 and end at the token count "
                             f"{total} (batch + 1 >= 2 entries), got {list(offsets[:4])}..."
                             f"{list(offsets[-2:])}.")
        steps = [b - a for a, b in zip(offsets, offsets[1:])]
        if min(steps) < 0:
            raise ValueError(f"{name}: {label} decreases at index {steps.index(min(steps)) + 1}: "
                             "offsets must be non-decreasing (lengths >= 0).")
        lengths[label] = steps
    if len(lengths["cu_seqlens_q"]) != len(lengths["cu_seqlens_k"]):
        raise ValueError(f"{name}: cu_seqlens_q and cu_seqlens_k describe "
                         f"{len(lengths['cu_seqlens_q'])} and {len(lengths['cu_seqlens_k'])} "
                         "sequences.")
    for label, value, steps in (("max_seqlen_q", max_seqlen_q, lengths["cu_seqlens_q"]),
                                ("max_seqlen_k", max_seqlen_k, lengths["cu_seqlens_k"])):
        if value < max(steps):
            raise ValueError(f"{name}: {label} must be an int >= the longest sequence "
                             f"({max(steps)}), got {value!r}.")
    ### END SOLUTION

# %% nbgrader={"grade": true, "grade_id": "ch4_validate_test", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
ch4.check_validate_varlen(validate_varlen)
### BEGIN HIDDEN TESTS
ch4.check_validate_varlen(validate_varlen, hidden=True)
### END HIDDEN TESTS

# %% [markdown]
# ## 6. Making it fast: two query tiles per program
#
# Chapter 3's fastest kernel gave each program two query tiles, A and B, ordered so that one
# tile's softmax runs while the other's matmul is on the tensor cores. The same works with
# masks: the pair's `key_tiles` are those of its `BLOCK_M = 2 x HALF` rows (a tile is full only
# if it is full for both), and a partial tile masks each half with its own `visible_pairs`.
# `attn_two_tile_step` below is the pair's loop body, `attn_scores` and `attn_update` for
# both tiles in Chapter 3's order.

# %% tags=["export:flashbook.kernels"]
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

# %% [markdown]
# **Exercise 4 (optional, 1 point).** Write `attn_masked_two_tiles`: your `attn_masked_kernel`
# with two query tiles of `HALF = BLOCK_M // 2` rows per program. The program still takes the
# `BLOCK_M` rows from `m0 = m_block * BLOCK_M`: tile A holds the first `HALF` of them, tile B
# the next `HALF`. Load both Q tiles, keep two running states `(acc, l, m)`, call `key_tiles`
# once for all `BLOCK_M` rows, and run Exercise 2b's three loops with `attn_two_tile_step`: a
# partial tile takes `visible_pairs` of each tile's own rows, a full tile `MASKED=False` and no
# mask. Then `attn_store_rows` for each tile. The check runs Exercise 2b's cases and random
# shapes with tiles of 2 x 16 and 2 x 32 rows (2 x 64 for the random shapes), and counts in CPU
# mode the K tiles each program loads (each tile that its rows see, once for each query tile)
# and those it takes through the masked path (partial tiles only). Until you write it,
# `attention_varlen` below runs your one-tile `attn_masked_kernel` instead, and says so once.
# About 50 lines, most of them Exercise 2b's.

# %% nbgrader={"grade": false, "grade_id": "ch4_two_tiles", "locked": false, "schema_version": 3, "solution": true, "task": false}
@triton.jit
def attn_masked_two_tiles(Q, K, V, O, LSE, CU_Q, CU_K,
                          stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                          stride_ot, stride_oh, H, total_q, qk_scale, window_left,
                          window_right, heads_per_section, HEAD_DIM: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          DOT_PRECISION: tl.constexpr):
    """attn_masked_kernel with two query tiles of HALF = BLOCK_M // 2 rows per program: A
    holds rows m0 .. m0 + HALF - 1 of the program's BLOCK_M rows, B the next HALF."""
    HALF: tl.constexpr = BLOCK_M // 2
    ### BEGIN SOLUTION
    m_block, pid_bh = program_tile(heads_per_section)
    seq = pid_bh // H
    h = pid_bh % H
    m0 = m_block * BLOCK_M
    q_start = tl.load(CU_Q + seq)
    seqlen_q = tl.load(CU_Q + seq + 1) - q_start
    if m0 >= seqlen_q:
        return
    k_start = tl.load(CU_K + seq)
    seqlen_k = tl.load(CU_K + seq + 1) - k_start
    rows_a = m0 + tl.arange(0, HALF)
    rows_b = rows_a + HALF
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    q_h = Q + q_start * stride_qt + h * stride_qh + offs_d[None, :]
    q_a = tl.load(q_h + rows_a[:, None] * stride_qt, mask=(rows_a < seqlen_q)[:, None], other=0.0)
    q_b = tl.load(q_h + rows_b[:, None] * stride_qt, mask=(rows_b < seqlen_q)[:, None], other=0.0)
    k_ptrs = K + (k_start + offs_n)[None, :] * stride_kt + h * stride_kh + offs_d[:, None]
    v_ptrs = V + (k_start + offs_n)[:, None] * stride_vt + h * stride_vh + offs_d[None, :]
    m_a = tl.full([HALF], float("-inf"), tl.float32)
    l_a = tl.zeros([HALF], tl.float32)
    acc_a = tl.zeros([HALF, HEAD_DIM], tl.float32)
    m_b = tl.full([HALF], float("-inf"), tl.float32)
    l_b = tl.zeros([HALF], tl.float32)
    acc_b = tl.zeros([HALF, HEAD_DIM], tl.float32)
    lo, full_lo, full_hi, hi = key_tiles(m0, seqlen_q, seqlen_k, window_left, window_right,
                                         BLOCK_M, BLOCK_N)
    for start_n in range(lo, full_lo, BLOCK_N):
        cols = start_n + offs_n
        acc_a, l_a, m_a, acc_b, l_b, m_b = attn_two_tile_step(
            acc_a, l_a, m_a, q_a, acc_b, l_b, m_b, q_b, k_ptrs + start_n * stride_kt,
            v_ptrs + start_n * stride_vt, cols < seqlen_k,
            visible_pairs(rows_a, cols, seqlen_q, seqlen_k, window_left, window_right),
            visible_pairs(rows_b, cols, seqlen_q, seqlen_k, window_left, window_right),
            qk_scale, True, DOT_PRECISION)
    all_keys = offs_n < BLOCK_N
    for start_n in range(full_lo, full_hi, BLOCK_N):
        acc_a, l_a, m_a, acc_b, l_b, m_b = attn_two_tile_step(
            acc_a, l_a, m_a, q_a, acc_b, l_b, m_b, q_b, k_ptrs + start_n * stride_kt,
            v_ptrs + start_n * stride_vt, all_keys, all_keys[None, :], all_keys[None, :],
            qk_scale, False, DOT_PRECISION)
    for start_n in range(full_hi, hi, BLOCK_N):
        cols = start_n + offs_n
        acc_a, l_a, m_a, acc_b, l_b, m_b = attn_two_tile_step(
            acc_a, l_a, m_a, q_a, acc_b, l_b, m_b, q_b, k_ptrs + start_n * stride_kt,
            v_ptrs + start_n * stride_vt, cols < seqlen_k,
            visible_pairs(rows_a, cols, seqlen_q, seqlen_k, window_left, window_right),
            visible_pairs(rows_b, cols, seqlen_q, seqlen_k, window_left, window_right),
            qk_scale, True, DOT_PRECISION)
    attn_store_rows(O, LSE, acc_a, l_a, m_a, q_start, rows_a, seqlen_q, h, stride_ot, stride_oh,
                    total_q, offs_d)
    attn_store_rows(O, LSE, acc_b, l_b, m_b, q_start, rows_b, seqlen_q, h, stride_ot, stride_oh,
                    total_q, offs_d)
    ### END SOLUTION

# %% nbgrader={"grade": true, "grade_id": "ch4_two_tiles_test", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
ch4.check_two_tile_kernel(attn_masked_two_tiles)
### BEGIN HIDDEN TESTS
ch4.check_two_tile_kernel(attn_masked_two_tiles, hidden=True)
### END HIDDEN TESTS

# %% [markdown]
# `attention_varlen` is the public entry point, flash-attn's signature: your checks, then the
# launch of the fastest kernel you have written. A call's host time matters as much as the
# kernel's at small sizes (a 256-token batch runs in a few µs on an H200), so nothing is worked
# out twice: `ch4.launch_varlen` remembers its tile config, grid and strides by the inputs'
# metadata (shapes, strides, dtypes, devices and the Python arguments), launches through
# Triton's compiled kernel (`flashbook.plans` says why that is safe), and, handed your checks as
# `validate=`, runs them when it meets new metadata, before it plans the launch. Where values are
# checked (CPU mode, the graded checks, `flashbook.check_values()`) it runs them on every call,
# since the metadata says nothing about what `cu_seqlens` holds.

# %%
def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                     causal=False, window_size=(-1, -1), softmax_scale=None, config=None,
                     sections=None):
    """flash-attn's flash_attn_varlen_func, forward: returns O (total_q, H, d) and LSE
    (H, total_q), from the two-tile kernel (the one-tile kernel while the two-tile one is
    still a stub). Causal masks are bottom-right; window_size=(left, right), -1 unlimited
    (Python, NumPy or torch integers). Shapes, dtypes, devices and strides are always checked
    (once per metadata: a repeated call looks the result up); cu_seqlens' values in CPU mode
    and, on a GPU, inside ``flashbook.check_values()``."""
    window_size = as_window(window_size)         # NumPy or torch integers as Python ints
    window = ch4.window_bounds(window_size, causal, max_seqlen_q, max_seqlen_k)
    kernel, two_tiles = ch4.pick_kernel(attn_masked_two_tiles, attn_masked_kernel,
                                        "attention_varlen")
    return ch4.launch_varlen(kernel, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                             max_seqlen_k, window=window, scale=softmax_scale, config=config,
                             two_tiles=two_tiles, sections=sections,
                             validate=validate_varlen, validate_args=(window_size,))


def attention_varlen_one_tile(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                              causal=False, window_size=(-1, -1), softmax_scale=None,
                              config=None, sections=None):
    """attention_varlen with Exercise 2b's one-tile kernel (for comparison)."""
    window_size = as_window(window_size)         # NumPy or torch integers as Python ints
    window = ch4.window_bounds(window_size, causal, max_seqlen_q, max_seqlen_k)
    return ch4.launch_varlen(attn_masked_kernel, q, k, v, cu_seqlens_q, cu_seqlens_k,
                             max_seqlen_q, max_seqlen_k, window=window, scale=softmax_scale,
                             config=config, sections=sections, validate=validate_varlen,
                             validate_args=(window_size,))

# %% tags=["demo"]
# The public wrapper on a packed causal batch, against the float64 reference; then a bad call.
lens_q, lens_k = [5, 0, 37, 64], [9, 3, 37, 80]
cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32,
                    device=backend.device)
cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32,
                    device=backend.device)
q = torch.randn(sum(lens_q), 2, 32, device=backend.device)
k, v = (torch.randn(sum(lens_k), 2, 32, device=backend.device) for _ in range(2))
try:
    o, lse = attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True)
    want, _ = reference.attention_varlen(q.double(), k.double(), v.double(), cu_q, cu_k,
                                         causal=True)
    print(f"max |O - float64 reference| = {(o.double() - want).abs().max().item():.2e}")
    attention_varlen(q, k, v, cu_q.long(), cu_k, max(lens_q), max(lens_k), causal=True)
except ValueError as e:
    print(f"ValueError: {e}")
except NotImplementedError:
    print("Finish Exercises 1-3 to run the wrapper.")

# %% [markdown]
# ## 7. Benchmark
#
# On a GPU the next cell times *your* `attention_varlen` (your two-tile kernel, or your one-tile
# kernel until Exercise 4 is done) on a causal batch against torch SDPA's cuDNN backend, with
# FLOPs counted on the visible pairs only (half the square for causal). `flashbook bench ch4`
# measures the chapter's solution on the book's shapes against cuDNN, FlashAttention-2,
# FlexAttention (compiled, with a causal or document `BlockMask`) and SDPA on jagged nested
# tensors, and records the result in `src/flashbook/data/bench/ch4/`; the plots after it show
# that record.

# %% tags=["demo"]
from flashbook import bench, results
if bench.needs_gpu("the masked attention benchmark"):
    B, H, N, d = 2, 16, 4096, 128
    x = torch.randn(3, B * N, H, d, device="cuda", dtype=torch.float16)
    cu = torch.arange(0, B + 1, device="cuda", dtype=torch.int32) * N
    dense = [t.view(B, N, H, d).transpose(1, 2).contiguous() for t in x]
    kw = dict(B=B, H=H, N_q=N, N_k=N, d=d, dtype=torch.float16, causal=True)
    try:
        rows = [bench.measure_attention(
            "your kernel", "reference",
            lambda: attention_varlen(*x, cu, cu, N, N, causal=True), graph=True, **kw)]
        if bench.sdpa_supports("sdpa_cudnn", *dense, causal=True):
            cudnn = bench.sdpa("sdpa_cudnn")
            rows.append(bench.measure_attention("sdpa_cudnn", "baseline",
                                                lambda: cudnn(*dense, causal=True), graph=True,
                                                **kw))
        print(results.table(rows))
    except Exception as e:  # a stub kernel raises or does not compile
        print(f"Could not benchmark your kernel (are Exercises 1-3 done?): {type(e).__name__}")
        if "captur" in str(e):   # a copy to the host while the CUDA graph was being captured
            print("The wrapper read a GPU tensor on the host during the capture: read "
                  "cu_seqlens with host_values (Exercise 3).")

# %% tags=["demo"]
recorded = results.recorded("ch4", "h200")
if recorded:
    print(ch4.summary(recorded.rows))
    fig = ch4.plot_recorded(recorded.rows)
else:
    print("No recorded H200 benchmark found.")

# %% tags=["remove-cell"]
# The figures the prose quotes, from the recorded H200 data: the book pastes each into its
# glue:text role (myst-nb's glue); elsewhere this does nothing.
from flashbook import quoted
quoted.glue(ch4.CHAPTER)

# %% [markdown]
# ## What was measured, and further reading
#
# The numbers above come from one run of `flashbook bench ch4` on an H200 (provenance in
# `src/flashbook/data/bench/ch4/h200.json`), every kernel row timed replayed from a CUDA graph,
# FLOPs counted on visible pairs only. Beside each two-tile row the run times
# `attention_varlen(...)` as you call it (its checks on, its plan chosen, launched); the
# figures quoted for the two-tile kernel against the baselines are that call's, and its
# ablations (schedules, the uniform batch) compare the kernels as launched from the graph. The
# call is within 2 % of its kernel at every shape here. **Causal.** The two-tile kernel reaches
# {glue:text}`ch4_vs_cudnn_big:.2f`x cuDNN at `(1, 16, 16384, 128)` ({glue:text}`ch4_tflops:.0f`
# against {glue:text}`ch4_cudnn_tflops:.0f` TFLOP/s) and is ahead of FlexAttention with a causal
# `BlockMask` by {glue:text}`ch4_vs_flex_attention_big:.2f`x and
# {glue:text}`ch4_vs_flex_attention_small:.2f`x and of FlashAttention-2 by
# {glue:text}`ch4_vs_flash_big:.2f`x and {glue:text}`ch4_vs_flash_small:.2f`x at the two shapes;
# at `(4, 16, 4096, 128)`, where a program's band of partial tiles is a larger share of its work,
# it reaches {glue:text}`ch4_vs_cudnn_small:.2f`x cuDNN. **Schedule.** The ablation of Section 4
# ran the same kernel with one (sequence, head) pair per section (L2 locality alone) and with all
# of them in one (pure longest-first): at `(1, 16, 16384, 128)` causal they reach
# {glue:text}`ch4_tiles_first_tflops:.0f` and {glue:text}`ch4_heads_first_tflops:.0f` TFLOP/s
# against {glue:text}`ch4_sections_tflops:.0f` for {glue:text}`ch4_sections` pairs per section,
# and on the packed batch the pure longest-first order loses most
# ({glue:text}`ch4_varlen_heads_first_tflops:.0f` against {glue:text}`ch4_varlen_tflops:.0f`
# TFLOP/s, non-causal). **Packed batches.** On 65536 tokens in
# {glue:text}`ch4_varlen_sequences` sequences of a long-tailed mix (the longest
# {glue:text}`ch4_varlen_longest`, padding ratio {glue:text}`ch4_padding_ratio:.1f`), the packed
# kernel runs at {glue:text}`ch4_varlen_vs_uniform_noncausal:.2f`x (non-causal) and
# {glue:text}`ch4_varlen_vs_uniform_causal:.2f`x (causal) the throughput of the same kernel on
# four sequences of 16384, counted on real pairs; FlexAttention with a document mask reaches
# {glue:text}`ch4_flex_varlen_tflops_noncausal:.0f` and
# {glue:text}`ch4_flex_varlen_tflops_causal:.0f` TFLOP/s, SDPA on jagged nested tensors
# {glue:text}`ch4_jagged_tflops:.0f`, and cuDNN on the batch padded to the longest sequence
# {glue:text}`ch4_padded_tflops_noncausal:.0f` and {glue:text}`ch4_padded_tflops_causal:.0f` on
# real pairs, because it computes {glue:text}`ch4_padded_pairs_ratio:.1f` times as many pairs as
# there are: against that padded batch (padding ratio {glue:text}`ch4_padding_ratio:.1f`) the
# packed kernel is {glue:text}`ch4_vs_padded_noncausal:.1f`x faster non-causal and
# {glue:text}`ch4_vs_padded_causal:.1f`x causal. **Windows.** At N = 65536, a causal window of
# {glue:text}`ch4_window_0`, {glue:text}`ch4_window_1` and {glue:text}`ch4_window_2` keys takes
# {glue:text}`ch4_window_0_ms:.2f`, {glue:text}`ch4_window_1_ms:.2f` and
# {glue:text}`ch4_window_2_ms:.2f` ms against {glue:text}`ch4_causal_ms:.2f` ms without one: the
# time follows the window, not N: a window of {glue:text}`ch4_window_1` keys costs
# {glue:text}`ch4_window_1_share:.2f` of the causal attention over all 65536 keys.
#
# **Further reading**
# * FlashAttention-2 {cite}`dao2023flashattention2`: the varlen interface and the causal
#   loop split this chapter follows.
# * FlashAttention-3 {cite}`shah2024flashattention3`: its tile schedulers order causal work
#   longest-first and group heads for the L2 cache.
# * FlexAttention {cite}`dong2024flexattention`: masks as `mask_mod` functions, compiled into a
#   `BlockMask` of full and partial blocks.
# * Longformer {cite}`beltagy2020longformer` and Mistral 7B {cite}`jiang2023mistral`: sliding-window
#   attention in models.
