"""The graded-check harness (introduced in Chapter 1).

Visible checks (in the student notebook) and hidden tests (added by the autograder) both
call these functions. A failed check raises ``CheckFailure`` (an AssertionError, so nbgrader
counts the cell as failed) with a message meant to teach: which case, which positions are
wrong, by how much, and a hint about the usual cause.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, Sequence

import torch

from . import reference

# (atol, rtol) against a float64 reference, by the dtype of the tensors under test.
TOLERANCES = {
    torch.float64: (1e-9, 1e-9),
    torch.float32: (2e-5, 1e-4),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}


class CheckFailure(AssertionError):
    """A graded check failed; the message says where and why."""


@dataclasses.dataclass(frozen=True)
class Case:
    """One seeded attention problem."""
    name: str
    B: int = 1
    H: int = 2
    N_q: int = 16
    N_k: int = 16
    d: int = 16
    dtype: torch.dtype = torch.float32
    causal: bool = False
    scale: float | None = None
    logit_boost: float = 1.0   # multiplies q: large values stress the softmax's stability

    def describe(self) -> str:
        dt = str(self.dtype).replace("torch.", "")
        extra = " causal" if self.causal else ""
        extra += f" scale={self.scale:g}" if self.scale is not None else ""
        extra += f" logits x{self.logit_boost:g}" if self.logit_boost != 1 else ""
        return (f"'{self.name}' (B={self.B}, H={self.H}, N_q={self.N_q}, N_k={self.N_k}, "
                f"d={self.d}, {dt}{extra})")


def make_qkv(case: Case, seed: int = 0, device: str = "cpu"):
    """Seeded q (B,H,N_q,d), k and v (B,H,N_k,d) in ``case.dtype``."""
    g = torch.Generator().manual_seed(seed)
    shape_q = (case.B, case.H, case.N_q, case.d)
    shape_k = (case.B, case.H, case.N_k, case.d)
    q = torch.randn(shape_q, generator=g) * case.logit_boost
    k = torch.randn(shape_k, generator=g)
    v = torch.randn(shape_k, generator=g)
    return tuple(t.to(device=device, dtype=case.dtype) for t in (q, k, v))


def format_ranges(values, limit: int = 6) -> str:
    """[1,2,3,7,9,10] -> '1-3, 7, 9-10' (at most ``limit`` runs)."""
    runs, start, prev = [], None, None
    for x in sorted(set(int(v) for v in values)):
        if start is None:
            start = prev = x
        elif x == prev + 1:
            prev = x
        else:
            runs.append((start, prev))
            start = prev = x
    if start is not None:
        runs.append((start, prev))
    text = ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs[:limit])
    return text + (", ..." if len(runs) > limit else "")


def assert_close(actual, expected, *, what: str, dims: Sequence[str], dtype=None,
                 hint: str = "", atol: float | None = None, rtol: float | None = None):
    """Compare ``actual`` with a (float64) ``expected``; raise CheckFailure that locates errors.

    ``dims`` names the axes (e.g. ("b", "h", "row", "col")) so messages say where errors are.
    -inf must match -inf exactly; NaN is always an error.
    """
    if not isinstance(actual, torch.Tensor):
        raise CheckFailure(f"{what}: expected a torch.Tensor, got {type(actual).__name__}.")
    if tuple(actual.shape) != tuple(expected.shape):
        raise CheckFailure(f"{what}: shape {tuple(actual.shape)} but expected "
                           f"{tuple(expected.shape)} ({', '.join(dims)}).")
    dtype = dtype or actual.dtype
    d_atol, d_rtol = TOLERANCES.get(dtype, TOLERANCES[torch.float32])
    atol, rtol = atol if atol is not None else d_atol, rtol if rtol is not None else d_rtol
    a = actual.detach().to("cpu", torch.float64)
    e = expected.detach().to("cpu", torch.float64)
    both_inf = torch.isinf(a) & torch.isinf(e) & (torch.sign(a) == torch.sign(e))
    err = torch.where(both_inf, torch.zeros_like(a), (a - e).abs())
    err = torch.nan_to_num(err, nan=math.inf)
    bad = err > atol + rtol * e.abs().nan_to_num(posinf=0.0, neginf=0.0)
    if not bool(bad.any()):
        return
    n_bad, n = int(bad.sum()), bad.numel()
    worst = torch.nonzero(err == err.max())[0].tolist()
    where = ", ".join(f"{name}={i}" for name, i in zip(dims, worst))
    lines = [f"{what}: {n_bad} of {n} values are wrong (tolerance atol={atol:g}, rtol={rtol:g})."]
    if torch.isnan(a).any():
        lines.append(f"  It contains NaN ({int(torch.isnan(a).sum())} values) - often exp(inf - inf) "
                     "or 0 * inf; check rows that see no key and very large logits.")
    lines.append(f"  Largest error {float(err.max()):.3g} at {where}: got {float(a[tuple(worst)]):.6g}, "
                 f"expected {float(e[tuple(worst)]):.6g}.")
    if bad.dim() >= 2:
        # Summarise by the leading axes (e.g. which heads) and by rows (second-to-last or last axis).
        row_axis = list(dims).index("row") if "row" in dims else len(dims) - 2
        other = [i for i in range(bad.dim()) if i != row_axis]
        rows = torch.nonzero(bad.any(dim=other) if other else bad).flatten().tolist()
        lines.append(f"  Wrong {dims[row_axis]}s: {format_ranges(rows)} (of 0-{bad.shape[row_axis] - 1}).")
        if bad.dim() >= 3:
            lead = bad.flatten(2).any(-1)
            pairs = [tuple(p) for p in torch.nonzero(lead).tolist()]
            lines.append(f"  Wrong ({', '.join(dims[:2])}): {pairs[:8]}{' ...' if len(pairs) > 8 else ''}.")
    if hint:
        lines.append(f"  Hint: {hint}")
    raise CheckFailure("\n".join(lines))


def call_student(fn: Callable, *args, what: str, **kwargs):
    """Call student code; turn NotImplementedError into a clear message."""
    try:
        return fn(*args, **kwargs)
    except NotImplementedError:
        raise CheckFailure(f"{what}: not implemented yet (the stub still raises "
                           "NotImplementedError).") from None


def _report(title: str, passed: int):
    print(f"PASSED {title}: {passed}/{passed} cases")


# --------------------------------------------------------------------------- softmax (Ch. 1)

def softmax_cases(hidden: bool = False) -> list[tuple[str, torch.Tensor]]:
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
    ]
    if hidden:
        cases += [
            ("a row of only -inf (masked) (2, 3)",
             torch.tensor([[float("-inf")] * 3, [1.0, 2.0, 3.0]], dtype=torch.float64)),
            ("3-d input (2, 3, 33), float32", torch.randn(2, 3, 33, generator=g) * 30),
            ("float16 input (5, 64)", (torch.randn(5, 64, generator=g) * 8).half()),
        ]
    return cases


def check_softmax(fn: Callable, hidden: bool = False):
    """Check a row softmax over the last axis against the float64 reference.

    Hidden cases add fully masked rows (must give zeros, not NaN), 3-d and float16 inputs.
    """
    cases = softmax_cases(hidden)
    for name, x in cases:
        what = f"softmax, case {name}"
        got = call_student(fn, x.clone(), what=what)
        want = reference.softmax(x.to(torch.float64))
        dims = [f"axis{i}" for i in range(x.dim() - 2)] + ["row", "col"]
        assert_close(got, want, what=what, dims=dims, dtype=x.dtype,
                     atol=1e-3 if x.dtype == torch.float16 else None,
                     hint="subtract the row maximum before exp so exp never overflows; a row "
                          "whose maximum is -inf must not produce -inf - (-inf) = NaN.")
        if got.dtype != x.dtype:
            raise CheckFailure(f"{what}: returned {got.dtype}, expected the input's dtype {x.dtype}.")
    _report("softmax", len(cases))


# ------------------------------------------------------------------------- attention (Ch. 1+)

def attention_cases(hidden: bool = False, causal: bool | None = None,
                    dtypes: Sequence[torch.dtype] = (torch.float32,)) -> list[Case]:
    """Seeded attention problems: typical shapes, edge shapes, large logits, causal layouts."""
    base = [
        Case("small", B=1, H=2, N_q=16, N_k=16, d=16),
        Case("N=1", B=1, H=1, N_q=1, N_k=1, d=8),
        Case("N not a power of two", B=2, H=3, N_q=13, N_k=13, d=16),
        Case("large logits", B=1, H=2, N_q=8, N_k=8, d=16, logit_boost=300.0),
        Case("N_q != N_k", B=1, H=2, N_q=5, N_k=9, d=16),
        Case("explicit scale", B=1, H=1, N_q=7, N_k=7, d=32, scale=0.5),
    ]
    if hidden:
        base += [
            Case("long rows", B=1, H=2, N_q=33, N_k=100, d=64),
            Case("more queries than keys", B=2, H=1, N_q=9, N_k=5, d=16),
            Case("d=128", B=1, H=1, N_q=10, N_k=10, d=128),
        ]
    cases = []
    for c in base:
        for dt in dtypes:
            modes = [False, True] if causal is None else [causal]
            for cz in modes:
                cases.append(dataclasses.replace(c, dtype=dt, causal=cz))
    return cases


def check_attention(fn: Callable, hidden: bool = False, causal: bool | None = None,
                    dtypes: Sequence[torch.dtype] = (torch.float32,), returns_lse: bool = True,
                    device: str | None = None, seed: int = 0):
    """Check ``fn(q, k, v, scale=None, causal=False) -> (O, LSE)`` on seeded cases.

    O must match the float64 reference within the dtype's tolerance; LSE (natural log,
    float32, shape (B, H, N_q)) within 1e-4 relative. Rows that see no key must give
    O = 0 and LSE = -inf.
    """
    from .device import current
    device = device or current().device
    cases = attention_cases(hidden, causal, dtypes)
    for i, case in enumerate(cases):
        q, k, v = make_qkv(case, seed=seed + i, device=device)
        what = f"attention, case {case.describe()}"
        out = call_student(fn, q, k, v, scale=case.scale, causal=case.causal, what=what)
        if returns_lse:
            if not (isinstance(out, tuple) and len(out) == 2):
                raise CheckFailure(f"{what}: expected a tuple (O, LSE), got {type(out).__name__}.")
            o, lse = out
        else:
            o, lse = out, None
        # Reference in float64 from the same (possibly rounded) inputs the kernel saw.
        want_o, want_lse = reference.attention(q.double(), k.double(), v.double(),
                                               scale=case.scale, causal=case.causal,
                                               return_lse=True)
        hint = ("a causal mask is aligned bottom-right: query i sees key j iff "
                "j <= i + (N_k - N_q); rows that see no key give O = 0."
                if case.causal else "scale S = Q K^T by 1/sqrt(d) (or the given scale) before "
                "the softmax, and compute the softmax over keys (the last axis).")
        assert_close(o, want_o, what=f"{what}, output O", dims=("b", "h", "row", "col"),
                     dtype=case.dtype, hint=hint)
        if o.dtype != case.dtype:
            raise CheckFailure(f"{what}: O has dtype {o.dtype}, expected {case.dtype}.")
        if lse is not None:
            assert_close(lse, want_lse, what=f"{what}, LSE", dims=("b", "h", "row"),
                         dtype=torch.float32, atol=1e-4, rtol=1e-4,
                         hint="LSE is log(sum_j exp(s_ij)) in natural log of the scaled, "
                              "masked scores: m + log(l). A row with no visible key has LSE -inf.")
    _report("attention" + (" (causal)" if causal else ""), len(cases))
