"""Known-wrong answers to Chapter 4's exercises: each is the solution cell with one classic bug
edited in, and each must lose points to that bug."""
from flashbook.contract import Variant

VARIANTS = (
    # ----------------------------------------------------------------- ch4_varlen_kernel
    Variant('varlen_off_by_one_cu_seqlens', 'ch4_varlen_kernel', (
        ('seqlen_k = tl.load(CU_K + seq + 1) - k_start\n    rows',
         'seqlen_k = tl.load(CU_K + seq + 1) - k_start + 1\n    rows'),
    ), expect='canary'),                 # one key too many: the canary's first
    Variant('varlen_tail_leaks_into_next_sequence', 'ch4_varlen_kernel', (
        ('kv_ok = n_full + offs_n < seqlen_k\n',
         'kv_ok = n_full + offs_n < n_full + BLOCK_N\n'),
    ), expect='canary'),                 # the tail tile reads the neighbour's keys
    Variant('varlen_nan_on_empty_row', 'ch4_varlen_kernel', (
        ('o = acc / tl.where(has_key, l_i, 1.0)[:, None]',
         'o = acc / l_i[:, None]'),
    ), expect='NaN'),                    # 0 / 0 for a sequence without keys
    Variant('varlen_lse_in_base_2', 'ch4_varlen_kernel', (
        ('(m_i + tl.math.log2(l_i)) * 0.6931471805599453', 'm_i + tl.math.log2(l_i)'),
    ), expect='LSE'),
    # ----------------------------------------------------------------- ch4_masks
    Variant('varlen_ignores_program_tile', 'ch4_varlen_kernel', (
        ('m_block, pid_bh = program_tile(heads_per_section)',
         'm_block, pid_bh = tl.program_id(0), tl.program_id(1)'),
    ), expect='program_tile'),
    Variant('varlen_k_and_v_with_q_strides', 'ch4_varlen_kernel', (
        ('(k_start + offs_n)[None, :] * stride_kt + h * stride_kh',
         '(k_start + offs_n)[None, :] * stride_qt + h * stride_qh'),
        ('(k_start + offs_n)[:, None] * stride_vt + h * stride_vh',
         '(k_start + offs_n)[:, None] * stride_qt + h * stride_qh'),
    ), expect='K and V with their own strides'),
    Variant('varlen_max_starts_at_minus_1e4', 'ch4_varlen_kernel', (
        ('m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)',
         'm_i = tl.full([BLOCK_M], -1e4, tl.float32)'),
    ), expect='every score -96000'),
    Variant('mask_top_left_alignment', 'ch4_masks', (
        ('diag = rows[:, None] + (seqlen_k - seqlen_q)', 'diag = rows[:, None]'),
    ), expect='visible_pairs'),
    Variant('mask_window_edge_off_by_one', 'ch4_masks', (
        ('(cols[None, :] >= diag - window_left)', '(cols[None, :] > diag - window_left)'),
    ), expect='visible_pairs'),
    Variant('tiles_skip_one_too_many_at_the_diagonal', 'ch4_masks', (
        ('hi = tl.minimum(m0 + BLOCK_M + diag + window_right, seqlen_k)',
         'hi = tl.minimum(m0 + BLOCK_M + diag + window_right, seqlen_k) - BLOCK_N'),
    ), expect='would be skipped'),
    Variant('tiles_full_range_too_wide', 'ch4_masks', (
        ('end_full = tl.minimum(m0 + diag + window_right + 1, seqlen_k)',
         'end_full = tl.minimum(m0 + BLOCK_M + diag + window_right, seqlen_k)'),
    ), expect='would run without a mask'),
    # ----------------------------------------------------------------- ch4_masked_kernel
    Variant('masked_but_no_skipping', 'ch4_masked_kernel', (
        ('for start_n in range(full_hi, hi, BLOCK_N):',
         'for start_n in range(full_hi, seqlen_k, BLOCK_N):'),
    ), expect='nothing is skipped'),     # right, but loads every future tile
    Variant('masked_one_loop_masks_every_tile', 'ch4_masked_kernel', (
        ('    for start_n in range(lo, full_lo, BLOCK_N):                       # left band (windows)',
         '    for start_n in range(lo, hi, BLOCK_N):                   # every tile, masked'),
        ('for start_n in range(full_lo, full_hi, BLOCK_N):', 'for start_n in range(0, 0, BLOCK_N):'),
        ('for start_n in range(full_hi, hi, BLOCK_N):', 'for start_n in range(0, 0, BLOCK_N):'),
    ), expect='Full tiles run with MASKED=False'),   # right and skips, but masks full tiles
    Variant('masked_left_band_only_for_windows', 'ch4_masked_kernel', (
        ('    for start_n in range(lo, full_lo, BLOCK_N):                       # left band (windows)',
         '    for start_n in range(lo, full_lo if window_left < seqlen_k else lo, BLOCK_N):'),
    ), expect='random shapes'),          # a short sequence in a tall tile has a left band too
    Variant('masked_left_band_reads_v_one_key_late', 'ch4_masked_kernel', (
        ('# left band (windows)\n'
         '        cols = start_n + offs_n\n'
         '        acc, l_i, m_i = attn_step(acc, l_i, m_i, q, k_ptrs + start_n * stride_kt,\n'
         '                                  v_ptrs + start_n * stride_vt,',
         '# left band (windows)\n'
         '        cols = start_n + offs_n\n'
         '        acc, l_i, m_i = attn_step(acc, l_i, m_i, q, k_ptrs + start_n * stride_kt,\n'
         '                                  v_ptrs + (start_n + 1) * stride_vt,'),
    ), expect="window's left edge"),
    Variant('masked_band_without_mask', 'ch4_masked_kernel', (
        ('visible_pairs(rows, cols, seqlen_q, seqlen_k, window_left,\n'
         '                                                window_right), qk_scale, True, '
         'DOT_PRECISION)\n    attn_store_rows',
         'visible_pairs(rows, cols, seqlen_q, seqlen_k, window_left,\n'
         '                                                window_right), qk_scale, False, '
         'DOT_PRECISION)\n    attn_store_rows'),
    ), expect='canary'),                 # the band runs as a full tile: unmasked loads
    # ----------------------------------------------------------------- ch4_validate
    Variant('validate_accepts_decreasing_cu_seqlens', 'ch4_validate', (
        ('if min(steps) < 0:', 'if False:'),
    ), expect='decreases'),
    Variant('validate_accepts_int64_cu_seqlens', 'ch4_validate', (
        ('cu.dim() != 1 or cu.dtype != torch.int32', 'cu.dim() != 1'),
    ), expect='int64'),
    Variant('validate_skips_the_kv_shapes', 'ch4_validate', (
        ('if k.shape != v.shape or k.shape[1:] != q.shape[1:]:', 'if False:'),
    ), expect='k has another head'),
    Variant('validate_skips_the_head_count', 'ch4_validate', (
        ('if k.shape != v.shape or k.shape[1:] != q.shape[1:]:',
         'if k.shape != v.shape or k.shape[2] != q.shape[2]:'),
    ), expect='another head count'),
    Variant('validate_skips_the_head_dims', 'ch4_validate', (
        ('if q.shape[2] not in ch4.HEAD_DIMS:', 'if False:'),
    ), expect='head dimension 24'),
    Variant('validate_one_message_for_everything', 'ch4_validate', (
        ('def validate_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,\n'
         '                    window_size=(-1, -1)):\n',
         'def validate_varlen(*args, **kwargs):\n'
         '    try:\n'
         '        _validate_varlen(*args, **kwargs)\n'
         '    except ValueError:\n'
         '        raise ValueError("bad call: check q, k, v, cu_seqlens_q, cu_seqlens_k, "\n'
         '                         "max_seqlen_q, max_seqlen_k, window_size") from None\n\n\n'
         'def _validate_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,\n'
         '                     window_size=(-1, -1)):\n'),
    ), expect='say which one is wrong'),
    Variant('validate_trusts_max_seqlen', 'ch4_validate', (
        ('if value < max(steps):', 'if value < 0:'),
    ), expect='max_seqlen_q'),
    # ----------------------------------------------------------------- ch4_two_tiles
    Variant('two_tiles_b_a_whole_tile_late', 'ch4_two_tiles', (
        ('rows_b = rows_a + HALF', 'rows_b = rows_a + BLOCK_M'),
    ), expect='never wrote some of its rows'),   # the rows between A and B are never written
    Variant('two_tiles_b_masked_with_a_rows', 'ch4_two_tiles', (
        ('visible_pairs(rows_b, cols, seqlen_q, seqlen_k, window_left, window_right),\n'
         '            qk_scale, True, DOT_PRECISION)\n    attn_store_rows',
         'visible_pairs(rows_a, cols, seqlen_q, seqlen_k, window_left, window_right),\n'
         '            qk_scale, True, DOT_PRECISION)\n    attn_store_rows'),
    ), expect='visible_pairs of its own rows'),  # B's diagonal band masked as A's
    Variant('two_tiles_masked_but_no_skipping', 'ch4_two_tiles', (
        ('for start_n in range(full_hi, hi, BLOCK_N):',
         'for start_n in range(full_hi, seqlen_k, BLOCK_N):'),
    ), expect='nothing is skipped'),     # right, but loads every future tile, twice
    Variant('two_tiles_masks_full_tiles', 'ch4_two_tiles', (
        ('all_keys, all_keys[None, :], all_keys[None, :],\n            qk_scale, False,',
         'all_keys, all_keys[None, :], all_keys[None, :],\n            qk_scale, True,'),
    ), expect='Full tiles run with MASKED=False'),   # right, but pays for masks it needs not
)
