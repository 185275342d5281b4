"""Known-wrong answers to Chapter 5's exercises: each is the solution cell with one classic bug
edited in, and each must lose points to that bug."""
from flashbook.contract import Variant

VARIANTS = (
    # ----------------------------------------------------------------- ch5_mfold_kernel
    Variant('mfold_wrong_kv_head', 'ch5_mfold_kernel', (
        ('heads = kv_head * GROUP + (c + r) % GROUP             # each row',
         'heads = ((c + r) % GROUP) * H_KV + kv_head            # each row'),
    ), expect='output O'),               # query head h reads K/V head h % h_kv, not h // G
    # PackGQA's index arithmetic. The position without the first row's head c, m0 + r // GROUP
    # (the power-of-two fold's): right while GROUP divides BLOCK_M (every tile starts at head
    # 0); for G = 3 a tile that starts part-way into a position leaves pairs unwritten.
    Variant('mfold_position_from_the_tiles_first_position', 'ch5_mfold_kernel', (
        ('rows = m0 + (c + r) // GROUP', 'rows = m0 + r // GROUP'),
    ), expect='start part-way into a position'),
    # Heads that restart at 0 in every tile: the same mistake in the other index.
    Variant('mfold_heads_restart_at_each_tile', 'ch5_mfold_kernel', (
        ('heads = kv_head * GROUP + (c + r) % GROUP', 'heads = kv_head * GROUP + r % GROUP'),
    ), expect='start part-way into a position'),
    # The tail: rows past seqlen_q * GROUP (the last tile's, unless BLOCK_M divides it) stored
    # anyway, into the next sequence's tokens or past the end of O.
    Variant('mfold_tail_rows_stored', 'ch5_mfold_kernel', (
        ('o.to(O.dtype.element_ty), mask=ok[:, None])', 'o.to(O.dtype.element_ty))'),
    ), expect='out-of-bounds store'),
    Variant('mfold_repeats_kv_per_query_head', 'ch5_mfold_kernel', (
        ('    window = ch4.window_bounds(',
         '    k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))\n'
         '    window = ch4.window_bounds('),
    ), expect='once per query head'),    # right numbers, G times the K/V traffic
    Variant('mfold_left_band_only_for_windows', 'ch5_mfold_kernel', (
        ('    for start_n in range(lo, full_lo, BLOCK_N):                       # left band (windows)',
         '    for start_n in range(lo, full_lo if window_left < seqlen_k else lo, BLOCK_N):'),
    ), expect='random shapes'),          # a short sequence in a tall tile has a left band too
    Variant('mfold_max_starts_at_minus_1e4', 'ch5_mfold_kernel', (
        ('m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)',
         'm_i = tl.full([BLOCK_M], -1e4, tl.float32)'),
    ), expect='every score -96000'),
    # A running max kept in float16 (rounded after every full tile): P and l were computed with
    # the unrounded max, the next tile's rescale exp2(m_old - m_new) uses the rounded one, so
    # every later tile is weighted wrong (by ~1e-4 in an fp32 run).
    Variant('mfold_running_max_in_float16', 'ch5_mfold_kernel', (
        ('m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)',
         'm_i = tl.full([BLOCK_M], float("-inf"), tl.float16)'),
        ('window_right), qk_scale, True, DOT_PRECISION)\n    all_keys',
         'window_right), qk_scale, True, DOT_PRECISION)\n'
         '        m_i = m_i.to(tl.float16)\n    all_keys'),
        ('                                  qk_scale, False, DOT_PRECISION)\n',
         '                                  qk_scale, False, DOT_PRECISION)\n'
         '        m_i = m_i.to(tl.float16)\n'),
        ('window_right), qk_scale, True, DOT_PRECISION)\n    ok =',
         'window_right), qk_scale, True, DOT_PRECISION)\n'
         '        m_i = m_i.to(tl.float16)\n    ok ='),
    ), expect='values are wrong'),
    Variant('mfold_left_band_reads_v_one_key_late', 'ch5_mfold_kernel', (
        ('# left band (windows)\n'
         '        cols = start_n + offs_n\n'
         '        acc, l_i, m_i = attn_step(acc, l_i, m_i, q, k_ptrs + start_n * stride_kt,\n'
         '                                  v_ptrs + start_n * stride_vt,',
         '# left band (windows)\n'
         '        cols = start_n + offs_n\n'
         '        acc, l_i, m_i = attn_step(acc, l_i, m_i, q, k_ptrs + start_n * stride_kt,\n'
         '                                  v_ptrs + (start_n + 1) * stride_vt,'),
    ), expect='left edge'),
    # ----------------------------------------------------------------- ch5_two_tiles
    Variant('two_tiles_b_a_whole_program_late', 'ch5_two_tiles', (
        ('rows_b = m0 + (c + HALF + r) // GROUP', 'rows_b = m0 + (c + BLOCK_M + r) // GROUP'),
    ), expect='never wrote some of its rows'),   # the rows between A and B: never written
    # The power-of-two fold's shortcut: B's heads are A's only when GROUP divides HALF.
    Variant('two_tiles_b_reuses_a_heads', 'ch5_two_tiles', (
        ('heads_b = kv_head * GROUP + (c + HALF + r) % GROUP', 'heads_b = heads_a'),
    ), expect='start part-way into a position'),
    Variant('two_tiles_b_masked_with_a_positions', 'ch5_two_tiles', (
        ('vis_b = visible_pairs(rows_b, cols,', 'vis_b = visible_pairs(rows_a, cols,'),
    ), expect='visible_pairs of its own positions'),   # B's diagonal band masked as A's
    Variant('two_tiles_loads_past_the_diagonal', 'ch5_two_tiles', (
        ('for start_n in range(full_hi, hi, BLOCK_N):',
         'for start_n in range(full_hi, seqlen_k, BLOCK_N):'),
    ), expect='hold no visible pair'),   # right, but loads every future tile, twice
    Variant('two_tiles_store_lse_in_base_2', 'ch5_two_tiles', (
        ('(m_i + tl.math.log2(l_i)) * 0.6931471805599453', 'm_i + tl.math.log2(l_i)'),
    ), expect='LSE'),                    # store_folded_rows: the LSE in natural log
    # ----------------------------------------------------------------- ch5_cache_rows
    Variant('page_lookup_off_by_one', 'ch5_cache_rows', (
        ('keys // rows_per_seq,', 'keys // rows_per_seq + 1,'),
    ), expect='cache_rows, paged'),
    Variant('page_offset_ignores_position_in_page', 'ch5_cache_rows', (
        ('return page * rows_per_seq + keys % rows_per_seq',
         'return page * rows_per_seq + keys'),
    ), expect='cache_rows, paged'),
    Variant('page_lookup_once_per_tile', 'ch5_cache_rows', (
        ('keys // rows_per_seq,', 'tl.min(keys, 0) // rows_per_seq + 0 * keys,'),
    ), expect='tiles of 64'),            # right while a tile sits in one page
    Variant('page_lookup_past_the_length', 'ch5_cache_rows', (
        ('mask=keys < cache_len, other=0)', ')'),
    ), expect='cache_rows, paged'),      # reads the table past its last entry
    # ----------------------------------------------------------------- ch5_decode_kernel
    Variant('decode_reads_past_cache_seqlens', 'ch5_decode_kernel', (
        ('            cols < cache_len, visible_pairs(t, cols, n_new, cache_len, window_left, '
         'window_right),\n            qk_scale, True, DOT_PRECISION)\n    ok',
         '            cols < cache_len + BLOCK_N, visible_pairs(t, cols, n_new, cache_len + BLOCK_N,'
         ' window_left, window_right),\n            qk_scale, True, DOT_PRECISION)\n    ok'),
    ), expect='NaN'),                    # the last partial page's slots past the length
    Variant('decode_max_starts_at_minus_1e4', 'ch5_decode_kernel', (
        ('m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)',
         'm_i = tl.full([BLOCK_M], -1e4, tl.float32)'),
    ), expect='every score -96000'),
    Variant('decode_running_max_in_float16', 'ch5_decode_kernel', (
        ('m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)',
         'm_i = tl.full([BLOCK_M], float("-inf"), tl.float16)'),
        ('            qk_scale, True, DOT_PRECISION)\n    all_keys',
         '            qk_scale, True, DOT_PRECISION)\n        m_i = m_i.to(tl.float16)\n'
         '    all_keys'),
        ('            all_keys, all_keys[None, :], qk_scale, False, DOT_PRECISION)\n',
         '            all_keys, all_keys[None, :], qk_scale, False, DOT_PRECISION)\n'
         '        m_i = m_i.to(tl.float16)\n'),
        ('            qk_scale, True, DOT_PRECISION)\n    ok =',
         '            qk_scale, True, DOT_PRECISION)\n        m_i = m_i.to(tl.float16)\n'
         '    ok ='),
    ), expect='values are wrong'),
    Variant('decode_wrong_kv_head', 'ch5_decode_kernel', (
        ('heads = kv_head * GROUP + r % GROUP', 'heads = (r % GROUP) * H_KV + kv_head'),
    ), expect='values are wrong'),
    # ----------------------------------------------------------------- ch5_validate
    Variant('validate_trusts_the_page_table', 'ch5_validate', (
        ('if any(not 0 <= p < k_cache.shape[0] for p in used):', 'if False:'),
    ), expect='page table entry'),
    Variant('validate_decode_skips_the_head_dims', 'ch5_validate', (
        ('    if d not in ch5.HEAD_DIMS:\n', '    if False:\n'),
    ), expect='head dimension 24'),
    Variant('validate_decode_skips_the_page_size', 'ch5_validate', (
        ('        if rows_per_seq % 16:', '        if False:'),
    ), expect='pages of 8'),
    Variant('validate_decode_skips_the_v_cache_shape', 'ch5_validate', (
        ('if v_cache.shape != k_cache.shape or k_cache.shape[3] != d', 'if k_cache.shape[3] != d'),
    ), expect='v_cache holds fewer slots'),
    Variant('validate_decode_rejects_unused_pages', 'ch5_validate', (
        ('used = row[:-(-n // rows_per_seq)]', 'used = row'),
    ), expect='-1 in the entries past'),
    Variant('validate_decode_capacity_from_max_len', 'ch5_validate', (
        ('capacity = block_table.shape[1] * rows_per_seq', 'capacity = 1 << 30'),
    ), expect='paged capacity'),
    Variant('validate_trusts_cache_seqlens', 'ch5_validate', (
        ('or max(lengths, default=0) > capacity', ''),
    ), expect='beyond the cache'),
)
