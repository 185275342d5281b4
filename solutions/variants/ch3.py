"""Known-wrong answers to Chapter 3's exercises: each is the solution cell with one classic bug
edited in, and each must lose points to that bug."""
from flashbook.contract import Variant

VARIANTS = (
    Variant('softmax_no_rescale_of_l', 'ch3_softmax_kernel', (
        ('l_vec = l_vec * tl.exp(m_vec - m_ref) + tl.exp(x - m_ref)',
         'l_vec = l_vec + tl.exp(x - m_ref)'),
    ), expect='multiply l by exp(m_old - m_new)'),
    Variant('softmax_unmasked_load', 'ch3_softmax_kernel', (
        ('x = tl.load(x_row + start + cols, mask=start + cols < n_cols, other=float("-inf"))\n',
         'x = tl.load(x_row + start + cols)\n'),
    ), expect='out-of-bounds load'),
    Variant('softmax_nan_on_empty_rows', 'ch3_softmax_kernel', (
        ('m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)',
         'm_ref = m_new'),
        ('m_safe = tl.where(m == float("-inf"), 0.0, m)',
         'm_safe = m'),
    ), expect='NaN'),
    # ----------------------------------------------------------------- ch3_tile_load
    Variant('tile_load_without_mask', 'ch3_tile_load', (
        ('tile = tl.load(X + rows[:, None] * stride_xr + cols[None, :] * stride_xc, mask=ok, other=0.0)',
         'tile = tl.load(X + rows[:, None] * stride_xr + cols[None, :] * stride_xc)'),
    ), expect='out-of-bounds load'),     # the tiles at the bottom and right edges stick out
    Variant('tile_load_swapped_strides', 'ch3_tile_load', (
        ('X + rows[:, None] * stride_xr + cols[None, :] * stride_xc',
         'X + rows[:, None] * stride_xc + cols[None, :] * stride_xr'),
    ), expect='values are wrong'),       # in bounds for (37, 20), but the wrong elements
    Variant('tile_load_masks_rows_only', 'ch3_tile_load', (
        ('ok = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)',
         'ok = rows[:, None] < n_rows'),
    ), expect='out-of-bounds'),          # columns past n_cols run into the next row, then off the end
    # ----------------------------------------------------------------- ch3_attn_tile
    Variant('attn_missing_rescale_of_acc', 'ch3_attn_tile', (
        ('acc = acc * alpha[:, None]',
         'acc = acc'),
    ), expect='accumulator acc'),        # named by the tile check: attn_update, its acc
    Variant('attn_missing_rescale_of_l', 'ch3_attn_tile', (
        ('l_i = l_i * alpha + tl.sum(p, 1)',
         'l_i = l_i + tl.sum(p, 1)'),
    ), expect='running sum l'),
    Variant('attn_no_score_mask_in_tail', 'ch3_attn_tile', (
        ('s = tl.where(kv_ok[None, :], s, float("-inf"))',
         's = s'),
    ), expect='must be -inf'),           # attn_scores: keys past N_k keep score 0
    Variant('attn_update_unmasked_v_load', 'ch3_attn_tile', (
        ('v = tl.load(v_ptrs, mask=kv_ok[:, None], other=0.0)',
         'v = tl.load(v_ptrs)'),
    ), expect='of `attn_update`), program id'),   # the guard names the V load in attn_update
    Variant('attn_unmasked_tail_loads', 'ch3_attn_tile', (
        ('kT = tl.load(k_ptrs, mask=kv_ok[None, :], other=0.0)',
         'kT = tl.load(k_ptrs)'),
        ('v = tl.load(v_ptrs, mask=kv_ok[:, None], other=0.0)',
         'v = tl.load(v_ptrs)'),
    ), expect='out-of-bounds load'),
    Variant('attn_scale_rounded_to_input_dtype', 'ch3_attn_kernel', (
        ('                mask=row_ok[:, None], other=0.0)                      # read BLOCK_M*d, once\n',
         '                mask=row_ok[:, None], other=0.0)\n    q = q * (qk_scale * tl.full([1, 1], 1.0, tl.float32)).to(q.dtype)\n'),
        ('start_n, N_k, qk_scale, offs_n',
         'start_n, N_k, 1.0, offs_n'),
        ('n_full, N_k, qk_scale, offs_n',
         'n_full, N_k, 1.0, offs_n'),
    ), expect='LSE'),
    Variant('attn_exp_instead_of_exp2', 'ch3_attn_tile', (
        ('p = tl.math.exp2(s * qk_scale - m_new[:, None])',
         'p = tl.exp(s * qk_scale - m_new[:, None])'),
    ), expect='attn_update'),
    Variant('attn_no_final_normalisation', 'ch3_attn_kernel', (
        ('o = acc / tl.where(has_key, l_i, 1.0)[:, None]',
         'o = acc'),
    ), expect='output O'),
    Variant('attn_lse_left_in_base_2', 'ch3_attn_kernel', (
        ('(m_i + tl.math.log2(l_i)) * 0.6931471805599453',
         '(m_i + tl.math.log2(l_i))'),
    ), expect='LSE: '),
    Variant('attn_forgets_the_tail_tile', 'ch3_attn_kernel', (
        ('if n_full < N_k:',
         'if n_full < 0:'),
    ), expect='16x64 tiles, output O'),
    Variant('attn_unmasked_output_store', 'ch3_attn_kernel', (
        ('o.to(O.dtype.element_ty), mask=row_ok[:, None])',
         'o.to(O.dtype.element_ty))'),
    ), expect='out-of-bounds store'),
    Variant('two_tiles_b_repeats_a', 'ch3_two_tiles_kernel', (
        ('rows_b = rows_a + HALF',
         'rows_b = rows_a'),
    ), expect='contains NaN'),
    Variant('two_tiles_b_scores_with_q_a', 'ch3_two_tiles_kernel', (
        ('acc_a, l_a, m_a, q_a, acc_b, l_b, m_b, q_b, k_ptrs + start_n * stride_kn',
         'acc_a, l_a, m_a, q_a, acc_b, l_b, m_b, q_a, k_ptrs + start_n * stride_kn'),
    ), expect='Wrong rows: 16-31, 48-63'),
    Variant('two_tiles_forgets_the_tail_tile', 'ch3_two_tiles_kernel', (
        ('if n_full < N_k:',
         'if n_full < 0:'),
    ), expect='32x64 tiles, output O'),
    Variant('two_tiles_unmasked_output_store', 'ch3_two_tiles_kernel', (
        ('o.to(O_bh.dtype.element_ty),\n             mask=ok[:, None])',
         'o.to(O_bh.dtype.element_ty))'),
    ), expect='out-of-bounds store'),
    Variant('two_tiles_lse_left_in_base_2', 'ch3_two_tiles_kernel', (
        ('(m_i + tl.math.log2(l_i)) * 0.6931471805599453',
         '(m_i + tl.math.log2(l_i))'),
    ), expect='LSE: '),
    Variant('merge_unmasked_loads', 'ch3_merge_kernel', (
        ('oa = tl.load(O_a + offs, mask=ok[:, None], other=0.0)',
         'oa = tl.load(O_a + offs)'),
    ), expect='out-of-bounds load'),
    Variant('merge_nan_when_both_sides_empty', 'ch3_merge_kernel', (
        ('m_safe = tl.where(m == float("-inf"), 0.0, m)',
         'm_safe = m'),
    ), expect='NaN'),
    Variant('attn_max_starts_at_minus_1e4', 'ch3_attn_kernel', (
        ('m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)',
         'm_i = tl.full([BLOCK_M], -1e4, tl.float32)'),
    ), expect='-96000'),
    Variant('attn_has_key_when_l_is_zero', 'ch3_attn_kernel', (
        ('has_key = l_i > 0.0', 'has_key = l_i >= 0.0'),
    ), expect='no key at all'),
    Variant('attn_batch_and_head_offsets_swapped', 'ch3_attn_kernel', (
        ('q = tl.load(Q + b * stride_qb + h * stride_qh', 'q = tl.load(Q + h * stride_qb + b * stride_qh'),
    ), expect='out-of-bounds load'),
    Variant('attn_q_assumed_contiguous', 'ch3_attn_kernel', (
        ('offs_m[:, None] * stride_qn + offs_d[None, :],\n                mask=row_ok',
         'offs_m[:, None] * HEAD_DIM + offs_d[None, :],\n                mask=row_ok'),
    ), expect='strided'),
    Variant('merge_naive_logsumexp', 'ch3_merge_kernel', (
        ('lse = m_safe + tl.log(total)', 'lse = tl.log(tl.exp(la) + tl.exp(lb))'),
    ), expect='large LSE'),
    Variant('merge_plain_average', 'ch3_merge_kernel', (
        ('o = (oa * (wa * inv)[:, None] + ob * (wb * inv)[:, None])',
         'o = 0.5 * (oa + ob)'),
    ), expect='merge kernel, case'),
    # A float16 running state (cast back after every K/V tile, as `.to(q.dtype)` would do): its
    # error grows with N_k and the logits' range; the fp32 long-row case and the -96000 row see it.
    Variant('attn_accumulator_in_float16', 'ch3_attn_kernel', (
        ('acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)',
         'acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float16)'),
        ('                                  False, DOT_PRECISION)\n',
         '                                  False, DOT_PRECISION)\n        acc = acc.to(tl.float16)\n'),
    ), expect='float32), 16x16 tiles, output O'),
    Variant('two_tiles_accumulator_a_in_float16', 'ch3_two_tiles_kernel', (
        ('acc_a = tl.zeros([HALF, HEAD_DIM], tl.float32)', 'acc_a = tl.zeros([HALF, HEAD_DIM], tl.float16)'),
        ('offs_n, False, DOT_PRECISION)\n', 'offs_n, False, DOT_PRECISION)\n        acc_a = acc_a.to(tl.float16)\n'),
    ), expect='float32), 32x16 tiles, output O'),
    Variant('two_tiles_running_max_a_in_float16', 'ch3_two_tiles_kernel', (
        ('m_a = tl.full([HALF], float("-inf"), tl.float32)', 'm_a = tl.full([HALF], float("-inf"), tl.float16)'),
        ('offs_n, False, DOT_PRECISION)\n', 'offs_n, False, DOT_PRECISION)\n        m_a = m_a.to(tl.float16)\n'),
    ), expect='float32), 32x16 tiles, LSE'),
    Variant('two_tiles_running_sum_b_in_float16', 'ch3_two_tiles_kernel', (   # rounded to fp16
        ('offs_n, False, DOT_PRECISION)\n',
         'offs_n, False, DOT_PRECISION)\n        l_b = l_b.to(tl.float16).to(tl.float32)\n'),
    ), expect='LSE'),
    Variant('two_tiles_max_starts_at_minus_1e4', 'ch3_two_tiles_kernel', (
        ('m_b = tl.full([HALF], float("-inf"), tl.float32)', 'm_b = tl.full([HALF], -1e4, tl.float32)'),
    ), expect='-96000'),
)
