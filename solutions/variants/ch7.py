"""Known-wrong answers to Chapter 7's exercises: each is a solution cell with one classic bug
edited in, and each must lose points to that bug (its ``expect`` text is in the failure)."""
from flashbook.contract import Variant

VARIANTS = (
    # ----------------------------------------------------------------- ch7_tmem_plan
    # O placed right after S0, on top of S1 (and of P1 and stats1, which alias S1)
    Variant('tmem_o_overlaps_s', 'ch7_tmem_plan', (
        ('plan[f"O{i}"] = (2 * s + i * head_dim, head_dim)',
         'plan[f"O{i}"] = (s + i * head_dim, head_dim)'),
    ), expect='overlap: S1'),
    # P given columns of its own after the O tiles instead of aliasing S: 640 columns at d=128
    Variant('tmem_p_not_aliased', 'ch7_tmem_plan', (
        ('plan[f"P{i}"] = (i * s + 32, p)',
         'plan[f"P{i}"] = (2 * s + 2 * head_dim + i * p, p)'),
    ), expect='overflow: P0'),
    # P packed right after the two statistics columns: off the 32-column granule
    Variant('tmem_p_misaligned', 'ch7_tmem_plan', (
        ('plan[f"P{i}"] = (i * s + 32, p)', 'plan[f"P{i}"] = (i * s + 2, p)'),
    ), expect='misaligned: P0'),
    # the allocation sized to the buffers (384 at d=64), not rounded up to a power of two
    Variant('tmem_alloc_not_power_of_two', 'ch7_tmem_plan', (
        ('    alloc = 32\n', '    alloc = need\n'),
    ), expect='not a power of two'),

    # ----------------------------------------------------------------- ch7_lazy_update
    # the test inverted: the first tile never sets a reference, every exponential is 2^inf
    Variant('lazy_test_inverted', 'ch7_lazy_update', (
        ('rescale = grow > tau', 'rescale = grow < tau'),
    ), expect='overflowed'),
    # "lazy" that rescales on every step: exact, but nothing avoided
    Variant('lazy_rescales_every_tile', 'ch7_lazy_update', (
        ('rescale = grow > tau', 'rescale = grow >= 0.0'),
    ), expect='rescaled on every tile'),
    # skips the multiplication but still moves the max: acc and l mix two references
    Variant('lazy_skip_still_moves_max', 'ch7_lazy_update', (
        ('    p = EXP2(s * qk_scale - m_i[:, None])',
         '    m_i = m_new\n    p = EXP2(s * qk_scale - m_i[:, None])'),
    ), expect='output O'),
    # the threshold in natural-log units while m is in base 2: rescales too often
    Variant('lazy_threshold_natural_log', 'ch7_lazy_update', (
        ('tau = math.log2(max_growth)', 'tau = math.log(max_growth)'),
    ), expect='natural-log units'),

    # ----------------------------------------------------------------- ch7_exp2_poly
    # no range reduction: one cubic asked to follow 2^x from -126 to 0
    Variant('exp2_no_range_reduction', 'ch7_exp2_poly', (
        ('n = torch.round(x)', 'n = torch.zeros_like(x)'),
    ), expect='grows with |x|'),
    # floor(x) puts f in [0, 1), but the coefficients were fitted on [-1/2, 1/2]
    Variant('exp2_floor_with_round_fit', 'ch7_exp2_poly', (
        ('n = torch.round(x)', 'n = torch.floor(x)'),
    ), expect='outside the interval'),
    # a quadratic: 1.7e-3, seventeen times the bound
    Variant('exp2_degree_too_low', 'ch7_exp2_poly', (
        ('coeffs = ch7.fit_exp2(3)', 'coeffs = ch7.fit_exp2(2)'),
    ), expect='raise the degree'),
    # the hardware exponential: what the exercise replaces
    Variant('exp2_is_torch_exp2', 'ch7_exp2_poly', (
        ('    return p * two_n\n', '    return torch.exp2(x)\n'),
    ), expect='hardware exp2'),
    # a quartic: below the bound, but one FMA a score more than needed
    Variant('exp2_degree_higher_than_needed', 'ch7_exp2_poly', (
        ('coeffs = ch7.fit_exp2(3)', 'coeffs = ch7.fit_exp2(4)'),
    ), expect='higher-degree polynomial'),

    # ----------------------------------------------------------------- ch7_exp2_poly_tl
    # the exponent bias off by one: every result half of 2^x
    Variant('exp2_tl_bias_off_by_one', 'ch7_exp2_poly_tl', (
        ('+ 127) << 23)', '+ 126) << 23)'),
    ), expect='factor of two'),
    # no clamp: -inf (a masked score) turns into garbage
    Variant('exp2_tl_no_clamp', 'ch7_exp2_poly_tl', (
        ('    x = tl.maximum(x, -126.0)\n', ''),
    ), expect='clamp x at -126'),
    # floor instead of round with the [-1/2, 1/2] coefficients
    Variant('exp2_tl_floor_with_round_fit', 'ch7_exp2_poly_tl', (
        ('n = tl.floor(x + 0.5)', 'n = tl.floor(x)'),
    ), expect='outside the interval'),
    Variant('exp2_tl_is_the_hardware_exp2', 'ch7_exp2_poly_tl', (
        ('    return p * two_n\n', '    return tl.math.exp2(x)\n'),
    ), expect='hardware exp2'),

    # PV reads P_t from S_t's columns while softmax t is still writing it (or before): the
    # scores are still there
    Variant('pv_before_softmax_wrote_p', 'ch7_roles_schedule', (
        ('        yield pipe.wait(bars.p_ready[t], j % 2)              # softmax t wrote P_t of '
         'step j\n', ''),
    ), expect='P read by the MMA before softmax'),
    # the PV MMA accumulates into O_t while (or before) the correction rescales it
    Variant('pv_skips_the_rescale', 'ch7_roles_schedule', (
        ('            yield pipe.wait(bars.o_ready[t], (j - 1) % 2)    # the correction rescaled '
         'O_t\n', '            pass\n'),
    ), expect='O rescaled while an MMA accumulates into it'),
    # QK_1(j) issued before PV_1(j-1): it overwrites P_1 (S_1's columns) before the PV read it
    Variant('qk_before_the_pv_that_reads_p', 'ch7_roles_schedule', (
        ('        if j > 0:\n'
         '            yield from pv(1, j - 1)\n'
         '            yield pipe.commit(bars.v_free[pipe.slot(j - 1)])  # both PVs read V of step '
         'j - 1\n'
         '        yield pipe.qk(1, j)\n',
         '        yield pipe.qk(1, j)\n'
         '        if j > 0:\n'
         '            yield from pv(1, j - 1)\n'
         '            yield pipe.commit(bars.v_free[pipe.slot(j - 1)])  # both PVs read V of step '
         'j - 1\n'),
    ), expect='overwritten before PV1'),
    # the K slot released when QK1 is issued, not when it has finished: the load warp refills it
    # while the QK MMAs may still read it
    Variant('release_k_with_arrive', 'ch7_roles_schedule', (
        ('yield pipe.commit(bars.k_free[s])', 'yield pipe.arrive(bars.k_free[s])'),
    ), expect='not pipe.arrive'),
    # the correction never tells the MMA warp that O_t is rescaled: PV_t(1) waits forever
    Variant('correction_never_signals_o_ready', 'ch7_roles_schedule', (
        ('                yield pipe.arrive(bars.o_ready[t])           # PV_t(j) may accumulate\n',
         ''),
    ), expect='deadlock'),
    # the correction reads O_t for the output before the last PV_t has finished
    Variant('finish_before_the_last_pv', 'ch7_roles_schedule', (
        ('        yield pipe.wait(bars.o_done[t], (n - 1) % 2)         # the last PV_t has '
         'finished\n', ''),
    ), expect='finish('),
    # one slot per ring: the loads no longer overlap the MMAs (serialisation below the bound)
    Variant('one_slot_per_ring', 'ch7_roles_schedule', (
        ('KV_STAGES = 2 ', 'KV_STAGES = 1 '),
    ), expect='The ring is too short'),
    # three slots per ring do not fit in shared memory with two Q tiles
    Variant('three_slots_do_not_fit', 'ch7_roles_schedule', (
        ('KV_STAGES = 2 ', 'KV_STAGES = 3 '),
    ), expect='shared memory'),

    # ----------------------------------------------------------------- ch7_ordering
    # P published before its tcgen05.st has completed: no tcgen05.wait::st after exp
    Variant('arrive_before_wait_st', 'ch7_ordering', (
        ('        yield pipe.wait_st()                       # tcgen05.wait::st: P has landed\n',
         ''),
    ), expect='before tcgen05.wait::st'),
    # the consumer's half missing: the tcgen05.ld of S right after the wait on s_ready
    Variant('no_fence_after_the_wait', 'ch7_ordering', (
        ('        yield pipe.fence_after()                   # the tcgen05.ld comes after that '
         'wait\n', ''),
    ), expect='no tcgen05.fence::after_thread_sync in between'),
    # the producer's half missing: stats published with no fence after the tcgen05.wait::st
    Variant('no_fence_before_the_arrive', 'ch7_ordering', (
        ('        yield pipe.fence_before()                  # order the stores before the '
         'arrive\n', ''),
    ), expect='no tcgen05.fence::before_thread_sync since'),
    # the row max from registers the tcgen05.ld has not filled yet
    Variant('rowmax_before_wait_ld', 'ch7_ordering', (
        ('        yield pipe.wait_ld()                       # tcgen05.wait::ld: the registers '
         'hold S\n', ''),
    ), expect='no tcgen05.wait::ld in between'),
    # tensor memory used before the allocation handshake
    Variant('no_allocation_handshake', 'ch7_ordering', (
        ('    yield pipe.wait(bars.tmem_ready, 0)            # the MMA warp\'s tcgen05.alloc is '
         'done\n', ''),
    ), expect='before the allocation handshake'),

    # one Q tile for the CTA: but each softmax warpgroup owns its own 128 rows
    Variant('one_q_tile', 'ch7_resources', (
        ('[("q", 2 * config.BLOCK_M * d * size)', '[("q", config.BLOCK_M * d * size)'),
    ), expect='one Q tile'),
    # the per-slot barriers forgotten
    Variant('no_ring_barriers', 'ch7_resources', (
        ('    smem += [(name, config.STAGES * 8) for name in ("k_full", "k_free", "v_full", '
         '"v_free")]\n', ''),
    ), expect='mbarrier arrays'),
    # the columns used, not what tcgen05.alloc takes (384 at d = 64, Triton allocates 512)
    Variant('tmem_not_a_power_of_two', 'ch7_resources', (
        ('    columns = max(32, 1 << (used - 1).bit_length())\n', '    columns = used\n'),
    ), expect='power of two'),
    # P counted in columns of its own: it lives in S's
    Variant('p_in_its_own_columns', 'ch7_resources', (
        ('    used = 2 * config.BLOCK_N + 2 * d ',
         '    used = 2 * config.BLOCK_N + config.BLOCK_N + 2 * d '),
    ), expect="live in S's columns"),
    # 15 warps, not padded to whole warpgroups: 480 threads
    Variant('threads_not_whole_warpgroups', 'ch7_resources', (
        ('    threads = 32 * (-(-warps // 4) * 4) ', '    threads = 32 * warps '),
    ), expect='whole warpgroups'),
    # the threads of the chapter's kernel, whatever the config: a correction of two warpgroups
    # makes 20 warps
    Variant('threads_hard_coded', 'ch7_resources', (
        ('    threads = 32 * (-(-warps // 4) * 4) ', '    threads = 512 '),
    ), expect='threads = 512, but the CTA has 640'),
    # the kernel's .maxnreg, whatever the config: 640 threads start with 96
    Variant('launch_registers_hard_coded', 'ch7_resources', (
        ('launch_registers=launch,', 'launch_registers=128,'),
    ), expect='launch_registers = 128, but every thread starts with 96'),
    # 65,536 / 640 = 102 is not what a thread gets: registers come 8 at a time
    Variant('launch_registers_not_rounded', 'ch7_resources', (
        ('    launch = 65536 // threads // 8 * 8 ', '    launch = 65536 // threads '),
    ), expect='launch_registers = 102'),
    # the kernel's correction budget, whatever the requests: the example's 32 leave 96
    Variant('correction_registers_hard_coded', 'ch7_resources', (
        ('correction_registers=correction)', 'correction_registers=104)'),
    ), expect='correction_registers = 104, but setmaxnreg gives the correction 96'),
    # the rest shared by one warpgroup even when the correction has two
    Variant('correction_shares_one_warpgroup', 'ch7_resources', (
        ('rest // (32 * config.CORRECTION_WARPS) // 8 * 8', 'rest // 128 // 8 * 8'),
    ), expect='shared by the correction\'s 256 threads'),
)
