# ---
# jupyter:
#   flashbook:
#     local_ports: true
#   jupytext:
#     formats: py:percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Chapter 8: The distributed merge
#
# **What you will learn**
# - The partial softmax state $(m, \ell, O)$ of a query row over *some* of its keys, the merge
#   that combines two of them exactly, and why it is associative, commutative and has an
#   identity: the reason attention can be cut across programs, GPUs and machines. Its
#   $(O, \text{LSE})$ form, the empty state, and the dtype the state must travel in.
# - **Split-KV decode** (Flash-Decoding): one long sequence's keys cut across many programs of
#   one GPU, partial $(O, \text{LSE})$ written, then a combine kernel; how many splits for a
#   GPU's SM count and a batch.
# - **Reductions over workers**: the chain reduce of a GQA prefill kernel written for a
#   simulated mesh accelerator (an unpublished design; "the mesh kernel" below) over a 2-D mesh
#   of processing elements, its critical path, the deadlock it has when the group does not fill
#   its last row, and a tree; messages and latency of each.
# - **Ring attention** with `torch.distributed`: K/V blocks travel around a ring of processes
#   while each merges; causal balance with zig-zag shards; Ulysses (all-to-alls to head shards)
#   and all-gather context parallelism beside the ring: bytes and steps of each, and when each
#   wins; what context parallelism costs in memory and bandwidth as the sequence grows.
#
# **What you need**: Chapter 3 (the online softmax and its merge), Chapter 5 (the M-fold and
# decode); torch >= 2.11 and triton >= 3.6. Any runtime: on a CPU the kernels run in the Triton
# interpreter and the ring runs as 2 and 4 CPU processes over gloo; GPUs add the benchmarks.
# About 4-6 hours.
#
# **Exercises** (14 points): (1) `merge` (2); (2) the split-KV kernel and its combine kernel
# (3); (3) a chain reduction without the mesh kernel's deadlock (2) and a tree (1); (4) the zig-zag
# layout (1) and ring attention over `torch.distributed` (3); (5) Ulysses attention, all-to-alls
# from sequence shards to head shards and back (2).

# %%
import flashbook as fb
backend = fb.setup()          # before triton is imported: on CPU it switches on the interpreter
import math
import torch
import torch.distributed as dist
import triton
import triton.language as tl
from flashbook.chapters import ch8
from flashbook.chapters.ch8 import recv, send
from flashbook.kernels import attn_step

# %% [markdown]
# ## 1. The partial state and its merge
#
# Take one query row with scaled scores $s_j$ against keys $j$ and values $v_j$. For any subset
# $A$ of the keys define its **partial state**
#
# $$m_A = \max_{j \in A} s_j, \qquad \ell_A = \sum_{j \in A} e^{s_j - m_A}, \qquad
#   O_A = \frac{1}{\ell_A} \sum_{j \in A} e^{s_j - m_A}\, v_j .$$
#
# $O_A$ is what attention over $A$ alone would output, and $\text{LSE}_A = m_A + \log \ell_A$
# its log-sum-exp. For two disjoint subsets $A$ and $B$, with $m = \max(m_A, m_B)$, each side's
# weight relative to $e^{m}$ is $w_A = \ell_A e^{m_A - m}$ (that is $e^{\text{LSE}_A - m}$), and
#
# $$ (m_A, \ell_A, O_A) \oplus (m_B, \ell_B, O_B) = \Big(m,\; w_A + w_B,\;
#    \frac{w_A O_A + w_B O_B}{w_A + w_B}\Big) = (m_{A \cup B}, \ell_{A \cup B}, O_{A\cup B}).$$
#
# It is exact: $w_A + w_B = \sum_{j \in A \cup B} e^{s_j - m}$, and the numerator is
# $\sum_{j \in A\cup B} e^{s_j - m} v_j$. Because the merge of $A$ and $B$ *is* the state of
# $A \cup B$, and set union is associative and commutative, so is $\oplus$: $(a \oplus b) \oplus
# c = a \oplus (b \oplus c)$ and $a \oplus b = b \oplus a$ up to rounding. Its **identity** is the
# state of the empty set, $(-\infty, 0, 0)$: no key, zero weight. That is the whole license of
# this chapter: cut the keys anywhere, compute the pieces anywhere (another program, another
# GPU), merge them in any order or tree shape, and the answer is the same.
#
# Two cases need care. **The max shift**: $e^{m_A}$ overflows fp32 once $m_A > 88$ (logits of
# a few hundred are real: unscaled long-context scores, or a model that sharpens), so the weights
# are taken relative to the larger max, never $e^{m_A}$ itself. **Both sides empty**: then
# $m = -\infty$ and $e^{m_A - m} = e^{-\infty - (-\infty)} = $ NaN; take the shift from 0 instead
# (the weights are $0 \cdot e^{-\infty} = 0$) and return $(-\infty, 0, 0)$, with $O = 0$, not
# $0/0$. The seed skips both guards: a processing element whose shard of keys is empty
# (`S_kv < group_size`) poisons the whole group with NaN.
#
# **The (O, LSE) form.** Fold $\ell$ into $m$: $(m, \ell, O) = (\text{LSE}, 1, O)$ describes the
# same state. That is the form kernels write (every kernel of this book returns O and LSE), and
# the merge becomes $w_A = e^{\text{LSE}_A - m}$ with $m = \max(\text{LSE}_A, \text{LSE}_B)$.
# The seed carries the unnormalised $\tilde O = \ell\, O$ instead; normalising only at the end is
# equivalent, but a normalised $O$ is bounded by $\max |v|$, which matters for the wire
# (Section 2).
#
# **Exercise 1 (2 points).** Write `merge(a, b)`: `a` and `b` are states `(m, l, O)` of the same
# query rows, `m` and `l` of shape `(...)`, `O` of shape `(..., d)`; return the merged state in
# the inputs' dtype. Shift by the larger max, give both-empty rows `(-inf, 0, 0)`, never NaN.
# The check is property-based: shards of random rows merged left to right against the whole row,
# commutativity, associativity, the identity on either side, logits near $\pm 10^4$ and a gap
# of $2 \cdot 10^4$ between the sides. About 8 lines.

# %% nbgrader={"grade": false, "grade_id": "ch8_merge", "locked": false, "schema_version": 3, "solution": true, "task": false}
def merge(a, b):
    """(m, l, O) + (m, l, O) -> (m, l, O) of the union of the two key sets."""
    ### BEGIN SOLUTION
    (m_a, l_a, o_a), (m_b, l_b, o_b) = a, b
    m = torch.maximum(m_a, m_b)
    m_ref = torch.where(m == -math.inf, 0.0, m)           # both sides empty: no -inf - (-inf)
    w_a = l_a * torch.exp(m_a - m_ref)                    # exp(LSE_a - m): 0 for an empty side
    w_b = l_b * torch.exp(m_b - m_ref)
    l = w_a + w_b
    o = (w_a[..., None] * o_a + w_b[..., None] * o_b) / torch.where(l > 0, l, 1.0)[..., None]
    return m, l, o
    ### END SOLUTION

# %% nbgrader={"grade": true, "grade_id": "ch8_merge_test", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
ch8.check_merge(merge)
### BEGIN HIDDEN TESTS
ch8.check_merge(merge, hidden=True)
### END HIDDEN TESTS

# %% [markdown]
# Two helpers the rest of the chapter uses: a kernel's `(O, LSE)` as a state, and the merge in
# that form.

# %%
def as_state(o, lse):
    """(O, LSE) -> the state (LSE, 1, O); an empty row (LSE = -inf) -> (-inf, 0, 0)."""
    return lse, torch.where(lse == -math.inf, 0.0, 1.0).to(lse.dtype), o


def merge_lse(o_a, lse_a, o_b, lse_b):
    """(O, LSE) + (O, LSE) -> (O, LSE)."""
    m, l, o = merge(as_state(o_a, lse_a), as_state(o_b, lse_b))
    return o, m + torch.log(l)

# %% [markdown]
# ## 2. What dtype the state travels in
#
# The seed receives $m$, $\ell$ and $\tilde O$ from its neighbours in fp16. Each is a different
# risk. **$m$** sits in an exponent: fp16 has 10 mantissa bits, so a max near 100 is rounded to
# a multiple of $2^{-4}$, up to $0.03$ off, and the side's weight $e^{m - m'}$ is then up to 3 %
# off, for every element of its $O$. **$\ell$** is a sum of up to one term per key, each at most
# 1: it overflows fp16's largest value, 65504, once a shard holds more than 65504 keys of
# similar score, and a long-context shard does. **$O$**, normalised, is a weighted average of
# rows of V: fp16 holds it as well as it holds V. So the state should travel as **LSE in fp32**
# (4 bytes a row) and $O$ in the activations' dtype; $\tilde O = \ell O$ unnormalised inherits
# $\ell$'s range problem. The cell below chains 8 partial states of 16 rows over 4096 keys, each
# hop rounding what travels to a wire format, for logits of growing size, and shows $\ell$'s
# overflow.

# %% tags=["demo"]
for boost in (1.0, 4.0, 12.0, 20.0):
    err = ch8.wire_roundtrip_error(boost=boost)
    print(f"logits up to {err['largest m']:5.1f}: max |O - O_exact|  " + "   ".join(
        f"{k}: {v:.1e}" for k, v in err.items() if k.startswith("fp")))
print("l for a shard of 70000 keys of equal score, in fp16:", torch.tensor(70000.0).half().item())

# %% [markdown]
# The fp16 state's error grows with the logits, because $m$'s rounding does; with LSE in fp32
# the error stays at the level of fp16 rounding of $O$ itself.
#
# ## 3. Split-KV decode (Flash-Decoding)
#
# Chapter 5's decode kernel gives one program to each (sequence, K/V head) pair and walks the
# whole cache. With 32 sequences and 8 K/V heads that is 256 programs, enough to keep every SM
# of a GPU reading. With **one** sequence it is 8 programs, and an H200 has 132 SMs: 124 of them
# idle while 8 stream a cache of hundreds of megabytes. Chapter 5's benchmark recorded exactly
# this case (its batch-1 rows):

# %% tags=["demo"]
from flashbook import results
ch5_rows = results.recorded("ch5", "h200")
for r in (ch5_rows.rows if ch5_rows else []):
    if r.B == 1 and r.N_q == 1:
        print(f"{r.kernel:12s} batch 1, context {r.N_k}: {r.gbps:7.0f} GB/s of K and V read")

# %% [markdown]
# The cure {cite}`dao2023flashdecoding` is the merge: cut each sequence's keys into
# `num_splits` ranges, give each (sequence, K/V head, range) its own program, which writes a
# **partial** $(O, \text{LSE})$ for its query heads, and merge the partials in a second, tiny
# **combine** kernel. The cache is still read exactly once; the partials cost
# $B \cdot h_q \cdot S \cdot (d + 1)$ fp32 values written and read back, about 0.1 % of the
# cache at batch 1, 131072 keys, $h_q = 32$, $S = 32$, $d = 128$.
#
# **How many splits.** Enough programs to keep the memory system busy, not more: every split adds
# a partial to write and merge, and splits of too few tiles spend their time starting up.
# `choose_num_splits` follows two rules, both read off a sweep of split counts (1 to 128) and tile
# shapes at every batch and context of the book's decode sweep, measured on an H100. While the
# $B \cdot h_{kv}$ programs are fewer than a third of the SMs, it splits until every SM has one
# program, and not one more: three stages of K and V tiles fill most of an SM's shared memory, so
# one program more than the SMs would wait for a second wave. From a third of the SMs on, one
# program per sequence and K/V head, with three stages of loads in flight, reads the cache as fast
# as a split launch does. And no range is longer than 16384 keys, so a long context is read by
# more programs than the batch alone gives. It never makes more splits than key tiles, and rounds
# so that every split gets the same number of whole tiles.

# %% tags=["demo"]
print("splits on a GPU of 132 SMs (H200), h_kv = 8, 128-key tiles:")
for batch, context in ((1, 131072), (1, 8192), (4, 131072), (16, 32768), (32, 8192)):
    s = ch8.choose_num_splits(batch, 8, context, 132, 128)
    print(f"  batch {batch:2d}, context {context:6d}: {s:3d} splits -> {batch * 8 * s:4d} programs")

# %% [markdown]
# **Exercise 2 (3 points).** Write the two kernels. `split_kv_kernel` runs on the grid
# `(B * H_KV, num_splits)`: program `(pid_bh, split)` takes sequence `b = pid_bh // H_KV`, K/V
# head `pid_bh % H_KV`, and keys `[split * keys_per_split, min((split + 1) * keys_per_split,
# cache_len))` where `cache_len = CACHE_SEQLENS[b]` (the range may be empty). Row `r` of its
# `BLOCK_M`-row tile is query head `kv_head * GROUP + r` for `r < GROUP` (Chapter 5's M-fold with
# one new token; rows past `GROUP` are padding up to `tl.dot`'s 16). Q is `(B, 1, h_q, d)` (pass
# `stride_qb`, `stride_qh`), the cache `(B, max_len, H_KV, d)`. Use `attn_step` from
# `flashbook.kernels` (Chapter 4): the whole tiles of the range unmasked, then the last, partial
# one with the mask `cols < hi`: cache slots past the length hold NaN in the check. Write the
# partial O (normalised, fp32) at `O_PART + b * stride_pb + head * stride_ph + split *
# stride_ps`, and its LSE (natural log; `-inf` for an empty range) at
# `LSE_PART + (b * H_KV * GROUP + head) * num_splits + split`, with `num_splits =
# tl.num_programs(1)`. About 30 lines.
#
# `combine_kernel`, one program per `(b, head)` (`pid = b * H_Q + head`), loads the `num_splits`
# partial LSEs (`BLOCK_S` a power of two at least `num_splits`, masked with `-inf`) and
# partial O's, and writes `O = sum_s w_s O_s / sum_s w_s` with `w_s = exp(LSE_s - max_s LSE_s)`
# (in O's dtype) and `LSE = max + log(sum_s w_s)`; all splits empty gives O = 0, LSE = -inf.
# About 15 lines. After its fixed cases the check runs seeded random problems with the H200's
# 128-key tile (in CPU mode too): lengths next to its edges, G 1-8, 1-8 splits.

# %% nbgrader={"grade": false, "grade_id": "ch8_split_kernel", "locked": false, "schema_version": 3, "solution": true, "task": false}
@triton.jit
def split_kv_kernel(Q, K, V, O_PART, LSE_PART, CACHE_SEQLENS,
                    stride_qb, stride_qh, stride_kb, stride_kt, stride_kh,
                    stride_vb, stride_vt, stride_vh, stride_pb, stride_ph, stride_ps,
                    H_KV, keys_per_split, qk_scale, GROUP: tl.constexpr,
                    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    DOT_PRECISION: tl.constexpr):
    """One (sequence, K/V head, key range): its GROUP query heads' partial (O, LSE)."""
    ### BEGIN SOLUTION
    pid_bh = tl.program_id(0)
    split = tl.program_id(1)
    b = pid_bh // H_KV
    kv_head = pid_bh % H_KV
    cache_len = tl.load(CACHE_SEQLENS + b)
    lo = split * keys_per_split
    hi = tl.minimum(lo + keys_per_split, cache_len)       # may be <= lo: an empty range
    r = tl.arange(0, BLOCK_M)
    real = r < GROUP                                      # rows past GROUP: padding
    heads = kv_head * GROUP + r
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=real[:, None], other=0.0)
    k_base = K + b * stride_kb + kv_head * stride_kh
    v_base = V + b * stride_vb + kv_head * stride_vh
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    full_hi = lo + tl.maximum(hi - lo, 0) // BLOCK_N * BLOCK_N
    all_keys = offs_n < BLOCK_N
    for start_n in range(lo, full_hi, BLOCK_N):           # whole tiles: read BLOCK_N * d of K, V
        cols = start_n + offs_n
        acc, l_i, m_i = attn_step(acc, l_i, m_i, q, k_base + cols[None, :] * stride_kt
                                  + offs_d[:, None], v_base + cols[:, None] * stride_vt
                                  + offs_d[None, :], all_keys, all_keys[None, :], qk_scale,
                                  False, DOT_PRECISION)
    for start_n in range(full_hi, hi, BLOCK_N):           # the partial last tile
        cols = start_n + offs_n
        ok = cols < hi
        acc, l_i, m_i = attn_step(acc, l_i, m_i, q, k_base + cols[None, :] * stride_kt
                                  + offs_d[:, None], v_base + cols[:, None] * stride_vt
                                  + offs_d[None, :], ok, ok[None, :], qk_scale, True,
                                  DOT_PRECISION)
    has_key = l_i > 0.0
    o = acc / tl.where(has_key, l_i, 1.0)[:, None]
    lse = tl.where(has_key, (m_i + tl.math.log2(l_i)) * 0.6931471805599453, float("-inf"))
    tl.store(O_PART + b * stride_pb + heads[:, None] * stride_ph + split * stride_ps
             + offs_d[None, :], o, mask=real[:, None])   # write GROUP * d fp32
    tl.store(LSE_PART + (b * H_KV * GROUP + heads) * tl.num_programs(1) + split, lse, mask=real)
    ### END SOLUTION

# %% nbgrader={"grade": false, "grade_id": "ch8_combine_kernel", "locked": false, "schema_version": 3, "solution": true, "task": false}
@triton.jit
def combine_kernel(O_PART, LSE_PART, O, LSE, num_splits, stride_pb, stride_ph, stride_ps,
                   stride_ob, stride_oh, H_Q, HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr):
    """One (sequence, query head): merge its num_splits partial (O, LSE)."""
    ### BEGIN SOLUTION
    pid = tl.program_id(0)
    b = pid // H_Q
    head = pid % H_Q
    s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, HEAD_DIM)
    ok = s < num_splits
    lse = tl.load(LSE_PART + pid * num_splits + s, mask=ok, other=float("-inf"))
    m = tl.max(lse, 0)
    m_ref = tl.where(m == float("-inf"), 0.0, m)         # every split empty: no NaN
    w = tl.exp(lse - m_ref)                               # 0 for empty splits
    total = tl.sum(w, 0)
    o_part = tl.load(O_PART + b * stride_pb + head * stride_ph + s[:, None] * stride_ps
                     + offs_d[None, :], mask=ok[:, None], other=0.0)   # read S * d fp32
    o = tl.sum(o_part * w[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(O + b * stride_ob + head * stride_oh + offs_d, o.to(O.dtype.element_ty))
    tl.store(LSE + pid, m_ref + tl.log(total))            # log(0) = -inf: all splits empty
    ### END SOLUTION

# %% nbgrader={"grade": true, "grade_id": "ch8_split_kv_test", "locked": true, "points": 3, "schema_version": 3, "solution": false, "task": false}
ch8.check_split_kv(split_kv_kernel, combine_kernel)
### BEGIN HIDDEN TESTS
ch8.check_split_kv(split_kv_kernel, combine_kernel, hidden=True)
### END HIDDEN TESTS

# %% [markdown]
# The public wrapper hands its argument checks (a `ValueError` naming the argument) to the
# launcher, which runs them when it meets new metadata, as Chapters 4 and 5's do, and launches
# both kernels; `num_splits=None` lets `choose_num_splits` decide for this GPU. The values of
# `cache_seqlens` are checked in CPU mode and in the graded checks; on a GPU reading them would
# make every step wait for the device, so there they are checked only inside
# `with flashbook.check_values():`.
#
# With `num_splits=None` this is the book's decode call for one new token at any batch and
# context: where $B \cdot h_{kv}$ programs already keep the GPU busy and the context is short,
# `choose_num_splits` returns 1, and the split kernel, Chapter 5's decode kernel with one program
# per sequence and K/V head, writes O and the LSE itself (one partial needs no merge, so the
# combine is not launched); at batch 1 it cuts the keys into as many ranges as give every SM a
# program. A cache too large for the kernels' 32-bit offsets (more than $2^{31}$ elements: 32
# sequences of 131072 tokens at 8 heads of 128) is launched a slice of sequences at a time. Paged
# caches and several new tokens per step stay with Chapter 5's `decode`.

# %%
def decode_split_kv(q, k_cache, v_cache, cache_seqlens, num_splits=None, softmax_scale=None):
    """One decode step, split-KV: q (B, 1, h_q, d) against the cache (B, max_len, h_kv, d) with
    cache_seqlens (B,) int32. Returns O (B, 1, h_q, d) and LSE (B, h_q, 1)."""
    return ch8.launch_split_kv(split_kv_kernel, combine_kernel, q, k_cache, v_cache,
                               cache_seqlens, num_splits, scale=softmax_scale,
                               validate=ch8.validate_split_decode)

# %% tags=["demo"]
# Every split count gives the same answer (the merge is exact), up to rounding.
q = torch.randn(1, 1, 8, 32, device=backend.device)
k_cache, v_cache = (torch.randn(1, 96, 2, 32, device=backend.device) for _ in range(2))
lengths = torch.tensor([90], dtype=torch.int32, device=backend.device)
if fb.check.is_stub(split_kv_kernel) or fb.check.is_stub(combine_kernel):
    print("Finish Exercise 2 to run the split-KV decode.")
else:
    o1, _ = decode_split_kv(q, k_cache, v_cache, lengths, num_splits=1)
    for s in (2, 3, 6):
        o, _ = decode_split_kv(q, k_cache, v_cache, lengths, num_splits=s)
        print(f"{s} splits: max |O - O_1 split| = {(o - o1).abs().max().item():.1e}")
    try:
        decode_split_kv(q, k_cache, v_cache, lengths.long())
    except ValueError as e:
        print(f"ValueError: {e}")

# %% [markdown]
# ## 4. Reductions across workers: the mesh kernel's chain, and a tree
#
# The seed runs on a mesh accelerator: processing elements (PEs) on a 2-D grid, each talking to
# its four neighbours over links. The PEs of a group split a head's keys, each computes its
# partial state, and the partials must be merged into one at the group's root, PE 0. The seed
# lays the group out in rows of `cols = min(4, group_size)` PEs and reduces in two chains: along
# each row, westward (receive from the east neighbour, merge, send west), then along column 0,
# northward. The rows work in parallel, so the root is done after $(\text{cols} - 1) +
# (\text{rows} - 1)$ sequential messages, each one hop.
#
# The seed assumes every row is full. With `group_size = 6` and 4 columns, the second row holds
# PEs 4 and 5 only, and PE 5 (column 1) waits for its east neighbour, PE 6, which is not in the
# group (on the real machine it is another group's PE, or nothing). It waits forever, and so
# does everyone who waits on it. The simulator below runs PE programs written as Python
# generators: `x = yield recv(src)` blocks until PE `src` sends, `yield send(dst, x)` sends (the
# sender goes on); a message takes one time step; and when every unfinished PE is blocked, it
# reports a deadlock. Here is the mesh kernel's rule, drawn for a group of 6, then run:

# %% tags=["demo"]
fig = ch8.plot_mesh_chain(6, 4)
states = [ch8.identity((1,), 1) for _ in range(16)]
for n in (4, 8, 16, 6):
    try:
        r = ch8.simulate(ch8.seed_chain_reduce, states[:n], 4, merge=ch8.merge_states)
        print(f"group of {n:2d}: {r.messages} messages, {r.steps} sequential steps")
    except ch8.Deadlock as e:
        print(f"group of {n:2d}: {e}")

# %% [markdown]
# **Exercise 3a (2 points).** Write `chain_reduce(pe, n, cols, state, merge)`, the mesh kernel's chain
# without its deadlock: a generator that PE `pe` of a group of `n` runs (row `pe // cols`, column
# `pe % cols`, with `cols = min(cols, n)`); it merges what it receives with `merge` and the root,
# PE 0, returns the group's state (the others return `None`). The fix: a row's chain starts at
# its *last PE*, which in the last row need not be in column `cols - 1`. Send whole states, one
# message per hop (the mesh kernel sends m, l and O as three). The check runs groups whose size is not
# a multiple of the width, requires the exact merged result, $n - 1$ messages, each to a
# neighbour (one mesh hop), none left unreceived, and a critical path within
# $(\text{cols} - 1) + (\text{rows} - 1)$. About 15 lines.

# %% nbgrader={"grade": false, "grade_id": "ch8_chain", "locked": false, "schema_version": 3, "solution": true, "task": false}
def chain_reduce(pe, n, cols, state, merge):
    """Row chains flowing west, then column 0 flowing north, to PE 0."""
    ### BEGIN SOLUTION
    cols = min(cols, n)
    rows = -(-n // cols)
    row, col = pe // cols, pe % cols
    width = min(cols, n - row * cols)                     # the last row may be partial
    if col < width - 1:                                   # the row chain flows west
        state = merge(state, (yield recv(pe + 1)))
    if col > 0:
        yield send(pe - 1, state)
        return None
    if row < rows - 1:                                    # column 0 flows north
        state = merge(state, (yield recv(pe + cols)))
    if row > 0:
        yield send(pe - cols, state)
        return None
    return state
    ### END SOLUTION

# %% nbgrader={"grade": true, "grade_id": "ch8_chain_test", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
ch8.check_chain_reduce(chain_reduce)
### BEGIN HIDDEN TESTS
ch8.check_chain_reduce(chain_reduce, hidden=True)
### END HIDDEN TESTS

# %% [markdown]
# A chain is simple and uses only neighbour links, but its critical path grows with the mesh's
# side. A **binary tree** {cite}`thakur2005collectives` needs $\lceil \log_2 n \rceil$
# sequential messages: in round $k$ (step $2^k$), every PE whose index is an odd multiple of
# $2^k$ sends its state to the PE $2^k$ to its left and is done, and the others receive from the
# PE $2^k$ to their right, if it exists. Both send $n - 1$ messages, the minimum; the tree's
# messages travel further on the mesh (PE 0 and PE 8 are two rows apart), so it pays in link
# hops what it saves in latency. When the per-message cost is latency (a small state, a
# synchronisation), the tree wins; when it is bandwidth on busy links, neighbour chains and rings
# do.
#
# **Exercise 3b (1 point).** Write `tree_reduce(pe, n, cols, state, merge)` (the mesh width is
# only for the hop count). The check requires $\lceil \log_2 n \rceil$ steps and $n - 1$
# messages. About 8 lines.

# %% nbgrader={"grade": false, "grade_id": "ch8_tree", "locked": false, "schema_version": 3, "solution": true, "task": false}
def tree_reduce(pe, n, cols, state, merge):
    """A binary tree to PE 0: round k pairs PEs 2^k apart."""
    ### BEGIN SOLUTION
    step = 1
    while step < n:
        if pe % (2 * step):                               # an odd multiple of step: send, done
            yield send(pe - step, state)
            return None
        if pe + step < n:
            state = merge(state, (yield recv(pe + step)))
        step *= 2
    return state
    ### END SOLUTION

# %% nbgrader={"grade": true, "grade_id": "ch8_tree_test", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
ch8.check_tree_reduce(tree_reduce)
### BEGIN HIDDEN TESTS
ch8.check_tree_reduce(tree_reduce, hidden=True)
### END HIDDEN TESTS

# %% tags=["demo"]
sizes = (2, 4, 6, 8, 12, 16, 24, 32, 48, 64)
try:
    costs = ch8.reduction_costs({"chain": chain_reduce, "tree": tree_reduce}, sizes, cols=8)
    print("   n  chain: msgs steps hops   tree: msgs steps hops")
    for (n, *c), (_, *t) in zip(costs["chain"], costs["tree"]):
        print(f"{n:4d}  {c[0]:11d} {c[1]:5d} {c[2]:4d}  {t[0]:10d} {t[1]:5d} {t[2]:4d}")
    fig = ch8.plot_reduction_costs(costs, cols=8)
except NotImplementedError:
    print("Finish Exercise 3 to compare the chain and the tree.")

# %% [markdown]
# ## 5. Ring attention with `torch.distributed`
#
# Split-KV cuts one GPU's work; **context parallelism** cuts a sequence too long for one GPU.
# With $P$ processes, each holds $N/P$ of the queries, keys and values. Attention needs every
# query against every key, so the K/V shards travel {cite}`liu2023ring`: at step $t$, rank $r$
# computes its queries against the block it holds (its own at $t = 0$), merges the partial
# $(O, \text{LSE})$ into its running state, and passes the block to rank $r + 1$ while receiving
# the next from rank $r - 1$. After $P$ steps and $P - 1$ hops every rank has seen every block
# once, and its state is exact: the merge's associativity and commutativity say the order of
# arrival does not matter. The send of step $t$'s block is posted *before* step $t$'s compute,
# so the transfer runs while the GPU computes; the next step waits only for what has not arrived.
#
# `torch.distributed` is the engine, on every backend: gloo for CPU processes (what this
# chapter's check runs), NCCL for GPUs. Point-to-point transfers are `dist.P2POp(dist.isend,
# tensor, peer)` and `dist.P2POp(dist.irecv, buffer, peer)`, posted together with
# `reqs = dist.batch_isend_irecv([...])` and completed with `req.wait()` for each request. Posting
# both at once is what avoids the ordering deadlock of blocking sends and receives, the mesh kernel's
# "send before anyone receives" constraint. PyTorch has a prototype,
# `torch.distributed.tensor.experimental.context_parallel`, that swaps SDPA for context-parallel
# attention; by default it all-gathers K and V (its `rotate_method` is ALL_GATHER) rather than
# passing them round a ring, and it does not run on CPU processes with gloo, so this chapter
# writes the ring itself.
#
# Each rank needs one more thing for a **causal** mask: the positions of its queries and of the
# keys it holds, which travel with the keys. `block_attention` computes a block's partial
# $(O, \text{LSE})$ from them (a key is visible to a query when its position is not later).

# %%
def block_attention(q, k, v, q_pos, k_pos, causal):
    """Partial (O, LSE) of q (B, H_q, n, d) over one K/V block (B, H_kv, n_k, d); positions
    q_pos (n,), k_pos (n_k,) in the whole sequence. Materialises the (n, n_k) scores."""
    G = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        s = s.masked_fill(k_pos[None, :] > q_pos[:, None], -math.inf)
    lse = torch.logsumexp(s, dim=-1)                      # -inf for a row with no visible key
    p = torch.exp(s - torch.where(lse == -math.inf, 0.0, lse)[..., None])
    return p @ v, lse

# %% [markdown]
# **Causal balance.** Give rank $r$ the $r$-th contiguous slice of a causal sequence and the
# work is lopsided: the last rank's queries see every key, the first rank's see only their own
# slice, and every step waits for the slowest rank. **Zig-zag** shards {cite}`zhu2024ringflash`
# cut the sequence into $2P$ chunks and give rank $r$ chunks $r$ and $2P - 1 - r$: an early
# chunk and a late one, which together see the same number of keys on every rank. (Striped
# shards {cite}`brandon2023striped`, token $t$ on rank $t \bmod P$, balance too.)

# %% tags=["demo"]
fig = ch8.plot_zigzag_work(world_size=4, n=64)

# %% [markdown]
# **Exercise 4a (1 point).** Write `zigzag_chunks(rank, world_size)`: the two chunk indices, in
# increasing order, that rank `rank` holds. The check requires every chunk on exactly one rank
# and the same causal work on every rank. One line.

# %% nbgrader={"grade": false, "grade_id": "ch8_zigzag", "locked": false, "schema_version": 3, "solution": true, "task": false}
def zigzag_chunks(rank, world_size):
    """(first, second): the chunks of 2 * world_size that rank holds."""
    ### BEGIN SOLUTION
    return rank, 2 * world_size - 1 - rank
    ### END SOLUTION

# %% nbgrader={"grade": true, "grade_id": "ch8_zigzag_test", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
ch8.check_zigzag(zigzag_chunks)
### BEGIN HIDDEN TESTS
ch8.check_zigzag(zigzag_chunks, hidden=True)
### END HIDDEN TESTS

# %% [markdown]
# **Exercise 4b (3 points).** Write `ring_attention(q, k, v, q_pos, k_pos, causal=False)`, run
# by every rank of the default process group: `q` `(B, H_q, n, d)`, `k` and `v`
# `(B, H_kv, n, d)` are this rank's shard, `q_pos` and `k_pos` `(n,)` int64 their positions in
# the whole sequence. Return this rank's `(O, LSE)`: `O` in q's dtype, `LSE` `(B, H_q, n)`.
# Start from the empty state; in each of the $P$ steps, first post this block's K, V and
# positions to rank `(rank + 1) % P` and the receives of the next block from rank
# `(rank - 1) % P` (no posting at the last step), then merge `block_attention` of the block you
# hold (with `merge` and `as_state`), then wait and take the received block. The check runs your
# function in 2 processes (4 in the hidden tests) over gloo, started the way `torchrun` starts
# them, on zig-zag and contiguous shards, causal and not, GQA, fp64 and fp32, and compares every
# rank's O and LSE with single-process attention: fp64 must match to $10^{-10}$. It also counts
# what each rank sends with `batch_isend_irecv`: its K and V blocks $P - 1$ times (plus the
# positions), and no collective (an all-gather of K and V gives the same numbers, but it is not
# a ring: every rank holds all of K/V and nothing computes under the transfer). A rank that
# raises, or a ring that deadlocks, fails the check within a time limit, and every process is
# killed. About 15 lines.

# %% nbgrader={"grade": false, "grade_id": "ch8_ring", "locked": false, "schema_version": 3, "solution": true, "task": false}
def ring_attention(q, k, v, q_pos, k_pos, causal=False):
    """This rank's queries against every rank's keys, K/V blocks passed around the ring."""
    ### BEGIN SOLUTION
    rank, P = dist.get_rank(), dist.get_world_size()
    send_to, recv_from = (rank + 1) % P, (rank - 1) % P
    rows = q.shape[:-1]
    like = dict(dtype=q.dtype, device=q.device)          # on q's device: CPU or GPU ranks
    state = (torch.full(rows, -math.inf, **like), torch.zeros(rows, **like), torch.zeros_like(q))
    for step in range(P):
        if step < P - 1:                                  # post the hop, then compute under it
            nxt = [torch.empty_like(t) for t in (k, v, k_pos)]
            reqs = dist.batch_isend_irecv(
                [dist.P2POp(dist.isend, t, send_to) for t in (k, v, k_pos)]
                + [dist.P2POp(dist.irecv, t, recv_from) for t in nxt])
        state = merge(state, as_state(*block_attention(q, k, v, q_pos, k_pos, causal)))
        if step < P - 1:
            for req in reqs:
                req.wait()
            k, v, k_pos = nxt
    m, l, o = state
    return o, m + torch.log(l)
    ### END SOLUTION

# %% nbgrader={"grade": true, "grade_id": "ch8_ring_test", "locked": true, "points": 3, "schema_version": 3, "solution": false, "task": false}
ch8.check_ring_attention(ring_attention)
### BEGIN HIDDEN TESTS
ch8.check_ring_attention(ring_attention, hidden=True)
### END HIDDEN TESTS

# %% [markdown]
# **Overlap on GPUs.** With zig-zag shards every ring step after the first is the same amount of
# plain (unmasked) attention on every rank: a block from an earlier rank is seen by all of rank
# $r$'s queries, but only through its first chunk (its second chunk lies after both of rank
# $r$'s); a block from a later rank is seen whole, but only by rank $r$'s second chunk. The first
# step is the rank's own shard with a causal mask. So every step costs the same on every rank, and the
# hop of step $t + 1$'s block only has to be shorter than step $t$'s compute to disappear. The
# chapter's multi-GPU benchmark (`python -m torch.distributed.run --nproc-per-node=P -m
# flashbook.chapters.ch8.ring_bench`) runs this ring with NCCL and Chapter 5's fastest Triton
# forward, and records per step the compute time and the time the GPU waited for the
# transfer. Section 7 quotes its recording on two H200s and draws the timeline.
#
# ### Ulysses: shard the heads, not the sequence
#
# A ring keeps each rank's queries in place and moves K and V past them. DeepSpeed-Ulysses
# {cite}`jacobs2023ulysses` moves everything once instead: each rank starts with a sequence shard
# of q, k and v, all heads, and one **all-to-all** turns them into head shards over the whole
# sequence: rank $j$ receives heads $[jH/P, (j+1)H/P)$ of every rank's positions. Attention
# does not mix heads, so each rank then runs ordinary single-GPU attention over the full
# sequence for its heads (any mask, any kernel, no merge, and no causal imbalance to fix), and a
# second all-to-all sends O (and its LSE) back to sequence shards. Under GQA a rank must hold
# whole groups, its $h_q/P$ query heads with the $h_{kv}/P$ K/V heads they read, so $P$ must
# divide $h_{kv}$: Ulysses stops at $P = h_{kv}$ (8 for Llama-3-70B), where a ring does not stop.
#
# `dist.all_to_all_single(out, inp)` (gloo runs it on CPU processes, NCCL on GPUs) cuts `inp`
# along its first dimension into $P$ equal parts, sends part $j$ to rank $j$, and writes the part
# received from rank $j$ into `out[j]`. So cut a tensor `(B, H, n, ...)` into `(P, B, H/P, n,
# ...)`, heads grouped by the rank they go to, exchange, and lay what came back along the
# sequence: rank 0's positions, then rank 1's. The positions travel too (`dist.all_gather`, a few
# bytes), so `block_attention` can apply the causal mask to zig-zag shards.
#
# **Exercise 5 (2 points).** Write `ulysses_attention(q, k, v, q_pos, k_pos, causal=False)`, with
# the arguments and the result of `ring_attention`: this rank's sequence shard in, this rank's
# `(O, LSE)` out. Raise `ValueError` (saying that P must divide h_kv) when the world size does not
# divide `k.shape[1]`. Send $h_{kv}$ heads of K and V, not K/V repeated for the query heads. The
# check runs it in 2 processes (4 in the hidden tests), GQA, causal and not, zig-zag and
# contiguous shards, compares every rank's O and LSE with single-process attention (fp64 to
# $10^{-10}$), and counts what each rank sends: exactly $(P-1)/P$ of its q, k and v shards and of
# its O and LSE (the part for itself stays), through all-to-alls; no point-to-point ring, no
# all-gather of K/V. It also gives your function a world size that does not divide $h_{kv}$ and
# expects the ValueError. About 20 lines.

# %% nbgrader={"grade": false, "grade_id": "ch8_ulysses", "locked": false, "schema_version": 3, "solution": true, "task": false}
def ulysses_attention(q, k, v, q_pos, k_pos, causal=False):
    """This rank's sequence shard of attention, computed as head shards of the whole sequence."""
    ### BEGIN SOLUTION
    P = dist.get_world_size()
    if k.shape[1] % P:
        raise ValueError(f"Ulysses needs P to divide h_kv (whole GQA groups per rank): "
                         f"P = {P}, h_kv = {k.shape[1]}")

    def to_heads(t):          # (B, H, n, ...) -> (B, H/P, P n, ...): head group j to rank j
        parts = t.unflatten(1, (P, -1)).movedim(1, 0).contiguous()      # (P, B, H/P, n, ...)
        got = torch.empty_like(parts)
        dist.all_to_all_single(got, parts)                  # got[j]: rank j's positions
        return got.movedim(0, 2).flatten(2, 3)

    def to_sequence(t):       # (B, H/P, P n, ...) -> (B, H, n, ...): positions back to owners
        parts = t.unflatten(2, (P, -1)).movedim(2, 0).contiguous()      # (P, B, H/P, n, ...)
        got = torch.empty_like(parts)
        dist.all_to_all_single(got, parts)                  # got[j]: head group j
        return got.movedim(0, 1).flatten(1, 2)

    def gather(pos):
        parts = [torch.empty_like(pos) for _ in range(P)]
        dist.all_gather(parts, pos)
        return torch.cat(parts)

    o, lse = block_attention(to_heads(q), to_heads(k), to_heads(v), gather(q_pos),
                             gather(k_pos), causal)
    return to_sequence(o), to_sequence(lse)
    ### END SOLUTION

# %% nbgrader={"grade": true, "grade_id": "ch8_ulysses_test", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
ch8.check_ulysses(ulysses_attention)
### BEGIN HIDDEN TESTS
ch8.check_ulysses(ulysses_attention, hidden=True)
### END HIDDEN TESTS

# %% [markdown]
# ### All-gather: what PyTorch's `context_parallel` does by default
#
# The third way gathers instead of passing: every rank all-gathers K and V (`dist.all_gather`,
# one collective) and attends its own queries to the whole sequence at once. Under GQA this is
# cheap: K and V have $h_{kv}$ heads, 8 where Llama-3-70B has 64 query heads, so gathering all
# of K and V sends the same bytes as the ring ($2 (N/P) h_{kv} d$ per rank to each of the
# $P - 1$ others) in one call, and the attention needs no merge. What it gives up is the
# overlap: nothing computes while the gather runs (unless the next layer's gather is started
# under this layer's attention), and each rank holds all of K and V for the layer, $O(N)$ memory
# rather than $O(N/P)$. PyTorch's prototype `context_parallel` does this by default
# (`rotate_method` ALL_GATHER); its other method passes K/V round a ring. The cell below runs the
# three methods over gloo on one small problem and prints the bytes each rank sent, counted by
# the checks' counter, beside the formulas of the next table.

# %%
def allgather_attention(q, k, v, q_pos, k_pos, causal=False):
    """All-gather context parallelism: gather K, V (h_kv heads) and their positions, attend."""
    P = dist.get_world_size()
    ks, vs, ps = ([torch.empty_like(t) for _ in range(P)] for t in (k, v, k_pos))
    for parts, t in ((ks, k), (vs, v), (ps, k_pos)):
        dist.all_gather(parts, t)
    return block_attention(q, torch.cat(ks, 2), torch.cat(vs, 2), q_pos, torch.cat(ps), causal)

# %% tags=["demo"]
case = ch8.ShardedCase("traffic demo", 64, H_q=8, H_kv=2, d=16, causal=True, layout="zigzag")
methods = {name: fn for name, fn in (("ring", ring_attention), ("all-gather", allgather_attention),
                                     ("Ulysses", ulysses_attention)) if not fb.check.is_stub(fn)}
counted = ch8.counted_traffic(methods, case, world_size=2)
formula = ch8.cp_traffic(case.n, 2, case.H_q, case.H_kv, case.d, itemsize=8)
print(f"N={case.n}, P=2, h_q={case.H_q}, h_kv={case.H_kv}, d={case.d}, float64; rank 0 sent:")
for name, c in counted.items():
    print(f"{name:10s} {c['bytes']:6d} bytes counted, {formula[name]['bytes']:6d} by the formula "
          f"(+ positions), calls {c['calls']}")

# %% [markdown]
# ### Bytes and steps: the ring, all-gather and Ulysses
#
# Per rank, for one attention forward over $N$ tokens on $P$ ranks, in elements sent to other
# ranks (multiply by the element size; the positions are a few bytes more):
#
# | method | elements sent per rank | communication steps | constraint |
# |---|---|---|---|
# | ring | $2 \frac{N}{P} h_{kv} d\,(P-1)$ | $P - 1$ point-to-point, each under a block of compute | none |
# | all-gather | $2 \frac{N}{P} h_{kv} d\,(P-1)$ | 1 all-gather, exposed | holds all of K, V |
# | Ulysses | $\frac{N}{P}\,(2h_q + 2h_{kv})\,d\,\frac{P-1}{P}$ (+ $\frac{N}{P} h_q \frac{P-1}{P}$ of LSE) | 2 all-to-alls, exposed | $P$ divides $h_{kv}$ |
#
# The ring and the all-gather send every K/V element to every other rank: about $2 N h_{kv} d$
# per rank whatever $P$. Ulysses sends each of q, k, v and O once, minus the part that stays:
# about $2 N (h_q + h_{kv}) d / P$ per rank, which falls as $P$ grows. Their ratio is
# $\text{Ulysses} / \text{ring} = (h_q + h_{kv}) / (P\,h_{kv}) = (G + 1)/P$ with $G = h_q/h_{kv}$:
# Ulysses moves fewer bytes when $P > G + 1$. Without GQA ($G = 1$) that is every $P > 2$ (equal
# at $P = 2$), and at $P = 8$ a quarter of the ring's bytes. With GQA the K/V heads are few and
# the ring's traffic small, while Ulysses must also move the $h_q$ heads of q and O; and
# $P \le h_{kv}$ caps $P$ at $h_{kv}$, so with $G + 1 > h_{kv}$ Ulysses can never move fewer
# bytes than a ring: for Llama-3-70B ($G = 8$, $h_{kv} = 8$) it sends about $9/8$ of the ring's bytes
# at $P = 8$ and $4.5$ times at $P = 2$ (the cell below). Bytes are not the whole story: the
# ring's $P - 1$ steps hide under compute once a step's FLOPs per byte pass the GPU's FLOP/s over
# its link bandwidth (Section 6), while the all-gather's and Ulysses' transfers are exposed (or
# hidden only by overlapping them with other layers' work) but are one or two calls, with no
# compute step to wait on between hops (NCCL may still run an all-gather as a ring inside). What
# the formulas say, then: under GQA the ring and the all-gather move the fewest bytes; at short
# $N/P$, where a ring step's compute is too short to hide its hop, the ring's $P - 1$ steps and
# merges are overhead the all-gather's single call avoids, and at long $N/P$ the ring hides the
# same bytes the all-gather exposes. Ulysses pays for models with few query heads per K/V head
# (MHA, small $G$) on $P > G + 1$ GPUs with fast all-to-all links (within a node), where its
# traffic falls as $1/P$ and each GPU runs a plain full-sequence kernel. Past $P = h_{kv}$ only
# the ring and the all-gather remain (or a hybrid: Ulysses within a node, a ring across nodes).
# These are byte counts, not measurements: this chapter times only the ring (Section 7).

# %% tags=["demo"]
print("Llama-3-70B attention (h_q=64, h_kv=8, d=128, fp16), MiB sent per GPU, one layer's forward")
print("     N   P      ring  all-gather   Ulysses   steps (ring, all-gather, Ulysses)")
for r in ch8.traffic_rows(sizes=(32768, 131072, 262144), worlds=(2, 8)):
    print(f"{r['N']:6d}  {r['P']:2d}  {r['ring MiB']:8.0f}  {r['all-gather MiB']:10.0f}  "
          f"{r['Ulysses MiB']:8.0f}   {r['ring steps']}, {r['all-gather steps']}, "
          f"{r['Ulysses steps']}")

# %% [markdown]
# **The backward, and Chapter 9.** Ring attention's backward runs the same ring. Each rank keeps
# its q, O, dO and LSE, and K/V blocks travel as before; at each step the rank computes, for the
# block it holds, its share of dQ (accumulated locally) and the block's dK and dV from its own
# queries. Those partial dK, dV belong to the block's owner, so they travel with the block: each
# step a rank adds its contribution to the dK/dV buffers that arrived with the block and passes
# them on, and after $P$ hops the block, and its gradients, complete, are back with their
# owner. The backward sends twice the forward's bytes per step (K, V and dK, dV), and it needs
# the LSE this chapter's forward returns. Chapter 9 derives the single-GPU backward these steps
# are made of.
#
# ## 6. What context parallelism costs as N grows
#
# Per GPU, ring attention holds its $N/P$ rows of Q, K, V and O, one K/V block in flight and
# fp32 accumulators: memory $O(N/P)$, so $P$ GPUs fit a $P$ times longer sequence. Each step
# sends $2 \cdot (N/P) \cdot h_{kv} \cdot d$ elements, $P - 1$ times: every rank receives all
# of K and V, $O(N)$ bytes, whatever $P$. And each step computes $4 (N/P)^2 d\, h_q$ FLOPs
# (half of it causal): the FLOPs per byte sent grow with $N/P$. Once they exceed the GPU's peak
# FLOP/s over its link bandwidth, the transfer hides behind the compute; below that the ring is
# bound by its links. The figure uses H200 datasheet values (989 dense fp16 TFLOP/s, NVLink 4 at
# 450 GB/s per direction): the crossing is a few thousand tokens per GPU.

# %% tags=["demo"]
for N in (32768, 131072, 262144, 1048576):
    c = ch8.cp_costs(N, P=8)
    print(f"N={N:8d}, 8 GPUs: {c['held_gib']:6.2f} GiB held per GPU, {c['sent_per_step_mib']:7.1f} "
          f"MiB sent per step, {c['flops_per_byte']:8.0f} FLOPs per byte sent")
fig = ch8.plot_cp_costs(P=8, peak_tflops=989.0, link_gbps=450.0)

# %% tags=["remove-cell"]
# The figures the prose quotes, from the recorded H200 data: the book pastes each into its
# glue:text role (myst-nb's glue); elsewhere this does nothing.
from flashbook import quoted
quoted.glue(ch8.CHAPTER)

# %% [markdown]
# ## 7. Benchmark
#
# `flashbook bench ch8` measures on one H200 a batch-1 decode step at context 131072 with
# $h_q = 32$, $h_{kv} = 8$, $d = 128$, fp16: the split-KV kernels of Exercise 2 (split count from
# `choose_num_splits`, and a sweep of split counts), Chapter 5's decode kernel without splits,
# cuDNN and FlashAttention-2 through SDPA and compiled FlexAttention, with `hbm_read`, the read
# rate of a plain copy, measured in the same run (a reference, not a ceiling: cuDNN's kernel
# reads faster). Decode rows report the bytes of K and V read per second.
# The multi-GPU ring (`python -m torch.distributed.run --nproc-per-node=P -m
# flashbook.chapters.ch8.ring_bench`, NCCL, one process per GPU) runs at N = 32768, 131072 and
# 262144, 16 heads of d = 128 in fp16, causal (zig-zag) and not, against one GPU running the
# whole problem with the same kernel (Chapter 5's two-tile kernel, which returns the LSE the
# merge needs) and against PyTorch's prototype `context_parallel` where it runs.
#
# **Measured on H200s** (the figures below are read from the recorded data). Every kernel is
# timed replayed from a CUDA graph; beside them, `decode_split_kv(q, k_cache, v_cache,
# cache_seqlens)` is timed as you call it (checks on, split count chosen, launched), and the
# first figure is that call's. At batch 1 and
# context 131072, split-KV reads {glue:text}`ch8_split_gbps:.0f` GB/s,
# {glue:text}`ch8_split_vs_cudnn:.2f`x cuDNN ({glue:text}`ch8_cudnn_gbps:.0f`) and
# {glue:text}`ch8_split_pct_hbm_read:.0f` % of `hbm_read` ({glue:text}`ch8_hbm_read_gbps:.0f`);
# replayed from a CUDA graph its kernels read {glue:text}`ch8_split_kernels_gbps:.0f` GB/s,
# {glue:text}`ch8_split_kernels_vs_cudnn:.2f`x cuDNN, as fast as a plain copy.
# The step takes an eighth of a millisecond, and launching its two kernels, rather than
# replaying them, is a tenth of it (launched without the checks, `python -m flashbook.overhead`,
# they take as long as the call): a serving engine captures its whole decode step in a CUDA
# graph for this reason. Compiled FlexAttention is the
# low bar of the figure: at batch 1 with one query token its kernel is not built for decode,
# and it reads the cache at a small fraction of the others' rate. Chapter 5's decode kernel is
# the contrast:
# without splits the same cache reads at {glue:text}`ch8_no_split_gbps:.0f` GB/s, with 8 programs (one per K/V head) for 132
# SMs. The split count matters as much as the kernel: 8 splits give half the bandwidth of 32.
#
# On two H200s joined by NVLink,
# at N = 131072 causal the ring takes {glue:text}`ch8_ring_ms:.1f` ms on two GPUs against
# {glue:text}`ch8_one_gpu_ms:.1f` ms on one: {glue:text}`ch8_ring_efficiency:.1f` % scaling efficiency.
# Each K/V hop (1.8 ms alone) is hidden behind a
# step of attention twenty times longer, so the exposed wait per step is a few microseconds
# (the timeline on the right). PyTorch's `context_parallel` takes
# {glue:text}`ch8_context_parallel_ms:.1f` ms at the same size: it
# runs cuDNN's attention kernel on the K and V it all-gathers (its default), not in a ring, and
# on one GPU cuDNN's kernel leads ours by a
# similar margin (Chapter 5). At N = 32768 the steps shrink to a few milliseconds and the fixed costs of a step
# (launches, the merge) show: 85 %.

# %% tags=["demo"]
if fb.bench.needs_gpu("the split-KV benchmark") and not fb.check.is_stub(split_kv_kernel):
    B, h_q, h_kv, context, d = 1, 32, 8, 131072, 128
    q = torch.randn(B, 1, h_q, d, device="cuda", dtype=torch.float16)
    k_cache, v_cache = (torch.randn(B, context, h_kv, d, device="cuda", dtype=torch.float16)
                        for _ in range(2))
    lengths = torch.full((B,), context, dtype=torch.int32, device="cuda")
    q4, k4, v4 = (t.transpose(1, 2) for t in (q, k_cache, v_cache))
    kv_bytes = k_cache.nbytes + v_cache.nbytes
    for name, fn in (("split-KV (yours)", lambda: ch8.launch_split_kv(
                         split_kv_kernel, combine_kernel, q, k_cache, v_cache, lengths)),
                     ("torch SDPA", lambda: torch.nn.functional.scaled_dot_product_attention(
                         q4, k4, v4, enable_gqa=True))):
        ms = fb.bench.time_ms(fn)
        print(f"{name:17s} {ms:.3f} ms: {kv_bytes / ms / 1e6:.0f} GB/s of K and V read")

# %% tags=["demo"]
from flashbook.chapters.ch8 import recorded as ch8_recorded
decode, ring = results.recorded("ch8", "h200"), results.recorded("ch8", "h200x2")
if decode and ring:
    print(ch8_recorded.summary(decode, ring))
    fig = ch8_recorded.plot_decode(decode)
    fig.suptitle(results.describe(decode.provenance), fontsize=8, y=1.0)
    fig = ch8_recorded.plot_ring(ring)
    fig.suptitle(f"{ch8_recorded.world_size(ring.provenance)} GPUs: "
                 + results.describe(ring.provenance) + f", NCCL {ring.provenance.get('nccl')}",
                 fontsize=8, y=1.0)
else:
    print("No recorded GPU data for this chapter in this installation.")

# %% [markdown]
# ## What was measured, and what is left
#
# On a CPU this chapter measured what its cells print: the merge's properties, the error of each
# wire format, split-KV's independence of the split count, the mesh kernel's deadlock and the costs of
# a chain and a tree, a ring and Ulysses over 2 and 4 gloo processes exact against one process,
# and the bytes each context-parallel method sends, counted against its formula. On
# H200s, Section 7 recorded split-KV at a plain copy's read rate and the ring at 95.6 % scaling
# efficiency on two GPUs, with its communication hidden; runs on 4 and 8 GPUs are the next
# measurements this chapter needs.
#
# **Further reading**
# * Flash-Decoding {cite}`dao2023flashdecoding`: split-KV for long-context inference.
# * Ring attention {cite}`liu2023ring`; striped attention {cite}`brandon2023striped`; zig-zag
#   shards as ring-flash-attention implements them {cite}`zhu2024ringflash`.
# * DeepSpeed-Ulysses {cite}`jacobs2023ulysses`: all-to-alls between sequence and head shards.
# * Collective algorithms (chains, trees, recursive doubling) {cite}`thakur2005collectives`.
# * The online softmax the merge generalises {cite}`milakov2018online`.
