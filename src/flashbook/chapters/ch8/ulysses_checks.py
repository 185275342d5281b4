"""Exercise 5: Ulysses context parallelism, run like the ring (``ring.run_ring``: P gloo
processes, a time limit, every process torn down) and graded by its output and its traffic:
each rank sends (P - 1)/P of its q, k, v shards and of its O and LSE, with all-to-alls only
(plus the positions, gathered), and raises ValueError when P does not divide h_kv."""
from __future__ import annotations

import torch

from flashbook.check import CheckFailure, assert_close, report, require_implemented
from flashbook.sharding import ShardedCase

from . import ring
from .checks import raise_if_unfinished
from .state import block_attention

__all__ = ["check_ulysses", "ulysses_cases"]

F64 = torch.float64
A2A = ("all_to_all_single", "all_to_all")
GATHERS = ("all_gather", "all_gather_into_tensor", "all_gather_single")


def ulysses_cases(hidden: bool = False):
    """(world size, cases, indices of the cases that must raise ValueError): 2 processes
    visibly, 4 in the hidden tests (the visible call already ran 2); the cases that must
    raise come last."""
    if not hidden:
        return 2, [ShardedCase("non-causal, GQA (G=2)", 16, H_q=4, H_kv=2, seed=11),
                   ShardedCase("causal, float32", 16, H_q=2, H_kv=2, dtype="float32",
                               causal=True, layout="zigzag", seed=12),
                   ShardedCase("MQA: P = 2 does not divide h_kv = 1", 8, H_q=2, H_kv=1,
                               seed=13)], (2,)
    return 4, [ShardedCase("causal, GQA (G=2)", 16, H_q=8, H_kv=4, causal=True,
                           layout="zigzag", seed=14),
               ShardedCase("causal, G=3, contiguous shards", 16, H_q=12, H_kv=4, causal=True,
                           seed=15),
               ShardedCase("P = 4 > h_kv = 2", 8, H_q=4, H_kv=2, seed=16),
               ShardedCase("P = 4 does not divide h_kv = 6", 8, H_q=6, H_kv=6, seed=17)], (2, 3)


def _check_raise(out: dict, case: ShardedCase, P: int, what: str) -> None:
    raised = out.get("raised")
    if raised is None or not raised.startswith("ValueError"):
        got = f"it raised {raised}" if raised else "it returned a result"
        raise CheckFailure(f"{what}: {got}. Ulysses gives each rank h_kv / P whole K/V heads "
                           f"(and their G query heads): with P = {P} and h_kv = {case.H_kv} it "
                           "cannot, so ulysses_attention must raise ValueError saying that P "
                           "must divide h_kv.")


def _check_traffic(out: dict, case: ShardedCase, P: int, what: str) -> int:
    """Ulysses' traffic: all-to-alls of exactly (P - 1)/P of q, k, v, O and LSE, no point-to-
    point ring, no all-gather of K/V (the positions may be gathered). Returns the bytes."""
    item = torch.empty((), dtype=getattr(torch, case.dtype)).element_size()
    n = case.n // P
    cut = case.B * n * ((2 * case.H_q + 2 * case.H_kv) * case.d + case.H_q) * item
    need = cut * (P - 1) // P                         # q, k, v, O, LSE: all but this rank's part
    positions = 2 * (P - 1) * n * 8                   # q_pos and k_pos to every other rank
    by_name = out["collective_bytes"]
    a2a = sum(by_name.get(c, 0) for c in A2A)
    gathered = sum(by_name.get(c, 0) for c in GATHERS)
    if out["sent_bytes"]:
        raise CheckFailure(f"{what}: the rank sent {out['sent_bytes']} bytes point-to-point "
                           "(batch_isend_irecv): that is a ring. Ulysses moves every tensor "
                           "with all-to-alls (dist.all_to_all_single).")
    if gathered > positions:
        raise CheckFailure(f"{what}: the rank sent {gathered} bytes with an all_gather (more "
                           f"than the positions, {positions}): K and V gathered on every rank "
                           "is all-gather context parallelism. Ulysses sends each rank the "
                           "whole sequence of its own heads with all_to_all_single.")
    other = sorted(set(out["collectives"]) - set(A2A) - set(GATHERS))
    if other:
        raise CheckFailure(f"{what}: it called {', '.join(other)}; Ulysses needs all-to-alls "
                           "only (and, for the positions, an all-gather).")
    if not need <= a2a <= need + positions:
        parts = (f"q ({case.H_q} heads), k and v ({case.H_kv} heads each), O and its LSE "
                 f"({case.H_q} heads)")
        raise CheckFailure(
            f"{what}: the rank sent {a2a} bytes with all-to-alls; sending (P - 1)/P of each of "
            f"{parts}, its sequence shard of {n} positions, is {need}."
            + (" More: K/V expanded to the query heads (repeat_interleave) before sending? "
               "Send h_kv heads; expand after." if a2a > need else
               " Fewer: a tensor did not go through an all-to-all (q, k and v out, O and LSE "
               "back)."))
    return a2a + gathered


def check_ulysses(ulysses_attention, hidden: bool = False, timeout: float = ring.TIMEOUT_S):
    """Exercise 5: ulysses_attention in P processes over gloo, every rank's (O, LSE) against
    single-process float64 attention, its traffic counted, and a ValueError where P does not
    divide h_kv; a raise or a hang fails the check, and every process is torn down."""
    require_implemented(ulysses_attention, "ulysses_attention")
    P, cases, must_raise = ulysses_cases(hidden)
    run = ring.run_ring({"ulysses_attention": ulysses_attention}, cases, P, timeout=timeout,
                        entry="ulysses_attention", may_raise=must_raise)
    title = f"Ulysses attention over gloo, {P} processes"
    raise_if_unfinished(run, title, timeout,
                        "Every rank must call the same collectives in the same order.")
    sent, calls = [], []
    for i, case in enumerate(cases):
        for r in range(P):
            out = run.outputs.get((i, r))
            what = f"{title}, case {case.describe(P)}, rank {r}"
            if out is None:
                raise CheckFailure(f"{what}: no result came back.")
            if i in must_raise:
                _check_raise(out, case, P, what)
                continue
            _check_case(out, case, P, r, what)
            sent.append(_check_traffic(out, case, P, what))
            calls.append(sum(out["collective_calls"].get(c, 0) for c in A2A))
    report(title, len(cases) * P, hidden=hidden,
           extra=f" (exact against one process; {run.wall_s:.1f} s with process start; each rank "
                 f"sent {max(sent) / 1024:.1f} KiB at most, in {max(calls)} all-to-all calls)")


def _check_case(out: dict, case: ShardedCase, P: int, r: int, what: str) -> None:
    q, k, v = case.inputs()
    pos = torch.arange(case.n)
    want_o, want_lse = block_attention(q.double(), k.double(), v.double(), pos, pos, case.causal)
    p = case.positions(P, r)
    want_o, want_lse = want_o[:, :, p], want_lse[:, :, p]
    for got, want, name in ((out["o"], want_o, "O"), (out["lse"], want_lse, "LSE")):
        if tuple(got.shape) != tuple(want.shape):
            raise CheckFailure(f"{what}: {name} has shape {tuple(got.shape)}; this rank's "
                               f"sequence shard is {tuple(want.shape)}. Attention ran on head "
                               "shards of the whole sequence; the all-to-all back returns each "
                               "rank's positions, all heads, to it.")
    dt = getattr(torch, case.dtype)
    tol = 1e-10 if dt == F64 else None
    hint = ("rank j's part of a tensor cut for the all-to-all is heads [j H/P, (j + 1) H/P) of "
            "q and of k, v alike: query head h uses K/V head h // G, so a rank must hold whole "
            "GQA groups; the gathered sequence is rank 0's positions, then rank 1's, ...")
    assert_close(out["o"], want_o, what=what + ", output O", dims=("b", "h", "row", "col"),
                 dtype=dt, atol=tol, rtol=tol, hint=hint)
    assert_close(out["lse"], want_lse, what=what + ", LSE", dims=("b", "h", "row"), dtype=dt,
                 atol=tol or 1e-5, rtol=tol or 1e-5, hint=hint)
