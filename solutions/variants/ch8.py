"""Known-wrong answers to Chapter 8's exercises: each is the solution cell with one classic bug
edited in, and each must lose points to that bug."""
from flashbook.contract import Variant

VARIANTS = (
    # ------------------------------------------------------------------------- ch8_merge
    Variant('merge_without_max_shift', 'ch8_merge', (
        ('m_ref = torch.where(m == -math.inf, 0.0, m)', 'm_ref = torch.zeros_like(m)'),
        ('    return m, l, o', '    return m_ref, l, o'),
    ), expect='NaN'),                    # exact in exact arithmetic; exp(m) overflows at 1e4
    Variant('merge_weighted_by_l', 'ch8_merge', (
        ('w_a = l_a * torch.exp(m_a - m_ref)', 'w_a = l_a'),
        ('w_b = l_b * torch.exp(m_b - m_ref)', 'w_b = l_b'),
    ), expect='O of the merged shards'),  # l alone, not exp(LSE): each side's own max forgotten
    Variant('merge_nan_when_both_empty', 'ch8_merge', (
        ('m_ref = torch.where(m == -math.inf, 0.0, m)', 'm_ref = m'),
    ), expect='NaN'),
    # ------------------------------------------------------------------ ch8_split_kernel
    Variant('split_reads_past_cache_len', 'ch8_split_kernel', (
        ('hi = tl.minimum(lo + keys_per_split, cache_len)', 'hi = lo + keys_per_split'),
    ), expect='out-of-bounds'),          # past the length (NaN there), then past the cache
    Variant('split_wrong_kv_head', 'ch8_split_kernel', (
        ('heads = kv_head * GROUP + r', 'heads = r * H_KV + kv_head'),
    ), expect='values are wrong'),
    Variant('split_ranges_overlap', 'ch8_split_kernel', (
        ('lo = split * keys_per_split', 'lo = split * (keys_per_split - BLOCK_N)'),
    ), expect='values are wrong'),
    # ---------------------------------------------------------------- ch8_combine_kernel
    Variant('combine_without_max_shift', 'ch8_combine_kernel', (
        ('m_ref = tl.where(m == float("-inf"), 0.0, m)', 'm_ref = 0.0'),
    ), expect='combine kernel'),         # exp(LSE) overflows fp32 past 88
    Variant('combine_without_the_empty_guard', 'ch8_combine_kernel', (
        ('m_ref = tl.where(m == float("-inf"), 0.0, m)         # every split empty: no NaN',
         'm_ref = m'),
    ), expect='every split of (b=0, head=1) empty'),
    Variant('combine_not_normalised', 'ch8_combine_kernel', (
        ('/ tl.where(total > 0.0, total, 1.0)', '/ num_splits'),
    ), expect='combine kernel'),
    # ------------------------------------------------------------------------ ch8_chain
    Variant('chain_assumes_full_rows', 'ch8_chain', (
        ('width = min(cols, n - row * cols)', 'width = cols'),
    ), expect='deadlock'),               # the mesh kernel's bug: group_size = 6, 4 columns
    Variant('chain_skips_last_of_row', 'ch8_chain', (
        ('if col < width - 1:', 'if col < width - 2:'),
    ), expect='never received'),
    Variant('chain_reduce_is_a_tree', 'ch8_chain', (
        ('    cols = min(cols, n)\n',
         '    step = 1\n'
         '    while step < n:\n'
         '        if pe % (2 * step):\n'
         '            yield send(pe - step, state)\n'
         '            return None\n'
         '        if pe + step < n:\n'
         '            state = merge(state, (yield recv(pe + step)))\n'
         '        step *= 2\n'
         '    return state\n'
         '    cols = min(cols, n)\n'),
    ), expect='mesh hops'),              # as few steps, but messages to far PEs
    # ------------------------------------------------------------------------- ch8_tree
    Variant('tree_partner_past_the_group', 'ch8_tree', (
        ('if pe + step < n:', 'if pe + step <= n:'),
    ), expect='deadlock'),
    Variant('tree_is_a_chain', 'ch8_tree', (
        ('step *= 2', 'step += 1'),
    ), expect='tree_reduce'),
    # ----------------------------------------------------------------------- ch8_zigzag
    Variant('zigzag_second_chunk_off_by_one', 'ch8_zigzag', (
        ('return rank, 2 * world_size - 1 - rank', 'return rank, 2 * world_size - rank'),
    ), expect='exactly one rank'),
    Variant('zigzag_wrong_ranks', 'ch8_zigzag', (
        ('return rank, 2 * world_size - 1 - rank', 'return rank, world_size + rank'),
    ), expect='not balanced'),
    # ------------------------------------------------------------------------- ch8_ring
    Variant('ring_sends_k_not_v', 'ch8_ring', (
        ('[dist.P2POp(dist.isend, t, send_to) for t in (k, v, k_pos)]',
         '[dist.P2POp(dist.isend, t, send_to) for t in (k, k_pos)]'),
        ('[dist.P2POp(dist.irecv, t, recv_from) for t in nxt]',
         '[dist.P2POp(dist.irecv, t, recv_from) for t in nxt[::2]]'),
        ('k, v, k_pos = nxt', 'k, _, k_pos = nxt'),
    ), expect='output O'),               # V stays on its rank: O is wrong, LSE right
    Variant('ring_all_gathers_k_and_v', 'ch8_ring', (
        ('    rank, P = dist.get_rank(), dist.get_world_size()\n',
         '    P = dist.get_world_size()\n'
         '    ks, vs, ps = ([torch.empty_like(t) for _ in range(P)] for t in (k, v, k_pos))\n'
         '    for parts, t in ((ks, k), (vs, v), (ps, k_pos)):\n'
         '        dist.all_gather(parts, t)\n'
         '    return block_attention(q, torch.cat(ks, 2), torch.cat(vs, 2), q_pos, '
         'torch.cat(ps), causal)\n'
         '    rank, P = dist.get_rank(), dist.get_world_size()\n'),
    ), expect='all_gather'),
    Variant('ring_merges_own_block_twice', 'ch8_ring', (
        ('    state = (torch.full(rows, -math.inf, **like), torch.zeros(rows, **like), '
         'torch.zeros_like(q))',
         '    state = as_state(*block_attention(q, k, v, q_pos, k_pos, causal))'),
    ), expect='ring attention'),
    # ---------------------------------------------------------------------- ch8_ulysses
    Variant('ulysses_splits_heads_strided', 'ch8_ulysses', (
        ('parts = t.unflatten(1, (P, -1)).movedim(1, 0).contiguous()',
         'parts = t.unflatten(1, (-1, P)).movedim(2, 0).contiguous()'),
        ('return got.movedim(0, 1).flatten(1, 2)', 'return got.movedim(0, 2).flatten(1, 2)'),
    ), expect='output O'),               # heads j, j + P, ...: exact for G = 1, but under GQA
                                         # a rank's query heads read K/V heads it does not hold
    Variant('ulysses_returns_head_shards', 'ch8_ulysses', (
        ('return to_sequence(o), to_sequence(lse)', 'return o, lse'),
    ), expect='all-to-all back'),        # the second all-to-all forgotten
    Variant('ulysses_all_gathers_k_and_v', 'ch8_ulysses', (
        ('    def to_heads(t):',
         '    ks, vs, ps = ([torch.empty_like(t) for _ in range(P)] for t in (k, v, k_pos))\n'
         '    for parts, t in ((ks, k), (vs, v), (ps, k_pos)):\n'
         '        dist.all_gather(parts, t)\n'
         '    return block_attention(q, torch.cat(ks, 2), torch.cat(vs, 2), q_pos, '
         'torch.cat(ps), causal)\n\n'
         '    def to_heads(t):'),
    ), expect='all_gather'),             # right answer, but all-gather context parallelism
    Variant('ulysses_without_the_divisibility_check', 'ch8_ulysses', (
        ('    if k.shape[1] % P:\n', '    if False:\n'),
    ), expect='must raise ValueError'),  # MQA on 2 ranks: a RuntimeError from unflatten
    Variant('ulysses_sends_kv_repeated_for_the_query_heads', 'ch8_ulysses', (
        ('to_heads(k), to_heads(v)',
         'to_heads(k.repeat_interleave(q.shape[1] // k.shape[1], 1)), '
         'to_heads(v.repeat_interleave(q.shape[1] // k.shape[1], 1))'),
    ), expect='repeat_interleave'),      # right answer, G times K/V's bytes on the wire
)
