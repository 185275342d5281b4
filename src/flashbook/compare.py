"""Comparing a result with its reference, and the failure every check raises (Chapter 1).

``assert_close`` locates errors (which heads, which rows, the worst element) so that a failed
check teaches; ``CheckFailure`` is an AssertionError, so nbgrader counts the cell as failed.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch


# (atol, rtol) against a float64 reference, by the dtype of the tensors under test.
TOLERANCES = {
    torch.float64: (1e-9, 1e-9),
    torch.float32: (2e-5, 1e-4),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}


class CheckFailure(AssertionError):
    """A graded check failed; the message says where and why."""


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
