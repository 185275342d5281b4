"""Chapter 7's tricks as hooks of the toolkit's Hopper FA3 roles (``flashbook.fa3_roles``), so the
benchmark times them inside Chapter 6's Gluon kernel: P's exponentials by Exercise 3's cubic,
twice or not at all (timing probes), and Exercise 2's lazy rescaling past ``TAU``. ``hooks``
gives one setting's, for ``attention_fa3`` and ``compile_for_sm90``. (Gluon resolves a jit
function's globals in its own module: the cubic's coefficients are constexprs here.)
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

__all__ = ["EXP2_MODES", "EXP2_CUBIC", "TAU", "hooks"]

TAU = 8.0                      # base 2: benchmark.TAU (a test compares them)
# the cubic for 2^f on [-1/2, 1/2] (max relative error 7.5e-5): the chapter's fit_exp2(3) in
# float32 (tests/test_ch7_bench.py compares them)
EXP2_CUBIC = (0.9999280571937561, 0.6932609677314758, 0.2426111251115799, 0.0551716648042202)
_C0, _C1, _C2, _C3 = (gl.constexpr(c) for c in EXP2_CUBIC)
_TAU = gl.constexpr(TAU)


@gluon.jit
def exp2_poly(x):
    """2^x by the cubic on the FMA units (Exercise 3): 2^n exactly, 2^f by three FMAs."""
    x = gl.maximum(x, -126.0)
    n = gl.floor(x + 0.5)                     # f in [-1/2, 1/2]
    f = x - n
    p = ((_C3 * f + _C2) * f + _C1) * f + _C0
    return p * ((n.to(gl.int32) + 127) << 23).to(gl.float32, bitcast=True)


@gluon.jit
def exp2_doubled(x):
    """Two exponentials whose product is 2^(x (1 + 2^-24)); distinct, so neither is folded."""
    return gl.exp2(x * 0.5) * gl.exp2(x * 0.50000006)


@gluon.jit
def exp2_removed(x):
    """No exponential: a clamp on the FMA units (a timing probe; O is wrong)."""
    return gl.maximum(x * 0.125 + 1.0, 0.0)


@gluon.jit
def lazy_max(m_i, m_new, rescaled):
    """The maxima move only when some row's grew by more than TAU since the last move."""
    grow = gl.max(gl.where(m_new == -float("inf"), 0.0, m_new - m_i), axis=0)
    rescaled = grow > _TAU
    return gl.where(rescaled, m_new, m_i), rescaled


@gluon.jit
def lazy_rescale(o, alpha, rescaled, o_rows: gl.constexpr):
    """O * alpha per row, only after a tile that moved the maxima (else alpha = 1)."""
    if rescaled:
        o = o * gl.expand_dims(gl.convert_layout(alpha, o_rows), 1)
    return o


EXP2_MODES = {"hw": None, "poly": exp2_poly, "doubled": exp2_doubled, "removed": exp2_removed}


def hooks(exp2: str = "hw", rescale_tau: float | None = None) -> dict:
    """The hooks of one setting: ``exp2`` a key of ``EXP2_MODES`` ("hw": the special-function
    unit, the kernel as Chapter 6 ships it), ``rescale_tau`` None (rescale at every tile) or
    ``TAU`` (lazy rescaling)."""
    if exp2 not in EXP2_MODES:
        raise ValueError(f"exp2 must be one of {sorted(EXP2_MODES)}, got {exp2!r}")
    if rescale_tau not in (None, TAU):
        raise ValueError(f"rescale_tau must be None or {TAU}, got {rescale_tau}")
    out = {} if EXP2_MODES[exp2] is None else dict(EXP2=EXP2_MODES[exp2])
    if rescale_tau is not None:
        out.update(MOVE_MAX=lazy_max, RESCALE=lazy_rescale)
    return out
