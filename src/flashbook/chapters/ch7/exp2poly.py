"""Chapter 7, Exercise 3: 2^x by a polynomial on the FMA units (FlashAttention-4's second trick),
in float32, in torch and as a Triton function: the fit (``fit_exp2``, Lawson's iteration on the
largest relative error), the checks against float64 on a dense set (``dense_points``, ``BOUND``)
and the picture. ``reference_exp2`` is the method: clamp at -126, x = n + f, 2^n p(f).
"""
from __future__ import annotations

import functools
import math

import matplotlib.pyplot as plt
import numpy as np
import torch
import triton
import triton.language as tl

from flashbook.check import CheckFailure, report, require_implemented, run_student
from flashbook.device import current

BOUND = 1e-4           # largest relative error allowed: a fifth of float16's unit roundoff 2^-11
LOWEST = -126.0        # below this, 2^x may be returned as anything in [0, 2^-126]
TINY = 2.0 ** -126
BELOW = torch.tensor([-126.5, -127.0, -150.0, -1000.0, -float("inf")])   # 2^x in [0, TINY]


@functools.cache
def fit_exp2(degree: int, lo: float = -0.5, hi: float = 0.5) -> tuple[float, ...]:
    """(c0, c1, ..., c_degree) of p(f) = sum c_i f^i ~ 2^f on [lo, hi], minimising the largest
    relative error, as float32 values (Python floats)."""
    n = 4000
    t = np.cos(np.pi * (np.arange(n) + 0.5) / n)                  # Chebyshev nodes
    f = (lo + hi) / 2 + (hi - lo) / 2 * t
    A = np.vander(f, degree + 1, increasing=True) / np.exp2(f)[:, None]
    w = np.full(n, 1.0 / n)
    for _ in range(200):                                           # Lawson: reweight by error
        sw = np.sqrt(w)
        c, *_ = np.linalg.lstsq(A * sw[:, None], sw, rcond=None)
        err = np.abs(A @ c - 1)
        w = w * err
        w /= w.sum()
    return tuple(float(x) for x in c.astype(np.float32))


def fit_error(degree: int, lo: float = -0.5, hi: float = 0.5) -> float:
    """The largest relative error of ``fit_exp2(degree, lo, hi)`` on [lo, hi], in float64."""
    f = np.linspace(lo, hi, 20001)
    c = np.array(fit_exp2(degree, lo, hi), dtype=np.float64)
    return float(np.abs(np.polyval(c[::-1], f) / np.exp2(f) - 1).max())


def all_floats(lo: float, hi: float, step: int = 1) -> torch.Tensor:
    """Every float32 x with lo <= x < hi (both of one sign, in one or more binades), or every
    ``step``-th of them: their bit patterns are consecutive integers."""
    a, b = (torch.tensor([v], dtype=torch.float32).view(torch.int32).item() for v in (lo, hi))
    if lo < 0:                                   # negative floats: larger magnitude, larger bits
        a, b = b + 1, a + 1
    return torch.arange(a, b, step, dtype=torch.int32).view(torch.float32)


def dense_points(hidden: bool = False, triton_kernel: bool = False) -> torch.Tensor:
    """The x at which the checks measure: a uniform grid of [-126, 0], every integer in it, every
    float32 in [-1, -1/2) (every 8th in the Triton check: the interpreter is slower), a grid of
    (0, 8], and in the hidden checks every float32 of two more binades."""
    step = 8 if triton_kernel else 1
    parts = [torch.linspace(LOWEST, 0.0, (1 << 20) + 1), torch.arange(-126.0, 1.0),
             all_floats(-1.0, -0.5, step), torch.linspace(0.0, 8.0, 1 << 14)[1:]]
    if hidden:
        parts += [all_floats(-64.0, -32.0, 4 * step), all_floats(-0.25, -0.125, 4 * step),
                  torch.linspace(-125.9990234375, -0.0009765625, (1 << 19) + 7)]
    return torch.cat(parts)


def _errors(y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    want = torch.exp2(x.double())
    return (y.double() / want - 1).abs().nan_to_num(nan=math.inf)


def _diagnose(x: torch.Tensor, err: torch.Tensor, y: torch.Tensor) -> str:
    """Which mistake produces this error pattern (the worst error is above the bound)."""
    xd = x.double()
    ratio = (y.double() / torch.exp2(xd))
    mid = ratio[(xd > -100) & (xd < -1)].median().item()
    if abs(mid - 2) < 0.05 or abs(mid - 0.5) < 0.05:
        return (f"The result is {mid:.3g} times 2^x almost everywhere: 2^n is off by a factor "
                "of two. float32's exponent field holds n + 127 (bits 23-30): 2^n is "
                "((n + 127) << 23) read as a float32.")
    near = err[(xd >= -0.5) & (xd <= 0)].max().item()
    far = err[xd <= -64].max().item()
    if far > 100 * max(near, BOUND):
        return ("The error grows with |x| (largest %.3g on [-0.5, 0], %.3g below -64): no "
                "polynomial of low degree follows 2^x over [-126, 0]. Reduce the range first: "
                "x = n + f with n an integer, 2^x = 2^n * p(f)." % (near, far))
    g = xd - torch.floor(xd)                          # position inside each unit interval
    low = err[(g > 0.02) & (g < 0.45)].max().item()
    high = err[(g > 0.55) & (g < 0.98)].max().item()
    if max(low, high) > 5 * min(low, high):
        side = "just below" if high > low else "just above"
        return (f"The error is {max(low, high):.3g} {side} each integer but "
                f"{min(low, high):.3g} on the other half of each unit interval: the reduced "
                "argument f = x - n falls outside the interval the coefficients were fitted on "
                "(round(x) gives f in [-1/2, 1/2], floor(x) gives f in [0, 1): the reduction "
                "and the fit must agree).")
    return (f"The error is about {max(low, high):.3g} on every unit interval: the reduction is "
            "right but the polynomial itself is not accurate enough; raise the degree (the "
            "figure above gives each degree's error).")


def _judge(y, x, what: str) -> float:
    if not isinstance(y, torch.Tensor) or y.shape != x.shape:
        raise CheckFailure(f"{what}: expected a tensor of x's shape {tuple(x.shape)}, got "
                           f"{getattr(y, 'shape', type(y).__name__)}.")
    if y.dtype != torch.float32:
        raise CheckFailure(f"{what}: returned {y.dtype}; compute and return float32.")
    err = _errors(y, x)
    worst = int(err.argmax())
    if err[worst] > BOUND:
        raise CheckFailure(
            f"{what}: largest relative error {float(err[worst]):.3g} > {BOUND:g} (the bound), at "
            f"x = {float(x[worst]):.9g}: got {float(y[worst]):.9g}, 2^x = "
            f"{2.0 ** float(x[worst]):.9g}. {int((err > BOUND).sum())} of {x.numel()} points "
            f"exceed the bound.\n  " + _diagnose(x, err, y))
    return float(err.max())


def _judge_all(call, x, what: str) -> float:
    """``call(points, block)`` within ``BOUND`` on ``x``; no more accurate than a cubic (a higher
    degree, or the hardware exp2 that the exercise replaces); in [0, 2^-126] below -126, -inf
    included. Returns the largest error."""
    worst = _judge(call(x), x, what)
    if worst < 0.3 * fit_error(3):               # the cubic's error, with room for rounding
        raise CheckFailure(
            f"{what}: largest relative error {worst:.2e}, below any cubic's ({fit_error(3):.1e}): "
            "this is a higher-degree polynomial or the hardware exp2 (torch.exp2 / "
            "tl.math.exp2). The exercise asks for the lowest degree whose error is below the "
            f"bound {BOUND:g}: each degree costs an FMA per score on the units it relieves.")
    y = call(BELOW, 16)
    ok = torch.isfinite(y) & (y >= 0) & (y <= TINY * (1 + BOUND))
    if not bool(ok.all()):
        bad = int((~ok).nonzero()[0])
        raise CheckFailure(f"{what}: 2^x for x = {float(BELOW[bad])} gave {float(y[bad]):.6g}; "
                           f"below -126 return a value in [0, 2^-126] (clamp x at -126 first). A "
                           f"masked score is -inf and must give a weight of 0, never NaN or "
                           f"garbage.")
    return worst


def check_exp2_poly(exp2_poly, hidden: bool = False):
    """Exercise 3a: ``exp2_poly(x)`` (torch, float32), as ``_judge_all`` says."""
    require_implemented(exp2_poly, "exp2_poly")
    x, what = dense_points(hidden), "exp2_poly"
    worst = _judge_all(lambda t, block=None: run_student(exp2_poly, t.clone(), what=what), x,
                       what)
    report("polynomial exp2 (torch, float32)", x.numel() + BELOW.numel(), hidden=hidden,
           extra=f" (largest relative error {worst:.2e} <= {BOUND:g})")


# ---------------------------------------------------------------- inside a Triton kernel
def _exp2_probe(X, Y, n, EXP2: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    x = tl.load(X + offs, mask=ok, other=0.0)
    tl.store(Y + offs, EXP2(x), mask=ok)


def _softmax_probe(X, Y, n_cols, EXP2: tl.constexpr, BLOCK: tl.constexpr):
    """One row of a base-2 softmax with the exponential under test."""
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    x = tl.load(X + row * n_cols + offs, mask=offs < n_cols, other=float("-inf"))
    p = EXP2(x - tl.max(x, 0))
    tl.store(Y + row * n_cols + offs, p / tl.sum(p, 0), mask=offs < n_cols)


@functools.cache
def _probes():
    return triton.jit(_exp2_probe), triton.jit(_softmax_probe)


def run_exp2(exp2_tl, x: torch.Tensor, block: int | None = None) -> torch.Tensor:
    """``exp2_tl`` (a @triton.jit function of one tensor) applied to every element of ``x``
    (blocks of 65536 in the interpreter, which pays per operation, 1024 on a GPU)."""
    probe, _ = _probes()
    dev = current().device
    block = block or (1024 if current().gpu else 1 << 16)
    xs = x.to(dev).contiguous()
    y = torch.empty_like(xs)
    probe[(triton.cdiv(xs.numel(), block),)](xs, y, xs.numel(), EXP2=exp2_tl, BLOCK=block)
    return y.cpu()


def check_exp2_poly_triton(exp2_poly_tl, hidden: bool = False):
    """Exercise 3b: the Triton ``exp2_poly_tl`` inside a kernel, as ``_judge_all`` says, and a
    base-2 softmax built on it (rows with masked and huge logits) within 2 * BOUND."""
    require_implemented(exp2_poly_tl, "exp2_poly_tl")
    x, what = dense_points(hidden, triton_kernel=True), "exp2_poly_tl (in a Triton kernel)"
    worst = _judge_all(lambda t, block=None: run_student(run_exp2, exp2_poly_tl, t, block=block,
                                                         what=what, guard=True), x, what)
    _, probe = _probes()
    g = torch.Generator().manual_seed(9 if hidden else 3)
    rows = torch.randn(12, 100, generator=g) * torch.tensor([1.0, 5.0, 40.0]).repeat(4)[:, None]
    rows[0, 50:] = -float("inf")                                      # a masked tail
    rows[1, 7] = 1e4                                                  # one huge logit
    dev = current().device
    xs, out = rows.to(dev), torch.empty(rows.shape, device=dev)
    run_student(lambda: probe[(rows.shape[0],)](xs, out, rows.shape[1], EXP2=exp2_poly_tl,
                                                BLOCK=128), what=what + ", softmax", guard=True)
    want = torch.softmax(rows.double() * math.log(2), -1)
    err = ((out.cpu().double() - want).abs() / want.clamp_min(1e-30))[want > 1e-30]
    if not bool((err <= 2 * BOUND).all()) or not bool(torch.isfinite(out).all()):
        raise CheckFailure(f"{what}, softmax: a base-2 softmax built on it is off by up to "
                           f"{float(err.nan_to_num(nan=math.inf).max()):.3g} relative (allowed "
                           f"{2 * BOUND:g}); rows 0-11 have masked (-inf) tails and huge logits.")
    report("polynomial exp2 (Triton)", x.numel() + BELOW.numel() + rows.shape[0], hidden=hidden,
           extra=f" (largest relative error {worst:.2e} <= {BOUND:g})")


# -------------------------------------------------------------------------- pictures
def reference_exp2(x: torch.Tensor, coeffs, reduction: str = "round") -> torch.Tensor:
    """The method in torch float32 with given coefficients (for the figures and tests)."""
    x = torch.clamp(x, min=LOWEST)
    n = torch.round(x) if reduction == "round" else torch.floor(x)
    f = x - n
    p = torch.full_like(x, coeffs[-1])
    for c in coeffs[-2::-1]:
        p = p * f + c
    return p * ((n.to(torch.int32) + 127) << 23).view(torch.float32)


def plot_exp2_error(degrees=(2, 3, 4), lo: float = -3.0, hi: float = 0.0, extra=None):
    """Relative error of 2^n p(f) on [lo, hi] for polynomial degrees ``degrees`` (round
    reduction), with the bound; ``extra``: {label: callable(x) -> y} drawn too."""
    x = torch.linspace(lo, hi, 30001)
    fig, ax = plt.subplots(figsize=(8, 3.6))
    for i, deg in enumerate(degrees):
        err = _errors(reference_exp2(x, fit_exp2(deg)), x)
        ax.semilogy(x, err.clamp_min(1e-9), lw=0.8, color=f"C{i}",
                    label=f"degree {deg} (largest {fit_error(deg):.1e})")
    for j, (label, fn) in enumerate((extra or {}).items()):
        ax.semilogy(x, _errors(fn(x), x).clamp_min(1e-9), lw=0.8, color=f"C{len(degrees) + j}",
                    label=label)
    for y, text, color, ls in ((BOUND, f"bound {BOUND:g}", "black", "--"),
                               (2.0 ** -11, "float16 unit roundoff 2^-11", "0.5", ":"),
                               (2.0 ** -24, "float32 unit roundoff 2^-24", "0.5", ":")):
        ax.axhline(y, color=color, ls=ls, lw=1)
        ax.text(lo, y * 1.3, text, fontsize=8, color="black" if ls == "--" else "0.4")
    ax.set_xlabel("x")
    ax.set_ylabel("|p / 2^x - 1|")
    ax.set_ylim(1e-9, 1)
    ax.set_title("Relative error of 2^n p(x - n), n = round(x), float32 evaluation", fontsize=10)
    ax.legend(fontsize=8, loc="upper right")
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    return fig
