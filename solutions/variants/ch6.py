"""Known-wrong answers to Chapter 6's exercises: each is a solution cell with one classic
barrier bug edited in, and each must fail a check for its own reason."""
from flashbook.contract import Variant

VARIANTS = (
    # ----------------------------------------------------------------- ch6_ring_producer
    # refills a slot while the consumers may still read it: the race detector names the copy
    # and the consumer's read (and the interpreter then sees consumed complete twice)
    Variant('ring_skips_consumed_wait', 'ch6_ring_producer', (
        ('plgpu.barrier_wait(consumed.at[slot])', 'pass'),
    ), expect='data race'),
    # waits for the release of the next slot, not the one it refills: the phases of the two
    # consumed barriers drift apart until a wait can never complete
    Variant('ring_waits_on_wrong_slot', 'ch6_ring_producer', (
        ('consumed.at[slot]', 'consumed.at[lax.rem(step + 1, stages)]'),
    ), expect='hung'),
    # waits for a release before the first copies: the consumers wait for those tiles
    Variant('ring_waits_before_first_fill', 'ch6_ring_producer', (
        ('@pl.when(step >= stages)', '@pl.when(step >= 0)'),
    ), expect='deadlock'),
    # no drain: the interpreter finds consumed phases the producer never waited for
    Variant('ring_no_drain', 'ch6_ring_producer', (
        ('plgpu.barrier_wait(consumed.at[step % stages])', 'pass'),
    ), expect='must wait for every one of its phases'),
    # the copy arrives on another slot's full barrier: consumers read a slot whose copy their
    # wait does not cover (they read early)
    Variant('ring_copy_signals_wrong_barrier', 'ch6_ring_producer', (
        ('ring.at[slot], full.at[slot])', 'ring.at[slot], full.at[lax.rem(step + 1, stages)])'),
    ), expect='data race'),
    # no prefetch: copy a tile, then wait for its release before the next copy. Race-free and
    # exact, but the ring never holds more than one tile in flight; the order log shows it
    Variant('ring_waits_after_each_copy', 'ch6_ring_producer', (
        ('        @pl.when(step >= stages)                       # the slot still holds tile step - stages:\n'
         '        def _wait_for_release():                       # wait until every consumer is done\n'
         '            plgpu.barrier_wait(consumed.at[slot])\n\n', ''),
        ('ring.at[slot], full.at[slot])\n',
         'ring.at[slot], full.at[slot])\n        plgpu.barrier_wait(consumed.at[slot])\n'),
        ('    for step in range(max(0, steps - stages), steps):\n'
         '        plgpu.barrier_wait(consumed.at[step % stages])\n', ''),
    ), expect='the producer did not prefetch'),
    # a protocol-perfect ring that loads the wrong rows: exact sums catch it
    Variant('ring_loads_wrong_tile', 'ch6_ring_producer', (
        ('pl.ds(step * block, block)', 'pl.ds(slot * block, block)'),
    ), expect='result is wrong'),

    # ----------------------------------------------------------------- ch6_pipeline_ring
    Variant('consumed_expects_one_arrival', 'ch6_pipeline_ring', (
        ('arrivals=pipe.consumers)', 'arrivals=1)'),
    ), expect='one arrival per consumer'),     # the faster consumer's release refills the slot
    Variant('producer_skips_the_consumed_wait', 'ch6_pipeline_ring', (
        ('        yield pipe.wait(consumed[slot], pipe.phase(step) ^ 1)\n', ''),
    ), expect='did not wait on any barrier'),  # refills a slot nobody has read yet
    # ----------------------------------------------------------------- ch6_pipeline_consumer
    Variant('release_before_pv_reads_v', 'ch6_pipeline_consumer', (
        ('            yield pipe.pv(k - 1)'
         '                                    # reads V of step k - 1\n'
         '            yield pipe.arrive(consumed[pipe.slot(k - 1)])'
         '           # its slot may be refilled\n',
         '            yield pipe.arrive(consumed[pipe.slot(k - 1)])'
         '           # its slot may be refilled\n'
         '            yield pipe.pv(k - 1)'
         '                                    # reads V of step k - 1\n'),
    ), expect='before its last read'),         # the producer refills V under the PV GEMM
    Variant('reads_before_the_full_wait', 'ch6_pipeline_consumer', (
        ('            yield pipe.wait(full[pipe.slot(k)], pipe.phase(k))'
         '      # step k has landed',
         '            pass'),
    ), expect='Data not ready'),               # QK of step 0 reads K while its TMA is in flight
    Variant('no_pingpong', 'ch6_pipeline_consumer', (
        ('            yield pipe.wait(turn[wg], (k + wg + 1) % 2)'
         '             # my turn (warpgroup 0 first)',
         '            pass'),
    ), expect='shared the tensor core'),       # lockstep: 2g/(2g+s) instead of min(1, 2g/(g+s))
    Variant('turn_not_passed_after_the_last_block', 'ch6_pipeline_consumer', (
        ('        if turn is not None:\n            yield pipe.arrive(turn[1 - wg])',
         '        if turn is not None and k < n:\n            yield pipe.arrive(turn[1 - wg])'),
    ), expect='deadlock'),                     # the other consumer waits for a last turn forever

    # ----------------------------------------------------------------- ch6_planner_resources
    # one slot of K and one of V: the ring looks free, 3 and 4 stages "fit" at d=128
    Variant('ring_counts_one_slot', 'ch6_planner_resources', (
        ('kv = 2 * config.STAGES * config.BLOCK_N * d * size',
         'kv = 2 * config.BLOCK_N * d * size'),
    ), expect='one slot of K and one of V'),
    # one Q tile for the CTA: the second consumer warpgroup's rows are forgotten
    Variant('one_q_tile', 'ch6_planner_resources', (
        ('q = config.CONSUMERS * config.BLOCK_M * d * size',
         'q = config.BLOCK_M * d * size'),
    ), expect='counted one Q tile'),
    # 244 registers for two consumers: setmaxnreg takes multiples of 8
    Variant('budget_not_a_multiple_of_8', 'ch6_planner_resources', (
        ('return min(256, per_thread // 8 * 8)', 'return min(256, per_thread)'),
    ), expect='multiple of 8'),
    # one consumer would get 488 registers a thread: setmaxnreg stops at 256
    Variant('budget_over_256', 'ch6_planner_resources', (
        ('return min(256, per_thread // 8 * 8)', 'return per_thread // 8 * 8'),
    ), expect='at most 256 registers'),
    # ----------------------------------------------------------------- ch6_planner_choose
    # the SM's 228 KB, not the 227 KB a block may use (1 KB is reserved per block)
    Variant('smem_limit_is_the_sms_total', 'ch6_planner_choose', (
        ('device.shared_memory_per_block_optin', 'device.shared_memory_per_multiprocessor'),
    ), expect='not 228 KB'),
    # the model's favourite, 128 x 256 tiles, fits neither shared memory nor registers
    Variant('choose_ignores_feasibility', 'ch6_planner_choose', (
        ('feasible = [c for c in configs if fits(c, device)]', 'feasible = configs'),
    ), expect='which does not fit'),

    # the accumulator keeps its old scale when the running max grows: O is a mix of terms
    # weighed with different maxima; the check recognises the output and names the bug
    Variant('fa3_no_rescale', 'ch6_fa3_consumer', (
        ('        acc = acc * alpha[:, None]\n', ''),
    ), expect='not rescaled'),
    # P in base e of log2-domain scores and max: the keys are weighed wrongly
    Variant('fa3_natural_exp', 'ch6_fa3_consumer', (
        ('p = jnp.exp2(s - m_new[:, None])', 'p = jnp.exp(s - m_new[:, None])'),
    ), expect='P = exp(s - m)'),
    # S left in natural units before exp2: softmax(S ln 2), a flatter distribution
    Variant('fa3_no_log2e', 'ch6_fa3_consumer', (
        ('s * (scale * log2e)', 's * scale'),
    ), expect='not multiplied by log2(e)'),
    # the QK^T wgmma reads a K^T slot the TMA may still be writing: the race detector sees the
    # copy and the wgmma's read unordered (and the interpreter then sees k_full complete twice)
    Variant('fa3_skips_k_full_wait', 'ch6_fa3_consumer', (
        ('        plgpu.barrier_wait(k_full.at[slot])        # K^T of this step has landed\n',
         ''),
    ), expect='data race on kT_ring'),
    # V released between the PV wgmma's issue and its wait: the producer refills the slot
    # while the tensor cores may still read it (right values in the interpreter, a race)
    Variant('fa3_releases_v_before_pv_wait', 'ch6_fa3_consumer', (
        ('            plgpu.wgmma(acc_ref, p_smem, v_ring.at[slot])    # issue P V (async)\n',
         '            plgpu.wgmma(acc_ref, p_smem, v_ring.at[slot])    # issue P V (async)\n'
         '            plgpu.barrier_arrive(v_consumed.at[slot])\n'),
        ('        plgpu.barrier_arrive(v_consumed.at[slot])  # V is free\n', ''),
    ), expect='data race on v_ring'),
    # warpgroup 0 skips its closing rendezvous: warpgroup 1's last wait on the schedule
    # barrier never completes, nor its last V release, nor the producer's drain
    Variant('fa3_unbalanced_schedule', 'ch6_fa3_consumer', (
        ('    pl.when(wg == 0)(schedule_barrier)', '    pass'),
    ), expect='deadlock'),
    # no ping-pong at all: every use of the schedule barrier deleted. Right values, no race, no
    # hang; the order log shows that the two consumers issue their GEMMs without taking turns
    Variant('fa3_no_pingpong', 'ch6_fa3_consumer', (
        ('    pl.when(wg == 1)(schedule_barrier)             # warpgroup 1 starts half a step '
         'behind\n', ''),
        ("            schedule_barrier()                     # the other's softmax ends while "
         "it runs\n", ''),
        ('        plgpu.barrier_arrive(schedule)             # my softmax is done\n', ''),
        ('        plgpu.barrier_wait(schedule)               # the other has issued its GEMMs: '
         'my turn\n', ''),
        ("    pl.when(wg == 0)(schedule_barrier)             # balance warpgroup 1's extra "
         "rendezvous\n", ''),
    ), expect='do not take turns'),
    # P stored to SMEM and multiplied with no proxy fence: right values in the interpreter (one
    # proxy), a stale P sometimes on a GPU; the traced kernel shows the missing commit_smem
    Variant('fa3_no_commit_smem', 'ch6_fa3_consumer', (
        ('        plgpu.commit_smem()                        # visible to the wgmma that reads it\n',
         ''),
    ), expect='the proxy fence is missing'),
    # O returned unnormalised: off by the factor l of each row
    Variant('fa3_no_normalisation', 'ch6_fa3_consumer', (
        ('return acc / l[:, None],', 'return acc,'),
    ), expect='not divided by l'),
    # ----------------------------------------------------------------- ch6_fp8_quantize
    # the scale is the block's amax: values in [-1, 1] use an eighth of e4m3's exponents, and
    # small elements fall to subnormals
    Variant('fp8_scale_is_the_amax', 'ch6_fp8_quantize', (
        ('amax / 448.0', 'amax'),
    ), expect='should be amax / 448'),
    # one scale for the whole tensor: an outlier block coarsens every other block
    Variant('fp8_one_scale_per_tensor', 'ch6_fp8_quantize', (
        ('amax = rows.abs().amax(dim=-1)\n',
         'amax = rows.abs().amax(dim=-1).amax(dim=-1, keepdim=True).expand(rows.shape[:-1])\n'),
    ), expect='should be amax / 448'),
    # divided and clamped but never cast: float32 values, no quantization at all
    Variant('fp8_values_not_cast', 'ch6_fp8_quantize', (
        ('.clamp(-448.0, 448.0).to(torch.float8_e4m3fn)', '.clamp(-448.0, 448.0)'),
    ), expect='float8_e4m3fn'),
    # ----------------------------------------------------------------- ch6_fp8_rotation
    # the Hadamard matrix without 1 / sqrt(d): M M^T = d I, Q K^T scaled by d
    Variant('fp8_rotation_not_normalised', 'ch6_fp8_rotation', (
        ('return h * signs / d ** 0.5', 'return h * signs'),
    ), expect='should be the identity'),
    # no random signs: the same matrix for every seed
    Variant('fp8_rotation_without_signs', 'ch6_fp8_rotation', (
        ('return h * signs / d ** 0.5', 'return h / d ** 0.5'),
    ), expect='the signs must be random'),
    # a random signed permutation: orthogonal and exact, but it moves an outlier, never spreads it
    Variant('fp8_rotation_is_a_permutation', 'ch6_fp8_rotation', (
        ('return h * signs / d ** 0.5',
         'return torch.eye(d)[torch.randperm(d, generator=gen)] * signs'),
    ), expect='every entry should be +-1/sqrt(d)'),
    # ----------------------------------------------------------------- ch6_fp8_tiles
    # K's block scale left out of S: scores off by a factor per tile
    Variant('fp8_tiles_forget_k_scale', 'ch6_fp8_tiles', (
        ('s = (q @ k8[rows].float().T) * ks[j]', 's = q @ k8[rows].float().T'),
    ), expect='only P\'s rounding to e4m3 may differ'),
    # the accumulator not rescaled when the row max grows
    Variant('fp8_tiles_acc_not_rescaled', 'ch6_fp8_tiles', (
        ('acc = acc * alpha[:, None] + ', 'acc = acc + '),
    ), expect='only P\'s rounding to e4m3 may differ'),
    # the row sum not rescaled when the row max grows
    Variant('fp8_tiles_l_not_rescaled', 'ch6_fp8_tiles', (
        ('l = l * alpha + p.sum(dim=-1)', 'l = l + p.sum(dim=-1)'),
    ), expect='only P\'s rounding to e4m3 may differ'),
)
