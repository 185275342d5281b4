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
# # Chapter 6: The Hopper design (FlashAttention-3)
#
# **What you will learn**
# - What changed on Hopper (H100, H200) and why a FlashAttention-2-style kernel leaves about
#   two thirds of the tensor cores idle there (the recorded FlashAttention-2 row runs at about a
#   third of the H200's peak): TMA bulk copies that complete on mbarriers with transaction
#   counts, `wgmma` reading its operands from shared memory and accumulating asynchronously,
#   227 KB of shared memory per block, and register reallocation between warpgroups
#   (`setmaxnreg`).
# - The FlashAttention-3 structure {cite}`shah2024flashattention3`: a producer warpgroup that only
#   issues TMA loads into a ring of K/V stages guarded by *full* and *consumed* barriers; two
#   consumer warpgroups, each with its own Q tile; **ping-pong**, so one warpgroup's softmax runs
#   while the other's matrix multiplies hold the tensor cores; the overlap of softmax(j) with
#   QK^T(j+1) inside a warpgroup; the causal loop split; and the shared-memory limit that rules
#   configurations out.
# - How to write such a kernel and have it checked on a laptop: JAX Pallas Mosaic GPU's
#   interpret mode runs warp-specialized, barrier-driven kernels on a CPU and reports races and
#   barrier misuse.
# - FP8 attention, FlashAttention-3's third contribution: e4m3 operands with one scale per
#   block, V transposed for `wgmma`, the scales carried through the online softmax, and the
#   random Hadamard rotation that tames outlier channels.
#
# **What you need**: Chapters 3 and 4 (the online softmax, two query tiles per program);
# torch >= 2.11 and triton >= 3.6 (the Gluon kernel needs 3.6). The exercises run on any
# machine: Exercises 1 and 4 in JAX's interpret mode (no GPU needed), Exercises 2, 3 and 5-7 in
# plain Python and PyTorch. The setup cell below installs JAX (CPU wheels) when it is missing, keeps an installed
# one (Colab's), and prints which JAX versions the checks are proven on. The chapter's kernel
# runs for real on an H100 or H200.
#
# **Versions.** The Gluon kernel is one source for Triton 3.6 (which it ran on, on the H200) and
# Triton 3.9 (which compiles it for sm_90a in the test suite, without a GPU); the few names that
# differ between the two are mapped at the top of `flashbook/gluon_kit.py`.
#
# **Exercises** (19 points): (1) the producer of a K/V ring in Pallas Mosaic GPU (3); (2) the
# schedule of one producer and two consumers, (2a) the ring's barriers (3) and (2b) the
# consumers' ping-pong (2); (3) a config planner for the chapter's kernel (3); (4) the consumer
# warpgroups of an FA3-shaped kernel in Pallas Mosaic GPU (4); FP8: (5) block quantization (1),
# (6) the incoherent-processing rotation (1), (7) the scale bookkeeping of the online softmax
# (2). About 5-7 hours.

# %%
import flashbook as fb
backend = fb.setup()
import torch
from flashbook.chapters.ch6 import jax_setup, planner
jax_setup.ensure_jax()        # Exercises 1 and 4 run in JAX: installed when missing, never replaced

# %% [markdown]
# ## 1. What changed on Hopper
#
# Chapter 3's Triton kernel issues its loads, waits for them, multiplies, and repeats; the
# compiler overlaps what it can. On an A100 that is close to the best one can do. Hopper adds
# four pieces of hardware that a kernel must *schedule* to use fully.
#
# **TMA, the Tensor Memory Accelerator.** One thread describes a whole tile (a base, a shape, the
# strides: a *tensor descriptor*) and the copy engine moves it from global to shared memory,
# computing every address itself. The threads that asked are free at once. The copy announces
# its completion on an **mbarrier**, a 64-bit object in shared memory that counts two things:
# thread *arrivals* and transferred *bytes*. The waiter sets how many bytes to expect
# (`expect_tx`), the copy engine counts them down, and the barrier's **phase** flips when both
# counts reach zero. A waiter names the phase it waits for (its parity), so one barrier can be
# reused round after round, as long as no one falls a whole phase behind.
#
# **wgmma, the warpgroup matrix multiply.** Four warps (128 threads, a *warpgroup*) issue one
# `m64nNk16` multiply together, reading B, and optionally A, straight from shared memory, and
# accumulating into registers. It is **asynchronous**: the instruction returns before the
# multiply is done, and `wgmma.wait_group(n)` waits until at most n groups are in flight. Work
# issued between the two runs while the tensor cores multiply.
#
# **227 KB of shared memory per block** (232,448 bytes of the SM's 228 KB), against 163 KB on an
# A100: room for the Q tiles of 128 query rows and several stages of K and V.
#
# **Register reallocation.** An SM has 65,536 registers. A warpgroup can give some back
# (`setmaxnreg.dec`) and another can take them (`setmaxnreg.inc`): the producer warpgroup, which
# only issues copies, keeps 24-40 registers per thread, and the two consumer warpgroups, which
# hold 64 x d fp32 accumulators each, get 232-240.
#
# A kernel in which every warp loads, multiplies and does the softmax in turn cannot keep the
# tensor cores busy while it computes exponentials: an H100 does 989 TFLOP/s of fp16 matrix
# multiply but only 3.9 TFLOP/s of exponentials, so at d = 128, with 512 times more multiply
# FLOPs than exponentials, the exponentials alone can take half as long as the GEMMs
# {cite}`shah2024flashattention3`. FlashAttention-3's answer is
# to give each job to its own warpgroup and let barriers order them.

# %% [markdown]
# ## 2. The FlashAttention-3 structure
#
# One program (a CTA of three warpgroups) computes 128 query rows of one head, as two 64-row
# tiles, one per consumer warpgroup (a 64 x d fp32 accumulator fills half of a thread's
# registers at d = 128):
#
# - **The producer** (warpgroup 0) loads Q once, then walks the K/V tiles: for step j it waits
#   until ring slot `j % stages` has been *consumed* by both consumers, tells the slot's *full*
#   barrier how many bytes are coming, and issues the TMA copies of K_j and V_j onto it.
# - **The consumers** (warpgroups 1 and 2) each own a Q tile. For step j a consumer waits on the
#   slot's full barrier, computes $S_j = Q K_j^T$ (wgmma), the online-softmax update of
#   Chapter 3 in base 2 (below), then $O \mathrel{+}= \tilde P_j V_j$ (wgmma, $\tilde P_j$ staged
#   through shared memory or held in registers), and arrives on the slot's consumed barrier.
#   The consumed barrier expects **two** arrivals, one per consumer: the producer may refill
#   the slot only when both are done with it.
#
#   With the scale folded into $c = \log_2 e / \sqrt{d}$, the running maximum $m$ is kept in
#   base-2 units, so one `exp2` per score replaces `exp`:
#
#   $$m_j = \max\big(m_{j-1},\ c \max_k S_{j,k}\big), \qquad
#   \tilde P_j = 2^{\,c S_j - m_j}, \qquad \alpha_j = 2^{\,m_{j-1} - m_j},$$
#
#   $$\ell_j = \alpha_j \ell_{j-1} + \textstyle\sum_k \tilde P_{j,k}, \qquad
#   O_j = \alpha_j O_{j-1} + \tilde P_j V_j, \qquad
#   O = O_n / \ell_n, \quad \text{LSE} = (m_n + \log_2 \ell_n) \ln 2 .$$
# - **Ping-pong.** The two consumers share the tensor cores. A pair of *schedule barriers* makes
#   them take turns: consumer 1 issues its GEMMs while consumer 2 computes its softmax, then
#   they swap. With GEMM time $g$ and softmax time $s$ per step, one consumer alone keeps the
#   tensor cores busy a fraction $\frac{g}{g+s}$ of the time; two in ping-pong reach
#   $\min\!\big(1, \frac{2g}{g+s}\big)$: at $g = s$, 100 % against 50 %.
# - **Intra-warpgroup overlap.** Inside one consumer, the QK^T of step j+1 is issued before the
#   softmax of step j, so the multiply runs while the exponentials are computed.
# - **Causal.** Tiles wholly below the diagonal need no mask, tiles on it do, tiles above it
#   are skipped: the loop is split into those sections, as in Chapter 4.
#
# Exercise 1 builds the K/V ring in Pallas Mosaic GPU; Exercise 2 simulates the schedule and
# measures what ping-pong buys; Exercise 3 plans a configuration within the hardware limits;
# and the chapter's fastest kernel puts it all together in Triton's Gluon dialect.

# %% [markdown]
# ## 3. The K/V ring in Pallas Mosaic GPU
#
# On Hopper, FlashAttention-3 splits a CTA's warpgroups (128 threads each) into roles. One
# **producer** warpgroup does nothing but move K and V tiles from global memory (GMEM) into
# shared memory (SMEM) with the **TMA**, the copy engine: a single thread issues a copy of a
# whole tile and goes on, and the hardware signals an **mbarrier** when the bytes have landed.
# The **consumer** warpgroups run the matmuls and the softmax on the tiles. For the two to
# overlap, the producer must run ahead: SMEM holds a **ring** of `stages` slots, tile `i` goes
# into slot `i % stages`, and while the consumers work on tile `i` the next tiles are already
# on their way.
#
# A ring needs two barriers per slot:
#
# | barrier | arrivals to complete a phase | who arrives | who waits | meaning |
# |---|---|---|---|---|
# | `full[s]` | 1 | the TMA copy into slot `s` | each consumer, before reading slot `s` | the tile has landed |
# | `consumed[s]` | one per consumer warpgroup | each consumer, after reading slot `s` | the producer, before refilling slot `s` | everyone is done with the tile |
#
# An mbarrier counts arrivals; when the count is reached the barrier **completes a phase** and
# resets. A wait waits for the *next* phase this warpgroup has not seen yet (the hardware
# tracks a phase bit; Pallas keeps track of it for you). So the protocol is a strict
# alternation, per slot: copy → `full` completes → consumers read → `consumed` completes →
# the next copy into that slot, and so on.
#
# ```
# producer:   copy t0→s0   copy t1→s1   wait consumed[s0]   copy t2→s0   wait consumed[s1]   copy t3→s1 ...
#                 │ full[s0]    │ full[s1]        ▲                │ full[s0]       ▲
# consumers:      ▼ read t0, arrive consumed[s0] ─┘  read t1, arrive consumed[s1] ──┘  read t2 ...
# ```
#
# Two ways to get it wrong, and what each costs on a GPU:
# * the producer refills a slot **without waiting** on `consumed`: the TMA overwrites a tile a
#   consumer is still reading, and attention silently mixes two K tiles (no error, wrong
#   numbers, only sometimes: a timing-dependent bug);
# * a consumer **reads before its `full` wait** covers the copy into that slot (for example the
#   copy signalled another slot's barrier): it reads a half-written tile.
# A third one is a hang: a wait that no arrival will ever complete, such as waiting on
# `consumed` before the very first copies (the consumers are waiting for those tiles).
#
# You can't run a Hopper kernel on a CPU, but JAX can *interpret* one: in **Pallas Mosaic GPU
# interpret mode** every warpgroup is a thread, SMEM is a NumPy buffer, copies and barriers are
# simulated, and with `detect_races=True` a race detector reports any two accesses to the same
# SMEM words that no barrier orders, even when the timing happened to work out. It is also
# strict about barriers: a phase must be waited for before the next one completes, and every
# warpgroup that waits on a barrier must wait for **all** of its phases before the kernel ends.
# So the producer must also **drain**: after its last copy, wait for the releases of the last
# tiles, which no refill waited for (a persistent kernel that reuses the ring for its next work
# tile needs exactly this, to keep its phase bits in step).
#
# The kernel around your code is given (`flashbook.chapters.ch6.ring`): warpgroups
# `0 … num_consumers-1` are consumers (each waits on `full[slot]`, reads the tile into
# registers, arrives on `consumed[slot]` at once, like FA3's early release of K, and adds the
# tile, weighted by its step, to an accumulator); the last warpgroup runs your producer.
# Between its read and its arrival each consumer runs `plgpu.commit_smem()`, a proxy fence
# (`fence.proxy.async.shared::cta`): its read goes through the *generic proxy*, the refill
# through the TMA's *async proxy*, and a barrier alone orders accesses of one proxy only.
# (FA3's consumers need no such fence for K and V: `wgmma` reads them through the async proxy
# too. JAX 0.11's race detector models the two proxies and reports the missing fence as a race
# between the refill and the read; JAX 0.10.2's does not.) The Pallas calls you need:
#
# | call | does |
# |---|---|
# | `plgpu.copy_gmem_to_smem(src, dst, barrier)` | TMA copy of the GMEM ref `src` into the SMEM ref `dst`; arrives on `barrier` when it has landed |
# | `plgpu.barrier_wait(barrier)` | wait for this warpgroup's next phase of `barrier` |
# | `kv_gmem.at[pl.ds(start, size)]`, `ring.at[slot]`, `full.at[slot]` | sub-refs (rows, a slot, one barrier of an array) |
# | `@pl.loop(lo, hi)` | a loop over a traced `int32` step (`lax.rem(step, stages)` is its slot) |
# | `@pl.when(cond)` | run the decorated function only when `cond` (a traced bool) holds |
#
# `stages`, `steps` and `block` are Python ints, so a plain `for` loop over them unrolls.

# %%
from flashbook.chapters.ch6 import interpret, ring_checks
try:                                  # the check runs your kernel in its own process; JAX must
    import jax                        # be installed in this Python (no GPU needed)
    from jax import lax
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu
except ImportError:
    print("JAX is not installed:", interpret.INSTALL)

# %% [markdown]
# **Exercise 1 (3 points).** Write the producer's loop: for each tile `i` (slot
# `s = i % stages`), wait on `consumed[s]` when the slot still holds tile `i - stages`, then
# issue the TMA copy of rows `i * block … (i + 1) * block - 1` of `kv_gmem` into `ring[s]`,
# arriving on `full[s]`; after the loop, drain the final phases of `consumed`. About 10 lines.
#
# The check runs your producer in interpret mode, in a separate process with a time limit
# (a misused barrier can hang the interpreter), with the race detector on, for a ring of 3
# slots and 8 tiles (slots refilled once or twice); the hidden tests add a 2-slot ring, one
# consumer, fewer tiles than slots, and other depths. A failure names the two racing accesses (your line and the
# consumer's), the barrier that was misused, or the waits that were pending when the kernel
# hung. It also reads the order in which your producer issued its copies and waits: the copy of
# tile `i` may wait for the release of tile `i - stages`, never a later one, so a producer that
# waits for each tile's release before copying the next (one tile in flight) loses the points.

# %% nbgrader={"grade": false, "grade_id": "ch6_ring_producer", "locked": false, "schema_version": 3, "solution": true, "task": false}
def kv_producer(kv_gmem, ring, full, consumed, *, stages: int, steps: int, block: int):
    """The producer warpgroup of the K/V ring.

    kv_gmem:  GMEM ref (steps * block, cols); tile i is its rows i * block ... (i + 1) * block - 1
    ring:     SMEM ref (stages, block, cols); tile i goes into slot i % stages
    full:     `stages` barriers of 1 arrival (the copy's): the slot's tile has landed
    consumed: `stages` barriers of one arrival per consumer: the slot may be refilled
    stages, steps, block: Python ints
    """
    ### BEGIN SOLUTION
    @pl.loop(0, steps)
    def _load(step):                                   # step: a traced int32
        slot = lax.rem(step, stages)

        @pl.when(step >= stages)                       # the slot still holds tile step - stages:
        def _wait_for_release():                       # wait until every consumer is done
            plgpu.barrier_wait(consumed.at[slot])

        # TMA: GMEM -> SMEM; the copy arrives on the full barrier of the slot it fills
        plgpu.copy_gmem_to_smem(kv_gmem.at[pl.ds(step * block, block)],
                                ring.at[slot], full.at[slot])

    # Drain: nothing waited for the releases of the last tiles, and every phase of a barrier
    # must be waited for before the kernel ends (or before a persistent kernel reuses the ring).
    for step in range(max(0, steps - stages), steps):
        plgpu.barrier_wait(consumed.at[step % stages])
    ### END SOLUTION

# %% nbgrader={"grade": true, "grade_id": "ch6_ring_test", "locked": true, "points": 3, "schema_version": 3, "solution": false, "task": false}
ring_checks.check_kv_ring(kv_producer)
### BEGIN HIDDEN TESTS
ring_checks.check_kv_ring(kv_producer, hidden=True)
### END HIDDEN TESTS

# %% [markdown]
# ## 4. The schedule: one producer, two consumers, ping-pong
#
# FlashAttention-3 splits a CTA's warpgroups by role. One **producer** warpgroup does nothing but
# issue TMA copies: it streams the K and V tiles of key step 0, 1, 2, ... into a ring of
# `stages` shared-memory slots (step `k` goes to slot `k % stages`). Two **consumer** warpgroups,
# each with its own tile of queries, read every step: a QK GEMM reads K, the online softmax runs
# on the warpgroup's CUDA cores, a PV GEMM reads V. Nothing but barriers keeps them in order, and
# a wrong barrier does not crash: it lets the producer overwrite a tile that a consumer is still
# multiplying, or lets a consumer multiply a tile that has not arrived. On a GPU such a race
# shows up as a wrong number once in a thousand runs, or as a hang.
#
# So we write the schedule against a model first. `flashbook.chapters.ch6.pipeline` simulates the
# three warpgroups in time units: a TMA copy lands `tma` after it is issued, the two GEMMs of a
# step take `qk` and `pv` on the tensor cores and the softmax takes `softmax` on the
# warpgroup's own cores. The tensor cores are **one resource**: two GEMMs that run at the same
# time share them and each runs at half speed. Each warpgroup is a Python generator that
# `yield`s actions to the engine, which reports every hazard with the time, the warpgroups and
# the barrier, and stops a deadlock instead of hanging.
#
# **Barriers** behave as Hopper's `mbarrier`s: `pipe.barrier(name, arrivals)` makes one whose
# phase completes after `arrivals` arrivals; `yield pipe.arrive(bar)` is one arrival;
# `yield pipe.wait(bar, parity)` returns once the latest phase of that **parity** has completed.
# The parity is all a waiter gives: the phase a barrier completes in round `r` has parity
# `r % 2`, and on a fresh barrier a wait for parity 1 returns at once (as if a phase −1 had
# completed), which is how a first round waits for nothing.
#
# | action | what it does |
# |---|---|
# | `pipe.load(step, bar)` | TMA: K and V of `step` into slot `pipe.slot(step)`; one arrival on `bar` when they land |
# | `pipe.qk(step)`, `pipe.pv(step)` | a GEMM on the tensor cores, reading K (or V) of `step` from its slot |
# | `pipe.softmax(step)` | the online softmax of `step` (QK before softmax before PV, steps in order) |
# | `pipe.slot(step)`, `pipe.phase(step)` | `step % stages`, and the parity `(step // stages) % 2` of the phase in which `step` lands |
#
# **2a, the ring (3 points).** Write `make_barriers(pipe)`, returning three lists: `full[s]`,
# completed by the TMA when slot `s` holds its next step; `consumed[s]`, completed when **every**
# consumer (`pipe.consumers` of them) is done with slot `s`; `turn[wg]`, one per consumer, for
# 2b. Then `producer(pipe, full, consumed)`: for each step, wait until the consumers have released
# the slot's previous step (round `r` of a slot waits for the phase completed in round `r − 1`;
# in round 0 the parity trick above waits for nothing), then load the step. About 10 lines.
#
# **2b, the consumer and its ping-pong (2 points).** A consumer cannot start the PV GEMM of step
# `k` before the softmax of step `k`, and the softmax keeps the tensor cores idle. FA3's answer is
# to give the two consumers **turns**: a turn is one GEMM block, the PV GEMM of step `k − 1`
# followed by the QK GEMM of step `k`, and while one warpgroup has its turn the other runs its
# softmax. Write `consumer(pipe, wg, full, consumed, turn)` as a loop over blocks
# `k = 0, ..., n_steps` (block 0 has no PV, block `n_steps` no QK and no softmax):
#
# 1. (`k < n_steps`) wait until step `k` has landed in its slot;
# 2. (ping-pong) wait for your turn on `turn[wg]`: the warpgroups alternate, warpgroup 0 first,
#    so in block `k` warpgroup `wg` waits for parity `(k + wg + 1) % 2` (for warpgroup 0 in
#    block 0 that is parity 1 on a fresh barrier: no wait);
# 3. (`k > 0`) the PV GEMM of step `k − 1`, then release its slot;
# 4. (`k < n_steps`) the QK GEMM of step `k`;
# 5. (ping-pong) pass the turn: arrive on the other warpgroup's `turn`;
# 6. (`k < n_steps`) the softmax of step `k`.
#
# `turn` is `None` when the checks run without ping-pong (and with a single consumer): skip
# steps 2 and 5 then. About 15 lines.
#
# The checks run your schedule for rings of 2 to 4 slots and 1 to 9 steps, with ping-pong, with
# two consumers and no ping-pong, and with one consumer: no hazard, no deadlock, and every step
# loaded once and consumed once by each consumer. 2a's check runs your barriers and producer
# with consumers of its own (each takes whole steps in turn), so 2a earns its points whether or
# not 2b is done; 2b's check runs the same cases with your consumer. Then it measures the
# tensor cores in the steady state, leaving out the pipeline's fill and drain. With per-step
# GEMM time `g = qk + pv` and softmax time `s`, a single warpgroup keeps them busy
# `g / (g + s)` of the time; two taking turns fill one's softmax with the other's GEMMs, one
# period lasts `max(2g, g + s)` and the tensor cores are busy `min(1, 2g / (g + s))` of it: at
# `g = s`, 100% against 50%.

# %%
from flashbook.chapters.ch6 import Timing, check_pingpong, check_ring_protocol, plot_gantt, \
    simulate

# %% nbgrader={"grade": false, "grade_id": "ch6_pipeline_ring", "locked": false, "schema_version": 3, "solution": true, "task": false}
def make_barriers(pipe):
    """The shared barriers: full[s] (the TMA arrives once slot s holds its step), consumed[s]
    (every consumer arrives once it is done with slot s), turn[wg] (one per consumer, ping-pong).
    Returns (full, consumed, turn)."""
    ### BEGIN SOLUTION
    full = [pipe.barrier(f"full[{s}]", arrivals=1) for s in range(pipe.stages)]
    consumed = [pipe.barrier(f"consumed[{s}]", arrivals=pipe.consumers)
                for s in range(pipe.stages)]
    turn = [pipe.barrier(f"turn[{wg}]", arrivals=1) for wg in range(pipe.consumers)]
    return full, consumed, turn
    ### END SOLUTION


def producer(pipe, full, consumed):
    """The producer warpgroup: loads steps 0..pipe.n_steps-1 into the ring, each only once the
    consumers have released the slot's previous step."""
    ### BEGIN SOLUTION
    for step in range(pipe.n_steps):
        slot = pipe.slot(step)
        # round r waits for the release of round r - 1; in round 0 parity 1 passes at once
        yield pipe.wait(consumed[slot], pipe.phase(step) ^ 1)
        yield pipe.load(step, full[slot])
    ### END SOLUTION

# %% nbgrader={"grade": false, "grade_id": "ch6_pipeline_consumer", "locked": false, "schema_version": 3, "solution": true, "task": false}
def consumer(pipe, wg, full, consumed, turn=None):
    """Consumer warpgroup wg: GEMM block k is the PV GEMM of step k-1, then the QK GEMM of step
    k; with ping-pong (turn is not None) the two consumers take turns for their GEMM blocks."""
    ### BEGIN SOLUTION
    n = pipe.n_steps
    for k in range(n + 1):
        if k < n:
            yield pipe.wait(full[pipe.slot(k)], pipe.phase(k))      # step k has landed
        if turn is not None:
            yield pipe.wait(turn[wg], (k + wg + 1) % 2)             # my turn (warpgroup 0 first)
        if k > 0:
            yield pipe.pv(k - 1)                                    # reads V of step k - 1
            yield pipe.arrive(consumed[pipe.slot(k - 1)])           # its slot may be refilled
        if k < n:
            yield pipe.qk(k)                                        # reads K of step k
        if turn is not None:
            yield pipe.arrive(turn[1 - wg])                         # the other warpgroup's turn
        if k < n:
            yield pipe.softmax(k)                                   # overlaps the other's GEMMs
    ### END SOLUTION

# %% nbgrader={"grade": true, "grade_id": "ch6_pipeline_ring_test", "locked": true, "points": 3, "schema_version": 3, "solution": false, "task": false}
check_ring_protocol(make_barriers, producer)
### BEGIN HIDDEN TESTS
check_ring_protocol(make_barriers, producer, hidden=True)
### END HIDDEN TESTS

# %% nbgrader={"grade": true, "grade_id": "ch6_pipeline_pingpong_test", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
check_pingpong(make_barriers, producer, consumer)
### BEGIN HIDDEN TESTS
check_pingpong(make_barriers, producer, consumer, hidden=True)
### END HIDDEN TESTS

# %% [markdown]
# Your schedule at work, with `g = s`: above, the two consumers take turns and the tensor cores
# run one GEMM block after another; below, the same warpgroups without the turns issue their
# GEMMs together, share the tensor cores (hatched) at half speed each, and then both run their
# softmax while the tensor cores wait. The producer's row shows where it waits for a slot to be
# released (▼ marks each TMA it issues); the TMA row has one lane per ring slot.

# %% tags=["demo"]
timing = Timing(tma=2, qk=1, pv=1, softmax=2)                   # g = qk + pv = s
try:
    runs = [simulate(make_barriers, producer, consumer, stages=3, n_steps=8, timing=timing,
                     pingpong=pingpong) for pingpong in (True, False)]
    fig = plot_gantt(*runs)
except NotImplementedError:
    print("Finish Exercise 2 to see your schedule's Gantt chart.")

# %% [markdown]
# And what the checks catch: the same schedule with consumed barriers that complete after one
# arrival instead of one per consumer. The producer refills a slot as soon as the faster
# consumer releases it; the engine stops at the overwrite (the dashed line) and says why.

# %% tags=["demo"]
def one_arrival(pipe):
    full, consumed, turn = make_barriers(pipe)
    for bar in consumed:
        bar.arrivals = 1              # the bug: the first consumer's release completes the phase
    return full, consumed, turn


try:
    broken = simulate(one_arrival, producer, consumer, stages=2, n_steps=8, timing=timing)
    print(broken.error)
    fig = plot_gantt(broken)
except NotImplementedError:
    print("Finish Exercise 2 to see what the checks catch.")

# %% [markdown]
# FA3 goes one step further than your schedule: K and V get separate full and consumed barriers,
# and a consumer releases K right after its QK GEMM instead of waiting for its PV GEMM. The
# producer can then refill K of a slot about one softmax earlier. In this model that never stalls
# the producer longer than one combined barrier does, and on a 2-stage ring with a long TMA
# latency it stalls it less.

# %% [markdown]
# ## 5. A config planner
#
# The Gluon kernel of the next section has four tunables: `BLOCK_M` query rows per consumer
# warpgroup, `BLOCK_N` keys per K/V tile, `STAGES` slots in the K/V ring, and the head dim `d`
# (with the dtype) that the inputs fix. Bigger tiles do more work per barrier handshake and per
# softmax row, and a deeper ring hides more of the TMA's latency, so a speed model alone always
# asks for the biggest config. Two hardware limits say no.
#
# **Shared memory.** An H100 or H200 SM has 228 KB of shared memory
# (`shared_memory_per_multiprocessor` = 233,472 B in `torch.cuda.get_device_properties`), but
# one block may use at most **227 KB** (`shared_memory_per_block_optin` = 232,448 B): the
# system keeps 1 KB of the SM for every block it runs. (A kernel that does not opt in gets
# only `shared_memory_per_block`, 48 KB; Triton opts in at launch.) A config that needs more is
# refused at launch with "out of resource: shared memory". The kernel allocates every buffer
# once, for the whole kernel, because all of them are in use together:
#
# | buffer | bytes |
# |---|---|
# | the Q tiles, one per consumer warpgroup (each reused to stage its O tile) | `CONSUMERS × BLOCK_M × d × 2` |
# | persistent kernel only: O's own tiles, one per consumer (its Q tile is freed for the next work tile's Q as soon as its last QK^T is done), and a Q-free mbarrier per consumer | `CONSUMERS × BLOCK_M × d × 2 + CONSUMERS × 8` |
# | the K ring, `STAGES` slots | `STAGES × BLOCK_N × d × 2` |
# | the V ring, `STAGES` slots | `STAGES × BLOCK_N × d × 2` |
# | mbarriers, 8 bytes each: Q landed and the ping-pong token (one each per consumer), K full, K empty, V full, V empty (one each per slot) | `(2 × CONSUMERS + 4 × STAGES) × 8` |
# | `gl.warp_specialize`'s own: the arguments it hands the worker partitions (220 B) and their state (4 B per consumer) | `WARP_SPECIALIZE_BYTES` = 228 |
#
# (fp16 and bf16 are 2 bytes; the kernel has `CONSUMERS = 2`.) Triton's allocator then places
# the buffers one after another, largest first, each at a multiple of its alignment (1,024 B
# for a swizzled tile, 16 for a barrier array), so what the compiled kernel reports
# (`metadata.shared`) can be a few dozen bytes more than the sum: at d = 128 with 64 × 128
# tiles and 2 stages, 32,768 + 2 × 65,536 + 96 + 228 = 164,164 bytes, and the compiled kernel
# needs 164,168. With 3 stages the ring grows to 196,608 bytes and the config still fits with
# 2,680 bytes to spare; a fourth stage, or 256-key tiles, does not fit.
#
# **Registers.** An SM has 65,536 32-bit registers. The kernel's CTA is three warpgroups (384
# threads), so at launch each thread gets 65,536 / 384 = 170.7, rounded down to a multiple of
# 8: 168. Then `setmaxnreg` moves them: the producer, which only issues TMA copies, drops to
# the minimum, 24 a thread, and the consumers take what it frees. `setmaxnreg` takes
# multiples of 8 from 24 to 256, so two consumers get
# ⌊(65,536 − 128 × 24) / (2 × 128) / 8⌋ × 8 = 240 a thread, and 2 × 128 × 240 + 128 × 24 =
# 64,512 ≤ 65,536. What a consumer thread keeps live is mostly its tiles, each spread over the
# warpgroup's 128 threads:
#
# | in registers | per consumer thread |
# |---|---|
# | the O accumulator, fp32 | `BLOCK_M × d / 128` |
# | the scores S, fp32 | `BLOCK_M × BLOCK_N / 128` |
# | P in 16 bits, two to a register | `BLOCK_M × BLOCK_N / 256` |
# | addresses, loop counters, the row statistics m and l, masks | 32 |
#
# d = 128 with 64 × 128 tiles needs 64 + 64 + 32 + 32 = 192 ≤ 240. With 128-row consumers it
# needs 256 (64-key tiles) to 544 (256-key tiles): ptxas then **spills** the excess to local
# memory, which lives in the caches and DRAM, in the middle of the softmax. This estimate is
# the planner's, and it is a good one: of the 40 configs compiled ahead of time for the check
# (below), ptxas spilled in exactly those where it exceeds 240.
#
# **Speed.** `planner.predict(config, B, H, N_q, causal=...)` is the chapter's speed model
# (fitted to H200 measurements of this kernel): it returns a dict whose `"ms"` is the predicted
# time. It knows nothing about the limits: its favourite at d = 128 is 128 × 256 tiles, which
# fit neither the shared memory nor the registers.
#
# **Exercise 3 (3 points).** Write the planner for a resolved `planner.Config` (its `HEAD_DIM`
# and `DTYPE` set; `c.for_inputs(d, dtype)` resolves one):
# - `smem_bytes(config)`: the sum of the table above;
# - `register_budget(consumers)`: the registers a consumer thread gets once the producer keeps
#   24 (`REGISTERS_PER_SM`, `PRODUCER_REGS`): a multiple of 8, at most 256;
# - `consumer_register_need(config)`: the sum of the second table;
# - `fits(config, device)`: True when the shared memory fits one block of `device` and the
#   registers fit the budget. `device` has the fields of `torch.cuda.get_device_properties`
#   (`H100_PROPS` holds an H100's; on a Hopper GPU you can pass the real thing);
# - `choose(d, dtype, candidates, device, **problem)`: resolve the candidates for `d` and
#   `dtype` and return the one that fits with the least `planner.predict(config,
#   **problem)["ms"]` (any of them if several tie), or None if none fits.
#
# About 20 lines. The check compares your shared memory with what the kernel really needs:
# `metadata.shared` of the kernel compiled ahead of time for sm_90a
# (`src/flashbook/data/ch6_compiled.json`, which records how it was made), up to the
# allocator's padding (your figure may be up to 64 bytes below it, never above). Your register
# estimate must predict exactly the configs where ptxas spilled, `fits` must agree with the
# planner and hold at a device's exact limit, and `choose` must return the fastest config that
# fits. The hidden tests add d = 64, bf16, causal problems, other candidate lists and GPUs with
# less shared memory.

# %%
from flashbook.chapters.ch6 import (H100_PROPS, H200_PROPS, MBARRIER_BYTES, PRODUCER_REGS,
                                    REGISTERS_PER_SM, WARP_SPECIALIZE_BYTES, Config,
                                    check_planner, choice_table)

# %% nbgrader={"grade": false, "grade_id": "ch6_planner_resources", "locked": false, "schema_version": 3, "solution": true, "task": false}
def smem_bytes(config: Config) -> int:
    """Bytes of shared memory the kernel allocates for `config`: the Q tiles, the K and V
    rings, the mbarriers and warp_specialize's own bytes."""
    ### BEGIN SOLUTION
    d, size = config.HEAD_DIM, 2                                # fp16 and bf16: 2 bytes
    q = config.CONSUMERS * config.BLOCK_M * d * size            # a Q tile per consumer
    kv = 2 * config.STAGES * config.BLOCK_N * d * size          # K and V: STAGES slots each
    barriers = (2 * config.CONSUMERS + 4 * config.STAGES) * MBARRIER_BYTES
    return q + kv + barriers + WARP_SPECIALIZE_BYTES
    ### END SOLUTION


def register_budget(consumers: int) -> int:
    """Registers a consumer thread gets (setmaxnreg) once the producer warpgroup keeps 24."""
    ### BEGIN SOLUTION
    per_thread = (REGISTERS_PER_SM - 128 * PRODUCER_REGS) // (128 * consumers)
    return min(256, per_thread // 8 * 8)                        # setmaxnreg: multiples of 8
    ### END SOLUTION


def consumer_register_need(config: Config) -> int:
    """Registers one consumer thread keeps live: its tiles over 128 threads, plus 32."""
    ### BEGIN SOLUTION
    o = config.BLOCK_M * config.HEAD_DIM // 128                 # the fp32 O accumulator
    s = config.BLOCK_M * config.BLOCK_N // 128                  # the fp32 scores
    p = config.BLOCK_M * config.BLOCK_N // 256                  # P in 16 bits, two a register
    return o + s + p + 32                                       # addresses, counters, m, l
    ### END SOLUTION

# %% nbgrader={"grade": false, "grade_id": "ch6_planner_choose", "locked": false, "schema_version": 3, "solution": true, "task": false}
def fits(config: Config, device=H100_PROPS) -> bool:
    """Whether `device` can run `config`: its shared memory fits one block and a consumer
    thread's registers fit the setmaxnreg budget."""
    ### BEGIN SOLUTION
    smem_ok = smem_bytes(config) <= device.shared_memory_per_block_optin
    regs_ok = consumer_register_need(config) <= register_budget(config.CONSUMERS)
    return smem_ok and regs_ok
    ### END SOLUTION


def choose(d: int, dtype: str, candidates, device=H100_PROPS, **problem):
    """Of the candidates (resolved for d and dtype), the one that fits `device` with the least
    planner.predict(config, **problem)["ms"]; None if none fits."""
    ### BEGIN SOLUTION
    configs = [c.for_inputs(d, dtype) for c in candidates]
    feasible = [c for c in configs if fits(c, device)]
    return min(feasible, key=lambda c: planner.predict(c, **problem)["ms"], default=None)
    ### END SOLUTION

# %% nbgrader={"grade": true, "grade_id": "ch6_planner_test", "locked": true, "points": 3, "schema_version": 3, "solution": false, "task": false}
check_planner(smem_bytes, register_budget, consumer_register_need, fits, choose)
### BEGIN HIDDEN TESTS
check_planner(smem_bytes, register_budget, consumer_register_need, fits, choose, hidden=True)
### END HIDDEN TESTS

# %% [markdown]
# Your planner on every tile config of FA3's order, next to what the compiled kernel needs
# (the shared memory, and whether ptxas spilled) and the model's speed, for a long non-causal
# problem, (1, 16, 16384). On a Hopper GPU it asks the GPU itself for its limits.

# %% tags=["demo"]
device = H100_PROPS
if backend.capability is not None and tuple(backend.capability)[0] == 9:
    device = torch.cuda.get_device_properties(0)          # the real limits of this GPU
try:
    for d in (128, 64):
        print(f"d = {d}, fp16, on {device.name}:")
        print(choice_table(smem_bytes, register_budget, consumer_register_need, fits, choose,
                           d, device=device))
        print()
except NotImplementedError:
    print("Finish Exercise 3 to see your planner's choices.")

# %% [markdown]
# ## 6. The consumers, in Pallas
#
# Exercise 1 built the producer's ring; Exercise 2 simulated the whole schedule. Now the
# consumers for real: the two warpgroups that multiply, in the same Pallas Mosaic GPU kernel,
# checked on a CPU in interpret mode and run compiled on an H100 or H200.
#
# The kernel around your code is given (`flashbook.chapters.ch6.fa3_pallas`). One CTA computes
# 128 query rows of one head with three warpgroups:
#
# - **warpgroup 2, the producer**, is Exercise 1's ring twice: K^T and V tiles of `block_kv`
#   keys go into slot `step % stages` of their rings, each slot with its own *full* barrier
#   (the TMA copy arrives) and *consumed* barrier (two arrivals, one per consumer). K and V have
#   separate barriers, so a slot's K can be refilled as soon as both consumers are done with
#   QK^T, while the PV GEMMs still read V.
# - **warpgroups 0 and 1, the consumers**, each load their own 64-row Q tile into SMEM, call
#   your `fa3_consumer`, and store what it returns: the normalised O tile (through the Q tile's
#   SMEM, which is free by then) and the LSE of its rows.
#
# Your consumer runs this loop over the K/V steps, with `slot = step % stages`:
#
# 1. **Wait for K.** `plgpu.barrier_wait(k_full.at[slot])`: the TMA copy has landed.
# 2. **S = Q K^T with `wgmma`.** `pl.run_scoped(qk, plgpu.ACC((64, block_kv), jnp.float32))`
#    gives `qk` a fresh fp32 accumulator, zero, in registers; inside it
#    `plgpu.wgmma(acc_ref, q_smem, kT_ring.at[slot])` *issues* the multiply: the tensor cores
#    read both operands from SMEM and the instruction returns at once. Reading the accumulator,
#    `acc_ref[...]`, *waits* for it (on the GPU: `wgmma.wait_group`). Whatever the warpgroup
#    does between the two runs while the tensor cores work; here, that is its turn at the
#    schedule barrier (below). K^T comes transposed from the host: this interpret mode cannot
#    transpose an SMEM view (`plgpu.transpose_ref`), which FA3 uses to read K in place.
# 3. **Release K.** `plgpu.barrier_arrive(k_consumed.at[slot])` as soon as S is in registers
#    (FA3's early release): the producer may refill the slot during your softmax.
# 4. **The online softmax, in base 2.** Chapter 3's update with `exp2` instead of `exp`, which
#    is what the hardware computes (`ex2.approx`; `exp(x)` costs a multiply more). Fold the
#    scale and log2(e) into one multiply, `s = S * (scale * log2(e))`, apply `mask(s, step)`
#    (causal masking, given; it returns `s` unchanged when the kernel is not causal), and keep
#    the running max `m` in these log2 units: `m_new = max(m, rowmax(s))`,
#    `alpha = exp2(m - m_new)`, `p = exp2(s - m_new)`, `l = l * alpha + rowsum(p)`,
#    `acc = acc * alpha`. Since 2^(x log2 e) = e^x, this is exactly the softmax in base e.
# 5. **P to shared memory.** `p_smem[...] = p.astype(p_smem.dtype)` (fp16), then
#    `plgpu.commit_smem()`, the fence that makes stores from registers visible to the tensor
#    cores and the TMA (which read SMEM through another path, the *async proxy*). FlashAttention-3
#    does not do this: `wgmma` can take its A operand from **registers**, and the S accumulator,
#    converted to fp16 in place, is already laid out as that operand, so P never leaves the
#    registers and costs no SMEM bandwidth. JAX 0.10.2's interpret mode accepts only an SMEM A
#    operand, so this kernel takes the detour (64 x `block_kv` fp16 per step, 8-16 KB).
# 6. **Wait for V and for your turn.** Arrive on the schedule barrier (softmax done), wait for
#    V (`v_full.at[slot]`), then wait on the schedule barrier.
# 7. **O += P V with `wgmma`.** A fresh ACC of (64, d) and `plgpu.wgmma(acc_ref, p_smem,
#    v_ring.at[slot])`; add what it returns to `acc`. (FA3 accumulates in place, with
#    `pl.run_state` and `plgpu.ACC.init(acc)`; interpret mode does not run `pl.run_state`.)
# 8. **Release V** (`v_consumed.at[slot]`), only once the PV result has been read: until its
#    wait, a wgmma may still be reading V, and a release before it lets the TMA overwrite the
#    tile under the multiply.
#
# After the loop, return `(acc / l[:, None], m + log2(l))`: O and the LSE in **base 2**, as FA3
# computes it (write log2(l) as `jnp.log(l) * log2e`: Mosaic GPU compiles `log`, and one
# multiply is cheaper than `jnp.log2`'s division). The book's functions return the natural
# log; the boundary converts (`lse = lse2 * ln 2`: `run_fa3` does, and so does the check).
#
# **The schedule barrier: ping-pong.** `schedule` is one barrier that completes after two
# arrivals, one from each consumer; `arrive` then `wait` is a rendezvous with the other
# warpgroup. Each step has two: between issuing QK^T and reading S, and between the end of the
# softmax and the PV GEMM. Warpgroup 1 makes one extra rendezvous before its loop (which puts it
# half a step behind) and warpgroup 0 one after its loop (so both arrive equally often; else the
# last wait never completes: a deadlock). The effect is Exercise 2b's turns: a warpgroup reads
# S (starts its softmax) only after the other has finished its softmax, and issues its PV and
# next QK^T only after the other has issued its own GEMMs, so one warpgroup's softmax overlaps
# the other's GEMMs:
#
# ```
# tensor cores:  wg0 QK0 | wg1 QK0    | wg0 PV0 QK1 | wg1 PV0 QK1 | wg0 PV1 QK2 | ...
# warpgroup 0:   QK0     | softmax 0  | PV0 QK1     | softmax 1   | PV1 QK2     | ...
# warpgroup 1:   (wait)  | QK0        | softmax 0   | PV0 QK1     | softmax 1   | ...
# ```
#
# | call | does |
# |---|---|
# | `pl.run_scoped(fn, plgpu.ACC((rows, cols), jnp.float32))` | calls `fn(acc_ref)` with a zeroed fp32 wgmma accumulator; returns what `fn` returns |
# | `plgpu.wgmma(acc_ref, a_smem, b_smem)` | issues `acc += a @ b` on the tensor cores, `a` (64, k) and `b` (k, n) SMEM refs |
# | `acc_ref[...]` | waits for the wgmma and reads the accumulator |
# | `plgpu.barrier_wait(bar)`, `plgpu.barrier_arrive(bar)` | wait for this warpgroup's next phase of `bar`; one arrival on `bar` |
# | `kT_ring.at[slot]`, `k_full.at[slot]` | a slot of a ring, a barrier of an array |
# | `plgpu.commit_smem()` | fence: register stores to SMEM become visible to wgmma and the TMA |
# | `lax.fori_loop(0, steps, step_fn, carry)` | the loop over K/V steps; `step_fn(step, carry)` returns the new carry |
# | `pl.when(cond)(fn)` | calls `fn()` only where `cond` (a traced bool) holds |
#
# `jnp.exp2`, `jnp.log`, `jnp.maximum`, `s.max(axis=1)`, `p.sum(axis=1)` and `x[:, None]`
# (broadcast a row vector over columns) work as in NumPy.

# %%
import math
from flashbook.chapters.ch6 import fa3_checks, fa3_pallas, interpret
try:                                  # the check runs your kernel in its own process; JAX must
    import jax                        # be installed in this Python (no GPU needed)
    import jax.numpy as jnp
    from jax import lax
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu
except ImportError:
    print("JAX is not installed:", interpret.INSTALL)

# %% [markdown]
# **Exercise 4 (4 points).** Write the consumer warpgroups' part of the kernel,
# `fa3_consumer`: the schedule barrier's extra rendezvous (warpgroup 1 before the loop,
# warpgroup 0 after it), the loop of steps 1-8 above over `steps` K/V steps, and the final
# normalisation. It returns `(o, lse2)`: O (64, d) fp32 divided by l, and the base-2 LSE (64,).
# About 40 lines.
#
# The check runs the kernel with your consumer in interpret mode, in a separate process with a
# time limit, with the race detector on (it also checks what each wgmma reads, up to its wait),
# for N_q = 128 (your two warpgroups, 64 rows each), d = 64 and N_k = 384 (6 K/V steps): O within
# fp16 tolerance of a float64 reference, the LSE right, no data race, no barrier misuse, no hang.
# The hidden tests add 2 steps, causal masks, d = 128, 3-slot rings and 128-key tiles. A wrong O is
# compared with what the classic online-softmax mistakes give, and the message says which one
# it matches; a race names your line and the producer's; a hang lists the waits that never
# complete. Two things the values cannot show are checked as well: the fence (in the traced
# kernel, a `plgpu.commit_smem()` must stand between your store of P and the wgmma that reads
# it), and the ping-pong (from the order of the interpreter's barrier events, each warpgroup's
# GEMM block must wait, on the schedule barrier, for the other's previous one).

# %% nbgrader={"grade": false, "grade_id": "ch6_fa3_consumer", "locked": false, "schema_version": 3, "solution": true, "task": false}
def fa3_consumer(wg, q_smem, p_smem, kT_ring, v_ring, k_full, v_full, k_consumed, v_consumed,
                 schedule, *, steps: int, stages: int, scale: float, mask):
    """One consumer warpgroup of the FA3-shaped kernel.

    wg:          this warpgroup's index, 0 or 1 (a traced int32)
    q_smem:      SMEM ref (64, d): this warpgroup's Q tile (loaded)
    p_smem:      SMEM ref (64, block_kv): this warpgroup's staging buffer for P (fp16)
    kT_ring:     SMEM ref (stages, d, block_kv): K^T tiles; step j is in slot j % stages
    v_ring:      SMEM ref (stages, block_kv, d): V tiles, same slots
    k_full, v_full:          `stages` barriers each: the slot's K^T (V) tile has landed
    k_consumed, v_consumed:  `stages` barriers each, 2 arrivals: release the slot's K^T (V)
    schedule:    one barrier of 2 arrivals: the ping-pong between the two consumers
    steps, stages: Python ints; scale: float (applied to S = Q K^T in fp32)
    mask(s, step): s with -inf where a query may not see a key (causal), else s unchanged
    Returns (o, lse2): o (64, d) float32 = softmax(S) V for this tile's rows, and lse2 (64,)
    float32 = log2 of sum_j 2^(s_j), s in log2 units (the LSE in base 2).
    """
    ### BEGIN SOLUTION
    block_q, d = q_smem.shape
    block_kv = kT_ring.shape[2]
    log2e = math.log2(math.e)

    def schedule_barrier():                        # a rendezvous with the other consumer
        plgpu.barrier_arrive(schedule)
        plgpu.barrier_wait(schedule)

    pl.when(wg == 1)(schedule_barrier)             # warpgroup 1 starts half a step behind

    def step_fn(step, carry):
        acc, m, l = carry                          # (64, d), (64,), (64,): fp32, m in log2 units
        slot = lax.rem(step, stages)
        plgpu.barrier_wait(k_full.at[slot])        # K^T of this step has landed

        def qk(acc_ref):
            plgpu.wgmma(acc_ref, q_smem, kT_ring.at[slot])   # issue S = Q K^T (async)
            schedule_barrier()                     # the other's softmax ends while it runs
            return acc_ref[...]                    # wait for the wgmma, read S
        s = pl.run_scoped(qk, plgpu.ACC((block_q, block_kv), jnp.float32))
        plgpu.barrier_arrive(k_consumed.at[slot])  # K is free: the producer may refill it

        s = mask(s * (scale * log2e), step)        # log2 units: exp2(s) = e^(scale * S)
        m_new = jnp.maximum(m, s.max(axis=1))
        alpha = jnp.exp2(m - m_new)                # rescales what was summed with the old max
        p = jnp.exp2(s - m_new[:, None])
        l = l * alpha + p.sum(axis=1)
        acc = acc * alpha[:, None]
        p_smem[...] = p.astype(p_smem.dtype)       # P via SMEM (FA3 keeps it in registers)
        plgpu.commit_smem()                        # visible to the wgmma that reads it

        plgpu.barrier_arrive(schedule)             # my softmax is done
        plgpu.barrier_wait(v_full.at[slot])        # V of this step has landed
        plgpu.barrier_wait(schedule)               # the other has issued its GEMMs: my turn

        def pv(acc_ref):
            plgpu.wgmma(acc_ref, p_smem, v_ring.at[slot])    # issue P V (async)
            return acc_ref[...]                    # wait: V is no longer read after this
        acc = acc + pl.run_scoped(pv, plgpu.ACC((block_q, d), jnp.float32))
        plgpu.barrier_arrive(v_consumed.at[slot])  # V is free
        return acc, m_new, l

    init = (jnp.zeros((block_q, d), jnp.float32), jnp.full((block_q,), -jnp.inf, jnp.float32),
            jnp.zeros((block_q,), jnp.float32))
    acc, m, l = lax.fori_loop(0, steps, step_fn, init)
    pl.when(wg == 0)(schedule_barrier)             # balance warpgroup 1's extra rendezvous
    return acc / l[:, None], m + jnp.log(l) * log2e       # O, and log2(l) = ln(l) log2(e)
    ### END SOLUTION

# %% nbgrader={"grade": true, "grade_id": "ch6_fa3_test", "locked": true, "points": 4, "schema_version": 3, "solution": false, "task": false}
fa3_checks.check_fa3_consumer(fa3_consumer)
### BEGIN HIDDEN TESTS
fa3_checks.check_fa3_consumer(fa3_consumer, hidden=True)
### END HIDDEN TESTS

# %% [markdown]
# On an H100 or H200 the next cell compiles the same kernel, your consumer included, for the
# GPU (no interpreter: `wgmma`, TMA and mbarriers for real) and runs it at full size, checks one
# head against the float64 reference and times it; elsewhere it says why it cannot. Expect a
# fraction of FA3's speed: K^T is transposed by the host, P goes through shared memory, the
# tiles have no swizzled layout (bank conflicts), the registers are not reallocated between
# the warpgroups, and the causal kernel visits every tile instead of skipping those above the
# diagonal.

# %% tags=["demo"]
problem = fa3_pallas.sm90_problem()
try:
    fa3_consumer(*[None] * 10, steps=0, stages=0, scale=0.0, mask=None)
except NotImplementedError:
    problem = "Exercise 4 is not done yet"
except Exception:  # noqa: BLE001 - a real consumer cannot run outside a kernel: it is written
    pass
if problem is None:
    import numpy as np
    for d in (64, 128):
        rng = np.random.default_rng(0)
        q, k, v = (rng.standard_normal((1, 16, 4096, d)).astype(np.float16) for _ in range(3))
        for causal in (False, True):
            o, lse = fa3_pallas.run_fa3(fa3_consumer, q, k, v, causal=causal)
            want_o, want_lse = fa3_pallas.reference(q[0, 0], k[0, 0], v[0, 0], causal=causal)
            t = fa3_pallas.time_fa3(fa3_consumer, 1, 16, 4096, d, causal=causal)
            print(f"(1, 16, 4096, {d}) causal={causal}: max|O - ref| = "
                  f"{np.abs(o[0, 0] - want_o).max():.1e}, max|LSE - ref| = "
                  f"{np.abs(lse[0, 0] - want_lse).max():.1e} (head 0); {t['ms']:.2f} ms, "
                  f"{t['tflops']:.0f} TFLOP/s")
else:
    print(f"Skipped: the compiled kernel needs an sm_90 GPU (H100, H200), and here {problem}. "
          "The check above ran the same kernel in JAX's interpret mode instead.")

# %% [markdown]
# ## 7. The chapter's kernel, in Gluon
#
# `flashbook.fa3_launch` (its roles are `flashbook.fa3_roles`) is the structure of Sections 2-6
# written in Triton's **Gluon** dialect, which exposes Hopper's machinery (`tma`, `mbarrier`,
# `warpgroup_mma`, `warp_specialize`) with Triton's compiler underneath. One program owns
# `2 x BLOCK_M` query rows of one head and three roles:
#
# - the **producer** (one warp, 24 registers a thread) loads both Q tiles once, then streams K
#   and V through a ring of `STAGES` slots, each with a *full* barrier (the TMA arrives with
#   the tile's byte count) and an *empty* one that expects two arrivals, one per consumer;
# - each **consumer** (one warpgroup, 240 registers a thread) owns one Q tile and runs
#   `S = Q K^T` and `O += P V` with `warpgroup_mma`, the online softmax in base 2 between them,
#   and releases K as soon as S is in registers (FA3's early release);
# - a **token** passed between the consumers through two mbarriers is the ping-pong of
#   Exercise 2b: one consumer issues its GEMMs (QK^T of this tile, PV of the previous one)
#   while the other computes its softmax.
#
# Its configuration is the one Section 5's planner picks: two consumers of 64 query rows,
# 128-key tiles and two ring stages at d = 128.

# %% tags=["demo"]
print("planner's choice for d = 128:", planner.best(128))

# %% [markdown]
# On an sm_90 GPU the next cell runs the kernel against PyTorch's SDPA; elsewhere it says why
# it cannot (Gluon has no CPU interpreter).

# %% tags=["demo"]
if backend.capability is not None and tuple(backend.capability) >= (9, 0) and \
        tuple(backend.capability) < (10, 0):
    from flashbook.chapters.ch6 import attention_fa3
    q, k, v = (torch.randn(2, 4, 1000, 128, device="cuda", dtype=torch.float16)
               for _ in range(3))
    for causal in (False, True):
        o, lse = attention_fa3(q, k, v, causal=causal)
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
        print(f"causal={causal}: max |O - SDPA| = {(o - want).abs().max().item():.1e}")
else:
    print(f"The Gluon kernel needs an sm_90 GPU (H100, H200); this runtime: {backend}.")

# %% [markdown]
# ## 8. FP8: twice the tensor-core rate, paid for in scales
#
# Hopper's `wgmma` multiplies e4m3 operands (1 sign, 4 exponent and 3 mantissa bits, largest
# finite value 448) at twice its fp16 rate, and an fp8 operand is half the bytes to load. That
# is FlashAttention-3's third contribution {cite}`shah2024flashattention3`; what it takes:
#
# - **Scales.** e4m3 keeps about two significant decimal digits over a narrow range, so a
#   tensor is stored as e4m3 values times a scale. One scale per block of rows (the rows a
#   program loads as one tile) adapts to each block's range: `scale = amax / 448` sends the
#   block's largest element to +-448 and the rounding error of every element is at most half a
#   unit in its last place, $2^{-4}|x|$, or $2^{-10}$ of the scale near zero (e4m3's subnormal
#   spacing is $2^{-9}$).
# - **V transposed.** `wgmma` reads its B operand from shared memory; for fp8 only in
#   K-major order (the reduction dimension contiguous). In $QK^T$ the reduction runs over $d$,
#   which K's rows already hold contiguously; in $PV$ it runs over the keys, so V must be
#   stored as $V^T$ `(d, N)`. FA3 transposes V in shared memory inside the kernel; here it is
#   done once on the way in.
# - **The bookkeeping.** $S = (Q_8 K_8^T)\, s_q s_k$: the scales multiply the fp32 accumulator,
#   one pair per tile. $P = \exp(S - m)$ lies in $[0, 1]$, so it is cast to e4m3 as it is; and
#   $P_8 V_8$ is multiplied by V's block scale before it joins the accumulator. The row sum
#   $\ell$ adds the unrounded $P$.
# - **Incoherent processing.** Large language models have *outlier channels*: a few features of
#   Q and K far larger than the rest. One of them sets the whole block's amax, and every other
#   element is rounded on that coarse grid. Multiplying Q and K by the same random orthogonal
#   $M$ changes nothing exactly, $(QM)(KM)^T = Q K^T$, but spreads each outlier over all $d$
#   channels first. FA3 uses $M = H_d\, \mathrm{diag}(s) / \sqrt{d}$: a Hadamard matrix (entries
#   $\pm 1$, built by doubling, $H_{2n} = [[H_n, H_n], [H_n, -H_n]]$) times random signs,
#   which a fast transform applies in $O(d \log d)$ per row; the paper reports 2.6x lower error.

# %%
from flashbook.chapters import ch6

# %% [markdown]
# **Exercise 5 (1 point).** Write `quantize_blocks(x, block)`: `x` `(..., N, d)` float, `N` a
# multiple of `block` -> `(values, scales)`: `values` like `x` in `torch.float8_e4m3fn`,
# `scales` float32 `(..., N // block)`, one per block of `block` rows, `amax / 448` (1 for an
# all-zero block). Divide each block by its scale, clamp to +-448, cast with
# `.to(torch.float8_e4m3fn)`. The check computes each block's amax itself and holds every
# element to the rounding bound above. About 6 lines.

# %% nbgrader={"grade": false, "grade_id": "ch6_fp8_quantize", "locked": false, "schema_version": 3, "solution": true, "task": false}
def quantize_blocks(x, block):
    """x (..., N, d) -> (e4m3 values like x, float32 scales (..., N // block))."""
    ### BEGIN SOLUTION
    *lead, N, d = x.shape
    rows = x.float().reshape(*lead, N // block, block * d)         # one row per block
    amax = rows.abs().amax(dim=-1)
    scales = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    values = (rows / scales[..., None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return values.reshape(x.shape), scales
    ### END SOLUTION

# %% nbgrader={"grade": true, "grade_id": "ch6_fp8_quantize_test", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
ch6.check_block_quantization(quantize_blocks)
### BEGIN HIDDEN TESTS
ch6.check_block_quantization(quantize_blocks, hidden=True)
### END HIDDEN TESTS

# %% [markdown]
# **Exercise 6 (1 point).** Write `random_rotation(d, seed)`: the `(d, d)` float32 matrix
# $H_d\, \mathrm{diag}(s) / \sqrt{d}$ for `d` a power of two, with signs $s_j = \pm 1$ drawn from
# `torch.Generator().manual_seed(seed)` (the same seed, the same matrix). The check asks for
# $M M^T = I$, entries $\pm 1/\sqrt{d}$, $(QM)(KM)^T = Q K^T$, and on inputs with four outlier
# channels at least 1.5x less error in the e4m3 $QK^T$ than without the rotation. About 6 lines.

# %% nbgrader={"grade": false, "grade_id": "ch6_fp8_rotation", "locked": false, "schema_version": 3, "solution": true, "task": false}
def random_rotation(d, seed):
    """(d, d) float32 orthogonal: a Hadamard matrix times random signs, over sqrt(d)."""
    ### BEGIN SOLUTION
    h = torch.ones(1, 1)
    while h.shape[0] < d:                                          # H_2n = [[H, H], [H, -H]]
        h = torch.cat([torch.cat([h, h], dim=1), torch.cat([h, -h], dim=1)])
    gen = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 2, (d,), generator=gen).float() * 2 - 1
    return h * signs / d ** 0.5
    ### END SOLUTION

# %% nbgrader={"grade": true, "grade_id": "ch6_fp8_rotation_test", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
ch6.check_rotation(random_rotation)
### BEGIN HIDDEN TESTS
ch6.check_rotation(random_rotation, hidden=True)
### END HIDDEN TESTS

# %% [markdown]
# What the rotation buys, measured here in float64 on a CPU: the error of $QK^T$ computed from
# block-quantized e4m3 Q and K (your two functions), on Gaussian inputs with four channels 20x
# larger, against the same without outliers.

# %% tags=["demo"]
def qk_error(q, k, rotation=None, block=16):
    """RMS error of Q K^T from block-quantized e4m3 Q and K, relative to its RMS."""
    if rotation is not None:
        q, k = q @ rotation, k @ rotation
    exact = q.double() @ k.double().T
    (q8, qs), (k8, ks) = quantize_blocks(q, block), quantize_blocks(k, block)
    dq = q8.double() * qs.double().repeat_interleave(block)[:, None]
    dk = k8.double() * ks.double().repeat_interleave(block)[:, None]
    return ((dq @ dk.T - exact).pow(2).mean().sqrt() / exact.pow(2).mean().sqrt()).item()

try:
    for d in (64, 128):
        m = random_rotation(d, 0)
        q, k = ch6.outlier_inputs((256, d), 1), ch6.outlier_inputs((256, d), 2)
        plain, rotated = qk_error(q, k), qk_error(q, k, m)
        print(f"d={d}: outlier channels {plain:.2e} -> rotated {rotated:.2e} "
              f"({plain / rotated:.1f}x lower); no outliers {qk_error(torch.randn(256, d), torch.randn(256, d)):.2e}")
except NotImplementedError:
    print("Finish Exercises 5 and 6 to see the errors.")

# %% [markdown]
# **Exercise 7 (2 points).** Write `fp8_attention_tiles(q8, qs, k8, ks, v8, vs, block, scale)`,
# the kernel's arithmetic for one head in PyTorch: `q8` `(n_q, d)`, `k8` and `v8` `(n_k, d)`
# e4m3 with float32 scales per block of `block` rows (`qs` `(n_q // block,)`, ...), `scale`
# the softmax's $1/\sqrt{d}$. Loop over the K/V blocks keeping the online softmax's `m`, `l`
# and `acc` in float32: $S = (Q_8 K_{8,j}^T)$ times each query row's scale, K's block scale and
# `scale`; then the Chapter 3 update, with $P$ cast to e4m3 before it meets $V_{8,j}$ and the
# product times `vs[j]`. Return O `(n_q, d)` float32. (Multiply e4m3 tensors after
# `.float()`: PyTorch's CPU matmul takes no fp8.) The check compares with float64 attention
# over the values your inputs encode: only the rounding of $P$ may differ. About 14 lines.

# %% nbgrader={"grade": false, "grade_id": "ch6_fp8_tiles", "locked": false, "schema_version": 3, "solution": true, "task": false}
def fp8_attention_tiles(q8, qs, k8, ks, v8, vs, block, scale):
    """One head's O (n_q, d) float32 from e4m3 Q, K, V with per-block scales."""
    ### BEGIN SOLUTION
    n_q, d = q8.shape
    q = q8.float() * (qs.repeat_interleave(block) * scale)[:, None]   # Q's scales, once
    m = torch.full((n_q,), float("-inf"))
    l, acc = torch.zeros(n_q), torch.zeros(n_q, d)
    for j in range(k8.shape[0] // block):
        rows = slice(j * block, (j + 1) * block)
        s = (q @ k8[rows].float().T) * ks[j]
        m_new = torch.maximum(m, s.amax(dim=-1))
        alpha = torch.exp(m - m_new)
        p = torch.exp(s - m_new[:, None])
        l = l * alpha + p.sum(dim=-1)                                 # the unrounded P
        acc = acc * alpha[:, None] + (p.to(torch.float8_e4m3fn).float() @ v8[rows].float()) * vs[j]
        m = m_new
    return acc / l[:, None]
    ### END SOLUTION

# %% nbgrader={"grade": true, "grade_id": "ch6_fp8_tiles_test", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
ch6.check_fp8_tiles(fp8_attention_tiles)
### BEGIN HIDDEN TESTS
ch6.check_fp8_tiles(fp8_attention_tiles, hidden=True)
### END HIDDEN TESTS

# %% [markdown]
# **The kernel.** `ch6.attention_fp8(q8, qs, k8, ks, vt8, vs, causal)` is Exercise 7 as a Triton
# kernel (`flashbook/chapters/ch6/fp8.py`): `tl.dot` of two e4m3 tiles runs on the fp8
# tensor cores on sm_89 and newer, S and the accumulator stay fp32, and $P$ is cast with
# `p.to(tl.float8e4nv)`. Three changes to Exercise 7's arithmetic cost nothing:
#
# - $P$ is computed as $2^8 \exp(S - m)$, in $[0, 256]$, by subtracting 8 more from the
#   exponent. Most of $P$ is small, and below $2^{-6}$ e4m3 has only subnormals (3 bits or
#   fewer); scaled, it keeps its 3 mantissa bits down to $2^{-14}$. The row sum $\ell$ carries
#   the same $2^8$ and the final division cancels it. (On the outlier inputs below the rounding
#   of Q and K dominates and the shift changes little; it counts where P's rounding is the
#   largest error.)
# - The accumulator is kept in units of the current V block's scale: each step multiplies it by
#   $\alpha\, s_{v,\text{old}} / s_{v,\text{new}}$ (the rescale it needed anyway) and `tl.dot`
#   adds $P_8 V_8$ into it in place; $s_v$ multiplies it once at the end, not once per tile.
# - Causal: the tiles wholly below the diagonal run without a mask; only the diagonal ones
#   compute it.
#
# It takes what your `quantize_blocks` makes (Q in blocks of 64 rows, its query tile; K and V in
# blocks of 128, its key tile) and V transposed. On an fp8 GPU the next cell compares it with
# fp16 SDPA against float64, with and without your rotation, on inputs with outlier channels;
# elsewhere it says why it cannot run.

# %% tags=["demo"]
if backend.capability is not None and tuple(backend.capability) >= (8, 9):
    def run_fp8(q, k, v, causal, rotation=None):
        if rotation is not None:
            q, k = q.float() @ rotation, k.float() @ rotation
        (q8, qs), (k8, ks), (v8, vs) = quantize_blocks(q, 64), quantize_blocks(k, 128), \
            quantize_blocks(v, 128)
        return ch6.attention_fp8(q8, qs, k8, ks, v8.transpose(-1, -2).contiguous(), vs, causal)
    q, k = (ch6.outlier_inputs((1, 4, 2048, 128), s).cuda() for s in (3, 4))
    v = torch.randn(1, 4, 2048, 128, device="cuda")
    m = random_rotation(128, 0).cuda()
    for causal in (False, True):
        want = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(),
                                                                is_causal=causal)
        rms = lambda o: (o.double() - want).pow(2).mean().sqrt().item()
        fp16 = torch.nn.functional.scaled_dot_product_attention(q.half(), k.half(), v.half(),
                                                                is_causal=causal)
        print(f"causal={causal}: RMS error against float64: fp8 {rms(run_fp8(q, k, v, causal)):.2e}, "
              f"fp8 rotated {rms(run_fp8(q, k, v, causal, m)):.2e}, fp16 SDPA {rms(fp16):.2e}")
else:
    print(f"The fp8 kernel needs a GPU with fp8 tensor cores (sm_89 or newer); this runtime: {backend}.")

# %% [markdown]
# **Measured.** `python -m flashbook.fp8_bench` times the kernel on inputs quantized once (as a
# model that keeps fp8 activations would call it) beside `attention_fa3` in fp16 as you call it
# and cuDNN, and records the errors of the cell above, at its shape. On an
# {glue:text}`ch6_fp8_gpu` at `(1, 16, 16384, 128)` the fp8 kernel, with its default tiles (64
# query rows against 128 keys in one warpgroup; 128 rows in two warpgroups were slower, as the
# figure below shows), reaches
# {glue:text}`ch6_fp8_tflops_noncausal:.0f` TFLOP/s non-causal,
# {glue:text}`ch6_fp8_vs_fp16_noncausal:.2f`x the book's fp16 forward and
# {glue:text}`ch6_fp8_vs_cudnn_noncausal:.2f`x cuDNN's, and
# {glue:text}`ch6_fp8_tflops_causal:.0f` TFLOP/s causal
# ({glue:text}`ch6_fp8_vs_fp16_causal:.2f`x and {glue:text}`ch6_fp8_vs_cudnn_causal:.2f`x).
# Twice the tensor-core rate does not make twice the speed: the matmuls take half the time, but
# the softmax's work per element (a multiply-add, an exponential, the row max and sum, the cast
# of $P$) does not shrink, so its share of each tile doubles. FlashAttention-3 hides it behind
# the other warpgroup's matmuls with the ping-pong schedule of Section 4 and reports about
# 1.2 PFLOP/s on an H100; this Triton kernel leaves that overlap to the compiler. On the
# outlier inputs the rotation cuts the RMS error against float64 from
# {glue:text}`ch6_fp8_err_plain_noncausal:.2e` to {glue:text}`ch6_fp8_err_rotated_noncausal:.2e`
# non-causal ({glue:text}`ch6_fp8_err_gain_noncausal:.1f`x lower) and from
# {glue:text}`ch6_fp8_err_plain_causal:.2e` to {glue:text}`ch6_fp8_err_rotated_causal:.2e`
# causal ({glue:text}`ch6_fp8_err_gain_causal:.1f`x; the FA3 paper reports 2.6x).
#
# **The same kernel in Gluon.** `ch6.attention_fp8_gluon(q8, qs, k8, ks, vt8, vs, causal,
# block_m=64, block_n=256)` takes the same arguments and runs Section 7's design with e4m3
# operands (`flashbook/fa3_fp8_kernel.py`): the same producer warp loads Q, K and V^T tiles by
# TMA into the ring, and the two consumer warpgroups take turns at the tensor cores, each issuing
# $S = Q_8 K_8^T$ and $P_8 V_8$ as e4m3 `wgmma`. V^T arrives K-major as `wgmma` needs it: the
# producer loads `(d, BLOCK_N)` boxes of it, and the consumer hands `wgmma` their transposed
# view. What is new is how $P$ reaches the second GEMM. `wgmma` reads an fp8 A operand from
# registers only with four consecutive keys packed in each 32-bit register, while $S$'s
# accumulator gives each thread pairs of keys eight apart, so the kernel has four paths
# (`p_path`, and a fifth below): "regs" lets Triton convert the layout, with warp shuffles and byte permutes in
# every iteration; "perm" permutes V^T's keys within each 32 on the way in (FA3's way), so that
# the keys a thread holds are the ones it must hand over and the conversion moves no data;
# "perm4" is "perm" with $P$ cast to e4m3 four values at a time just before its `wgmma`; "smem"
# stores $P$ to shared memory, from which `wgmma` reads it as it reads $V^T$. Staging $P$ costs a
# few stores per thread and no exchange between threads, and beat the shuffles; it also frees the
# registers $P$ would hold until its `wgmma`, and with 256 keys a tile in two stages it was the
# fastest of these four on an H100, and is the default. The registers decide it at 256 keys.
# While $S_j$'s and $PV_{j-1}$'s `wgmma`s are both in flight, a consumer thread's $S$ holds 128
# registers and $O$ 64; $P_{j-1}$, kept in registers, holds 32 more: 224 of the 240 that
# `setmaxnreg` gives it, before the addresses, scales and row statistics. With $P$ in registers
# ("perm" at 64 x 256) ptxas (Triton 3.9's, the one the book's tests compile with) finds too few
# and issues the `wgmma`s one at a time, its note C7512 ("wgmma.mma_async instructions are
# serialized due to insufficient register resources"); with $P$ staged it keeps them
# asynchronous. FlashAttention-3 keeps $P$ in registers by taking 224 keys a tile ($S$ 112
# registers, $P$ 28); a Triton tile's sides are powers of two, so here the choice is 128 keys
# with $P$ in registers or 256 with $P$ in shared memory. Measured beside the others, the default
# reaches {glue:text}`ch6_fp8_gluon_tflops_noncausal:.0f` TFLOP/s non-causal,
# {glue:text}`ch6_fp8_gluon_vs_fp16_noncausal:.2f`x the book's fp16 forward, and
# {glue:text}`ch6_fp8_gluon_tflops_causal:.0f` TFLOP/s causal
# ({glue:text}`ch6_fp8_gluon_vs_fp16_causal:.2f`x): the ping-pong that hides the softmax behind
# the other warpgroup's matmuls, which the Triton kernel leaves to the compiler.
#
# **Four keys a store.** Staging $P$ costs each thread 64 two-byte stores a tile: $S$'s
# accumulator gives a thread pairs of keys eight apart. With V^T's keys permuted on the way in,
# as for "perm", the four keys of each register of the A layout are four adjacent bytes of the
# permuted tile, and Triton stores a thread's $P$ with eight `stmatrix` instructions
# (`p_path="sperm"`, V^T from `permute_keys`). It reaches
# {glue:text}`ch6_fp8_sperm_tflops_noncausal:.0f` TFLOP/s non-causal
# ({glue:text}`ch6_fp8_sperm_vs_fp16_noncausal:.2f`x the fp16 forward) and
# {glue:text}`ch6_fp8_sperm_tflops_causal:.0f` causal
# ({glue:text}`ch6_fp8_sperm_vs_fp16_causal:.2f`x).
#
# **FlashAttention-4's polynomial, tried on Hopper.** Chapter 7 computes part of the
# exponentials by a polynomial on the FMA units, because a B200's tensor cores doubled and its
# exponential unit did not. FP8 does the same to an H100: in Chapter 7's model a 128 x 128 tile
# at d = 128 needs 1,024 cycles of e4m3 tensor cores and 1,024 of exponentials, the balance
# at which the polynomial pays on a B200. With `exp2_fma=True` the kernel computes half the
# exponentials FlashAttention-4's way (`fa3_fp8_kernel.exp2_fma`: round by adding
# $1.5 \cdot 2^{23}$, a cubic for $2^f$, the integer part added into the exponent bits). It is
# slower: {glue:text}`ch6_fp8_exp2_fma_tflops_noncausal:.0f` TFLOP/s non-causal
# ({glue:text}`ch6_fp8_exp2_fma_vs_mufu_noncausal:.2f`x the kernel with every exponential on
# MUFU) and {glue:text}`ch6_fp8_exp2_fma_tflops_causal:.0f` causal
# ({glue:text}`ch6_fp8_exp2_fma_vs_mufu_causal:.2f`x), at the same accuracy (RMS error on the
# outlier inputs {glue:text}`ch6_fp8_gluon_exp2_fma_err_noncausal:.2e` against
# {glue:text}`ch6_fp8_gluon_err_noncausal:.2e` non-causal,
# {glue:text}`ch6_fp8_gluon_exp2_fma_err_causal:.2e` against
# {glue:text}`ch6_fp8_gluon_err_causal:.2e` causal). The main loop's SASS says why, counted on
# the path a full tile takes (the mask's block, which only the diagonal and the last tile run,
# left out). Per key a thread holds, the default issues
# {glue:text}`ch6_fp8_sass_per_key_default:.2f` instructions,
# {glue:text}`ch6_fp8_sass_other_per_key_default:.2f` of them besides the exponential (the model
# counts 3.5: the max, the scale, the sum, the cast; here also the rescale of O, the stores of
# P, the loop). A warp scheduler issues one instruction a clock, and an SM computes 16
# exponentials a clock, so a warp's MUFU instruction holds its quarter of them 8 clocks: the
# exponentials take {glue:text}`ch6_fp8_sass_mufu_clocks_default:.2f` clocks a key. The
# default is bound by the exponential unit, though not by much. Each exponential moved to the FMA
# units costs {glue:text}`ch6_fp8_sass_added_per_emulated:.2f` more instructions (a clamp, two
# adds for the rounding, three FMAs, a shift and an add): with half of them moved, a key takes
# {glue:text}`ch6_fp8_sass_per_key_exp2_fma:.2f` instructions against
# {glue:text}`ch6_fp8_sass_mufu_clocks_exp2_fma:.2f` clocks of MUFU, and issue sets a slower
# pace. By these counts the two meet when one key in eight to ten is moved. `exp2_fma=n` moves
# one in $2^n$; on "sperm" ({glue:text}`ch6_fp8_sass_per_key_sperm:.2f` instructions and
# {glue:text}`ch6_fp8_sass_mufu_clocks_sperm:.2f` MUFU clocks a key), one in four gives
# {glue:text}`ch6_fp8_sass_per_key_sperm_fma4:.2f` against
# {glue:text}`ch6_fp8_sass_mufu_clocks_sperm_fma4:.2f` and runs at
# {glue:text}`ch6_fp8_sperm_fma4_tflops_noncausal:.0f` /
# {glue:text}`ch6_fp8_sperm_fma4_tflops_causal:.0f` TFLOP/s (non-causal / causal;
# {glue:text}`ch6_fp8_sperm_fma4_vs_fp16_noncausal:.2f`x /
# {glue:text}`ch6_fp8_sperm_fma4_vs_fp16_causal:.2f`x the fp16 forward), and one in eight gives
# {glue:text}`ch6_fp8_sass_per_key_sperm_fma8:.2f` against
# {glue:text}`ch6_fp8_sass_mufu_clocks_sperm_fma8:.2f`, the counts' balance, and runs at
# {glue:text}`ch6_fp8_sperm_fma8_tflops_noncausal:.0f` /
# {glue:text}`ch6_fp8_sperm_fma8_tflops_causal:.0f` TFLOP/s
# ({glue:text}`ch6_fp8_sperm_fma8_vs_fp16_noncausal:.2f`x /
# {glue:text}`ch6_fp8_sperm_fma8_vs_fp16_causal:.2f`x), with RMS errors
# {glue:text}`ch6_fp8_gluon_sperm_fma8_err_noncausal:.2e` /
# {glue:text}`ch6_fp8_gluon_sperm_fma8_err_causal:.2e`. Both are slower than "sperm" with every
# exponential on MUFU: the counts bound a warp's softmax from below, but at
# {glue:text}`ch6_fp8_sperm_tflops_noncausal:.0f` TFLOP/s the tensor cores are busy under half
# the time, so neither count alone sets the pace, and at every share measured the
# polynomial's instructions cost more than the exponential unit's time they save. The flag
# stays off; "sperm" is the fastest path measured, but its V^T must come permuted, so "smem"
# stays the default.
#
# **What the profiler measures.** Nsight Compute, run on "sperm" at the same shape on the
# {glue:text}`ch6_fp8_prof_gpu` (the SM clock locked at {glue:text}`ch6_fp8_prof_clock:.2f` GHz;
# `src/flashbook/data/profiles/ch6_fp8_sperm_h100_noncausal_ncu.txt`, whose header gives the
# command and the program), measures what the counts above only bound. The tensor pipe is busy
# {glue:text}`ch6_fp8_prof_tensor:.0f` % of the active cycles, and the XU pipe, where MUFU's
# exponentials run, {glue:text}`ch6_fp8_prof_xu:.0f` %. The warps issue in
# {glue:text}`ch6_fp8_prof_issue:.0f` % of the cycles, and in
# {glue:text}`ch6_fp8_prof_no_eligible:.0f` % no warp is ready to issue. So the two units that
# Chapter 7's model weighs are each busy about half the time, and together about all of it. Our
# reading: a consumer's exponentials wait for its `wgmma`s, and its next `wgmma`s wait for its
# exponentials, and the ping-pong hides only part of one consumer's chain behind the other's.
# In the fp16 forward a tile's exponentials need half the time of its matmuls, so the other
# consumer's matmuls cover them with room to spare; in FP8 at d = 128 the two are equal, and any
# part of a softmax left uncovered adds to the tile's time.

# %% tags=["demo"]
import matplotlib.pyplot as plt
from flashbook import results
from flashbook.chapters.ch6 import fp8_recorded
fp8_record = fp8_recorded.record()
if fp8_record:
    fig = fp8_recorded.plot(fp8_record)
    fig.suptitle("FP8 forward (" + results.describe(fp8_record["provenance"]) + ")", fontsize=9)
    fig.tight_layout()
    plt.show()
else:
    print("No recorded FP8 data in this installation.")

# %% tags=["remove-cell"]
# The figures the prose quotes, from the recorded H200 data: the book pastes each into its
# glue:text role (myst-nb's glue); elsewhere this does nothing.
from flashbook import quoted
from flashbook.chapters import ch6
quoted.glue(ch6.CHAPTER)

# %% [markdown]
# ## Measured on an H200
#
# `flashbook bench ch6` times the chapter's Gluon kernel, your Pallas kernel of Exercise 4 at
# full size (compiled for the GPU, the same source that ran in the interpreter), JAX's shipped
# FA3 kernel, Chapter 3's two-tile Triton kernel (Chapter 4's, with its mask, for causal rows),
# cuDNN and the FlashAttention-2 backend, every torch and Triton row replayed from a CUDA graph
# and JAX's rows timed with its own CUPTI profiler; beside the Gluon kernel, a row times
# `attention_fa3(q, k, v, causal)` as you call it (no config: the planner's choice, remembered
# per shape; checks on; launched), and the Gluon figures quoted here are that call's, within
# 2 % of the kernel at every shape. In fp16 `attention_fa3` reaches
# {glue:text}`ch6_ours_1_16384_128_noncausal:.0f` TFLOP/s non-causal at `(1, 16, 16384, 128)`,
# {glue:text}`ch6_vs_cudnn_noncausal:.2f`x cuDNN ({glue:text}`ch6_cudnn_noncausal:.0f`), and
# {glue:text}`ch6_ours_1_16384_128_causal:.0f` TFLOP/s causal at `(1, 16, 16384, 128)`,
# {glue:text}`ch6_vs_cudnn_causal:.2f`x cuDNN ({glue:text}`ch6_cudnn_causal:.0f`).
# Against JAX's FA3 kernel, the Pallas version of the same design:
#
# * against JAX's FA3 at `(1, 16, 16384, 128)`:
#   {glue:text}`ch6_vs_jax_1_16384_128_noncausal:.2f`x non-causal
#   ({glue:text}`ch6_ours_1_16384_128_noncausal:.0f` against {glue:text}`ch6_jax_1_16384_128_noncausal:.0f`),
#   {glue:text}`ch6_vs_jax_1_16384_128_causal:.2f`x causal
#   ({glue:text}`ch6_ours_1_16384_128_causal:.0f` against {glue:text}`ch6_jax_1_16384_128_causal:.0f`)
# * against JAX's FA3 at `(4, 16, 4096, 128)`:
#   {glue:text}`ch6_vs_jax_4_4096_128_noncausal:.2f`x non-causal
#   ({glue:text}`ch6_ours_4_4096_128_noncausal:.0f` against {glue:text}`ch6_jax_4_4096_128_noncausal:.0f`),
#   {glue:text}`ch6_vs_jax_4_4096_128_causal:.2f`x causal
#   ({glue:text}`ch6_ours_4_4096_128_causal:.0f` against {glue:text}`ch6_jax_4_4096_128_causal:.0f`)
# * against JAX's FA3 at `(4, 16, 4096, 64)`:
#   {glue:text}`ch6_vs_jax_4_4096_64_noncausal:.2f`x non-causal
#   ({glue:text}`ch6_ours_4_4096_64_noncausal:.0f` against {glue:text}`ch6_jax_4_4096_64_noncausal:.0f`),
#   {glue:text}`ch6_vs_jax_4_4096_64_causal:.2f`x causal
#   ({glue:text}`ch6_ours_4_4096_64_causal:.0f` against {glue:text}`ch6_jax_4_4096_64_causal:.0f`)
#
# Where it falls short, and why. At d = 64 each K/V tile carries half the matmul work, so the
# per-tile costs that do not shrink with d (the barrier waits, the token hand-over, the row
# statistics) weigh twice as much; JAX's kernel takes 256-key tiles there, which this kernel
# cannot hold in registers with two 64-row consumers (the planner rules them out).
# FlashAttention-3 answers with a third consumer warpgroup at d = 64 (192 query rows a CTA, the
# token going round three): one consumer's softmax now hides behind two others' GEMMs. The
# planner does the same (`planner.three_consumers`; 160 registers a consumer thread), except for
# short problems, where the persistent two consumers stay faster; the second table below
# measures it. (The persistent kernel takes three consumers too, `Config(CONSUMERS=3,
# PERSISTENT=True)`. On an H100 it was never more than 2.3 % faster than the planner's choice
# up to 4,096 queries, less than the gap between two timings of one launch in that run; causal
# it was slower, about half as fast at 512 queries: the three consumers of a 192-row work tile
# all take a turn at every K/V tile that its longest rows read.) The H200 figures above were
# recorded with two consumers. In the
# short causal case, half of the programs finish early and the tail of the grid runs half empty.
# The kernel now has a persistent variant for this (`Config.PERSISTENT`: one CTA per SM walks a
# static schedule of the tiles head by head, each round in the opposite direction to the last,
# so that long and short tiles share an SM), and the planner picks it for causal problems of up
# to 4,096 queries: on an H100 it was faster at every such shape we timed, and slower at
# 16,384 (the table below). A persistent consumer also frees its Q tile as soon as its last
# QK^T is done and stores O from a tile of its own, as FlashAttention-3 does, so the next work
# tile's Q loads while the last PV and the O store run. That makes it faster non-causal too
# wherever a grid CTA has only a few K/V tiles to hide its Q load and O store behind: the
# planner launches it up to 4,096 queries at d = 128 and 1,024 at d = 64 (on an H100, 480
# against 410 TFLOP/s at (64, 16, 512, 128)), and at causal problems of at most 512 queries
# with 64-key tiles in four stages, which mask half as many keys on the diagonal (311 against
# 263 TFLOP/s at (64, 16, 512, 128), cuDNN 322). The H200 figures above were recorded before it. And at d = 128 the
# kernel stays near cuDNN, short of the up to 740 TFLOP/s FlashAttention-3 reports on an H100:
# ptxas moves the wait for
# the warpgroup's own PV to the top of the softmax (the SASS shows it; the book's tests check
# it on every compile, with Triton 3.9's ptxas): it converts each new exponential to 16 bits
# at once, into the very registers that PV still reads. Giving alternate tiles a P of their
# own (the loop unrolled by two) does not move the wait: with 64 x 128 tiles the second P
# overflows the 240 registers, and ptxas spills and waits after every wgmma; with 64 x 64
# tiles it fits, and the wait still comes first. So the intra-warpgroup
# overlap of Section 6 is only partly realised, and each K/V tile pays a few hundred cycles of
# barrier traffic (`planner.TILE_SYNC`). Your Pallas kernel of Exercise 4 is correct at full
# size and about two-thirds as fast as the Gluon kernel non-causal: it streams 64-key tiles
# through a two-slot ring, passes P through shared memory and skips no masked tile, which is
# why its causal rows are far slower.

# %% tags=["demo"]
import matplotlib.pyplot as plt
from flashbook import results
from flashbook.chapters.ch6 import recorded
found = results.recorded("ch6")
if found:
    print(recorded.summary(found.rows))
    fig = recorded.plot_recorded(found.rows)
    fig.suptitle("Chapter 6 on an H200 (" + results.describe(found.provenance) + ")", fontsize=9)
    fig.tight_layout()
    plt.show()
else:
    print("No recorded H200 data in this installation.")

# %% [markdown]
# ### What each piece buys, measured on an H100
#
# `python -m flashbook.fa3_ablation` times the kernel with one design choice changed at a time,
# in one run on the {glue:text}`ch6_abl_gpu`, fp16, each variant's O checked against float32
# SDPA before it is timed (launched as you launch it, `triton.testing.do_bench` medians). TFLOP/s
# (x cuDNN's forward):
#
# | variant | (1, 16, 16384, 128) | causal | (2, 16, 4096, 128) | causal |
# |---|---|---|---|---|
# | `attention_fa3` as you call it (the planner's choice) | {glue:text}`ch6_abl_default_1_16384_128_noncausal:.0f` ({glue:text}`ch6_abl_default_vs_cudnn_1_16384_128_noncausal:.2f`x) | {glue:text}`ch6_abl_default_1_16384_128_causal:.0f` ({glue:text}`ch6_abl_default_vs_cudnn_1_16384_128_causal:.2f`x) | {glue:text}`ch6_abl_default_2_4096_128_noncausal:.0f` ({glue:text}`ch6_abl_default_vs_cudnn_2_4096_128_noncausal:.2f`x) | {glue:text}`ch6_abl_default_2_4096_128_causal:.0f` ({glue:text}`ch6_abl_default_vs_cudnn_2_4096_128_causal:.2f`x) |
# | the planner's tiles launched as a grid, a CTA per query tile | {glue:text}`ch6_abl_grid_1_16384_128_noncausal:.0f` ({glue:text}`ch6_abl_grid_vs_cudnn_1_16384_128_noncausal:.2f`x) | {glue:text}`ch6_abl_grid_1_16384_128_causal:.0f` ({glue:text}`ch6_abl_grid_vs_cudnn_1_16384_128_causal:.2f`x) | {glue:text}`ch6_abl_grid_2_4096_128_noncausal:.0f` ({glue:text}`ch6_abl_grid_vs_cudnn_2_4096_128_noncausal:.2f`x) | {glue:text}`ch6_abl_grid_2_4096_128_causal:.0f` ({glue:text}`ch6_abl_grid_vs_cudnn_2_4096_128_causal:.2f`x) |
# | the same tiles persistent: a CTA per SM, head-major snake | {glue:text}`ch6_abl_persistent_1_16384_128_noncausal:.0f` ({glue:text}`ch6_abl_persistent_vs_cudnn_1_16384_128_noncausal:.2f`x) | {glue:text}`ch6_abl_persistent_1_16384_128_causal:.0f` ({glue:text}`ch6_abl_persistent_vs_cudnn_1_16384_128_causal:.2f`x) | {glue:text}`ch6_abl_persistent_2_4096_128_noncausal:.0f` ({glue:text}`ch6_abl_persistent_vs_cudnn_2_4096_128_noncausal:.2f`x) | {glue:text}`ch6_abl_persistent_2_4096_128_causal:.0f` ({glue:text}`ch6_abl_persistent_vs_cudnn_2_4096_128_causal:.2f`x) |
# | the planner's choice without the intra-warpgroup overlap | {glue:text}`ch6_abl_no_overlap_1_16384_128_noncausal:.0f` ({glue:text}`ch6_abl_no_overlap_vs_cudnn_1_16384_128_noncausal:.2f`x) | {glue:text}`ch6_abl_no_overlap_1_16384_128_causal:.0f` ({glue:text}`ch6_abl_no_overlap_vs_cudnn_1_16384_128_causal:.2f`x) | {glue:text}`ch6_abl_no_overlap_2_4096_128_noncausal:.0f` ({glue:text}`ch6_abl_no_overlap_vs_cudnn_2_4096_128_noncausal:.2f`x) | {glue:text}`ch6_abl_no_overlap_2_4096_128_causal:.0f` ({glue:text}`ch6_abl_no_overlap_vs_cudnn_2_4096_128_causal:.2f`x) |
# | cuDNN | {glue:text}`ch6_abl_cudnn_1_16384_128_noncausal:.0f` | {glue:text}`ch6_abl_cudnn_1_16384_128_causal:.0f` | {glue:text}`ch6_abl_cudnn_2_4096_128_noncausal:.0f` | {glue:text}`ch6_abl_cudnn_2_4096_128_causal:.0f` |
#
# The first row is always one of the next two: the planner launches a grid, except for problems
# of up to 4,096 queries (causal, or at d = 128), where it goes persistent. Compare those two
# rows column by column to see where each launch wins. Our reading: a persistent CTA keeps its
# SM from the first tile to the last, so a short causal problem's unequal tiles even out over
# the rounds of the schedule and a short problem's Q loads and O stores overlap the
# neighbouring work tiles, while at 16,384 queries the grid is many waves deep and the hardware's own
# scheduler already balances it. The overlap row shows what FlashAttention-3's intra-warpgroup
# overlap buys here: with `OVERLAP=False` a consumer waits for its PV of tile j - 1 as well as
# for S before the softmax of tile j, so the softmax no longer runs while that PV is on the
# tensor cores. These are an H100's figures, not the H200's of the table above. Each variant
# was timed three times, in turn with the others, and the table gives the median: one variant's
# three timings differ by up to {glue:text}`ch6_abl_spread_pct:.1f` %, so a smaller difference
# between two rows is within the run's noise. The overlap row is within that noise of the rows
# with the overlap, which is what the SASS predicts: ptxas already moves the wait for PV(j - 1)
# to the top of the softmax (see above), so with `OVERLAP=True` the consumer waits there too,
# and the overlap that FlashAttention-3 gets on an H100 is not yet realised in this kernel.
#
# At d = 64, from the same run, the planner's three consumers against two:
#
# | variant | (1, 16, 16384, 64) | causal | (4, 16, 4096, 64) | causal |
# |---|---|---|---|---|
# | `attention_fa3` as you call it (the planner's choice) | {glue:text}`ch6_abl_default_1_16384_64_noncausal:.0f` ({glue:text}`ch6_abl_default_vs_cudnn_1_16384_64_noncausal:.2f`x) | {glue:text}`ch6_abl_default_1_16384_64_causal:.0f` ({glue:text}`ch6_abl_default_vs_cudnn_1_16384_64_causal:.2f`x) | {glue:text}`ch6_abl_default_4_4096_64_noncausal:.0f` ({glue:text}`ch6_abl_default_vs_cudnn_4_4096_64_noncausal:.2f`x) | {glue:text}`ch6_abl_default_4_4096_64_causal:.0f` ({glue:text}`ch6_abl_default_vs_cudnn_4_4096_64_causal:.2f`x) |
# | the planner's tiles as a grid | {glue:text}`ch6_abl_grid_1_16384_64_noncausal:.0f` ({glue:text}`ch6_abl_grid_vs_cudnn_1_16384_64_noncausal:.2f`x) | {glue:text}`ch6_abl_grid_1_16384_64_causal:.0f` ({glue:text}`ch6_abl_grid_vs_cudnn_1_16384_64_causal:.2f`x) | {glue:text}`ch6_abl_grid_4_4096_64_noncausal:.0f` ({glue:text}`ch6_abl_grid_vs_cudnn_4_4096_64_noncausal:.2f`x) | {glue:text}`ch6_abl_grid_4_4096_64_causal:.0f` ({glue:text}`ch6_abl_grid_vs_cudnn_4_4096_64_causal:.2f`x) |
# | the fastest two-consumer tiles, as a grid | {glue:text}`ch6_abl_two_consumers_1_16384_64_noncausal:.0f` ({glue:text}`ch6_abl_two_consumers_vs_cudnn_1_16384_64_noncausal:.2f`x) | {glue:text}`ch6_abl_two_consumers_1_16384_64_causal:.0f` ({glue:text}`ch6_abl_two_consumers_vs_cudnn_1_16384_64_causal:.2f`x) | {glue:text}`ch6_abl_two_consumers_4_4096_64_noncausal:.0f` ({glue:text}`ch6_abl_two_consumers_vs_cudnn_4_4096_64_noncausal:.2f`x) | {glue:text}`ch6_abl_two_consumers_4_4096_64_causal:.0f` ({glue:text}`ch6_abl_two_consumers_vs_cudnn_4_4096_64_causal:.2f`x) |
# | two consumers, persistent | {glue:text}`ch6_abl_persistent_1_16384_64_noncausal:.0f` ({glue:text}`ch6_abl_persistent_vs_cudnn_1_16384_64_noncausal:.2f`x) | {glue:text}`ch6_abl_persistent_1_16384_64_causal:.0f` ({glue:text}`ch6_abl_persistent_vs_cudnn_1_16384_64_causal:.2f`x) | {glue:text}`ch6_abl_persistent_4_4096_64_noncausal:.0f` ({glue:text}`ch6_abl_persistent_vs_cudnn_4_4096_64_noncausal:.2f`x) | {glue:text}`ch6_abl_persistent_4_4096_64_causal:.0f` ({glue:text}`ch6_abl_persistent_vs_cudnn_4_4096_64_causal:.2f`x) |
# | the planner's choice without the overlap | {glue:text}`ch6_abl_no_overlap_1_16384_64_noncausal:.0f` ({glue:text}`ch6_abl_no_overlap_vs_cudnn_1_16384_64_noncausal:.2f`x) | {glue:text}`ch6_abl_no_overlap_1_16384_64_causal:.0f` ({glue:text}`ch6_abl_no_overlap_vs_cudnn_1_16384_64_causal:.2f`x) | {glue:text}`ch6_abl_no_overlap_4_4096_64_noncausal:.0f` ({glue:text}`ch6_abl_no_overlap_vs_cudnn_4_4096_64_noncausal:.2f`x) | {glue:text}`ch6_abl_no_overlap_4_4096_64_causal:.0f` ({glue:text}`ch6_abl_no_overlap_vs_cudnn_4_4096_64_causal:.2f`x) |
# | cuDNN | {glue:text}`ch6_abl_cudnn_1_16384_64_noncausal:.0f` | {glue:text}`ch6_abl_cudnn_1_16384_64_causal:.0f` | {glue:text}`ch6_abl_cudnn_4_4096_64_noncausal:.0f` | {glue:text}`ch6_abl_cudnn_4_4096_64_causal:.0f` |
#
# The first row is the second (three consumers, a grid) in every column but the last, where the
# persistent rule (causal, at most 4,096 queries; non-causal at d = 64, at most 1,024) picks the
# fourth. The third consumer changes nothing in a tile's work; it only changes how often the tensor cores wait: at d = 64 a 64 x 128 tile's two GEMMs
# take about as long as its softmax, so with two consumers one softmax is barely covered by the
# other consumer's GEMMs and every hand-over shows, while with three it is covered twice over.
# It costs registers, 160 a consumer thread instead of 240: ptxas moves values that do not
# change across the K/V loop to local memory, and two of the three consumers' loops reload 11 of
# them a tile (no stores in the loop). At d = 128, where O alone takes 64 registers, three
# consumers fit only with 64 x 64 tiles, which measured slower than two consumers of 64 x 128,
# so the kernel stays at two there.

# %% [markdown]
# ## What is next
#
# Chapter 7 takes the same design to Blackwell, where the tensor cores double their rate and the
# exponentials, hidden here, become the critical path.
#
# **Further reading**
# * FlashAttention-3 {cite}`shah2024flashattention3`: warp specialization, ping-pong and the
#   intra-warpgroup overlap on Hopper.
# * The CUDA C++ Programming Guide {cite}`nvidia2025cudaguide`: asynchronous barriers and the
#   Tensor Memory Accelerator.
