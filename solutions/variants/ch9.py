"""Known-wrong answers to Chapter 9's exercises: each is the solution cell with one classic bug
edited in, and each must lose points to that bug."""
from flashbook.contract import Variant

LSE2 = 'lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)'
LSE2_WRONG = 'lse2 = tl.where(lse == float("-inf"), float("inf"), lse)'

VARIANTS = (
    # ----------------------------------------------------------------- ch9_preprocess
    Variant('preprocess_sums_dO_only', 'ch9_preprocess', (
        ('tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)', 'tl.sum(do.to(tl.float32), 1)'),
    ), expect=', D:'),
    Variant('preprocess_unmasked_store', 'ch9_preprocess', (
        ('tl.store(Delta + h * total_q + t, delta, mask=t < total_q)',
         'tl.store(Delta + h * total_q + t, delta)'),
    ), expect='out-of-bounds store'),
    # ----------------------------------------------------------------- ch9_dkdv_step
    Variant('dkdv_D_missing', 'ch9_dkdv_step', (
        ('dsT = pT * (dpT - Di[None, :])', 'dsT = pT * dpT'),
    ), expect='dK'),
    Variant('dkdv_no_causal_mask', 'ch9_dkdv_step', (
        ('pT = tl.where(cols[:, None] <= rows[None, :] + diag, pT, 0.0)', 'pT = pT'),
    ), expect='causal'),
    Variant('dkdv_lse_in_wrong_base', 'ch9_dkdv_step', ((LSE2, LSE2_WRONG),), expect='dV'),
    # ----------------------------------------------------------------- ch9_dkdv_kernel
    Variant('dk_scale_twice', 'ch9_dkdv_kernel', (
        ('dk = dk * sm_scale', 'dk = dk * sm_scale * sm_scale'),
    ), expect='dK'),
    Variant('dk_scale_missing', 'ch9_dkdv_kernel', (
        ('dk = dk * sm_scale', 'dk = dk'),
    ), expect='dK'),
    Variant('gqa_grads_not_summed_over_the_group', 'ch9_dkdv_kernel', (
        ('for g in range(GROUP):', 'for g in range(1):'),
    ), expect='H_kv=2'),
    # ----------------------------------------------------------------- ch9_dq_step
    Variant('dq_D_missing', 'ch9_dq_step', (
        ('ds = p * (dp - Di[:, None])', 'ds = p * dp'),
    ), expect='dQ'),
    Variant('dq_no_causal_mask', 'ch9_dq_step', (
        ('p = tl.where((cols[None, :] <= rows[:, None] + diag) & kv_ok[None, :], p, 0.0)',
         'p = tl.where(kv_ok[None, :], p, 0.0)'),
    ), expect='causal'),
    Variant('dq_accumulated_in_fp16', 'ch9_dq_step', (
        ('dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION)',
         'dq = (dq + tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION)).to(tl.float16)'
         '.to(tl.float32)'),
    ), expect='dQ'),
    # ----------------------------------------------------------------- ch9_dq_kernel
    Variant('dq_lse_in_wrong_base', 'ch9_dq_kernel', ((LSE2, LSE2_WRONG),), expect='dQ'),
    Variant('dq_scale_twice', 'ch9_dq_kernel', (
        ('dq = dq * sm_scale', 'dq = dq * sm_scale * sm_scale'),
    ), expect='dQ'),
    Variant('dq_scale_missing', 'ch9_dq_kernel', (
        ('dq = dq * sm_scale', 'dq = dq'),
    ), expect='dQ'),
    # ----------------------------------------------------------------- ch9_autograd
    Variant('backward_forgets_the_scale', 'ch9_autograd', (
        ('ctx.meta = (max_seqlen_q, max_seqlen_k, causal, scale)',
         'ctx.meta = (max_seqlen_q, max_seqlen_k, causal, None)'),
    ), expect='gradcheck'),
    Variant('backward_forgets_causal', 'ch9_autograd', (
        ('ctx.meta = (max_seqlen_q, max_seqlen_k, causal, scale)',
         'ctx.meta = (max_seqlen_q, max_seqlen_k, False, scale)'),
    ), expect='gradcheck'),
    Variant('autograd_lse_left_differentiable', 'ch9_autograd', (
        ('        ctx.mark_non_differentiable(lse)\n', ''),
    ), expect='non-differentiable'),
    Variant('autograd_always_on_the_reference_path', 'ch9_autograd', (
        ('        if q.dtype == torch.float64:\n            o, lse = reference',
         '        if True:\n            o, lse = reference'),
        ('        if q.dtype == torch.float64:\n            dq, dk, dv = tiled',
         '        if True:\n            dq, dk, dv = tiled'),
    ), expect='must run the kernel path'),
    Variant('gradients_returned_in_the_wrong_order', 'ch9_autograd', (
        ('return dq, dk, dv, None', 'return dq, dv, dk, None'),
    ), expect='gradcheck'),
    # ----------------------------------------------------------------- ch9_dense
    Variant('dense_key_offsets_from_query_length', 'ch9_dense', (
        ('ch9.dense_offsets(S, N_k, q.device)', 'ch9.dense_offsets(S, N_q, q.device)'),
    ), expect='N_k=20'),
    Variant('dense_backward_drops_causal', 'ch9_dense', (
        ('cu_q, cu_k,\n                                       N_q, N_k, causal, scale)',
         'cu_q, cu_k,\n                                       N_q, N_k, False, scale)'),
    ), expect='causal'),
    Variant('dense_unpacks_gradients_without_transpose', 'ch9_dense', (
        ('dq, dk, dv = (ch9.from_packed(g, B, layout, S) for g in grads)',
         'dq, dk, dv = (g.reshape(t.shape) for g, t in zip(grads, (q, k, v)))'),
    ), expect='dQ'),
    Variant('dense_backward_ignores_the_layout', 'ch9_dense', (
        ('seq = 2 if layout == "bhnd" else 1', 'seq, layout = 2, "bhnd"'),
    ), expect='bnhd'),
    Variant('dense_lse_repacked_without_transpose', 'ch9_dense', (
        ('lse_p = ch9.lse_to_packed(lse, S)', 'lse_p = lse.reshape(lse.shape[1], -1)'),
    ), expect='lse must be'),
    Variant('dense_gradient_of_o_not_packed_like_q', 'ch9_dense', (
        ('ch9.to_packed(do, layout, S)', 'ch9.to_packed(do, layout)'),
    ), expect='dense, causal GQA'),
    Variant('dense_views_outside_the_function', 'ch9_dense', (
        ('    o, lse = DenseFlashAttentionFn.apply(q, k, v, causal, softmax_scale, layout)',
         '    q, k, v = (t.view(t.shape) for t in (q, k, v))       # views autograd records\n'
         '    o, lse = DenseFlashAttentionFn.apply(q, k, v, causal, softmax_scale, layout)'),
    ), expect='inside the Function'),
)
