"""Chapter 8's graded checks: the merge of partial states (property checks), split-KV decode
(the partial and the combine kernels), the chain and tree reductions on a 2-D mesh (message
counts, critical path, the deadlock), the zig-zag layout and ring attention over gloo."""
from __future__ import annotations

import math
import random

import torch

from flashbook import oob
from flashbook.case_sweeps import decode_sweep
from flashbook.cases import seeded
from flashbook.check import CheckFailure, assert_close, no_nan, report, require_implemented, \
    run_student
from flashbook.device import current
from flashbook.sharding import ShardedCase

from . import mesh, ring
from .launch import launch_combine, launch_split_kv, split_config
from .state import block_attention, merge_states, state_of

__all__ = ["check_merge", "check_split_kv", "check_chain_reduce", "check_tree_reduce",
           "check_zigzag", "check_ring_attention", "merge_cases", "split_cases", "mesh_cases",
           "ring_cases"]

F64 = torch.float64


# ------------------------------------------------------------------ Exercise 1: the merge

def _lse(st):
    m, l, _ = st
    return m + torch.log(l)


def _shards(seed: int, rows: int = 6, keys: int = 24, d: int = 4, parts: int = 3,
            shift: float = 0.0, empty: int | None = 1):
    """Scores (rows, keys) cut into ``parts`` key shards (shard ``empty`` gets no key), their
    states, and the whole row's (O, LSE), float64."""
    s = seeded((rows, keys), seed, F64, scale=3.0, device="cpu") + shift
    v = seeded((keys, d), seed + 1, F64, device="cpu")
    owner = torch.arange(keys) % parts
    if empty is not None:
        owner[owner == empty] = (empty + 1) % parts
    states = []
    for p in range(parts):
        cols = (owner == p).nonzero().flatten()
        states.append(state_of(s[:, cols], v[cols]) if len(cols) else
                      (torch.full((rows,), -math.inf, dtype=F64), torch.zeros(rows, dtype=F64),
                       torch.zeros(rows, d, dtype=F64)))
    return states, torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)


def _call_merge(merge, a, b, what):
    out = run_student(merge, a, b, what=what)
    if not (isinstance(out, tuple) and len(out) == 3 and
            all(isinstance(t, torch.Tensor) for t in out)):
        raise CheckFailure(f"{what}: merge must return a tuple (m, l, O) of tensors, got "
                           f"{type(out).__name__}.")
    for t, name in zip(out, "mlO"):
        if torch.isnan(t).any():
            raise CheckFailure(f"{what}: {name} contains NaN. Typical causes: exp(m_a - m) with "
                               "both m = -inf (-inf - (-inf) = NaN), or exp(m) without the max "
                               "shift overflowing to inf (inf / inf = NaN).")
    return out


def _same(got, want, what, atol=1e-12):
    for g, w, name in zip(got, want, ("m", "l", "O")):
        assert_close(g, w, what=f"{what}, {name}", dims=("row", "col")[:g.dim()], dtype=F64,
                     atol=atol, rtol=atol)


def merge_cases(hidden: bool = False):
    """(name, seed, score shift, parts, empty shard)."""
    cases = [("three shards, one empty", 1, 0.0, 3, 1), ("logits near +1e4", 2, 1e4, 3, None),
             ("logits near -1e4", 3, -1e4, 2, None)]
    if hidden:
        cases += [("five shards, one empty", 4, 0.0, 5, 3), ("logits near +800", 5, 800.0, 4, 0),
                  ("two shards", 6, 50.0, 2, None)]
    return cases


def check_merge(merge, hidden: bool = False):
    """Exercise 1: merging shards gives the whole row's (O, LSE); the merge is commutative and
    associative, (-inf, 0, 0) is its identity (two empty sides give it back, no NaN), and huge
    logits and huge gaps between the sides neither overflow nor lose the larger side."""
    require_implemented(merge, "merge")
    n = 0
    for name, seed, shift, parts, empty in merge_cases(hidden):
        what = f"merge, case '{name}'"
        states, o_full, lse_full = _shards(seed, parts=parts, shift=shift, empty=empty)
        acc = states[0]
        for st in states[1:]:
            acc = _call_merge(merge, acc, st, what + ", shards merged left to right")
        assert_close(acc[2], o_full, what=what + ", O of the merged shards", dims=("row", "col"),
                     dtype=F64, atol=1e-10, rtol=1e-10,
                     hint="weight each side by l * exp(m_side - m) with m the larger max: "
                          "exp(LSE) in the (O, LSE) form, not l alone.")
        assert_close(_lse(acc), lse_full, what=what + ", m + log(l) of the merged shards",
                     dims=("row",), dtype=F64, atol=1e-10, rtol=1e-10,
                     hint="m = max(m_a, m_b); l = l_a exp(m_a - m) + l_b exp(m_b - m).")
        a, b, c = states[0], states[1], states[-1]
        _same(_call_merge(merge, a, b, what + ", merge(a, b)"),
              _call_merge(merge, b, a, what + ", merge(b, a)"), what + ": merge(a, b) vs (b, a)")
        left = _call_merge(merge, _call_merge(merge, a, b, what), c, what)
        right = _call_merge(merge, a, _call_merge(merge, b, c, what), what)
        assert_close(_lse(left), _lse(right), what=what + ": (a + b) + c vs a + (b + c), LSE",
                     dims=("row",), dtype=F64, atol=1e-12, rtol=1e-12)
        assert_close(left[2], right[2], what=what + ": (a + b) + c vs a + (b + c), O",
                     dims=("row", "col"), dtype=F64, atol=1e-12, rtol=1e-12)
        n += 3
    rows, d = 4, 3
    empty = (torch.full((rows,), -math.inf, dtype=F64), torch.zeros(rows, dtype=F64),
             torch.zeros(rows, d, dtype=F64))
    states, _, _ = _shards(7, rows=rows, d=d, parts=2, empty=None)
    got = _call_merge(merge, empty, empty, "merge(identity, identity)")
    if not (torch.all(got[0] == -math.inf) and torch.all(got[1] == 0) and torch.all(got[2] == 0)):
        raise CheckFailure(f"merge(identity, identity) must be (-inf, 0, 0) (no key on either "
                           f"side), got m={got[0].tolist()}, l={got[1].tolist()}.")
    for st, side in ((_call_merge(merge, states[0], empty, "merge(a, identity)"), "right"),
                     (_call_merge(merge, empty, states[0], "merge(identity, a)"), "left")):
        _same(st, states[0], f"merge with the identity on the {side}", atol=1e-14)
    big = tuple(t.clone() for t in states[0])
    big[0].add_(2e4)
    got = _call_merge(merge, big, states[1], "merge(a, b) with m_a - m_b = 2e4")
    _same(got, big, "merge(a, b) with m_a - m_b = 2e4 (b's weight is exp(-2e4) = 0)", atol=1e-12)
    n += 4
    f32 = tuple(t.float() for t in states[0]), tuple(t.float() for t in states[1])
    got = _call_merge(merge, *f32, "merge of float32 states")
    if got[2].dtype != torch.float32:
        raise CheckFailure(f"merge of float32 states returned O in {got[2].dtype}: keep the "
                           "inputs' dtype.")
    report("merge (commutative, associative, identity, huge logits)", n + 1, hidden=hidden)


# ------------------------------------------------------------ Exercise 2: split-KV decode

_SPLIT_HINT = ("program (pid_bh, split) covers keys [split * keys_per_split, min((split + 1) * "
               "keys_per_split, cache_len)); row r < GROUP is query head kv_head * GROUP + r.")


def split_cases(hidden: bool = False):
    """(name, B, h_q, h_kv, d, lengths, max_len, num_splits, dtype, logit boost, BLOCK_N or None:
    the launcher's)."""
    cases = [("G=4, two sequences, 3 splits (empty ones for the short sequence)", 2, 8, 2, 16,
              (40, 1), 64, 3, torch.float32, 1.0),
             ("MQA (G=4), float16, logits x30", 1, 4, 1, 16, (70,), 80, 4, torch.float16, 30.0),
             ("G=1, one split (no split at all)", 2, 2, 2, 16, (33, 17), 48, 1, torch.float32,
              1.0)]
    if hidden:
        cases += [("G=2, h_kv=3, d=32, 5 splits", 2, 6, 3, 32, (50, 23), 80, 5, torch.float32,
                   1.0),
                  ("G=8, more splits than tiles", 1, 8, 1, 16, (20,), 32, 6, torch.float32, 1.0)]
    cases = [c + (None,) for c in cases]
    # then seeded random problems with the H200's 128-key tile (in CPU mode too): lengths next
    # to its edges, G 1-8, 1-8 splits (a split's keys are a whole number of tiles, so short
    # sequences leave splits empty)
    block_n = split_config((9, 0))[0]
    rng = random.Random(80 if hidden else 8)
    cases += [(c.name, c.B, c.h_q, c.h_kv, 16, c.lengths, c.max_len, rng.randint(1, 8),
               torch.float32, 1.0, block_n)
              for c in decode_sweep("random", seed=80 if hidden else 8, n=3 if hidden else 2,
                                    block_n=block_n, tiles=3)]
    return cases


def _cache(B, max_len, h_kv, d, lengths, dtype, seed):
    k = seeded((B, max_len, h_kv, d), seed, dtype)
    v = seeded((B, max_len, h_kv, d), seed + 1, dtype)
    for b, n in enumerate(lengths):
        k[b, n:], v[b, n:] = math.nan, math.nan            # canaries: reading one poisons O
    return k, v


def _check_combine(combine_kernel, hidden: bool) -> int:
    """The combine kernel alone, on random partials with empty splits and huge LSEs."""
    n = 0
    shapes = [(2, 3, 4, 16), (1, 2, 5, 32)] + ([(2, 2, 7, 16)] if hidden else [])
    for i, (B, H, S, d) in enumerate(shapes):
        o_part = seeded((B, H, S, d), 60 + i, torch.float32)
        lse_part = seeded((B, H, S), 70 + i, torch.float32, scale=5.0)
        lse_part[0, 0, 1:] = -math.inf                            # only split 0
        lse_part[-1, -1, :] += 500.0                              # exp(lse) overflows fp32
        o_part[0, 0, 1:] = 0.0
        empty = B * H > 2                                          # a row whose splits are all
        if empty:                                                  # empty: O = 0, LSE = -inf
            lse_part[0, 1, :], o_part[0, 1] = -math.inf, 0.0
        what = (f"combine kernel, partials (B={B}, h_q={H}, splits={S}, d={d}"
                + (", every split of (b=0, head=1) empty" if empty else "") + ")")
        o, lse = run_student(launch_combine, combine_kernel, o_part, lse_part, what=what,
                             guard=True)
        no_nan(o, what + ", O")
        want_lse = torch.logsumexp(lse_part.double().cpu(), -1)
        w = torch.exp(lse_part.double().cpu() - want_lse[..., None]).nan_to_num(0.0)
        want_o = (w[..., None] * o_part.double().cpu()).sum(-2)
        assert_close(o, want_o, what=what + ", O", dims=("b", "head", "col"),
                     dtype=torch.float32, hint="w_s = exp(LSE_s - max_s LSE_s); O = sum_s w_s O_s "
                     "/ sum_s w_s; empty splits (LSE = -inf) weigh 0.")
        assert_close(lse, want_lse.float(), what=what + ", LSE", dims=("b", "head"),
                     dtype=torch.float32, atol=2e-4, rtol=1e-5,
                     hint="LSE = max + log(sum_s exp(LSE_s - max)).")
        n += 1
    return n


def _count_k_loads(split_kernel, combine_kernel) -> str:
    """CPU mode: the K tiles loaded in all must be each (K/V head, split)'s tiles once: the G
    query heads of a K/V head share every tile (the M-fold), and no split reads another's."""
    if current().gpu:
        return " (K tile loads are counted in CPU mode only)"
    B, h_q, h_kv, d, length, max_len, S, BN = 1, 8, 2, 16, 50, 64, 3, 16
    q = seeded((B, 1, h_q, d), 5, torch.float32)
    k, v = _cache(B, max_len, h_kv, d, (length,), torch.float32, 6)
    lens = torch.tensor([length], dtype=torch.int32)
    what = (f"split-KV decode (h_q={h_q}, h_kv={h_kv}, length {length}, {S} splits, "
            f"{BN}-key tiles)")
    counter = oob.Guard()
    with counter:
        run_student(launch_split_kv, split_kernel, combine_kernel, q, k, v, lens, S,
                    what=what, guard=True)
    per = -(-(-(-max_len // S)) // BN) * BN                  # keys_per_split, as launched
    need = h_kv * sum(-(-max(0, min(lo + per, length) - lo) // BN)
                      for lo in range(0, S * per, per))
    got = sum(c for (_, name), c in counter.loads.items() if name == "K")
    if got != need:
        raise CheckFailure(
            f"{what}: the kernels loaded {got} K tiles in all; each (K/V head, split)'s tiles "
            f"once is {need}." + (" The G query heads of a K/V head must share each tile "
                                  "(rows of one tile), and a split reads its own keys only."
                                  if got > need else ""))
    return f" (K tiles loaded: {got}, each once for the {h_q // h_kv} query heads of its K/V head)"


def check_split_kv(split_kernel, combine_kernel, hidden: bool = False):
    """Exercise 2: the combine kernel on random partials, then both kernels against float64
    attention over each sequence's cache (NaN in every slot past its length)."""
    require_implemented(split_kernel, "split_kv_kernel")
    require_implemented(combine_kernel, "combine_kernel")
    n = _check_combine(combine_kernel, hidden)
    for i, (name, B, h_q, h_kv, d, lengths, max_len, S, dtype, boost, block_n) in \
            enumerate(split_cases(hidden)):
        q = seeded((B, 1, h_q, d), 80 + i, dtype, scale=boost)
        k, v = _cache(B, max_len, h_kv, d, lengths, dtype, 90 + 2 * i)
        seqlens = torch.tensor(lengths, dtype=torch.int32, device=q.device)
        want_o = torch.zeros(B, 1, h_q, d, dtype=F64)
        want_lse = torch.zeros(B, h_q, 1, dtype=F64)
        for b, L in enumerate(lengths):
            o_b, lse_b = block_attention(q[b].transpose(0, 1).double().cpu()[None],
                                         k[b, :L].transpose(0, 1).double().cpu()[None],
                                         v[b, :L].transpose(0, 1).double().cpu()[None])
            want_o[b], want_lse[b] = o_b[0].transpose(0, 1), lse_b[0]
        what = (f"split-KV decode, case '{name}' (B={B}, h_q={h_q}, h_kv={h_kv}, d={d}, lengths "
                f"{list(lengths)}, max_len={max_len}, {S} splits, {str(dtype)[6:]}"
                + (f", {block_n}-key tiles" if block_n else "") + ")")
        o, lse = run_student(launch_split_kv, split_kernel, combine_kernel, q, k, v, seqlens, S,
                             block_n=block_n, what=what, guard=True)
        no_nan(o, what + ", O (NaN: a key past cache_seqlens was read)")
        assert_close(o, want_o, what=what + ", O", dims=("b", "new", "head", "col"), dtype=dtype,
                     hint=_SPLIT_HINT)
        assert_close(lse, want_lse, what=what + ", LSE", dims=("b", "head", "new"),
                     dtype=torch.float32, atol=2e-4, rtol=1e-4,
                     hint="each split's LSE is m + log(l) in natural log (-inf when empty).")
        n += 1
    extra = "" if hidden else _count_k_loads(split_kernel, combine_kernel)
    report("split-KV decode (partials and combine)", n, extra=extra, hidden=hidden)


# ------------------------------------------------------ Exercise 3: chain and tree reduces

def mesh_cases(hidden: bool = False):
    """(n PEs, mesh columns)."""
    cases = [(1, 4), (4, 4), (6, 4), (8, 4), (9, 3), (16, 4), (5, 2)]
    if hidden:
        cases += [(2, 4), (7, 4), (12, 5), (13, 4), (3, 1), (10, 3), (64, 8), (33, 8)]
    return cases


def _run_reduce(program, n, cols, what):
    states, o_full, lse_full = _shards(100 + n * 7 + cols, rows=3, keys=max(2 * n, 4), d=2,
                                       parts=n, empty=(n // 2 if n > 2 else None))
    try:
        res = run_student(mesh.simulate, program, states, cols, merge=merge_states, what=what)
    except mesh.Deadlock as e:
        raise CheckFailure(f"{what}: {e}.\n  Hint: with n not a multiple of the row width, the "
                           "last row is partial: its last PE has no east neighbour.") from None
    if res.unreceived:
        src, dst = res.unreceived[0]
        raise CheckFailure(f"{what}: {len(res.unreceived)} message(s) were never received (PE "
                           f"{src} to PE {dst} first): their states are missing from the root's.")
    if not (isinstance(res.result, tuple) and len(res.result) == 3):
        raise CheckFailure(f"{what}: PE 0 must return the reduced (m, l, O), got "
                           f"{type(res.result).__name__}.")
    m, l, o = res.result
    assert_close(o, o_full, what=what + ", the root's O", dims=("row", "col"), dtype=F64,
                 atol=1e-10, rtol=1e-10, hint="every PE's state merged exactly once.")
    assert_close(m + torch.log(l), lse_full, what=what + ", the root's m + log(l)",
                 dims=("row",), dtype=F64, atol=1e-10, rtol=1e-10,
                 hint="every PE's state merged exactly once.")
    if res.messages != n - 1:
        raise CheckFailure(f"{what}: {res.messages} messages; reducing {n} states to one needs "
                           f"{n - 1}, each carrying one whole (m, l, O) state (the mesh kernel sends m, "
                           "l and O as three).")
    return res


def check_chain_reduce(chain_reduce, hidden: bool = False):
    """Exercise 3a: the mesh kernel's chain without its deadlock: the root's state is every PE's
    merged once, n - 1 messages, and a critical path of at most (cols - 1) + (rows - 1)."""
    require_implemented(chain_reduce, "chain_reduce")
    hops = []
    for n, cols in mesh_cases(hidden):
        rows, c = mesh.mesh_shape(n, cols)
        what = f"chain_reduce, {n} PEs on {rows} x {c} (cols={cols})"
        res = _run_reduce(chain_reduce, n, cols, what)
        if res.steps > (c - 1) + (rows - 1):
            raise CheckFailure(f"{what}: the root finished after {res.steps} sequential "
                               f"messages; the chain's critical path is (cols - 1) + (rows - 1) "
                               f"= {(c - 1) + (rows - 1)}: rows reduce in parallel, then column 0.")
        if res.hops != n - 1:
            raise CheckFailure(f"{what}: its {n - 1} messages travelled {res.hops} mesh hops in "
                               f"all; a chain sends each state to a neighbour, one hop: west "
                               f"along its row to column 0, then north up column 0 ({n - 1}).")
        hops.append(res.hops)
    report("chain_reduce (no deadlock, n - 1 messages)", len(hops), hidden=hidden)


def check_tree_reduce(tree_reduce, hidden: bool = False):
    """Exercise 3b: a binary tree: n - 1 messages and at most ceil(log2 n) sequential steps."""
    require_implemented(tree_reduce, "tree_reduce")
    k = 0
    for n, cols in mesh_cases(hidden):
        rows, c = mesh.mesh_shape(n, cols)
        what = f"tree_reduce, {n} PEs on {rows} x {c}"
        res = _run_reduce(tree_reduce, n, cols, what)
        depth = math.ceil(math.log2(n)) if n > 1 else 0
        if res.steps > depth:
            raise CheckFailure(f"{what}: the root finished after {res.steps} sequential "
                               f"messages; a binary tree takes at most ceil(log2 {n}) = {depth}.")
        k += 1
    report("tree_reduce (at most ceil(log2 n) steps, n - 1 messages)", k, hidden=hidden)


# ------------------------------------------------------ Exercise 4: zig-zag and the ring

def check_zigzag(zigzag_chunks, hidden: bool = False):
    """Exercise 4a: every one of the 2P chunks on exactly one rank, and equal causal work."""
    require_implemented(zigzag_chunks, "zigzag_chunks")
    sizes = [1, 2, 3, 4] + ([5, 8, 16] if hidden else [])
    chunk = 4
    for P in sizes:
        got = [run_student(zigzag_chunks, r, P, what=f"zigzag_chunks({r}, {P})")
               for r in range(P)]
        flat = [c for pair in got for c in pair]
        if sorted(flat) != list(range(2 * P)):
            raise CheckFailure(f"zigzag_chunks with world_size={P}: ranks hold chunks {got}; "
                               f"each of the {2 * P} chunks must be on exactly one rank.")
        work = [ring.causal_work(torch.cat([torch.arange(c * chunk, (c + 1) * chunk)
                                            for c in pair])) for pair in got]
        if len(set(work)) != 1:
            raise CheckFailure(f"zigzag_chunks with world_size={P}: ranks hold chunks {got}, and "
                               f"causal work (query-key pairs, chunks of {chunk}) per rank is "
                               f"{work}: not balanced. Pair an early chunk with a late one.")
    report("zigzag_chunks (every chunk once, equal causal work)", len(sizes), hidden=hidden)


def ring_cases(hidden: bool = False):
    """(world size, cases): 2 processes visibly, 4 in the hidden tests."""
    cases = [ShardedCase("non-causal", 16, seed=1),
             ShardedCase("causal, GQA (G=2)", 32, H_q=4, H_kv=2, causal=True,
                         layout="zigzag", seed=2),
             ShardedCase("causal, float32", 16, d=16, dtype="float32", causal=True,
                         layout="zigzag", seed=3)]
    if hidden:
        cases.append(ShardedCase("causal, contiguous shards", 24, causal=True, seed=4))
    return (4 if hidden else 2), cases


def _check_traffic(out: dict, case, P: int, q, pos, what: str) -> None:
    """A ring's traffic: point-to-point messages only, and each rank sends its K and V block
    (and, if it likes, their positions) to the next rank P - 1 times."""
    if out.get("collectives"):
        raise CheckFailure(f"{what}: it called {', '.join(out['collectives'])}: a collective "
                           "gathers K and V on every rank at once (all of K/V in memory per "
                           "rank, and no compute under the transfer). The ring passes one K/V "
                           "block to the next rank each step, with batch_isend_irecv.")
    item = torch.empty((), dtype=getattr(torch, case.dtype)).element_size()
    block = case.B * case.H_kv * (case.n // P) * case.d * item          # K's shard on a rank
    least = (P - 1) * 2 * block                                          # K and V, P - 1 hops
    most = least + (P - 1) * (case.n // P) * pos.element_size()          # + the positions
    if not least <= out["sent_bytes"] <= most:
        raise CheckFailure(f"{what}: the rank sent {out['sent_bytes']} bytes with "
                           f"batch_isend_irecv; a ring sends its K and V blocks ({2 * block} "
                           f"bytes) to the next rank P - 1 = {P - 1} times: {least} bytes (plus "
                           f"the key positions, up to {most}). Fewer: K/V did not travel round "
                           "the ring; more: blocks were sent to more than one rank.")


def raise_if_unfinished(run, title: str, timeout: float, deadlock_hint: str) -> None:
    """The CheckFailure of a gloo run (``ring.run_ring``) that hung (with ``deadlock_hint``) or
    whose rank raised or died (the last lines of its traceback); nothing for a finished run."""
    if run.status == "timeout":
        raise CheckFailure(f"{title}: no result within {timeout:.0f} s: a deadlock? "
                           f"{deadlock_hint} (All processes were killed.)")
    if run.status in ("raised", "died"):
        tail = "\n".join(run.error.strip().splitlines()[-12:])
        who = f"rank {run.rank}" if run.rank is not None else "a worker"
        raise CheckFailure(f"{title}: {who} failed (the others were killed):\n{tail}")


def check_ring_attention(ring_attention, hidden: bool = False, timeout: float = ring.TIMEOUT_S):
    """Exercise 4b: ring_attention in P processes over gloo, every rank's (O, LSE) against
    single-process float64 attention; a raise or a hang fails the check, and every process is
    torn down."""
    require_implemented(ring_attention, "ring_attention")
    P, cases = ring_cases(hidden)
    run = ring.run_ring({"ring_attention": ring_attention}, cases, P, timeout=timeout)
    title = f"ring attention over gloo, {P} processes"
    raise_if_unfinished(run, title, timeout, "Every rank must post its send and its receive "
                        "together (batch_isend_irecv), and every rank must run the same number "
                        "of steps.")
    sent = []
    for i, case in enumerate(cases):
        q, k, v = case.inputs()
        pos = torch.arange(case.n)
        want_o, want_lse = block_attention(q.double(), k.double(), v.double(), pos, pos,
                                           case.causal)
        dt = getattr(torch, case.dtype)
        tol = 1e-10 if dt == F64 else None
        for r in range(P):
            out = run.outputs.get((i, r))
            what = f"{title}, case {case.describe(P)}, rank {r}"
            if out is None:
                raise CheckFailure(f"{what}: no result came back.")
            p = case.positions(P, r)
            assert_close(out["o"], want_o[:, :, p], what=what + ", output O",
                         dims=("b", "h", "row", "col"), dtype=dt, atol=tol, rtol=tol,
                         hint="each step: this rank's queries against the K/V block it holds, "
                              "merged into the running state; then K and V move one rank on.")
            assert_close(out["lse"], want_lse[:, :, p], what=what + ", LSE",
                         dims=("b", "h", "row"), dtype=dt, atol=tol or 1e-5, rtol=tol or 1e-5,
                         hint="every block merged exactly once: P steps, P - 1 hops.")
            _check_traffic(out, case, P, q, pos, what)
            sent.append(out["sent_bytes"])
    report(title, len(cases) * P, hidden=hidden,
           extra=f" (exact against one process; {run.wall_s:.1f} s with process start; each rank "
                 f"sent {max(sent) / 1024:.1f} KiB at most)")
