"""Chapter 1's graded checks: the stable softmax, naive attention (O and LSE, optional causal
mask) and the traffic model of the three-kernel version.

Each check is ``check_x(fn, hidden=False)``: the visible cases run in the student's notebook,
``hidden=True`` adds the autograder's cases. All are built on ``check.run_student`` (stubs and
rejected calls become a CheckFailure that says so) and ``check.check_attention``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from flashbook import check, reference
from flashbook.cases import AttnCase, grid
from flashbook.check import CheckFailure, assert_close, run_student

# ------------------------------------------------------------------------------ softmax


def softmax_cases(hidden: bool = False) -> list[tuple[str, torch.Tensor]]:
    """(name, x) pairs, a fully masked row among the visible ones; hidden adds a 3-d input and a
    float16 input."""
    g = torch.Generator().manual_seed(1 if hidden else 0)
    cases = [
        ("random rows (4, 7)", torch.randn(4, 7, generator=g, dtype=torch.float64)),
        ("one element per row (3, 1)", torch.randn(3, 1, generator=g, dtype=torch.float64)),
        ("large logits (+-1e4) (2, 5)", torch.tensor([[1e4, -1e4, 0.0, 9999.0, 5.0],
                                                       [-1e4, -9999.5, -1e4, -1e4, -1e4]],
                                                      dtype=torch.float64)),
        ("some -inf entries (2, 4)", torch.tensor([[0.5, float("-inf"), 1.0, float("-inf")],
                                                   [float("-inf"), 2.0, 2.0, 2.0]],
                                                  dtype=torch.float64)),
        ("a row of only -inf (masked) (2, 3)",
         torch.tensor([[float("-inf")] * 3, [1.0, 2.0, 3.0]], dtype=torch.float64)),
    ]
    if hidden:
        cases += [
            ("3-d input (2, 3, 33), float32", torch.randn(2, 3, 33, generator=g) * 30),
            ("float16 input (5, 64)", (torch.randn(5, 64, generator=g) * 8).half()),
        ]
    return cases


# The library softmaxes the exercise asks not to call: (owner, attribute name).
_LIBRARY_SOFTMAX = ((torch, "softmax"), (torch, "log_softmax"), (torch.Tensor, "softmax"),
                    (F, "softmax"), (F, "log_softmax"))


def _without_library_softmax(fn, what: str):
    """``fn`` with torch's softmaxes replaced, while it runs, by a CheckFailure."""
    def forbidden(*args, **kwargs):
        raise CheckFailure(f"{what}: softmax must be written by hand, without torch.softmax, "
                           "F.softmax or log_softmax (the exercise is to write it).")

    def run(*args):
        saved = [getattr(owner, name) for owner, name in _LIBRARY_SOFTMAX]
        for owner, name in _LIBRARY_SOFTMAX:
            setattr(owner, name, forbidden)
        try:
            return fn(*args)
        finally:
            for (owner, name), original in zip(_LIBRARY_SOFTMAX, saved):
                setattr(owner, name, original)
    return run


def check_softmax(fn, hidden: bool = False):
    """Check a row softmax over the last axis against the float64 reference.

    Every run has torch's own softmax disabled, and a row of only -inf must give zeros, not NaN;
    hidden cases add 3-d and float16 inputs.
    """
    cases = softmax_cases(hidden)
    for name, x in cases:
        what = f"softmax, case {name}"
        got = run_student(_without_library_softmax(fn, what), x.clone(), what=what)
        want = reference.softmax(x.to(torch.float64))
        dims = [f"axis{i}" for i in range(x.dim() - 2)] + ["row", "col"]
        assert_close(got, want, what=what, dims=dims, dtype=x.dtype,
                     atol=1e-3 if x.dtype == torch.float16 else None,
                     hint="subtract the row maximum before exp so exp never overflows; a row "
                          "whose maximum is -inf must not produce -inf - (-inf) = NaN.")
        if got.dtype != x.dtype:
            raise CheckFailure(f"{what}: returned {got.dtype}, expected the input's dtype {x.dtype}.")
    check.report("softmax", len(cases), hidden=hidden)


# ---------------------------------------------------------------------------- attention

_ATTENTION = [   # q, k, v: (B, H, N_q, d) and (B, H, N_k, d)
    AttnCase("small", B=1, H_q=2, N_q=16, N_k=16, d=16),
    AttnCase("N=1", B=1, H_q=1, N_q=1, N_k=1, d=8),
    AttnCase("N not a power of two", B=2, H_q=3, N_q=13, N_k=13, d=16),
    AttnCase("large logits", B=1, H_q=2, N_q=8, N_k=8, d=16, logit_boost=300.0),
    AttnCase("N_q != N_k", B=1, H_q=2, N_q=5, N_k=9, d=16),
    AttnCase("explicit scale", B=1, H_q=1, N_q=7, N_k=7, d=32, scale=0.5),
    AttnCase("more queries than keys", B=1, H_q=1, N_q=6, N_k=3, d=8),   # causal: 3 rows see no key
]
_ATTENTION_HIDDEN = [
    AttnCase("long rows", B=1, H_q=2, N_q=33, N_k=100, d=64),
    AttnCase("more queries than keys, batch of two", B=2, H_q=1, N_q=9, N_k=5, d=16),
    AttnCase("d=128", B=1, H_q=1, N_q=10, N_k=10, d=128),
]
# The hidden test cells' seeds and dtypes (distinct seeds: the hidden inputs differ from the
# visible ones).
HIDDEN_SEED = {False: 100, True: 200, None: 100}
HIDDEN_DTYPES = (torch.float32, torch.float16)


def attention_cases(hidden: bool = False, causal: bool | None = None,
                    dtypes=(torch.float32,)) -> list[AttnCase]:
    """Typical shapes, edge shapes, large logits; each in every dtype and causal mode
    (``causal=None``: both)."""
    base = _ATTENTION + (_ATTENTION_HIDDEN if hidden else [])
    return grid(base, dtype=tuple(dtypes), causal=(False, True) if causal is None else (causal,))


def check_attention(fn, hidden: bool = False, causal: bool | None = None, seed: int | None = None,
                    dtypes=None, returns_lse: bool = True):
    """Check ``fn(q, k, v, scale=None, causal=False) -> (O, LSE)`` on seeded cases.

    O must match the float64 reference within the dtype's tolerance; LSE (natural log,
    float32, (B, H, N_q)) within 1e-4. Rows that see no key give O = 0 and LSE = -inf.
    ``causal``: only unmasked (False) or causal (True) cases; None: both. ``hidden`` adds
    cases and, unless given, uses the hidden seed and float32 + float16 inputs.
    """
    if seed is None:
        seed = HIDDEN_SEED[causal] if hidden else 0
    if dtypes is None:
        dtypes = HIDDEN_DTYPES if hidden else (torch.float32,)

    def run(q, k, v, case, config):
        return fn(q, k, v, scale=case.scale, causal=case.causal)
    # no return value: a test cell's last value would be read as partial credit by nbgrader
    check.check_attention(run, attention_cases(hidden, causal, dtypes),
                          title="attention" + (" (causal)" if causal else ""),
                          returns_lse=returns_lse, seed=seed, quiet=hidden)


# ------------------------------------------------------------------------ traffic model

# (B, H, N, d, bytes per element): visible and hidden cases for the traffic model.
_TRAFFIC_CASES = [(1, 1, 4, 2, 4), (1, 16, 4096, 64, 2), (2, 8, 1000, 128, 4)]
_TRAFFIC_HIDDEN = [(3, 5, 7, 11, 2), (1, 1, 1, 1, 8), (4, 32, 16384, 128, 2)]


def expected_traffic(B, H, N, d, e) -> tuple[int, int]:
    """(FLOPs, bytes): an independent statement of the chapter's model (three kernels, S and
    P in HBM), per kernel rather than in the solution's closed form."""
    qk = e * B * H * (2 * N * d + N * N)          # read Q, K; write S
    sm = e * B * H * (2 * N * N)                  # read S; write P
    pv = e * B * H * (N * N + 2 * N * d)          # read P, V; write O
    return 4 * B * H * N * N * d, qk + sm + pv


def check_traffic(fn, hidden: bool = False):
    """Check ``fn(B, H, N, d, bytes_per_element) -> {"flops": ..., "bytes": ...}``."""
    cases = _TRAFFIC_CASES + (_TRAFFIC_HIDDEN if hidden else [])
    for B, H, N, d, e in cases:
        what = f"naive_traffic(B={B}, H={H}, N={N}, d={d}, bytes_per_element={e})"
        got = run_student(fn, B, H, N, d, e, what=what)
        if not isinstance(got, dict) or not {"flops", "bytes"} <= set(got):
            raise CheckFailure(f"{what}: return a dict with keys 'flops' and 'bytes', got {got!r}.")
        flops, nbytes = expected_traffic(B, H, N, d, e)
        if got["flops"] != flops:
            raise CheckFailure(
                f"{what}: flops = {got['flops']:,} but the two matmuls do {flops:,}.\n  Hint: each "
                "of the N*N scores takes d multiply-adds (2d FLOPs), and so does each of the "
                "N*d outputs' N-term sum; count both, for every batch and head.")
        if got["bytes"] != nbytes:
            raise CheckFailure(
                f"{what}: bytes = {got['bytes']:,} but the three kernels move {nbytes:,}.\n  Hint: "
                "S and P are each written once and read once (N*N elements per head each way); "
                "Q, K, V are read once and O written once (N*d elements each).")
    check.report("naive_traffic", len(cases), hidden=hidden)
