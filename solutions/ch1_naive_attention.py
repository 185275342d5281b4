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
# # Chapter 1: Naive attention, and why it is slow
#
# **What you will learn**
# - the maths of scaled dot-product attention and the shape of every tensor in it;
# - why softmax must be *stabilised*, and what the log-sum-exp (LSE) is;
# - the conventions every later chapter keeps (scale, causal alignment, empty rows);
# - why the textbook implementation is **memory-bound**: it moves $O(N^2)$ bytes for
#   $O(N^2 d)$ FLOPs, and what that means on a roofline.
#
# **What you need**: any runtime with torch >= 2.11. A GPU (a free Colab T4 is plenty) makes the
# measurements real; on a CPU runtime everything runs at small sizes. About 45 minutes.
#
# **Exercises** (10 points): a stable softmax (3), naive attention with LSE and an optional
# causal mask (3 + 2), and a model of its memory traffic (2).

# %%
import flashbook as fb

# first: on a CPU-only runtime this switches on the simulators; it prints the versions it needs
backend = fb.setup(needs=("torch",))

import math

import matplotlib.pyplot as plt
import torch

from flashbook.chapters import ch1

# %% [markdown]
# ## 1. Scaled dot-product attention
#
# A head of attention takes queries $Q \in \mathbb{R}^{N_q \times d}$, keys
# $K \in \mathbb{R}^{N_k \times d}$ and values $V \in \mathbb{R}^{N_k \times d}$ and returns
#
# $$
# S = s\, Q K^\top \in \mathbb{R}^{N_q \times N_k}, \qquad
# P_{ij} = \frac{e^{S_{ij}}}{\sum_{j'} e^{S_{ij'}}}, \qquad
# O = P V \in \mathbb{R}^{N_q \times d},
# $$
#
# with the softmax scale $s = 1/\sqrt{d}$ by default. Row $i$ of $O$ is an average of the
# value rows, weighted by how well query $i$ matches each key. In a model there are $B$
# sequences and $H$ heads, so the tensors in this book are shaped `(B, H, N, d)` and the
# work is repeated for each of the $B \cdot H$ heads independently.
#
# Counting work: $QK^\top$ is $N_q N_k$ dot products of length $d$ ($2 N_q N_k d$ FLOPs), and
# $PV$ is the same again, so one head costs $4 N_q N_k d$ FLOPs
# (`fb.reference.attention_flops`). The softmax's exponentials are $O(N_q N_k)$: negligible
# next to the matmuls in FLOPs, but not free, as Chapter 3 (Section 6) and Chapter 6 (Hopper)
# will show.

# %% [markdown]
# ## 2. Softmax overflows
#
# $e^x$ exceeds the largest float32 ($3.4 \times 10^{38}$) at $x \approx 88.7$, and the largest
# float16 (65504) already at $x \approx 11.1$. Scores that large are ordinary in a trained
# model, and the naive formula turns them into `inf / inf = nan`:

# %% tags=["demo"]
x = torch.tensor([[1.0, 2.0, 3.0], [1000.0, 1001.0, 1002.0]])
naive = torch.exp(x) / torch.exp(x).sum(-1, keepdim=True)
print("naive softmax:\n", naive)
print("float16 exp(12) =", torch.exp(torch.tensor(12.0, dtype=torch.float16)).item())

# %% [markdown]
# Softmax does not change when the same constant is subtracted from every entry of a row:
# $\frac{e^{x_j - m}}{\sum_{j'} e^{x_{j'} - m}} = \frac{e^{x_j}}{\sum_{j'} e^{x_{j'}}}$.
# Choosing $m = \max_j x_j$ makes every exponent $\le 0$, so nothing overflows, and the
# largest term is exactly $e^0 = 1$, so the sum is at least 1 and nothing underflows to 0/0.
#
# One more case matters for attention: a row in which **every** entry is $-\infty$ (a query
# that is masked from every key). Then $m = -\infty$ and $x - m = -\infty - (-\infty) = $ `nan`.
# The book's convention is that such a row has probability 0 everywhere (and, later, output 0).
#
# ### Exercise 1 (3 points): a stable softmax
# Write `softmax(x)` over the last axis of a tensor of any shape. Requirements:
# - no overflow for entries as large as $\pm 10^4$;
# - entries equal to $-\infty$ get probability 0; a row of only $-\infty$ gives all zeros;
# - the result has the input's dtype (compute in float32 or wider internally for float16);
# - do not call `torch.softmax` or its relatives: the point is to write it.

# %% nbgrader={"grade": false, "grade_id": "ch1_softmax", "locked": false, "schema_version": 3, "solution": true, "task": false}
def softmax(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the last axis. x: (..., n) -> (..., n), same dtype as x."""
    # Hint: about 6 lines. torch.amax, torch.where and torch.isfinite help with -inf rows.
    ### BEGIN SOLUTION
    work = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    m = work.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))   # all -inf row: avoid -inf - -inf
    e = torch.exp(work - m)                                      # every exponent <= 0
    total = e.sum(dim=-1, keepdim=True)
    p = torch.where(total > 0, e / total, torch.zeros_like(e))
    return p.to(x.dtype)
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "ch1_softmax_test", "locked": true, "points": 3, "schema_version": 3, "solution": false, "task": false}
ch1.check_softmax(softmax)
### BEGIN HIDDEN TESTS
ch1.check_softmax(softmax, hidden=True)   # more cases, and torch's own softmax switched off
### END HIDDEN TESTS

# %% [markdown]
# ## 3. The log-sum-exp, and the book's conventions
#
# The normaliser of row $i$ is worth keeping. Its logarithm,
#
# $$
# \mathrm{LSE}_i = \log \sum_j e^{S_{ij}} = m_i + \log \sum_j e^{S_{ij} - m_i},
# $$
#
# is what the backward pass (Chapter 9) needs to recompute $P_{ij} = e^{S_{ij} - \mathrm{LSE}_i}$ without
# storing $P$, and what lets two partial attention results be merged exactly (Chapters 3 and 8).
# Every attention function in this book returns it. The conventions, kept by every chapter
# (the kernels this book starts from, listed in the preface, disagree on each of them; their
# chapters show the conversions):
#
# | | convention |
# |---|---|
# | shapes | `q`: `(B, H, N_q, d)`; `k`, `v`: `(B, H, N_k, d)`; `O` like `q`; `LSE`: `(B, H, N_q)`, float32 |
# | scale | `scale` defaults to $1/\sqrt{d}$ and multiplies $S$ in float32 (never the fp16 inputs) |
# | LSE | natural log (kernels may work in base 2 inside and convert: $\ln x = \log_2 x \cdot \ln 2$) |
# | causal | aligned **bottom-right**: query $i$ sees key $j$ iff $j \le i + (N_k - N_q)$ |
# | empty rows | a query that sees no key gets $O = 0$ and $\mathrm{LSE} = -\infty$, never NaN |
#
# Bottom-right alignment is what decoding needs: the last query is the newest token and sees
# every key. With $N_q > N_k$ the first $N_q - N_k$ queries see nothing at all.
# [Chapter 4](ch4_masks_varlen.ipynb) builds this mask into a kernel, with sliding windows and
# packed batches of sequences, and skips the tiles it hides:

# %% tags=["demo"]
fig, axes = plt.subplots(1, 3, figsize=(9, 3))
for ax, (nq, nk) in zip(axes, [(6, 6), (3, 7), (7, 3)]):
    ax.imshow(fb.reference.causal_mask(nq, nk), cmap="Blues", vmin=0, vmax=1.3)
    ax.set_title(f"N_q={nq}, N_k={nk}")
    ax.set_xlabel("key j")
    ax.set_ylabel("query i")
fig.suptitle("causal masks, aligned bottom-right (blue: visible)")
fig.tight_layout()
plt.show()

# %% [markdown]
# ### Exercise 2 (3 + 2 points): naive attention with LSE
# Write `naive_attention(q, k, v, scale=None, causal=False)` returning `(O, LSE)` with the
# conventions above. Compute $S$, the mask and the softmax in float32 (or wider) whatever the
# input dtype, and return `O` in the input dtype. Use your `softmax`. The first test cell
# checks the unmasked cases, the second the causal ones, including $N_q \neq N_k$.

# %% nbgrader={"grade": false, "grade_id": "ch1_attention", "locked": false, "schema_version": 3, "solution": true, "task": false}
def naive_attention(q, k, v, scale=None, causal=False):
    """q: (B, H, N_q, d), k, v: (B, H, N_k, d) -> O (B, H, N_q, d), LSE (B, H, N_q) float32."""
    # Hint: about 10 lines. fb.reference.causal_mask(N_q, N_k) gives the visible pairs.
    ### BEGIN SOLUTION
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale      # (B, H, N_q, N_k)
    if causal:
        visible = fb.reference.causal_mask(q.shape[-2], k.shape[-2], device=q.device)
        s = s.masked_fill(~visible, float("-inf"))
    p = softmax(s)
    o = torch.matmul(p, v.float()).to(q.dtype)
    m = s.amax(dim=-1)
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    lse = m_safe + torch.log(torch.exp(s - m_safe[..., None]).sum(dim=-1))   # log 0 = -inf
    return o, lse
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "ch1_attention_test", "locked": true, "points": 3, "schema_version": 3, "solution": false, "task": false}
ch1.check_attention(naive_attention, causal=False)
### BEGIN HIDDEN TESTS
ch1.check_attention(naive_attention, causal=False, hidden=True)   # more cases, float32 + float16
### END HIDDEN TESTS

# %% nbgrader={"grade": true, "grade_id": "ch1_attention_causal_test", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
ch1.check_attention(naive_attention, causal=True)
### BEGIN HIDDEN TESTS
ch1.check_attention(naive_attention, causal=True, hidden=True)   # more cases, float32 + float16
### END HIDDEN TESTS

# %% [markdown]
# ## 4. Where the time goes: bytes, not FLOPs
#
# Written with library calls, naive attention is three kernels, and each one reads its inputs
# from the GPU's main memory (HBM) and writes its output back:
#
# | kernel | reads | writes |
# |---|---|---|
# | $S = s\,QK^\top$ | $Q$, $K$: $2Nd$ | $S$: $N^2$ |
# | $P = \mathrm{softmax}(S)$ | $S$: $N^2$ | $P$: $N^2$ |
# | $O = PV$ | $P$: $N^2$, $V$: $Nd$ | $O$: $Nd$ |
#
# (elements per head, with $N_q = N_k = N$). The $N \times N$ matrices dominate: for $N = 4096$
# and $d = 64$ they are 64 times larger than $Q$, $K$, $V$ and $O$ together.
#
# ### Exercise 3 (2 points): the traffic model
# Write `naive_traffic(B, H, N, d, bytes_per_element)` returning a dict with the total
# `"flops"` of the two matmuls and the total `"bytes"` the three kernels above move, for all
# $B \cdot H$ heads. Use integers (exact counts).

# %% nbgrader={"grade": false, "grade_id": "ch1_traffic", "locked": false, "schema_version": 3, "solution": true, "task": false}
def naive_traffic(B, H, N, d, bytes_per_element):
    """FLOPs and HBM bytes of the three-kernel naive attention (N_q = N_k = N)."""
    # Hint: 3 lines.
    ### BEGIN SOLUTION
    flops = 4 * B * H * N * N * d
    elements = B * H * (4 * N * d + 4 * N * N)
    return {"flops": flops, "bytes": elements * bytes_per_element}
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "ch1_traffic_test", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
ch1.check_traffic(naive_traffic)
### BEGIN HIDDEN TESTS
ch1.check_traffic(naive_traffic, hidden=True)
### END HIDDEN TESTS

# %% [markdown]
# ### The roofline
# Divide FLOPs by bytes and you get the **arithmetic intensity**: how much work each byte
# fetched from HBM pays for. A GPU can do at most $\min(\text{peak FLOP/s},\ \text{intensity}
# \times \text{bandwidth})$. For large $N$ the naive version does about
# $4N^2d / (4N^2 e) = d/e$ FLOPs per byte ($e$ bytes per element): 32 for fp16 at $d = 64$,
# whatever $N$ is. An H200 needs about 206 FLOPs per byte to keep its tensor cores busy, so naive
# attention can never reach more than about 15% of the chip. A *fused* kernel that keeps $S$ and
# $P$ on chip moves only $Q, K, V, O$ ($4Nd$ elements), so its intensity grows with $N$
# ($N/e$): that is the whole idea of FlashAttention, and the rest of this book.

# %% tags=["demo"]
h200 = fb.bench.PEAKS["H200"]
try:
    naive = naive_traffic(1, 16, 4096, 64, 2)   # your model from Exercise 3
    fused_bytes = 2 * 16 * 4 * 4096 * 64         # Q, K, V read once, O written once
    points = {"naive, N=4096, d=64": naive["flops"] / naive["bytes"],
              "fused, N=4096, d=64": naive["flops"] / fused_bytes}
    fb.viz.roofline(h200[0], h200[2], points,
                    title="H200 roofline, fp16 tensor cores (datasheet peaks)")
    plt.show()
except NotImplementedError:
    print("Finish Exercise 3 to place naive and fused attention on the roofline.")

# %% [markdown]
# ## 5. Measured: time and memory as N grows
#
# The cell below times the naive three-kernel version (`ch1.benchmark.naive_attention`)
# against `torch.nn.functional.scaled_dot_product_attention` (SDPA), which on a GPU dispatches
# to fused kernels, and records the peak extra memory each needs.
#
# On a GPU the memory column is exact (the caching allocator's peak counter), and both panels
# are log-log: naive memory grows as $N^2$, fused memory as $N$. On a CPU runtime it is only an
# estimate: the rise of the process's resident memory during the call, counted in whole 4 KiB
# pages, and **0 whenever the allocator reuses memory the process already holds**. SDPA's few
# small buffers usually are reused, so its CPU numbers are noise around 0 (a few tenths of a
# MiB, or exactly 0, changing from run to run), and a log axis could not even draw a 0. So on a
# CPU the memory panel has a linear axis, with the size of $S$ and $P$ ($2 B H N^2$ floats,
# dotted) for scale: only the naive version's growth toward that line is a real trend there.

# %% tags=["demo"]
if backend.gpu:
    rows = ch1.benchmark.sweep([512, 1024, 2048, 4096, 8192], B=1, H=16, d=64,
                               dtype=torch.float16, device="cuda", baselines=(None,))
else:
    rows = ch1.benchmark.sweep([128, 256, 512, 1024], B=1, H=4, d=32, dtype=torch.float32,
                               device="cpu", baselines=(None,))
print(fb.results.table(rows))
title = f"this runtime ({backend.name}): naive vs SDPA"
if backend.gpu:
    fb.results.plot(rows, y=("ms", "peak_mib"), logx=True, logy=True, title=title)
else:
    fig, (ax_time, ax_mem) = plt.subplots(1, 2, figsize=(10, 3.8))
    fb.results.plot(rows, y="ms", ax=ax_time, logx=True, logy=True)
    r0 = rows[0]
    Ns = sorted({r.N_q for r in rows})
    ax_mem.plot(Ns, [2 * r0.B * r0.H_q * n * n * 4 / 2**20 for n in Ns], ":", color="grey",
                label="S and P (model)")
    fb.results.plot(rows, y="peak_mib", ax=ax_mem, logx=True)   # linear y: a 0 stays visible
    ax_mem.legend(fontsize=8)
    ax_mem.set_title("CPU: page-granular estimate, 0 when memory is reused", fontsize=9)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
plt.show()

# %% [markdown]
# And measured once on an NVIDIA H200 with `flashbook bench ch1` (fp16, $B=1$, $H=16$, $d=64$),
# with each SDPA backend forced in turn; the naive version runs out of the GPU's memory where
# its line stops (the dashed line):

# %% tags=["demo"]
recorded = fb.results.recorded("ch1", "h200")
if recorded is None:
    print("No recorded GPU data in this installation.")
else:
    fb.results.plot(recorded.rows, y=("ms", "peak_mib"), logx=True, logy=True,
                    title="H200: " + fb.results.describe(recorded.provenance))
    plt.show()
    big = max(r.N_q for r in recorded.rows if r.kernel == "naive_torch" and r.ms)
    for r in recorded.rows:
        if r.N_q != big:
            continue
        name = r.kernel + (" (as called)" if r.role == "public" else "")
        if r.ms is None:
            print(f"N={big}: {name:<28} {r.note}")
        else:
            memory = "" if r.peak_mib is None else f"{r.peak_mib:10.0f} MiB"
            print(f"N={big}: {name:<28} {r.ms:8.2f} ms  {r.tflops:7.1f} TFLOP/s  {memory}")

# %% [markdown]
# ### The traffic model against the measurement
# If naive attention is memory-bound, its time should be about its bytes divided by the HBM
# bandwidth. The cell below takes your `naive_traffic` for each recorded H200 size, divides by
# the datasheet's 4.8 TB/s (`fb.bench.PEAKS`), and sets the prediction beside the measured time.
# The benchmark's version (`ch1.benchmark.naive_attention`) is written as `(q @ k^T) * scale`,
# so it runs **four** kernels: the multiply by the scale is a separate pass that reads and writes
# $S$ once more, $2N^2$ elements per head. The column `+ scale pass` adds it to your model.

# %% tags=["demo"]
if recorded is not None:
    bandwidth = fb.bench.PEAKS["H200"][2] * 1e9                       # bytes per second
    try:
        print(f"{'N':>6} {'model GB':>9} {'predicted ms':>13} {'+ scale pass':>13} "
              f"{'measured ms':>12} {'measured / predicted':>21}")
        for r in recorded.rows:
            if r.kernel != "naive_torch" or r.role == "public" or r.ms is None:
                continue
            e = torch.empty((), dtype=getattr(torch, r.dtype)).element_size()
            nbytes = naive_traffic(r.B, r.H_q, r.N_q, r.d, e)["bytes"]
            predicted = nbytes / bandwidth * 1e3
            with_scale = (nbytes + 2 * r.B * r.H_q * r.N_q**2 * e) / bandwidth * 1e3
            print(f"{r.N_q:>6} {nbytes / 1e9:9.3f} {predicted:13.4f} {with_scale:13.4f} "
                  f"{r.ms:12.4f} {r.ms / predicted:12.2f} ({r.ms / with_scale:.2f})")
    except NotImplementedError:
        print("Finish Exercise 3 to compare your traffic model with the measurement.")

# %% tags=["remove-cell"]
# The figures the prose quotes, from the recorded H200 data: the book pastes each into its
# glue:text role (myst-nb's glue); elsewhere this does nothing.
from flashbook import quoted
quoted.glue(ch1.CHAPTER)

# %% [markdown]
# The model gets the growth right: from $N = 1024$ to $N = 32768$ the bytes grow by a factor of
# 1024 ($N^2$) and the measured time by a factor of {glue:text}`ch1_growth:.0f`. It is too
# optimistic everywhere: the measurement is {glue:text}`ch1_vs_model_min:.1f`x to
# {glue:text}`ch1_vs_model_max:.1f`x the three-kernel prediction, and still
# {glue:text}`ch1_vs_scaled_min:.1f`x to {glue:text}`ch1_vs_scaled_max:.1f`x the prediction with
# the scale pass counted. A bandwidth model is a lower bound, and this one leaves out:
#
# - **kernel launches**: at $N = 512$ the model predicts {glue:text}`ch1_model_us_512:.0f`
#   microseconds, less than the fixed cost of launching four kernels from Python one after the
#   other, a few microseconds each (this chapter's benchmark times each call as Python makes
#   it, launches included);
# - **the bandwidth a kernel really reaches**: 4.8 TB/s is the datasheet's peak; streaming
#   kernels get a fraction of it, and a kernel that moves its bytes in several short passes
#   gets less;
# - **the softmax's own passes**: a row softmax needs the row's maximum and sum before it can
#   write anything; a kernel that cannot keep a whole row on chip reads it more than once, and
#   our model counts one read;
# - **the matmuls' compute**: $4N^2d$ FLOPs are not free even on tensor cores, and the time of
#   the two matmul kernels adds to the time of the memory-bound passes rather than overlapping
#   with them;
# - **caching**: the model sends every byte to HBM. At small $N$ the $S$ of all heads
#   ($16 \cdot 512^2$ fp16 values, 8 MiB at $N = 512$) fits in the H200's L2 cache, so the next
#   kernel may read it from there.
#
# We did not measure which of these costs the most (a profiler's per-kernel times and DRAM
# counters would). What the model does predict, and what holds, is the scaling: the bytes, and
# so the time, grow as $N^2$, and no tuning of the three kernels changes that.

# %% [markdown]
# ### Benchmark your kernel
# On a GPU this times *your* `naive_attention` against SDPA at one size and prints TFLOP/s and
# the share of the GPU's datasheet peak. Your version computes in float32, so expect it to be
# slower than the fp16 naive version above.

# %% tags=["demo"]
if fb.bench.needs_gpu("timing your kernel"):
    B, H, N, d = 1, 16, 4096, 64
    q, k, v = (torch.randn(B, H, N, d, device="cuda", dtype=torch.float16) for _ in range(3))
    try:
        mine = [fb.bench.measure_attention("your naive_attention", "reference",
                                           lambda: naive_attention(q, k, v), B=B, H=H,
                                           N_q=N, N_k=N, d=d, dtype=torch.float16),
                fb.bench.measure_attention("sdpa", "baseline", lambda: fb.bench.sdpa()(q, k, v),
                                           B=B, H=H, N_q=N, N_k=N, d=d, dtype=torch.float16)]
        print(fb.results.table(mine))
    except NotImplementedError:
        print("Implement naive_attention (Exercise 2) first.")

# %% [markdown]
# ## What we measured, and what comes next
#
# - Naive attention is correct but stores two $N \times N$ matrices per head: its memory grows as
#   $N^2$ and runs out long before SDPA's does, and its arithmetic intensity is stuck at $d/e$.
# - Its time follows the traffic model's $N^2$ growth, but the model's bandwidth bound is a floor,
#   not a prediction: the four library kernels spend more than their bytes at 4.8 TB/s would.
# - The fused kernels behind SDPA never write $S$ or $P$ to HBM. Doing that needs the softmax to
#   be computed **in pieces**, a tile of keys at a time, which is the online softmax of
#   Chapter 3. Chapter 2 starts from the first published kernel that did it, FlashAttention-1
#   {cite}`dao2022flashattention`, written in CUDA.
#
# **Further reading**: the attention paper {cite}`vaswani2017attention`; online softmax
# {cite}`milakov2018online`; the roofline model {cite}`williams2009roofline`; FlashAttention-2
# {cite}`dao2023flashattention2`.
