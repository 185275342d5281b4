"""The body a kernel entry of the FlashAttention-3 roles (``fa3_roles``) runs: allocate shared
memory, initialise the barriers, fork the roles: ``CONSUMERS`` consumer warpgroups (two, or three
as FlashAttention-3 runs d = 64, where the softmax is long beside the GEMMs and a third consumer
keeps the tensor cores busy through it) and the producer warp; ``fa3_hooked_kernel`` is an entry
with the softmax's hooks as constexprs (Chapter 6's ``fa3_kernel`` fixes them). Importing this
module needs Triton's Gluon dialect, not a GPU.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

from flashbook.fa3_roles import consumer, consumer_persistent, producer, producer_persistent

__all__ = ["fa3_forward", "fa3_hooked_kernel"]


@gluon.jit
def fa3_forward(q_desc, k_desc, v_desc, o_desc, LSE, N_Q, N_K, qk_scale,
                BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                STAGES: gl.constexpr, CAUSAL: gl.constexpr, OVERLAP: gl.constexpr,
                CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, EXP2: gl.constexpr,
                MOVE_MAX: gl.constexpr, RESCALE: gl.constexpr, PERSISTENT: gl.constexpr,
                GROUP: gl.constexpr, CONSUMERS: gl.constexpr):
    """What a kernel entry runs: O and the LSE of its (CONSUMERS*BLOCK_M rows, batch*head)
    block, the softmax's hooks ``EXP2``, ``MOVE_MAX`` and ``RESCALE`` (``fa3_roles``) passed to
    the consumers; ``PERSISTENT``: of the work tiles ``work_tile`` gives it (sections of
    ``GROUP`` heads)."""
    dtype: gl.constexpr = q_desc.dtype
    # shared memory: a Q tile a consumer (reused for O, unless persistent), STAGES K tiles and
    # STAGES V tiles, 128-byte swizzled (NVMMA layouts, what TMA writes and wgmma reads), then
    # 8-byte mbarriers
    q_smem = gl.allocate_shared_memory(dtype, [CONSUMERS] + q_desc.block_type.shape,
                                       q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    if PERSISTENT:
        # O's own tile a consumer: Q is freed after the tile's last QK^T, and O's TMA store
        # drains while the next tile runs (FlashAttention-3's epilogue)
        o_smem = gl.allocate_shared_memory(dtype, [CONSUMERS] + o_desc.block_type.shape,
                                           o_desc.layout)
    q_bars = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    k_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    sched = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(CONSUMERS):
        mbarrier.init(q_bars.index(i), count=1)      # the producer's expect-tx arrival
        mbarrier.init(sched.index(i), count=1)       # the previous consumer's release
    for i in gl.static_range(STAGES):
        mbarrier.init(k_full.index(i), count=1)
        mbarrier.init(v_full.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=CONSUMERS)     # every consumer
        mbarrier.init(v_empty.index(i), count=CONSUMERS)
    if PERSISTENT:
        q_free = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(CONSUMERS):
            mbarrier.init(q_free.index(i), count=1)  # its consumer, after its last QK^T
    fence_async_shared()                             # the inits, before any TMA completes on them

    # warp_specialize takes a literal list: one branch per (persistent, consumer count)
    if PERSISTENT and CONSUMERS == 3:
        gl.warp_specialize([
            (consumer_persistent, (q_smem, k_smem, v_smem, o_smem, q_bars, q_free, k_full,
                                   k_empty, v_full, v_empty, sched, o_desc, LSE, N_Q, N_K,
                                   qk_scale, 0, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, CAUSAL,
                                   OVERLAP, EXP2, MOVE_MAX, RESCALE, GROUP, 3)),
            (consumer_persistent, (q_smem, k_smem, v_smem, o_smem, q_bars, q_free, k_full,
                                   k_empty, v_full, v_empty, sched, o_desc, LSE, N_Q, N_K,
                                   qk_scale, 1, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, CAUSAL,
                                   OVERLAP, EXP2, MOVE_MAX, RESCALE, GROUP, 3)),
            (consumer_persistent, (q_smem, k_smem, v_smem, o_smem, q_bars, q_free, k_full,
                                   k_empty, v_full, v_empty, sched, o_desc, LSE, N_Q, N_K,
                                   qk_scale, 2, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, CAUSAL,
                                   OVERLAP, EXP2, MOVE_MAX, RESCALE, GROUP, 3)),
            (producer_persistent, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bars,
                                   q_free, k_full, k_empty, v_full, v_empty, N_Q, N_K, BLOCK_M,
                                   BLOCK_N, STAGES, CAUSAL, GROUP, 3)),
        ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS])
    elif PERSISTENT:
        gl.warp_specialize([
            (consumer_persistent, (q_smem, k_smem, v_smem, o_smem, q_bars, q_free, k_full,
                                   k_empty, v_full, v_empty, sched, o_desc, LSE, N_Q, N_K,
                                   qk_scale, 0, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, CAUSAL,
                                   OVERLAP, EXP2, MOVE_MAX, RESCALE, GROUP, 2)),
            (consumer_persistent, (q_smem, k_smem, v_smem, o_smem, q_bars, q_free, k_full,
                                   k_empty, v_full, v_empty, sched, o_desc, LSE, N_Q, N_K,
                                   qk_scale, 1, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, CAUSAL,
                                   OVERLAP, EXP2, MOVE_MAX, RESCALE, GROUP, 2)),
            (producer_persistent, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bars,
                                   q_free, k_full, k_empty, v_full, v_empty, N_Q, N_K, BLOCK_M,
                                   BLOCK_N, STAGES, CAUSAL, GROUP, 2)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    elif CONSUMERS == 3:
        gl.warp_specialize([
            (consumer, (q_smem, k_smem, v_smem, q_bars, k_full, k_empty, v_full, v_empty, sched,
                         o_desc, LSE, N_Q, N_K, qk_scale, 0, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES,
                         CAUSAL, OVERLAP, EXP2, MOVE_MAX, RESCALE, 3)),
            (consumer, (q_smem, k_smem, v_smem, q_bars, k_full, k_empty, v_full, v_empty, sched,
                         o_desc, LSE, N_Q, N_K, qk_scale, 1, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES,
                         CAUSAL, OVERLAP, EXP2, MOVE_MAX, RESCALE, 3)),
            (consumer, (q_smem, k_smem, v_smem, q_bars, k_full, k_empty, v_full, v_empty, sched,
                         o_desc, LSE, N_Q, N_K, qk_scale, 2, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES,
                         CAUSAL, OVERLAP, EXP2, MOVE_MAX, RESCALE, 3)),
            (producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bars, k_full, k_empty,
                         v_full, v_empty, N_Q, N_K, BLOCK_M, BLOCK_N, STAGES, CAUSAL, False, 3)),
        ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (consumer, (q_smem, k_smem, v_smem, q_bars, k_full, k_empty, v_full, v_empty, sched,
                         o_desc, LSE, N_Q, N_K, qk_scale, 0, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES,
                         CAUSAL, OVERLAP, EXP2, MOVE_MAX, RESCALE, 2)),
            (consumer, (q_smem, k_smem, v_smem, q_bars, k_full, k_empty, v_full, v_empty, sched,
                         o_desc, LSE, N_Q, N_K, qk_scale, 1, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES,
                         CAUSAL, OVERLAP, EXP2, MOVE_MAX, RESCALE, 2)),
            (producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bars, k_full, k_empty,
                         v_full, v_empty, N_Q, N_K, BLOCK_M, BLOCK_N, STAGES, CAUSAL, False, 2)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


@gluon.jit(do_not_specialize=["N_Q", "N_K"])     # one binary for every length
def fa3_hooked_kernel(q_desc, k_desc, v_desc, o_desc, LSE, N_Q, N_K, qk_scale,
                      BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                      STAGES: gl.constexpr, CAUSAL: gl.constexpr, OVERLAP: gl.constexpr,
                      CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                      EXP2: gl.constexpr, MOVE_MAX: gl.constexpr, RESCALE: gl.constexpr,
                      PERSISTENT: gl.constexpr, GROUP: gl.constexpr, CONSUMERS: gl.constexpr):
    """A kernel entry of these roles with the softmax's hooks as its constexprs (a chapter's
    own entry fixes them: Chapter 6's ``fa3_kernel``)."""
    fa3_forward(q_desc, k_desc, v_desc, o_desc, LSE, N_Q, N_K, qk_scale, BLOCK_M, BLOCK_N,
                HEAD_DIM, STAGES, CAUSAL, OVERLAP, CONSUMER_REGS, PRODUCER_REGS, EXP2, MOVE_MAX,
                RESCALE, PERSISTENT, GROUP, CONSUMERS)
