"""What three kinds of context parallelism send, per rank, for one attention forward over a
sequence of N tokens on P ranks: the formulas (elements and bytes sent, communication steps),
and the same traffic counted by running the methods over gloo (``ring.run_ring``'s counter).

- ring: each K/V block (2 (N/P) h_kv d elements) hops P - 1 times; P - 1 point-to-point
  steps, each overlapped with a block of attention.
- all-gather (PyTorch's ``context_parallel`` by default): every rank gathers all of K and V;
  the same bytes, one collective, with nothing to compute under it.
- Ulysses: an all-to-all of q, k and v from sequence shards to head shards, and one of O (and
  its LSE) back: (N/P)(2 h_q + 2 h_kv) d (P - 1)/P elements (+ (N/P) h_q (P - 1)/P of LSE),
  two all-to-all steps, and P must divide h_kv.
"""
from __future__ import annotations

from flashbook.sharding import ShardedCase

from . import ring

__all__ = ["cp_traffic", "traffic_rows", "counted_traffic"]

METHODS = ("ring", "all-gather", "Ulysses")


def cp_traffic(N: int, P: int, h_q: int, h_kv: int, d: int, itemsize: int = 2,
               B: int = 1) -> dict:
    """{method: dict(elements, bytes, steps, note)} sent by each rank (to the others) for one
    forward of attention over B sequences of N tokens on P ranks. Ulysses' entry is None when
    P does not divide h_kv. Shards are N/P tokens (N divisible by P)."""
    n = N // P
    kv = 2 * B * n * h_kv * d * (P - 1)                  # K and V blocks, P - 1 hops
    out = {"ring": dict(elements=kv, bytes=kv * itemsize, steps=P - 1,
                        note="point-to-point, overlapped with compute"),
           "all-gather": dict(elements=kv, bytes=kv * itemsize, steps=1,
                              note="one all-gather of K and V, not overlapped")}
    if h_kv % P:
        out["Ulysses"] = None
    else:
        # q, k, v out and O back: each rank keeps 1/P of every tensor it cuts (its own part)
        elems = B * n * ((2 * h_q + 2 * h_kv) * d + h_q) * (P - 1) // P   # + h_q: the LSE
        out["Ulysses"] = dict(elements=elems, bytes=elems * itemsize, steps=2,
                              note="two all-to-alls, not overlapped; P <= h_kv")
    return out


def traffic_rows(sizes=(32768, 131072, 262144), worlds=(2, 8), h_q: int = 64, h_kv: int = 8,
                 d: int = 128, itemsize: int = 2) -> list[dict]:
    """The table's rows: for each N and P, MiB each rank sends with each method, and steps
    (defaults: Llama-3-70B's attention, h_q = 64, h_kv = 8, d = 128, fp16)."""
    rows = []
    for N in sizes:
        for P in worlds:
            t = cp_traffic(N, P, h_q, h_kv, d, itemsize)
            rows.append(dict(N=N, P=P, **{f"{m} MiB": (t[m]["bytes"] / 2**20 if t[m] else None)
                                          for m in METHODS},
                             **{f"{m} steps": (t[m]["steps"] if t[m] else None)
                                for m in METHODS}))
    return rows


def counted_traffic(functions: dict, case: ShardedCase, world_size: int = 2,
                    timeout: float = ring.TIMEOUT_S) -> dict:
    """Run each of ``functions`` ({method: f(q, k, v, q_pos, k_pos, causal)}) on ``case`` in one
    job of ``world_size`` gloo processes; {method: bytes rank 0 sent (point-to-point and
    collectives), calls}. Raises RuntimeError with the worker's traceback if one fails."""
    names = list(functions)
    run = ring.run_ring(functions, [case] * len(names), world_size, timeout=timeout,
                        entry=names)
    if run.status != "ok":
        raise RuntimeError(f"the traffic demo failed ({run.status}):\n{run.error[-2000:]}")
    out = {}
    for i, name in enumerate(names):
        o = run.outputs[i, 0]
        calls = dict(o["collective_calls"])
        if o["sent_msgs"]:
            calls["isend"] = o["sent_msgs"]
        out[name] = dict(bytes=o["sent_bytes"] + sum(o["collective_bytes"].values()),
                         calls=calls)
    return out
