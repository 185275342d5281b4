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
# # Chapter 7: The Blackwell design (FlashAttention-4 era)
#
# **What you will learn**
# - What changed on Blackwell (B200, sm_100): the `tcgen05` matrix multiply, issued by a single
#   thread and fully asynchronous; **tensor memory** (TMEM), 128 lanes x 512 columns of 32-bit
#   cells per SM, where the accumulators now live instead of registers; how TMEM is allocated;
#   two 128-row query tiles per CTA.
# - How CUTLASS's CuTe DSL Blackwell attention example {cite}`cutlass2025fmha` ("the example"
#   below: a warp-specialized SM100 forward) divides the work: its
#   warp roles and the barriers between them, the register split between the roles, the
#   persistent tile scheduler, and the TMEM column map where P overwrites the scores it came from.
# - Why, once the tensor cores doubled, the **exponentials** of the softmax set the pace, and
#   FlashAttention-4's two numerical answers {cite}`zadouri2026flashattention4`: **lazy
#   rescaling** (rescale O only when the running max has grown past a threshold; exact after the
#   final normalisation) and **exp2 by a polynomial** on the FMA units (range reduction and a
#   cubic), with their error analysis; why the two softmax warpgroups' **shared exponential
#   unit** makes the polynomial pay on a B200, and not on a B300.
# - Blackwell's **ordering rules**: `tcgen05.ld` and `tcgen05.st` are asynchronous, and a
#   hand-off through tensor memory needs `tcgen05.wait::ld`/`wait::st` and the two
#   `tcgen05.fence`s around the mbarrier; the allocation handshake. Then 2-CTA MMAs and the
#   cluster-launch-control tile scheduler, in prose.
#
# **What you need**: Chapter 3 (the online softmax, its Triton kernel) and Chapter 6 (warp
# specialization, mbarriers, `setmaxnreg`); torch >= 2.11 and triton >= 3.6 (Gluon's
# `warp_specialize` signature changed in 3.5 and 3.6). No Blackwell GPU: every exercise runs on
# a CPU (the Triton ones in the interpreter) and on any GPU. About 4-6 hours.
#
# **Exercises** (21 points): (1) a TMEM column map for the example's tile shapes (3); (2) lazy
# rescaling in Chapter 3's Triton kernel, exact on adversarial logits, with a count of the
# rescales it avoids (4); (3) exp2 by a polynomial in float32, (3a) with torch (2) and (3b) as a
# Triton function inside a kernel (2); (4) the MMA and correction roles of a five-role schedule,
# simulated (4); (5) the resources of the chapter's Gluon kernel, against what the compiler
# reports for sm_100a (3); (6) the softmax warpgroup at the instruction level, with its tcgen05
# waits and fences, checked by the simulator (3).

# %%
import flashbook as fb
backend = fb.setup()          # before triton is imported: on CPU it switches on the interpreter
import math
import torch
import triton
import triton.language as tl
from flashbook.chapters import ch7

# %% [markdown]
# ## 1. What changed on Blackwell
#
# Chapter 6's Hopper kernel keeps its accumulators in registers: `wgmma` is issued by a whole
# warpgroup, reads A from registers or shared memory and B from shared memory, and adds into
# registers that the same 128 threads own. A 64 x 128 fp32 accumulator is 64 registers per
# thread, and two query tiles of them decide how large the tiles can be. Blackwell's fifth
# generation of tensor-core instructions, `tcgen05`, changes three things.
#
# **One thread issues the matrix multiply.** `tcgen05.mma` is issued by a single thread for the
# whole CTA, runs asynchronously, and reports completion through `tcgen05.commit`, which makes an
# mbarrier arrive when the multiplies issued so far are done. A is read from shared memory or
# from tensor memory, B from shared memory, and the result D is accumulated in **tensor memory**.
# One instruction computes a tile of up to M = 128 rows (M = 256 with a pair of CTAs, the 2-CTA
# mode, which the example does not use), so a single "MMA warp" can keep the tensor cores busy
# while the other warps do everything else.
#
# **Tensor memory.** Each SM has 256 KB of TMEM: 128 **lanes** x 512 **columns** of 32-bit cells.
# Lane i holds row i of a 128-row tile, so an fp32 accumulator of 128 x N occupies N columns, and
# a buffer is simply a range of columns. Threads reach it only through explicit copies
# (`tcgen05.ld` / `tcgen05.st` between TMEM and registers), and a warp sees only its quarter of
# the lanes (warp w of a warpgroup: lanes 32(w mod 4) to 32(w mod 4) + 31), so a warpgroup of 128
# threads owns one row per thread. TMEM is **allocated** at run time, like a heap: one warp
# executes `tcgen05.alloc` for a power-of-two number of columns (32 to 512) and receives the base
# address in shared memory; at the end the same warp frees it with `tcgen05.dealloc`, after every
# warp that used it has said so on an mbarrier; before that, `relinquish_alloc_permit` declares
# that this CTA will allocate no more.
#
# **Two query tiles per CTA.** A CTA of the example takes 256 query rows as two tiles, Q0 and Q1, of
# 128 rows each, and streams every K and V tile once for both. Each tile has its own scores
# (S0, S1) and its own output accumulator (O0, O1), all in TMEM, so the registers of the softmax
# warps hold only the row they are working on.
#
# | | Hopper (H100, sm_90) | Blackwell (B200, sm_100) |
# |---|---|---|
# | matrix multiply | `wgmma`, issued by a warpgroup (128 threads) | `tcgen05.mma`, issued by one thread |
# | accumulator | registers of the issuing warpgroup | tensor memory, 128 x 512 x 32 bit per SM |
# | A operand | registers or shared memory | shared memory or tensor memory |
# | completion | `wgmma.wait_group` in the issuing warps | `tcgen05.commit` -> an mbarrier anyone can wait on |
# | dense 16-bit FLOP per clock per SM | 4,096 | 8,192 |
# | exponentials per clock per SM (MUFU) | 16 | 16 |
#
# The last two rows are the subject of Section 2. TMA, mbarriers, `setmaxnreg` and the 227 KB of
# shared memory per block carry over from Chapter 6.
#
# ## 2. Where the time goes: the exponentials
#
# Count the work of one 128 x 128 tile of scores with head dimension d. The two matrix
# multiplies, $S = QK^T$ and $O \mathrel{+}= PV$, are $4 \cdot 128 \cdot 128 \cdot d$ FLOPs;
# the softmax needs $128 \cdot 128$ exponentials, and around each one a few more fp32
# operations on the ordinary cores (the scale-and-subtract FMA, the max, the sum, half a
# conversion to 16 bits). Per SM and clock an H100 does 4,096 dense 16-bit tensor-core FLOPs
# (989 TFLOP/s over 132 SMs at 1.83 GHz) and a B200 8,192, while both compute **16**
# exponentials on the special-function unit (MUFU) and 128 fp32 FMAs on the CUDA cores
# {cite}`nvidia2025cudaguide`. The model below turns these into clock cycles per tile. It is a
# back-of-the-envelope model (no latencies, no shared-memory traffic, perfect overlap), not a
# measurement:
#
# $$\text{MMA} = \frac{4 \cdot 128^2 d}{\text{FLOP/clk}}, \qquad
#   \text{exp} = \frac{128^2}{16}, \qquad \text{FMA} = \frac{3.5 \cdot 128^2}{128}.$$
#
# At d = 128 the H100 needs 2,048 cycles of tensor cores and 1,024 of exponentials: the matrix
# multiplies set the pace and the softmax hides behind them (Chapter 6's ping-pong). The B200
# needs 1,024 of each: the exponentials have caught up. At d = 64 they take twice as long as the
# multiplies. Doubling the tensor cores without the special-function unit moved the bottleneck.
# FlashAttention-4 {cite}`zadouri2026flashattention4` starts from this observation; its answers
# are a pipeline that overlaps everything (Section 3) and two ways to need fewer, or cheaper,
# exponentials and rescales (Sections 5 and 6). The third group of bars already uses Section 6:
# if about 30 % of the exponentials are computed by a polynomial on the FMA units, both units
# finish together and the softmax of a tile takes about 30 % fewer cycles.
#
# The model counts the FMA units' throughput and nothing else a warp must issue. Chapter 6
# (Section 8) tried the polynomial where the model puts the same balance, FP8 on an H100 (1,024
# cycles of each per tile at d = 128), and measured it slower at every share tried, down to one
# exponential in eight, where the SASS counts of issue slots and exponential-unit clocks per key
# balance: its softmax issues several instructions per key besides the exponential (the
# rescale of O, the stores of P, the loop), a warp scheduler issues one instruction a clock,
# and each emulated exponential costs seven more. The model's balance is what the polynomial
# needs to pay, not a promise that it will.

# %% tags=["demo"]
for d in (64, 128):
    for sm in (ch7.design.H100, ch7.design.B200):
        cyc = ch7.tile_cycles(sm, d)
        print(f"{sm.name:14s} d={d:3d}: MMA {cyc['mma']:5.0f}  exp {cyc['exp']:5.0f}  "
              f"other FMA {cyc['fma']:4.0f} cycles per 128x128 tile")
print(f"B200: emulate {ch7.best_emulated_fraction():.0%} of the exponentials to balance MUFU "
      "and the FMA units")
fig = ch7.plot_unit_cycles()

# %% [markdown]
# **One exponential unit for two softmax warpgroups.** The model counts one tile. A CTA of the
# example works on two query tiles at every key step, and both softmax warpgroups run on the
# same SM: the 16 exponentials a clock are the SM's, so the two tiles' exp phases do not
# overlap, they add up (Section 3's `s0_s1_sequence` makes them take turns, and Section 7's
# simulator has the same one unit). Per key step of two tiles, at d = 64 on a B200, the tensor
# cores need 1,024 cycles and the one exponential unit 2,048; with a unit per warpgroup the
# two tiles' exponentials would overlap and take 1,024, and the tensor cores would set the
# pace. The sharing is what makes the polynomial of Section 6 pay: with the best share (32 %)
# of the exponentials on the FMA units, both units need about 1,390 cycles and the step is
# 1.47x shorter in the model. At d = 128 the tensor cores' 2,048 cycles already match the
# exponentials'.
#
# **Blackwell Ultra (B300, sm_103)** doubles the exponential rate: 32 a clock per SM in the
# model, which keeps the B200's tensor-core rate. The exponential unit then needs 1,024 cycles
# a step, no more than the tensor cores at d = 64; the best share to emulate falls to 5 % and
# buys nothing, and FlashAttention-4 turns the polynomial off on sm_103. Every number of the
# table is the model's (`ch7.design`: its per-SM rates are the assumptions stated above), not
# a measurement.

# %% tags=["demo"]
print(ch7.exp_unit_table())

# %% [markdown]
# ## 3. The example kernel: warp roles, barriers, registers, scheduler
#
# The seed is a persistent, warp-specialized forward kernel for SM100 written in CuTe DSL (the
# Python front end of CUTLASS). A CTA has 16 warps, 512 threads, and each warp has exactly one
# job:
#
# | warps | role | registers | what it does |
# |---|---|---|---|
# | 0-3 (warpgroup 0) | softmax0 | 192 | loads S0 from TMEM, one row per thread; masks; row max; exp2; writes P0 over S0; row sum |
# | 4-7 (warpgroup 1) | softmax1 | 192 | the same for query tile 1 |
# | 8-11 (warpgroup 2) | correction | 96 | rescales O0 and O1 in TMEM after every step, by 2^(old max - new max); at the end O / l and the LSE |
# | 12 | MMA | 32 | allocates TMEM; issues every `tcgen05.mma` from one thread |
# | 13 | load | 32 | TMA loads: Q0, K0, Q1, V0, then K and V tile after tile |
# | 14 | epilogue | 32 | TMA stores of the finished O tiles |
# | 15 | (empty) | 32 | nothing: it completes the fourth warpgroup |
#
# FlashAttention-4's forward pass {cite}`zadouri2026flashattention4` is organised the same way:
# two softmax warpgroups, a correction warpgroup, an MMA warp, an epilogue warp and a load warp.
#
# **Registers.** `setmaxnreg` (Chapter 6) works per warpgroup, which is why warp 15 exists: warps
# 12 to 15 form a warpgroup that gives registers back together. The split uses the SM's 65,536
# registers exactly. The softmax threads need many (a thread holds a whole row of 128 scores),
# the correction warps fewer (they rescale O in chunks of 16 columns), the single-purpose warps
# almost none: the accumulators are in TMEM, not in anyone's registers.

# %% tags=["demo"]
print(ch7.register_table())

# %% [markdown]
# **Barriers.** The roles talk only through mbarrier pipelines, each a small ring of stages with
# a producer and a consumer (Chapter 6's *full* and *consumed* barriers, wrapped as objects with
# `acquire`, `commit`, `wait` and `release`). The figure shows the nine of the example. Four carry
# data: `load_q` and `load_kv` (K and V share one ring of 3 stages in shared memory) tell the MMA
# warp that a TMA copy landed; `mma_s0` and `mma_s1` hand a score tile S_i to its softmax
# warpgroup, and back: the softmax *releases* S_i when it has written P_i over it, which is the
# MMA warp's signal that P_i is ready for $O_i \mathrel{+}= P_i V$. Two carry row statistics:
# `s0_corr` and `s1_corr` give the correction warpgroup each step's old and new row max. Then
# `mma_corr` tells it that a $P V$ has been accumulated into O_i, so O_i may be rescaled; the MMA
# warp waits on the same pipeline before the next $P V$, so it never adds into an O that is
# half rescaled. `corr_epi` passes the normalised O tiles to the epilogue warp. The last one,
# `s0_s1_sequence`, carries nothing: the two softmax warpgroups take turns on the exponential
# unit through it, Blackwell's form of Chapter 6's ping-pong.
#
# The MMA warp issues, for each KV tile i, $S_0 = Q_0 K_i^T$, then $O_1 \mathrel{+}= P_1
# V_{i-1}$, then $S_1 = Q_1 K_i^T$, then $O_0 \mathrel{+}= P_0 V_i$: while softmax0 turns S0 into
# P0, the tensor cores work on tile 1, and the other way round.

# %% tags=["demo"]
fig = ch7.plot_roles()

# %% [markdown]
# **The persistent tile scheduler.** The work is a grid of tiles of 256 query rows: $\lceil N_q /
# 256 \rceil$ x heads x batch, the query block varying fastest. The kernel launches one CTA per
# SM (at most one fits: it takes all of TMEM) and CTA c processes tiles c, c + G, c + 2G, ...
# with G the number of CTAs. Every role walks this same list on its own, so no role waits for
# another to be told what comes next, and the load warp can start on the next tile's K and V
# while the softmax, correction and epilogue warps finish the last one. The schedule is static
# and round-robin: with causal masks the tiles differ in cost, and an ordering that starts the
# longest tiles first (as Chapter 4 did for its grid) balances better.

# %% tags=["demo"]
tiles = ch7.work_tiles(seqlen_q=1024, heads=3, batch=2)
for cta, mine in enumerate(ch7.static_schedule(tiles, sms=5)):
    print(f"CTA {cta}: tiles {mine} = (m_block, head, batch) "
          f"{[ch7.tile_coord(t, 1024, 3) for t in mine]}")

# %% [markdown]
# ### The CLC tile scheduler
#
# The static schedule fixes every CTA's tiles at launch. **Cluster launch control** (CLC),
# new on Blackwell, lets a persistent kernel keep the hardware scheduler's load balance
# instead. The grid is launched with one CTA per tile, as a kernel that is not persistent
# would be; a running CTA that has finished a tile executes `clusterlaunchcontrol.try_cancel`,
# which asks to cancel the launch of a CTA (of a cluster) that has not started yet. The answer
# is written asynchronously into shared memory and completes an mbarrier's transaction count;
# `clusterlaunchcontrol.query_cancel.is_canceled` says whether the cancel succeeded and
# `query_cancel.get_first_ctaid` gives the cancelled CTA's coordinates. The running CTA then
# processes that tile itself, with its tensor memory, barriers and warp roles already set up;
# when the cancel fails, every tile has started and the CTA exits. So a tile goes to whichever
# SM frees up first, as in an ordinary launch: tiles of different cost (causal masks) balance
# themselves without a precomputed order, and CTAs not yet launched still leave room for
# another kernel on the GPU.
#
# ### 2-CTA MMA (`cta_group::2`)
#
# A pair of CTAs of a cluster, on two SMs, can share one MMA: `tcgen05.mma.cta_group::2`,
# issued by one thread for the pair, computes a tile of M = 256 rows, the 128 rows of each CTA
# accumulated in its own tensor memory. Each CTA holds its 128 rows of A and **half of B** in
# its shared memory, and the tensor cores of both SMs read both halves, so each CTA loads half
# of every B tile: for attention, half of each K and V tile, which halves the K and V traffic
# per CTA for the same 256 query rows. The pair allocates tensor memory together
# (`tcgen05.alloc.cta_group::2`, one warp in each CTA) and a `tcgen05.commit` of the pair can
# signal the mbarriers of both CTAs. The example's forward does not use it (Section 1);
# FlashAttention-4 uses 2-CTA MMAs in its backward pass {cite}`zadouri2026flashattention4`.

# %% [markdown]
# ## 4. Tensor memory: the column map
#
# Everything the two query tiles accumulate lives in one TMEM allocation, and the example lays it
# out by hand. Each S_i is a 128 x 128 fp32 tile: 128 columns. Each O_i is 128 x d fp32: d
# columns. Two S and two O tiles with d = 128 fill all 512 columns, which is why the example stops
# at d = 128. The probabilities P_i, in 16 bits, need 128 x 16 / 32 = 64 columns, and the row
# statistics (the running max and sum a softmax warpgroup hands the correction warpgroup) two
# more. There is no room left for them, and no need: once a softmax thread has loaded its row
# of S_i into registers, those columns are free, so the example writes the statistics over the
# first columns of S_i and P_i over columns 32-95 of it. The tensor core then reads P_i straight
# from TMEM as the A operand of $O_i \mathrel{+}= P_i V$. The aliasing is safe only because of
# the barriers: the MMA warp overwrites S_i with the next $Q_i K^T$ only after the softmax
# released it, after the $P_i V$ that reads P_i, and after the correction warps read the
# statistics.

# %% tags=["demo"]
fig = ch7.plot_tmem(ch7.SEED_MAP, title="The example's TMEM map (d = 128): P and the statistics "
                    "alias S")

# %% [markdown]
# **Exercise 1 (3 points).** Write `plan_tmem(head_dim, block_n=128, p_bits=16)`, a planner for
# any shape the kernel might use: it returns `(alloc_cols, plan)` with `plan` a dict from the
# names `S0 S1 O0 O1 P0 P1 stats0 stats1` to `(first column, width)`. The rules
# (`ch7.tmem_problems(plan, head_dim, block_n, p_bits)` lists the ones a plan breaks):
#
# - widths: S_i is `block_n` columns, O_i `head_dim`, P_i `block_n * p_bits // 32` (16-bit P:
#   two values per column; 8-bit P: four), stats_i 2;
# - alignment: every buffer starts on a multiple of 32 columns. This is our planner's
#   convention: 32 columns is TMEM's allocation granule, and the example keeps every offset on it
#   (0, 32, 128, 160, 256, 384);
# - allocation: `alloc_cols` is a power of two from 32 to 512, the smallest that holds two S and
#   two O side by side (unlike the example, which always takes 512): the rest of the SM's TMEM stays
#   free for another CTA; no buffer may reach past it;
# - aliasing: P_i and stats_i lie inside S_i (not inside the other tile's S), without
#   overlapping each other; nothing else overlaps anything;
# - a shape whose two S and two O need more than 512 columns raises a `ValueError` that says
#   so (its message mentions 512).
#
# About 15 lines.

# %% nbgrader={"grade": false, "grade_id": "ch7_tmem_plan", "locked": false, "schema_version": 3, "solution": true, "task": false}
def plan_tmem(head_dim, block_n=128, p_bits=16):
    """TMEM map for two query tiles of 128 rows: (alloc_cols, {name: (first column, width)})
    for S0 S1 O0 O1 P0 P1 stats0 stats1; ValueError if the shape needs more than 512 columns."""
    ### BEGIN SOLUTION
    s = block_n                                   # fp32 scores: one column per key
    p = block_n * p_bits // 32                    # P packs 32 / p_bits values per column
    need = 2 * s + 2 * head_dim                   # S0, S1, O0, O1 side by side
    if need > 512:
        raise ValueError(f"plan_tmem: two S tiles and two O accumulators need {need} columns, "
                         f"more than TMEM's 512 (head_dim={head_dim}, block_n={block_n}).")
    alloc = 32
    while alloc < need:                           # tcgen05.alloc: a power of two >= 32
        alloc *= 2
    plan = {}
    for i in range(2):
        plan[f"S{i}"] = (i * s, s)
        plan[f"stats{i}"] = (i * s, 2)            # row max and sum, over S_i's first columns
        plan[f"P{i}"] = (i * s + 32, p)           # after them, on the next 32-column boundary
        plan[f"O{i}"] = (2 * s + i * head_dim, head_dim)
    return alloc, plan
    ### END SOLUTION

# %% nbgrader={"grade": true, "grade_id": "ch7_tmem_test", "locked": true, "points": 3, "schema_version": 3, "solution": false, "task": false}
ch7.check_tmem_plan(plan_tmem)
### BEGIN HIDDEN TESTS
ch7.check_tmem_plan(plan_tmem, hidden=True)
### END HIDDEN TESTS

# %% [markdown]
# Your map for d = 64: the allocation is still 512 columns (two S and two O need 384, and
# allocations come in powers of two). With 64-key tiles the same kernel would need only 256,
# and two CTAs could share an SM's TMEM. Below it, what the rules say about a map that puts O0
# where S1 is.

# %% tags=["demo"]
try:
    fig = ch7.plot_tmem(plan_tmem(64), head_dim=64)
    bad = plan_tmem(128)[1] | {"O0": (128, 128)}
    print("\n".join(ch7.tmem_problems((512, bad), 128)))
except NotImplementedError:
    print("Finish Exercise 1 to draw your map.")

# %% [markdown]
# ## 5. Lazy rescaling
#
# Chapter 3's online softmax keeps, per row, the running max $m$, the running sum $\ell$ and
# the unnormalised output $\tilde O$, all relative to $m$; when a tile raises the max to $m'$,
# both are multiplied by $\alpha = 2^{m - m'}$ (base 2, with $\log_2 e$ folded into the scale):
#
# $$\ell \leftarrow \alpha \ell + \sum_j 2^{s_j c - m'}, \qquad
#   \tilde O \leftarrow \alpha \tilde O + \sum_j 2^{s_j c - m'} v_j, \qquad
#   O = \tilde O / \ell .$$
#
# On Blackwell that multiplication is not free: O lives in TMEM, so the correction warpgroup
# loads all of it into registers, multiplies and stores it back, and the MMA warp must wait for
# that before the next $P V$. The seed does it after every KV tile.
#
# **The observation.** Nothing in the algorithm needs $m$ to be the *true* max. Take any
# reference $r$ per row and use it everywhere: $\ell = \sum_j 2^{s_j c - r}$ and $\tilde O =
# \sum_j 2^{s_j c - r} v_j$. Then $\tilde O / \ell$ is the softmax-weighted average for every
# $r$, because $2^{-r}$ cancels; and $\text{LSE} = (r + \log_2 \ell) \ln 2$ for every $r$. The
# true max is only a safe choice of $r$: it keeps every $2^{s_j c - r} \le 1$. So
# FlashAttention-4 {cite}`zadouri2026flashattention4` moves the reference only when the max has
# grown by more than a threshold $\tau$ since the reference was last set, and otherwise keeps
# the stale one and skips the rescale. Until then the exponentials may exceed 1, but never
# $2^\tau$. The result stays **exact**: the final normalisation divides by an $\ell$ that shares
# the reference of $\tilde O$.
#
# **Choosing $\tau$, and the error analysis.** The limit is overflow. P is converted to 16 bits
# for the tensor cores: float16's largest value is 65504, just below $2^{16}$, so $\tau \le 15$
# for float16 (bfloat16 reaches $2^{127}$); $\tilde O$ and $\ell$ stay in fp32, far from its
# $2^{128}$. FlashAttention-4 uses $\tau = 8$ (a factor of 256) for 16-bit inputs. Rounding gets
# a little worse, not much. A floating-point number's relative error does not depend on its
# scale, and every skipped rescale is one multiplication, one rounding, fewer; but with the
# true max the row's largest weight is exactly $2^0 = 1$, which 16 bits hold without error,
# while with a stale reference it is $2^x$ for some $x$ in $(0, \tau]$, rounded like every
# other weight. The row's dominant weight, the one that decides O, then carries a rounding
# error too: the recorded 16-bit errors of the lazy kernel are larger than the eager one's
# (each row's `err=` in Section 9's data). What matters for exactness is that $\tilde O$ and
# $\ell$ always use the *same* $r$. The tempting shortcut, to skip the multiplication but
# still move the max, mixes two references and is wrong by up to $2^\tau$.
#
# **Who decides.** On Blackwell the decision is per row (a softmax thread owns a row), but the
# work is per warp: the correction warpgroup's warps vote, and a warp skips its 32 rows of O
# only if none of them needs a rescale {cite}`zadouri2026flashattention4`. A Triton program has
# no warps to vote with; its unit is the tile: it rescales all its rows when any row's max has
# grown by more than $\tau$ (each row to its own new max), and skips otherwise. With random
# logits, as in the first case of the check below, the max of a row settles in the first tile
# and every later tile skips; logits that keep growing are the adversarial case. The figure
# follows one row whose logits drift upwards and then jump.

# %% tags=["demo"]
fig = ch7.plot_lazy_trace(tau=8.0)

# %% [markdown]
# The kernel of Exercise 2 is Chapter 3's `attn_fwd_kernel` with its loop body handed in as a
# `tl.constexpr` argument, `UPDATE`, and its exponential as another, `EXP2`. It loads each K and
# V tile itself and counts, per program, the steps whose `UPDATE` moved the reference max.
# `ch7.launch_lazy` launches the package's copy of this cell (`flashbook.lazy_kernels`, generated
# from it).

# %% tags=["export:flashbook.lazy_kernels"]
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

# %% [markdown]
# **Exercise 2 (4 points).** Write `lazy_update`, the loop body of Chapter 3's kernel with lazy
# rescaling, and the wrapper `attention_lazy`. The kernel above, `attn_fwd_lazy`, loads each K
# and V tile, calls your `lazy_update(acc, l_i, m_i, s, v, qk_scale, tau, EXP2, DOT_PRECISION)`
# with the raw scores `s` (`-inf` for keys past the end), adds up the `rescaled` flags you
# return, and ends with $O = \tilde O / \ell$ and LSE $= (m + \log_2 \ell) \ln 2$ from your
# `m_i`, the reference max. In `lazy_update`:
#
# 1. the true running max `m_new = max(m_i, rowmax(s) * qk_scale)` (base 2), and
#    `grow = tl.max(m_new - m_i, 0)`, the largest growth of any row since its reference was set
#    (`+inf` on the first tile, where `m_i` is `-inf`);
# 2. `rescale = grow > tau`; if so (a scalar `if`): `alpha = EXP2(m_i - m_new)`, multiply `acc`
#    and `l_i` by it, and move the reference, `m_i = m_new`; if not, change nothing;
# 3. `p = EXP2(s * qk_scale - m_i[:, None])` from the reference, add its row sums to `l_i`, and
#    `acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)`;
# 4. return `(acc, l_i, m_i, rescale.to(tl.int32))`.
#
# Use `EXP2` for every exponential (the kernel is given `hw_exp2` above, the special-function
# unit's, or Exercise 3's polynomial). `attention_lazy(q, k, v, scale=None, max_growth=256.0,
# exp2=None, config=None)` turns `max_growth` (a factor: how large an exponential may grow before a
# rescale) into the kernel's threshold `tau` and returns `ch7.launch_lazy(lazy_update, q, k, v,
# tau=tau, scale=scale, exp2=exp2, config=config)`: `(O, LSE, rescales)`, with `rescales` the
# count of each program. The check compares O and LSE with float64 attention on random logits,
# logits that grow on every key tile, and a huge logit late in a row (and first in a row), and
# replays the rule to compare the counts. About 15 lines.

# %% nbgrader={"grade": false, "grade_id": "ch7_lazy_update", "locked": false, "schema_version": 3, "solution": true, "task": false}
@triton.jit
def lazy_update(acc, l_i, m_i, s, v, qk_scale, tau, EXP2: tl.constexpr,
                DOT_PRECISION: tl.constexpr):
    """One online-softmax step with a lazy rescale. s (BLOCK_M, BLOCK_N): raw scores, -inf where
    masked; v (BLOCK_N, d): the V tile; m_i (BLOCK_M,): the reference max (base 2); tau: the
    threshold (base 2). Returns (acc, l_i, m_i, rescaled), rescaled int32 1 if this step moved
    the reference (and rescaled acc and l_i), else 0."""
    ### BEGIN SOLUTION
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)                  # the true running max
    grow = tl.max(m_new - m_i, 0)                                     # the worst row's growth
    rescale = grow > tau
    if rescale:                                                       # the whole tile
        alpha = EXP2(m_i - m_new)                                     # 0 on the first tile
        acc = acc * alpha[:, None]
        l_i = l_i * alpha
        m_i = m_new
    p = EXP2(s * qk_scale - m_i[:, None])                             # at most 2^tau
    l_i = l_i + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
    return acc, l_i, m_i, rescale.to(tl.int32)
    ### END SOLUTION


def attention_lazy(q, k, v, scale=None, max_growth=256.0, exp2=None, config=None):
    """O, LSE, rescales = attention_lazy(q, k, v): Chapter 3's kernel with lazy rescaling; an
    exponential may grow to max_growth (a factor) before O is rescaled."""
    ### BEGIN SOLUTION
    tau = math.log2(max_growth)                   # m and qk_scale are in base 2
    return ch7.launch_lazy(lazy_update, q, k, v, tau=tau, scale=scale, exp2=exp2, config=config)
    ### END SOLUTION

# %% nbgrader={"grade": true, "grade_id": "ch7_lazy_test", "locked": true, "points": 4, "schema_version": 3, "solution": false, "task": false}
ch7.check_lazy_attention(attention_lazy)
### BEGIN HIDDEN TESTS
ch7.check_lazy_attention(attention_lazy, hidden=True)
### END HIDDEN TESTS

# %% [markdown]
# How many rescales the threshold saves depends on the logits. With random logits the max of a
# row settles within the first tiles; with logits that grow steadily (here every query row
# leans on a direction along which the keys grow) the threshold turns one rescale per tile into
# one every few tiles. `max_growth=1` is the eager rule: rescale whenever a max grows.

# %% tags=["demo"]
try:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 96, 32, generator=g) for _ in range(3))
    q_up, k_up = q.clone(), k.clone()
    q_up[..., 0], k_up[..., 0] = 4.0, torch.linspace(0, 20, 96)     # logits grow with the key
    for name, (qq, kk) in (("random logits", (q, k)), ("growing logits", (q_up, k_up))):
        qq, kk, vv = (t.to(backend.device) for t in (qq, kk, v))
        want = fb.reference.attention(qq.double(), kk.double(), vv.double())
        for growth in (1.0, 256.0):
            o, lse, rescales = attention_lazy(qq, kk, vv, max_growth=growth)
            print(f"{name}, max_growth {growth:3g}: {int(rescales.sum()):3d} rescales in "
                  f"{rescales.numel()} programs, max |O - O_ref| = "
                  f"{(o.double() - want).abs().max().item():.1e}")
except NotImplementedError:
    print("Finish Exercise 2 to count your kernel's rescales.")

# %% [markdown]
# ## 6. exp2 by a polynomial on the FMA units
#
# Section 2's model says that on a B200 (sm_100) the special-function unit's 16 exponentials
# per clock are as slow as the tensor cores at d = 128 and slower below, while the FMA units,
# 128 per clock, are partly idle. This is a B200 answer: Blackwell Ultra (B300, sm_103) doubles
# the special-function unit's exponential rate, which moves the balance back towards MUFU. FlashAttention-4 {cite}`zadouri2026flashattention4` therefore computes
# a share of the exponentials in software, with instructions that run on the FMA units, and
# leaves the rest on MUFU. The method is the one every math library uses, cut down to what a
# 16-bit P needs:
#
# 1. **Range reduction.** Write $x = n + f$ with $n$ an integer, $2^x = 2^n \cdot 2^f$. With
#    $n = \text{round}(x)$, $f \in [-\tfrac12, \tfrac12]$; with $n = \lfloor x \rfloor$, $f \in
#    [0, 1)$. The subtraction $f = x - n$ is exact in floating point (Sterbenz's lemma: $x$ and
#    $n$ are within a factor of two of each other, or $n = 0$).
# 2. **A polynomial for $2^f$** on that small interval, evaluated by Horner's rule: a cubic is
#    three FMAs, $((c_3 f + c_2) f + c_1) f + c_0$.
# 3. **$2^n$ for free.** A float32 is $(-1)^s \cdot 2^{e - 127} \cdot 1.m$ with the exponent
#    field $e$ in bits 23-30, so $2^n$ is the integer $(n + 127) \ll 23$ read as a float32,
#    exactly, for $-126 \le n \le 127$. Multiplying by it, or adding $n \ll 23$ to the integer
#    bits of $p(f)$ as FlashAttention-4 does, costs one integer instruction.
#
# Below $x = -126$ the result would be a subnormal number; clamp there. A softmax weight of
# $2^{-126}$ is 0 in every 16-bit format, and a masked score of $-\infty$ then gives $2^{-126}$
# instead of NaN. FlashAttention-4 reduces with $\lfloor x \rfloor$ computed by one addition:
# $x + 1.5 \cdot 2^{23}$ rounded towards $-\infty$ leaves $\lfloor x \rfloor$ in the low bits of
# the sum, and subtracting $1.5 \cdot 2^{23}$ again gives it as a float; its polynomial is a cubic
# on $[0, 1)$.
#
# **The error analysis.** Three sources, measured as relative error, the only kind that
# survives the multiplication by $2^n$:
#
# - *the reduction* is exact (above), and so is $2^n$;
# - *the polynomial*: the best polynomial of degree k for $2^f$ on an interval of length 1 has
#   a largest relative error close to $(\ln 2)^{k+1} / ((k+1)!\, 2^{2k+1})$ (Chebyshev's bound:
#   the (k+1)-th derivative of $2^f$ is $(\ln 2)^{k+1} 2^f$, and the half-width is
#   $\tfrac12$): $1.7 \cdot 10^{-3}$ for k = 2, $7.5 \cdot 10^{-5}$ for k = 3, $2.7 \cdot
#   10^{-6}$ for k = 4, a factor of about 25 a degree. The shift of the interval does not
#   matter: $2^{f + 1/2} = \sqrt2 \cdot 2^f$, so a relative fit on $[0, 1)$ is the fit on
#   $[-\tfrac12, \tfrac12]$ moved over. What matters is that the reduction and the fit agree;
# - *float32 rounding* in Horner's rule and the final multiplication: a few units of $2^{-24}
#   \approx 6 \cdot 10^{-8}$, negligible next to the cubic's $7.5 \cdot 10^{-5}$.
#
# P is then rounded to 16 bits, which costs up to $2^{-11} \approx 4.9 \cdot 10^{-4}$
# (float16) or $2^{-8} \approx 3.9 \cdot 10^{-3}$ (bfloat16) anyway: a cubic is enough, a
# quadratic is not. In the output, weights $p_j (1 + \epsilon_j)$ with $|\epsilon_j| \le
# \epsilon$ move $O = \sum_j p_j v_j / \sum_j p_j$ by at most about $2 \epsilon \max_j |v_j|$.
# The check's bound is $\epsilon \le 10^{-4}$, a fifth of float16's rounding.
#
# `ch7.fit_exp2(degree)` returns the coefficients $(c_0, \dots, c_k)$ of the best relative fit
# on $[-\tfrac12, \tfrac12]$ as float32 values (`ch7.fit_exp2(degree, 0, 1)` fits $[0, 1)$).
# The figure measures $2^n p(f)$ in float32 for three degrees.

# %% tags=["demo"]
for deg in (2, 3, 4):
    print(f"degree {deg}: c = {[round(c, 8) for c in ch7.fit_exp2(deg)]}, largest relative "
          f"error {ch7.fit_error(deg):.2e}")
fig = ch7.plot_exp2_error()

# %% [markdown]
# **Exercise 3a (2 points).** Write `exp2_poly(x)` for a float32 tensor `x`, with torch, in
# float32: clamp at -126, `n = torch.round(x)`, `f = x - n`, Horner's rule with the coefficients
# of `ch7.fit_exp2(degree)` for the lowest degree whose error is below the bound in the figure,
# and $2^n$ from the bits (`((n.to(torch.int32) + 127) << 23).view(torch.float32)`). The check
# measures the largest relative error against float64 on a dense set: every float32 in
# $[-1, -\tfrac12)$ (8,388,608 numbers), a uniform grid of a million points of $[-126, 0]$, every
# integer there, and $(0, 8]$, where Exercise 2's lazy rescale takes the argument; the bound is
# `ch7.BOUND` = $10^{-4}$. Below -126 (and at $-\infty$) the result must lie in $[0, 2^{-126}]$.
# About 8 lines.

# %% nbgrader={"grade": false, "grade_id": "ch7_exp2_poly", "locked": false, "schema_version": 3, "solution": true, "task": false}
def exp2_poly(x):
    """2^x of a float32 tensor, by range reduction and a polynomial, in float32: within ch7.BOUND
    relative error on [-126, 8]; in [0, 2^-126] below -126."""
    ### BEGIN SOLUTION
    coeffs = ch7.fit_exp2(3)                      # degree 3: 7.5e-5 < 1e-4 (degree 2: 1.7e-3)
    x = torch.clamp(x, min=-126.0)                # 2^-126: float32's smallest normal number
    n = torch.round(x)                            # x = n + f, f in [-1/2, 1/2]
    f = x - n                                     # exact
    p = torch.full_like(x, coeffs[-1])
    for c in reversed(coeffs[:-1]):               # Horner: one FMA per coefficient
        p = p * f + c
    two_n = ((n.to(torch.int32) + 127) << 23).view(torch.float32)   # exponent field n + 127
    return p * two_n
    ### END SOLUTION

# %% nbgrader={"grade": true, "grade_id": "ch7_exp2_test", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
ch7.check_exp2_poly(exp2_poly)
### BEGIN HIDDEN TESTS
ch7.check_exp2_poly(exp2_poly, hidden=True)
### END HIDDEN TESTS

# %% [markdown]
# **Exercise 3b (2 points).** The same inside a Triton kernel: write `exp2_poly_tl(x)`, a
# `@triton.jit` function of a float32 tensor, with the cubic's coefficients `C0`, `C1`, `C2`,
# `C3` (given below as `tl.constexpr` globals, which a Triton function may read). Round with
# `tl.floor(x + 0.5)`, and read the integer bits as a float with `.to(tl.float32,
# bitcast=True)`. The check runs it inside a kernel over the dense set (every 8th float32 of
# $[-1, -\tfrac12)$ in CPU mode: the interpreter is slower), below -126, and as the exponential
# of a base-2 softmax over rows with masked tails and huge logits. About 6 lines.

# %%
C0, C1, C2, C3 = (tl.constexpr(c) for c in ch7.fit_exp2(3))

# %% nbgrader={"grade": false, "grade_id": "ch7_exp2_poly_tl", "locked": false, "schema_version": 3, "solution": true, "task": false}
@triton.jit
def exp2_poly_tl(x):
    """2^x (float32) on the FMA units: clamp, round, a cubic by Horner's rule, 2^n from the
    exponent bits."""
    ### BEGIN SOLUTION
    x = tl.maximum(x, -126.0)
    n = tl.floor(x + 0.5)                         # round to nearest: f in [-1/2, 1/2]
    f = x - n
    p = ((C3 * f + C2) * f + C1) * f + C0         # three FMAs
    two_n = ((n.to(tl.int32) + 127) << 23).to(tl.float32, bitcast=True)
    return p * two_n
    ### END SOLUTION

# %% nbgrader={"grade": true, "grade_id": "ch7_exp2_triton_test", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
ch7.check_exp2_poly_triton(exp2_poly_tl)
### BEGIN HIDDEN TESTS
ch7.check_exp2_poly_triton(exp2_poly_tl, hidden=True)
### END HIDDEN TESTS

# %% [markdown]
# **Both tricks at once.** Your lazy kernel takes its exponential as an argument: with
# `exp2=exp2_poly_tl` every exponential of the softmax is a polynomial. The analysis bounds the
# output's move by $2 \epsilon \max |v|$ (the weights' errors partly cancel, so it moves less)
# and the LSE's, the logarithm of a sum of the same weights, by about $\epsilon$.
# FlashAttention-4 emulates only a share of the exponentials and leaves the rest on MUFU, so
# that both units finish together.

# %% tags=["demo"]
try:
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 96, 32, generator=g).to(backend.device) for _ in range(3))
    want, want_lse = fb.reference.attention(q.double(), k.double(), v.double(), return_lse=True)
    for name, fn in (("special-function unit", None), ("polynomial", exp2_poly_tl)):
        o, lse, rescales = attention_lazy(q, k, v, exp2=fn)
        print(f"exp2 on the {name:21s}: max |O - O_ref| = {(o.double() - want).abs().max():.1e}"
              f" (2 eps max|v| = {2 * ch7.fit_error(3) * v.abs().max():.1e}), max |LSE - "
              f"LSE_ref| = {(lse.double() - want_lse.double()).abs().max():.1e}")
except NotImplementedError:
    print("Finish Exercises 2 and 3b to combine them.")

# %% [markdown]
# ## 7. Five warp roles, simulated (Exercise 4)
#
# Chapter 6 had one producer and two consumers that each ran their own GEMMs. On Blackwell the
# GEMMs leave the warpgroups: **one thread** of the MMA warp issues every `tcgen05` MMA, the
# accumulators live in **tensor memory** (TMEM), and the CTA splits into five roles that talk only
# through mbarriers:
#
# | role | warps | does | its actions |
# |---|---|---|---|
# | load | 1 | TMA: Q0 and Q1 once, then K and V of each key step into a ring of `stages` slots each | `pipe.load_q`, `pipe.load_k`, `pipe.load_v` |
# | MMA | 1 | `S_t = Q_t K_j^T` into TMEM; `O_t (+)= P_t V_j` with P read from TMEM | `pipe.qk(t, j)`, `pipe.pv(t, j)`, `pipe.commit(bar)` |
# | softmax 0, softmax 1 | 4 + 4 | tile t's S from TMEM, the row max for the correction, `P = exp2(S - m)` on the SM's exponential unit, written **into S's columns** | `pipe.rowmax`, `pipe.exp`, `pipe.rowsum` |
# | correction | 4 | O_t in TMEM times `exp2(m_old - m_new)` between two PV MMAs; at the end O / l into shared memory | `pipe.rescale(t, j)`, `pipe.finish(t)` |
# | epilogue | 1 | TMA store of each O tile | `pipe.store` |
#
# `flashbook.chapters.ch7.roles` simulates them on top of Chapter 6's engine (the same
# barriers: `pipe.barrier`, `yield pipe.wait(bar, parity)`, `yield pipe.arrive(bar)`). What is new
# is the MMA warp: `yield pipe.qk(t, j)` **returns at once**. The tensor core runs the MMAs one
# after the other in the order they were issued, and `yield pipe.commit(bar)` (PTX
# `tcgen05.commit`) arrives on `bar` when every MMA issued before it has finished. That is how the
# MMA warp tells the others that S is ready or that a K slot may be refilled: an `arrive` would
# say so the moment the MMA is *issued*, long before it has read anything.
#
# The simulator has a second shared unit: the SM's **exponential unit** (MUFU, Section 2's 16
# exponentials a clock for the whole SM). Both softmax warpgroups compute their exponentials
# on it, so `exp` (one tile's exponentials) runs for one tile at a time: an `exp` that finds the
# unit working for the other tile waits its turn, which the chart shows as "exp wait". This is
# the sharing that the example's `s0_s1_sequence` pipeline (Section 3) organises.
#
# The simulator also models what lives where, and reports a **hazard** when a role touches a
# buffer at the wrong time. The three that tensor memory adds:
#
# * **S overwritten before softmax read it**: QK of the next step writes S_t while softmax t has
#   not read this step's scores;
# * **P read by the MMA before softmax wrote it**: PV_t reads P_t from S_t's columns too early
#   (P *is* S's storage: until softmax writes P there, those columns hold the scores);
# * **O rescaled while an MMA accumulates into it**: the correction and a PV MMA work on O_t at
#   the same time, or in the wrong order.
#
# The chapter gives the load warp, the softmax warpgroups, the epilogue warp and the barriers
# (`roles.make_barriers`: `q_full[t]`, `k_full[s]`/`k_free[s]`, `v_full[s]`/`v_free[s]`,
# `s_ready[t]`, `p_ready[t]`, `stats[t]`, `o_done[t]`, `o_ready[t]`, `l_ready[t]`,
# `epi_ready[t]`, one arrival a phase each; `help(roles.make_barriers)` says who arrives on
# which). You write the two roles Hopper did not have.
#
# **`mma(pipe, bars)`** (about 22 lines). Wait for both Q tiles, then for each key step `j` issue,
# in this order, `QK0(j)`, `PV1(j-1)` (from step 1 on), `QK1(j)`, `PV0(j)`, and after the loop
# `PV1(n-1)`. While softmax 0 works on S0, the tensor core runs tile 1's PV and QK, and the other
# way round: the two Q tiles take the place of Chapter 6's ping-pong. Before each MMA wait for its
# inputs (K or V of step `j` landed: `k_full`/`v_full` of slot `pipe.slot(j)`, parity
# `pipe.phase(j)`; P_t written: `p_ready[t]`, parity `j % 2`; for `j > 0`, O_t rescaled:
# `o_ready[t]`, parity `(j - 1) % 2`), and after it commit what it produces or frees: `s_ready[t]`
# after a QK; `o_done[t]` after a PV; `k_free` after `QK1(j)` and `v_free` after `PV1(j)`, the
# last MMAs that read the slot. S_t and P_t share columns, so `QK_t(j)` may only come after
# `PV_t(j-1)`: the issue order does that for you.
#
# **`correction(pipe, bars)`** (about 12 lines). For each step `j` and tile `t`: wait for softmax t's
# row max of step `j` (`stats[t]`, parity `j % 2`: wait for step 0's too, or the parities drift);
# from step 1 on, wait until `PV_t(j-1)` has finished (`o_done[t]`, parity `(j - 1) % 2`), rescale
# O_t and tell the MMA warp (`o_ready[t]`). After the loop, for each tile: wait for the row sum
# (`l_ready[t]`, parity 0) and the last PV (`o_done[t]`), `finish(t)`, and tell the epilogue
# (`epi_ready[t]`).
#
# **`KV_STAGES`**, the slots of each ring, is given. Section 3's tiles are 128 x 128 in 16 bits
# (32 KB each): two Q tiles and `KV_STAGES` K and V tiles must fit in the 227 KB of shared memory a
# block may use. Leave it at 2 (the check measures the steady state with it): the chart below
# runs your roles with 2 slots and with 1, side by side.
#
# The check runs your roles with rings of 1 to 3 slots, 1 to 5 steps and two timings: no hazard,
# no deadlock, every MMA, softmax step, rescale and store done once. Then it measures the tensor
# core in the steady state with `KV_STAGES` slots. Per key step it has `2g` of work (`g = qk +
# pv`, one tile's MMAs); a tile waits `rowmax + max(exp, rescale)` between its QK and its PV, and
# the other tile's MMAs fill that wait; the correction rescales both tiles (`2 rescale`) and the
# one exponential unit computes both tiles' exponentials (`2 exp`). So a step lasts `max(2g,
# g + rowmax + max(exp, rescale), 2 rescale, 2 exp)` and the tensor core is busy `2g` of it: at
# `g = s`, 100%. When `exp > g + rowmax`, two exponential units would let the tiles' softmaxes
# overlap, and a step would last `g + rowmax + exp`; the SM's single unit makes it `2 exp`. That is
# Section 2's argument in time units: once the tensor cores are fast, the exponentials set the
# pace.

# %%
from flashbook.chapters.ch7 import roles
from flashbook.chapters.ch7 import Timing, check_roles_schedule, plot_schedule, simulate

# %% nbgrader={"grade": false, "grade_id": "ch7_roles_schedule", "locked": false, "schema_version": 3, "solution": true, "task": false}
KV_STAGES = 2          # slots in the K ring and in the V ring (32 KB a tile)


def mma(pipe, bars):
    """The MMA warp: one thread issues every MMA (they run in issue order) and commits."""
    ### BEGIN SOLUTION
    n = pipe.n_steps

    def pv(t, j):                                            # O_t (+)= P_t V_j
        yield pipe.wait(bars.p_ready[t], j % 2)              # softmax t wrote P_t of step j
        if j > 0:
            yield pipe.wait(bars.o_ready[t], (j - 1) % 2)    # the correction rescaled O_t
        yield pipe.pv(t, j)
        yield pipe.commit(bars.o_done[t])                    # O_t is the correction's again

    for t in (0, 1):
        yield pipe.wait(bars.q_full[t], 0)
    for j in range(n):
        s, ph = pipe.slot(j), pipe.phase(j)
        yield pipe.wait(bars.k_full[s], ph)                  # K of step j has landed
        yield pipe.qk(0, j)
        yield pipe.commit(bars.s_ready[0])
        if j > 0:
            yield from pv(1, j - 1)
            yield pipe.commit(bars.v_free[pipe.slot(j - 1)])  # both PVs read V of step j - 1
        yield pipe.qk(1, j)
        yield pipe.commit(bars.s_ready[1])
        yield pipe.commit(bars.k_free[s])                    # both QKs read K of step j
        yield pipe.wait(bars.v_full[s], ph)                  # V of step j has landed
        yield from pv(0, j)
    if n:
        yield from pv(1, n - 1)
        yield pipe.commit(bars.v_free[pipe.slot(n - 1)])
    ### END SOLUTION


def correction(pipe, bars):
    """The correction warpgroup: rescales O_t between two PV MMAs, then finishes both tiles."""
    ### BEGIN SOLUTION
    n = pipe.n_steps
    for j in range(n):
        for t in (0, 1):
            yield pipe.wait(bars.stats[t], j % 2)            # softmax t's row max of step j
            if j > 0:
                yield pipe.wait(bars.o_done[t], (j - 1) % 2)  # no MMA accumulates into O_t now
                yield pipe.rescale(t, j)
                yield pipe.arrive(bars.o_ready[t])           # PV_t(j) may accumulate
    for t in (0, 1):
        yield pipe.wait(bars.l_ready[t], 0)                  # the row sum
        yield pipe.wait(bars.o_done[t], (n - 1) % 2)         # the last PV_t has finished
        yield pipe.finish(t)
        yield pipe.arrive(bars.epi_ready[t])
    ### END SOLUTION

# %% nbgrader={"grade": true, "grade_id": "ch7_roles_test", "locked": true, "points": 4, "schema_version": 3, "solution": false, "task": false}
check_roles_schedule(KV_STAGES, mma, correction)
### BEGIN HIDDEN TESTS
check_roles_schedule(KV_STAGES, mma, correction, hidden=True)
### END HIDDEN TESTS

# %% [markdown]
# Your schedule at work, `g = s` (top): the tensor core alternates between the tiles and never
# waits; the MMA warp's row shows where it waits on a barrier (▲ marks each MMA it issues, long
# before the tensor core runs it), and the exponential unit's row shows the two tiles' `exp`
# taking turns on it. Below, the same roles with one slot per ring: the load of K of
# step `j + 1` can start only when both QKs of step `j` have finished, its TMA latency is no
# longer hidden, and the MMAs serialise behind the loads.

# %% tags=["demo"]
timing = Timing()                                   # tma 3, qk 1, pv 1, rowmax 0.5, exp 1.5
try:
    runs = [simulate(mma, correction, stages=stages, n_steps=6, timing=timing)
            for stages in (KV_STAGES, 1)]
    fig = plot_schedule(*runs)
except NotImplementedError:
    print("Finish Exercise 4 to see your schedule.")

# %% [markdown]
# Now make the exponentials longer than the MMAs, as Section 2 found them on a B200 at d = 64:
# `exp = 3.5` against `g = 2`. The exponential unit never rests, each softmax waits for the
# other's `exp` (the light hatched bars), and the tensor core is busy `2g / 2 exp` = 4 / 7 of
# the steady state, where two units would have given 4 / 6.

# %% tags=["demo"]
from flashbook.chapters.ch7 import steady_utilisation

try:
    exp_bound = simulate(mma, correction, stages=KV_STAGES, n_steps=14, timing=Timing(exp=3.5))
    print(f"tensor core busy {steady_utilisation(exp_bound):.1%} of the steady state; the "
          f"model says {roles.fa4_model(Timing(exp=3.5)):.1%}")
    fig = plot_schedule(exp_bound, t_max=40)
except NotImplementedError:
    print("Finish Exercise 4 to see the exponential unit set the pace.")

# %% [markdown]
# And what the checks catch: the same MMA warp without its wait on `p_ready`. PV0 of step 0 reads
# S0's columns while softmax 0 is still turning the scores into P; the run stops there (the
# dashed line) and says why.

# %% tags=["demo"]
def mma_too_early(pipe, bars):
    """Your MMA warp without its waits on p_ready."""
    for action in mma(pipe, bars):
        if not str(action).startswith("wait(p_ready"):
            yield action


try:
    broken = simulate(mma_too_early, correction, stages=2, n_steps=4, timing=timing)
    print(broken.error)
    fig = plot_schedule(broken)
except NotImplementedError:
    print("Finish Exercise 4 to see what the checks catch.")

# %% [markdown]
# ## 8. The kernel, compiled for sm_100a
#
# `flashbook.chapters.ch7.gluon_fa4` is Exercise 4's schedule written in Triton's **Gluon**
# dialect for sm_100a. One program owns `2 x 128` query rows of one head and forks into the
# roles with `gl.warp_specialize`: the **correction** warpgroup is the default partition (4
# warps), then **softmax 0** and **softmax 1** (4 warps each, one thread per query row), and the
# **MMA**, **load** and **epilogue** warps (1 warp each). The barriers are Exercise 4's, one
# `mbarrier` each; the MMA warp's `commit` is the `mbarriers=[...]` argument of
# `tcgen05_mma`, which arrives on them when the MMA (and every one issued before it) has
# finished.
#
# What Blackwell adds shows up in three places of the source:
#
# - `allocate_tensor_memory` takes S0, S1 (`BLOCK_N` fp32 columns each) and O0, O1 (`d` each)
#   in tensor memory: 512 columns of 128 lanes for d = 128, the whole SM's;
# - the softmax writes P as 16-bit values **into S's own columns** (`reinterpret` of the same
#   TMEM as fp16), and alpha and the final row max and sum into the columns after P;
# - `tcgen05_mma(q_tile, k_tile.permute((1, 0)), s_tmem.index(t), use_acc=False,
#   mbarriers=[s_ready.index(t)])` reads both operands from shared memory, while
#   `tcgen05_mma(p_tmem, v_tile, o_tmem.index(t), use_acc=j > 0, mbarriers=[o_done.index(t)])`
#   reads **P from tensor memory**: no trip through registers or shared memory.
#
# This kernel **cannot run here, nor on an H100/H200** (sm_90 has neither tensor memory nor
# tcgen05): it needs a B200. But Triton compiles it for sm_100a on any machine. The tests do
# that with triton 3.9 (and it was checked with triton 3.6, the version of the GPU images and
# Colab; `gluon_fa4.SHIM` lists the names that differ) and read what the kernel needs from the
# result: `metadata.shared` (bytes of shared memory), `metadata.tmem_size` (tensor-memory
# columns, also the operand of the PTX's `tcgen05.alloc`), the PTX's `.reqntid` (threads),
# `.maxnreg` (registers a thread at launch) and its `setmaxnreg` budgets. The results, with
# their provenance, are stored in `data/ch7_compiled.json`, so this notebook does not compile.

# %%
from flashbook.chapters.ch7 import planner

table = planner.compiled_table()
print(table["provenance"]["what"])
print("compiled with triton", table["provenance"]["triton"], "for",
      table["provenance"]["target"], "on", table["provenance"]["date"][:10])
print("| d | dtype | BLOCK_N | stages | causal | shared (B) | TMEM columns | threads | "
      ".maxnreg | setmaxnreg | MMAs (SS / TS) |")
print("|---|---|---|---|---|---|---|---|---|---|---|")
for e in table["configs"]:
    print(f"| {e['d']} | {e['dtype']} | {e['BLOCK_N']} | {e['STAGES']} | {e['causal']} | "
          f"{e['shared']:,} | {e['tmem_size']} | {e['reqntid']} | {e['maxnreg']} | "
          f"{e['setmaxnreg']} | {e['mma_ss']} / {e['mma_ts']} |")

# %% [markdown]
# **Exercise 5: what the kernel costs, before it is compiled.**
#
# A configuration that does not fit fails at launch (shared memory), at compile time (tensor
# memory) or silently slows down (registers spill). Compute what the kernel needs from the
# source alone and compare with the compiled kernel (3 points). Write
# `kernel_resources(config)` for a `planner.Config` (`HEAD_DIM`, `DTYPE`, `BLOCK_M = 128`,
# `BLOCK_N`, `STAGES`; 16-bit values; and the split of warps and registers: `SOFTMAX_REGS`,
# `SINGLE_WARP_REGS`, `CORRECTION_WARPS`, below), returning a dict with:
#
# - `smem_buffers`: a `(name, bytes)` pair for every shared-memory buffer the kernel allocates:
#   the Q tiles (two of `BLOCK_M x d`, reused for O at the end), the K ring and the V ring
#   (`STAGES` tiles of `BLOCK_N x d` each), and one array per mbarrier name, 8 bytes a barrier:
#   eight per Q tile (`q_full`, `s_ready`, `p_ready`, `stats`, `o_done`, `o_ready`, `l_ready`,
#   `epi_ready`, two barriers each) and four per ring slot (`k_full`, `k_free`, `v_full`,
#   `v_free`, `STAGES` barriers each). The check places them as Triton's allocator does
#   (`planner.place`: largest first, tiles at multiples of 1024 bytes, barrier arrays of 16) and
#   adds what `gl.warp_specialize` keeps for its worker warps;
# - `tmem_columns`: the columns `tcgen05.alloc` takes: S0 and S1 (`BLOCK_N` each) and O0 and O1
#   (`d` each) — P and the statistics live inside S — rounded up to a power of two, at least 32;
# - `threads`: the partitions' warps (`CORRECTION_WARPS` for the correction, 4 for each softmax
#   warpgroup, 1 each for the MMA, load and epilogue warps), padded to whole warpgroups
#   (`setmaxnreg` works per warpgroup), times 32;
# - `launch_registers`: the SM's 65,536 registers shared by those threads, rounded down to a
#   multiple of 8 (registers are allocated 8 at a time);
# - `correction_registers`: the correction's `setmaxnreg` budget: what the two softmax
#   warpgroups (`SOFTMAX_REGS` a thread) and the warpgroup of the one-warp roles
#   (`SINGLE_WARP_REGS` a thread) leave, shared by the correction's threads, rounded down to a
#   multiple of 8 (and at most 256).
#
# The kernel asks `setmaxnreg` for the config's `SOFTMAX_REGS` (192) and `SINGLE_WARP_REGS`
# (24), constexprs of `gluon_fa4`, and the correction gets the rest: 104. The example of
# Section 3 asks for 192 and 32, and its correction gets 96. `CORRECTION_WARPS` (4) is the
# correction's warps: 8 would give each Q tile a correction warpgroup of its own, a what-if
# that only the planner answers (the kernel's correction is written for one warpgroup).
#
# About 17 lines. The check compares with the compiled kernel for the five configs of the table
# above, and with `planner` (which matches the compiled kernel byte for byte) for two other
# splits of warps and registers: the example's requests, and a correction of two warpgroups.
# The hidden test runs more configs and splits against `planner`.

# %% nbgrader={"grade": false, "grade_id": "ch7_resources", "locked": false, "schema_version": 3, "solution": true, "task": false}
def kernel_resources(config):
    """Shared-memory buffers, tensor-memory columns, threads and register budgets of
    gluon_fa4's kernel for a resolved planner.Config."""
    ### BEGIN SOLUTION
    d, size = config.HEAD_DIM, 2                                 # fp16 / bf16
    smem = [("q", 2 * config.BLOCK_M * d * size),                 # Q0, Q1 (O at the end)
            ("k", config.STAGES * config.BLOCK_N * d * size),
            ("v", config.STAGES * config.BLOCK_N * d * size)]
    smem += [(name, 2 * 8) for name in ("q_full", "s_ready", "p_ready", "stats", "o_done",
                                        "o_ready", "l_ready", "epi_ready")]
    smem += [(name, config.STAGES * 8) for name in ("k_full", "k_free", "v_full", "v_free")]
    used = 2 * config.BLOCK_N + 2 * d                             # S0, S1, O0, O1
    columns = max(32, 1 << (used - 1).bit_length())
    warps = config.CORRECTION_WARPS + 4 + 4 + 1 + 1 + 1          # correction, softmax x 2, ...
    threads = 32 * (-(-warps // 4) * 4)                           # whole warpgroups
    launch = 65536 // threads // 8 * 8                            # allocated 8 at a time
    rest = 65536 - 128 * (2 * config.SOFTMAX_REGS + config.SINGLE_WARP_REGS)
    correction = min(256, rest // (32 * config.CORRECTION_WARPS) // 8 * 8)
    return dict(smem_buffers=smem, tmem_columns=columns, threads=threads,
                launch_registers=launch, correction_registers=correction)
    ### END SOLUTION

# %% nbgrader={"grade": true, "grade_id": "ch7_resources_test", "locked": true, "points": 3, "schema_version": 3, "solution": false, "task": false}
planner.check_resources(kernel_resources)
### BEGIN HIDDEN TESTS
planner.check_resources(kernel_resources, hidden=True)
### END HIDDEN TESTS

# %% [markdown]
# What the figures say. At d = 128 the two Q tiles and two slots of K and V take 196,608 of the
# 232,448 bytes a block may use, so a third slot (another 65,536) cannot fit: that is why
# Exercise 4's `KV_STAGES` is 2, and why the example shares one ring between K and V (three tiles,
# 96 KB). Tensor memory is full at d = 128 (512 of 512 columns), so d = 256 would need another
# map (the example supports d <= 128 for the same reason). One CTA per SM, 512 threads, 128
# registers each at launch; then the softmax threads, which hold a whole row of S, get 192. The
# what-if of a correction warpgroup per Q tile shows what a second one would cost: four more
# warps take the CTA to 640 threads (96 registers each at launch), and what the softmax and the
# one-warp roles leave, shared by 256 correction threads, is 48 a thread instead of 104, for the
# same 32-column chunks of O.

# %% tags=["demo"]
rows = ["| config | your shared memory (B) | compiled | your TMEM columns | compiled | your threads, "
        "registers (launch, correction) | compiled | fits a B200 |", "|---|---|---|---|---|---|---|---|"]
for config in planner.resource_cases(hidden=True)[:8]:
    try:
        mine = kernel_resources(config)
    except NotImplementedError:
        print("Finish Exercise 5 to compare your figures with the compiled kernel's.")
        break
    placed = planner.place([(n, b, 1024 if b >= 1024 else 16) for n, b in mine["smem_buffers"]]
                           + planner.warp_specialize_buffers(config))
    smem = max(o + b for _, o, b in placed)
    entry = planner.compiled_entry(config)
    verdict = planner.feasible(config)
    budget = planner.register_budget(config)
    rows.append(f"| {config.describe()} | {smem:,} | "
                f"{entry['shared'] if entry else planner.shared_memory(config):,} | "
                f"{mine['tmem_columns']} | "
                f"{entry['tmem_size'] if entry else planner.tmem_columns(config)} | "
                f"{mine['threads']}, {mine['launch_registers']}, "
                f"{mine['correction_registers']} | "
                + (f"{entry['reqntid']}, {entry['maxnreg']}, {budget['correction']} | " if entry
                   else f"not compiled (planner: {planner.threads(config)}, {budget['launch']}, "
                        f"{budget['correction']}) | ")
                + ("yes |" if verdict else "no: " + "; ".join(verdict.reasons) + " |"))
print("\n".join(rows))

# %% [markdown]
# On an sm_100 GPU the next cell runs the kernel against PyTorch's SDPA; elsewhere it says why it
# cannot.

# %% tags=["demo"]
import torch

if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 10:
    from flashbook.chapters.ch7 import attention_fa4
    q, k, v = (torch.randn(2, 4, 1000, 128, device="cuda", dtype=torch.float16)
               for _ in range(3))
    for causal in (False, True):
        o, lse = attention_fa4(q, k, v, causal=causal)
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
        print(f"causal={causal}: max |O - SDPA| = {(o - want).abs().max().item():.1e}")
else:
    print("The Gluon Blackwell kernel needs an sm_100 GPU (B200, GB200); this runtime has "
          + (torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU") + ".")

# %% [markdown]
# ### Ordering inside the roles: tcgen05's waits and fences (Exercise 6)
#
# Exercise 4's roles talk through barriers, and the simulator took a barrier's word for it: once
# `s_ready[t]` completes, S is there. On the hardware a barrier orders *ordinary* memory
# operations, and the tcgen05 instructions are not ordinary: `tcgen05.ld` (tensor memory to
# registers) and `tcgen05.st` (registers to tensor memory) are **asynchronous**, like the MMA.
# A softmax thread that issues `tcgen05.st` of P goes on at once; the registers a `tcgen05.ld`
# fills are undefined until the thread executes `tcgen05.wait::ld`, and its stores have landed
# only after `tcgen05.wait::st`. To hand tensor memory from one role to another, the PTX ISA's
# pattern is, in the producer, the wait, then `tcgen05.fence::before_thread_sync` (the tcgen05
# instructions before it are ordered before the synchronisation that follows), then the
# mbarrier arrive; in the consumer, the mbarrier wait, then `tcgen05.fence::after_thread_sync`
# (the tcgen05 instructions after it are ordered after the synchronisation before it), then its
# `tcgen05.ld` or `tcgen05.mma`. Without the after-fence the hardware may start the load before
# the wait has returned; without the wait::st or the before-fence, the consumer may see the
# barrier complete before the data is in tensor memory. An MMA's `tcgen05.commit` needs
# neither: it arrives once the MMAs before it have completed, with the before-fence built in.
#
# | hand-off | producer, before its arrive | consumer, after its wait |
# |---|---|---|
# | the TMEM address: MMA warp -> every role (`tmem_ready`) | `tcgen05.alloc`, `fence::before_thread_sync` | `fence::after_thread_sync`, then its first tcgen05 op |
# | S_t: QK MMA -> softmax t (`s_ready`) | `tcgen05.commit` | `fence::after_thread_sync`, `tcgen05.ld` |
# | the row max: softmax t -> correction (`stats`) | `tcgen05.st`, `wait::st`, `fence::before_thread_sync` | `fence::after_thread_sync`, `tcgen05.ld` |
# | P_t: softmax t -> MMA warp (`p_ready`) | `tcgen05.st`, `wait::st`, `fence::before_thread_sync` | `fence::after_thread_sync`, `tcgen05.mma` |
# | O_t rescaled: correction -> MMA warp (`o_ready`) | `tcgen05.st`, `wait::st`, `fence::before_thread_sync` | `fence::after_thread_sync`, `tcgen05.mma` |
# | O_t accumulated: MMA -> correction (`o_done`) | `tcgen05.commit` | `fence::after_thread_sync`, `tcgen05.ld` |
#
# The first row is the **allocation handshake**: one warp (the MMA warp) executes
# `tcgen05.alloc`, which writes the address of the allocation into shared memory; it fences and
# synchronises with the other roles through a barrier (here an mbarrier, `tmem_ready`), and
# each role fences after that barrier before it uses the address. A role that skips it may
# read the address before it was written.
#
# `ch7.ordering` checks these rules in the simulator, for the softmax warpgroups, which you now
# write at the level of instructions. Their actions: `pipe.load_s(t, j)` (`tcgen05.ld` of S_t),
# `pipe.wait_ld()`, `pipe.rowmax(t, j)` (the max from the registers, and a `tcgen05.st` of it
# into the statistics columns), `pipe.exp(t, j)` (P from the registers, and a `tcgen05.st` of P
# into S's columns), `pipe.rowsum(t)` (a `tcgen05.st` of the sum), `pipe.wait_st()`,
# `pipe.fence_before()` and `pipe.fence_after()`; the barriers are Exercise 4's and
# `bars.tmem_ready`, on which the MMA warp arrives once after its `tcgen05.alloc` (the chapter
# adds that prologue to your `mma`). A rule broken is a hazard of kind *ordering*, whose message
# names the role, the instruction, what is missing and what could go wrong on a GPU. Your MMA
# warp and correction of Exercise 4 run beside it; their fences follow the same table and the
# simulator takes them as given.
#
# **Exercise 6 (3 points).** Write `softmax_ordered(pipe, t, bars)`, softmax warpgroup t with
# every wait and fence it needs: first the allocation handshake, then for every key step `j`
# the scores (wait on `s_ready[t]`, parity `j % 2`), the row max for the correction (arrive on
# `stats[t]`) before the exponentials, so that the correction can rescale while the
# exponentials run, and P for the MMA warp (arrive on `p_ready[t]`); after the loop, the row
# sum (arrive on `l_ready[t]`). Each arrive publishes what the role stored in tensor memory.
# The check runs it with your Exercise 4 roles over rings of 2 slots, 1 to 5 steps and two
# timings (the hidden test: Exercise 4's rings, lengths and timings), wants every step done and
# the tensor core as busy as Exercise 4's schedule keeps it. About 20 lines.

# %% nbgrader={"grade": false, "grade_id": "ch7_ordering", "locked": false, "schema_version": 3, "solution": true, "task": false}
def softmax_ordered(pipe, t, bars):
    """Softmax warpgroup t at the instruction level: tcgen05.ld of S, the row max and P stored
    into tensor memory with tcgen05.st, each hand-off with its tcgen05 waits and fences."""
    ### BEGIN SOLUTION
    yield pipe.wait(bars.tmem_ready, 0)            # the MMA warp's tcgen05.alloc is done
    yield pipe.fence_after()                       # ... and the address is ours to read
    for j in range(pipe.n_steps):
        yield pipe.wait(bars.s_ready[t], j % 2)    # commit: QK_t of step j has completed
        yield pipe.fence_after()                   # the tcgen05.ld comes after that wait
        yield pipe.load_s(t, j)                    # tcgen05.ld: S_t into registers
        yield pipe.wait_ld()                       # tcgen05.wait::ld: the registers hold S
        yield pipe.rowmax(t, j)                    # the max, tcgen05.st into the stats columns
        yield pipe.wait_st()                       # tcgen05.wait::st: the max has landed
        yield pipe.fence_before()                  # order the stores before the arrive
        yield pipe.arrive(bars.stats[t])           # the correction may read the max
        yield pipe.exp(t, j)                       # P, tcgen05.st into S_t's columns
        yield pipe.wait_st()                       # tcgen05.wait::st: P has landed
        yield pipe.fence_before()                  # tcgen05.fence::before_thread_sync
        yield pipe.arrive(bars.p_ready[t])         # the MMA warp may read P
    yield pipe.rowsum(t)                           # the sum, tcgen05.st
    yield pipe.wait_st()                           # tcgen05.wait::st: the sum has landed
    yield pipe.fence_before()                      # then fence, then publish
    yield pipe.arrive(bars.l_ready[t])             # the correction may read the sum
    ### END SOLUTION

# %% nbgrader={"grade": true, "grade_id": "ch7_ordering_test", "locked": true, "points": 3, "schema_version": 3, "solution": false, "task": false}
ch7.check_ordering(softmax_ordered, mma, correction)
### BEGIN HIDDEN TESTS
ch7.check_ordering(softmax_ordered, mma, correction, hidden=True)
### END HIDDEN TESTS

# %% [markdown]
# What the rules catch: your softmax without its `tcgen05.wait::st` before the arrive on
# `p_ready`. In the simulator's time the store had landed (an `exp` takes its time); on a GPU
# nothing says so, and the MMA warp could multiply S's old scores by V.

# %% tags=["demo"]
def drop_second_wait_st(softmax):
    """softmax with the second tcgen05.wait::st of each step (the one after exp) left out."""
    def role(pipe, t, bars):
        after_exp = False
        for action in softmax(pipe, t, bars):
            if str(action).startswith("exp("):
                after_exp = True
            elif str(action) == "wait_st()" and after_exp:
                after_exp = False
                continue
            yield action
    return role


try:
    broken = ch7.simulate_ordered(drop_second_wait_st(softmax_ordered), mma, correction,
                                  stages=2, n_steps=3)
    print(broken.error)
except NotImplementedError:
    print("Finish Exercises 4 and 6 to see what the ordering rules catch.")

# %% tags=["remove-cell"]
# The figures the prose quotes, from the recorded H200 data: the book pastes each into its
# glue:text role (myst-nb's glue); elsewhere this does nothing.
from flashbook import quoted
quoted.glue(ch7.CHAPTER)

# %% [markdown]
# ## 9. The two tricks on a Hopper GPU, measured
#
# There is no Blackwell GPU among the machines this book is measured on. What can be measured
# is what the two tricks do on Hopper, inside the two fastest kernels of this book:
# `flashbook bench ch7` runs Chapter 3's two-tile Triton kernel with `attn_update` rebound to
# your `lazy_update` (threshold 8 in base 2: an exponential may grow to 256 before O is
# rescaled) and to your `exp2_poly_tl`, and Chapter 6's Gluon kernel with the same two
# switches, on Chapter 3's shapes, in fp16 and in bf16. Two timing probes, which are not attention,
# measure the exponentials' share: every exponential of P computed twice (two MUFU.EX2, the same
# value), and no exponential at all (a clamp on the FMA units).
#
# On an H200 at `(1, 16, 16384, 128)` in fp16, against the same kernel without the trick:
#
# * `ch3_two_tiles`: lazy rescaling {glue:text}`ch7_ch3_two_tiles_lazy:.2f`x, the polynomial on every exponential
#   {glue:text}`ch7_ch3_two_tiles_poly:.2f`x;
# * `ch6_gluon_fa3`: lazy rescaling {glue:text}`ch7_ch6_gluon_fa3_lazy:.2f`x, the polynomial on every exponential
#   {glue:text}`ch7_ch6_gluon_fa3_poly:.2f`x;
#
# and the probes:
#
# * `ch3_two_tiles`: exponentials doubled {glue:text}`ch7_ch3_two_tiles_exp_x2:.2f`x, removed
#   {glue:text}`ch7_ch3_two_tiles_no_exp:.2f`x;
# * `ch6_gluon_fa3`: exponentials doubled {glue:text}`ch7_ch6_gluon_fa3_exp_x2:.2f`x, removed
#   {glue:text}`ch7_ch6_gluon_fa3_no_exp:.2f`x.
#
# **Neither trick pays on Hopper at these shapes, and the probes say why.** Removing every
# exponential buys nothing (within a few percent at d = 64, where the matmuls per score halve):
# the exponentials are hidden under the tensor cores. Doubling them costs a quarter of the speed:
# the special-function unit is close to saturated, so it is nearly balanced with the tensor
# cores. That is exactly the balance Section 2 computed for Hopper, and Blackwell breaks it by
# doubling the tensor cores' rate without doubling MUFU's; only then do the exponentials become
# the critical path that FlashAttention-4 relieves. Moving them to the FMA units on Hopper
# trades a unit with slack for one without: the FMA pipe already carries the scaling, the row
# sums, the conversions and the rescale of the softmax, and the cubic adds about ten
# instructions per score there (the cubic on every second column only still runs at 0.84x).
# Lazy rescaling removes a multiplication of O in registers, which costs little on Hopper, and
# adds a whole-tile maximum and a branch on it each step: the two warpgroups of a tile must
# agree, which needs a reduction through shared memory and a barrier. On Blackwell the same
# rescale reads and writes O in tensor memory through a separate correction warpgroup, which
# is what makes skipping it worth the branch. The polynomial keeps the error where it was;
# lazy rescaling raises the 16-bit error a little, for the reason of Section 5 (the row's
# largest weight is no longer exactly 1). The per-case errors against float64 are in the
# figure's data (`err=` in each row's note).

# %% tags=["demo"]
import matplotlib.pyplot as plt
from flashbook import results
from flashbook.chapters.ch7 import recorded
found = results.recorded("ch7")
if found:
    print(recorded.summary(found.rows))
    fig = recorded.plot_recorded(found.rows)
    fig.suptitle("FlashAttention-4's tricks on an H200 (" + results.describe(found.provenance)
                 + ")", fontsize=9)
    fig.tight_layout()
    plt.show()
else:
    print("No recorded H200 data in this installation.")

# %% [markdown]
# On a GPU the next cell times your lazy kernel of Exercise 2 with and without the threshold
# (`max_growth` 256 against 1, which rescales whenever a max grows); on a CPU it says why it does
# nothing. The published Blackwell figures are FlashAttention-4's own
# {cite}`zadouri2026flashattention4`, measured by its authors on a B200 in BF16, not by us: up to
# 1.3x the speed of cuDNN 9.13 and 2.7x that of Triton, and up to 1,613 TFLOP/s, 71 % of the
# GPU's peak, with the kernel written in CuTe DSL.

# %% tags=["demo"]
if backend.gpu:
    try:
        q, k, v = (torch.randn(4, 16, 4096, 128, device="cuda", dtype=torch.float16)
                   for _ in range(3))
        flops = fb.reference.attention_flops(4, 16, 4096, 4096, 128)
        for growth in (1.0, 256.0):
            ms = triton.testing.do_bench(lambda: attention_lazy(q, k, v, max_growth=growth))
            print(f"max_growth {growth:5g}: {ms:.3f} ms, {flops / ms / 1e9:.0f} TFLOP/s")
    except NotImplementedError:
        print("Finish Exercise 2 to time it.")
else:
    print("CPU mode: the interpreter's timings say nothing about a GPU; nothing to measure.")

# %% [markdown]
# ## What was measured, and what is left
#
# Nothing in this chapter was measured on a Blackwell GPU. The cycle model of Section 2 is
# arithmetic on published per-SM throughputs (the B300's doubled exponential rate included);
# the ordering rules of Exercise 6 are the PTX ISA's, checked in a simulator, not on a GPU; the exactness of lazy rescaling and the error of
# the polynomial exp2 were checked in float32 on a CPU, against float64, on the inputs the
# checks list: the cubic's largest relative error is $7.5 \cdot 10^{-5}$ on every input tried,
# and the lazy rescale stays within float32 rounding of the reference, as the eager one does,
# while it skips most rescales. Section 9 measured both tricks on an H200, where neither pays;
# the speed-ups they buy on a B200 are FlashAttention-4's published figures. The Gluon kernel of
# Section 8 is compiled for sm_100a and inspected, never run.
#
# **Further reading**
# * FlashAttention-4 {cite}`zadouri2026flashattention4`: the Blackwell pipelines, the
#   software exponential, conditional rescaling, and the backward pass with 2-CTA MMAs.
# * FlashAttention-3 {cite}`shah2024flashattention3`: the Hopper design this one extends.
# * The CUDA C++ Programming Guide {cite}`nvidia2025cudaguide`: the arithmetic throughput per SM
#   used in Section 2.
