"""Chapter 6, Exercises 5-7 (FP8 attention): graded on a CPU with PyTorch's e4m3 dtype.

* ``check_block_quantization`` (5): every block's scale is its amax / 448 (computed here from
  x), the block's largest element lands on +-448, and every element is within the rounding
  bound ``max(2**-4 |x|, 2**-10 scale)`` of its dequantized value.
* ``check_rotation`` (6): orthogonal, Hadamard-shaped (every entry +-1/sqrt(d)), a function of
  the seed, Q K^T unchanged, and on inputs with outlier channels the error of the e4m3 Q K^T
  (one scale per tensor here, so that this exercise does not lean on Exercise 5) at least
  ``ROTATION_GAIN`` times smaller.
* ``check_fp8_tiles`` (7): the online softmax over random e4m3 tiles with random block scales,
  against float64 attention over the values they encode: what is left is P's rounding to e4m3,
  at most 2**-4 of max |V|.
"""
from __future__ import annotations

import math

import torch

from flashbook.check import CheckFailure, report, require_implemented, run_student

from .fp8 import E4M3, E4M3_MAX

__all__ = ["check_block_quantization", "check_rotation", "check_fp8_tiles", "outlier_inputs",
           "ROTATION_GAIN", "quantization_cases", "tile_cases"]

ROTATION_GAIN = 1.5     # the FA3 paper reports 2.6x lower error with incoherent processing


def outlier_inputs(shape, seed: int, outliers: int = 4, size: float = 20.0) -> torch.Tensor:
    """Gaussian float32 ``shape`` (..., d) whose first ``outliers`` channels are ``size`` times
    larger: the activation outliers of large language models that one scale per block serves
    badly."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    x[..., :outliers] *= size
    return x


def quantization_cases(hidden: bool = False) -> list[tuple[tuple, int, str]]:
    """(shape, block, kind): kind "normal", "outliers" or "zero-block" (one block all zero)."""
    cases = [((64, 32), 16, "normal"), ((2, 3, 64, 16), 32, "outliers")]
    if hidden:
        cases += [((128, 64), 64, "outliers"), ((4, 96, 8), 32, "zero-block"),
                  ((16, 128), 16, "normal")]
    return cases


def _case_input(shape, kind: str, seed: int) -> torch.Tensor:
    x = outlier_inputs(shape, seed) if kind == "outliers" else \
        torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 3
    if kind == "zero-block":
        x[..., :shape[-2] // 3, :] = 0
    return x


def check_block_quantization(quantize, hidden: bool = False) -> None:
    """Exercise 5: ``quantize(x, block)`` -> (e4m3 values like x, fp32 scales (..., N/block))."""
    title = "quantize_blocks"
    require_implemented(quantize, title)
    cases = quantization_cases(hidden)
    for i, (shape, block, kind) in enumerate(cases):
        x = _case_input(shape, kind, 100 + i)
        what = f"{title}, x {tuple(shape)} ({kind}), block {block}"
        out = run_student(quantize, x.clone(), block, what=what)
        if not (isinstance(out, tuple) and len(out) == 2):
            raise CheckFailure(f"{what}: return (values, scales), got {type(out).__name__}.")
        values, scales = out
        if not isinstance(values, torch.Tensor) or values.dtype != E4M3 or values.shape != x.shape:
            raise CheckFailure(f"{what}: values must be a torch.float8_e4m3fn tensor of x's shape "
                               f"{tuple(x.shape)}; got {getattr(values, 'dtype', values)!r} "
                               f"{tuple(getattr(values, 'shape', ()))}.")
        want_shape = (*shape[:-2], shape[-2] // block)
        if not isinstance(scales, torch.Tensor) or tuple(scales.shape) != want_shape:
            raise CheckFailure(f"{what}: scales must have shape {want_shape} (one per block of "
                               f"{block} rows); got {tuple(getattr(scales, 'shape', ()))}.")
        blocks = x.reshape(*shape[:-2], shape[-2] // block, block * shape[-1])
        amax = blocks.abs().amax(-1)
        s = scales.float()
        nonzero = amax > 0
        want = torch.where(nonzero, amax / E4M3_MAX, torch.ones_like(amax))
        off = torch.where(nonzero, (s / want - 1).abs(), torch.zeros_like(s))
        if bool((off > 1e-5).any()):
            bad = torch.stack(torch.unravel_index(off.argmax(), off.shape))  # the worst block
            raise CheckFailure(
                f"{what}: block {tuple(bad.tolist())} has scale {s[tuple(bad)].item():.4g}; its "
                f"amax is {amax[tuple(bad)].item():.4g}, so the scale should be amax / 448 = "
                f"{(amax[tuple(bad)] / E4M3_MAX).item():.4g} (the block's largest element "
                f"becomes +-448, e4m3's largest finite value: the whole range is used).")
        if not bool((s[~nonzero] > 0).all()):
            raise CheckFailure(f"{what}: an all-zero block needs a positive scale (1, say): "
                               f"dividing by amax / 448 = 0 gives NaN.")
        back = values.float().reshape(blocks.shape) * s[..., None]
        if not torch.isfinite(back).all():
            raise CheckFailure(f"{what}: the dequantized values are not all finite.")
        err = (back - blocks).abs()
        bound = torch.maximum(2.0 ** -4 * blocks.abs(), 2.0 ** -10 * s[..., None]) * 1.0001
        if bool((err > bound).any()):
            j = (err - bound).argmax().item()
            raise CheckFailure(
                f"{what}: an element {blocks.flatten()[j].item():.5g} came back as "
                f"{back.flatten()[j].item():.5g}, off by more than e4m3's rounding (half a unit "
                f"in the last place: 2**-4 of the value, or 2**-10 of the scale near zero). Round "
                f"x / scale to e4m3 (`.to(torch.float8_e4m3fn)`), clamped to +-448.")
    report(title, len(cases), hidden=hidden)


def _qk_error(q, k) -> float:
    """RMS error of Q K^T from e4m3 Q and K (one scale per tensor), relative to its RMS."""
    def e4m3(x):
        scale = x.abs().max() / E4M3_MAX
        return (x / scale).to(E4M3).double() * scale
    exact = q.double() @ k.double().T
    approx = e4m3(q.float()) @ e4m3(k.float()).T
    return ((approx - exact).pow(2).mean().sqrt() / exact.pow(2).mean().sqrt()).item()


def check_rotation(random_rotation, hidden: bool = False) -> None:
    """Exercise 6: ``random_rotation(d, seed)`` -> (d, d) float32 H_d diag(+-1) / sqrt(d)."""
    title = "random_rotation"
    require_implemented(random_rotation, title)
    dims = (16, 64) if not hidden else (32, 128)
    for d in dims:
        what = f"{title}({d}, seed)"
        m = run_student(random_rotation, d, 0, what=what)
        if not isinstance(m, torch.Tensor) or tuple(m.shape) != (d, d):
            raise CheckFailure(f"{what}: expected a ({d}, {d}) tensor, got "
                               f"{tuple(getattr(m, 'shape', ()))}.")
        m = m.double()
        gram = m @ m.T
        if not torch.allclose(gram, torch.eye(d, dtype=torch.float64), atol=1e-5):
            raise CheckFailure(
                f"{what}: M M^T should be the identity (an orthogonal M keeps (QM)(KM)^T = "
                f"Q K^T); its diagonal is about {gram.diagonal().mean().item():.3g}. A Hadamard "
                f"matrix of +-1 entries needs the factor 1 / sqrt(d).")
        if not torch.allclose(m.abs(), torch.full_like(m, 1 / math.sqrt(d)), atol=1e-6):
            raise CheckFailure(
                f"{what}: every entry should be +-1/sqrt(d) (a Hadamard matrix with random "
                f"signs): that is what spreads one channel's outlier over all d channels.")
        again, other = (run_student(random_rotation, d, s, what=what) for s in (0, 1))
        if not torch.equal(again.double(), m):
            raise CheckFailure(f"{what}: two calls with the same seed gave different matrices.")
        if torch.equal(other.double(), m):
            raise CheckFailure(f"{what}: seeds 0 and 1 gave the same matrix: the signs must be "
                               f"random (drawn from a generator seeded with `seed`).")
        q, k = outlier_inputs((96, d), 7 + d), outlier_inputs((80, d), 8 + d)
        rq, rk = q.double() @ m, k.double() @ m
        if not torch.allclose(rq @ rk.T, q.double() @ k.double().T, atol=1e-6 * d * 400):
            raise CheckFailure(f"{what}: (QM)(KM)^T differs from Q K^T.")
        plain, rotated = _qk_error(q, k), _qk_error(rq, rk)
        if rotated * ROTATION_GAIN > plain:
            raise CheckFailure(
                f"{what}: on inputs with outlier channels, Q K^T from e4m3 Q and K has relative "
                f"error {plain:.2e} without the rotation and {rotated:.2e} with it; incoherent "
                f"processing should cut it at least {ROTATION_GAIN}x.")
    report(title, len(dims), hidden=hidden)


def tile_cases(hidden: bool = False) -> list[tuple[int, int, int, int, str]]:
    """(n_q, n_k, d, block, kind) of one head."""
    cases = [(64, 64, 32, 16, "normal"), (32, 96, 16, 32, "outliers")]
    if hidden:
        cases += [(128, 64, 64, 64, "outliers"), (16, 160, 32, 16, "normal"),
                  (96, 96, 64, 32, "outliers")]
    return cases


def _random_blocks(n: int, d: int, block: int, kind: str, seed: int):
    """(e4m3 (n, d), fp32 scales (n / block,)): random values in e4m3's range (with ``kind``
    "outliers", four channels 20x larger, clipped at 448) and a random scale per block."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g) * 60
    if kind == "outliers":
        x[:, :4] *= 20
    scales = 2.0 ** (torch.rand(n // block, generator=g) * 6 - 7)      # 2**-7 .. 2**-1
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), scales


def check_fp8_tiles(fp8_attention_tiles, hidden: bool = False) -> None:
    """Exercise 7: ``fp8_attention_tiles(q8, qs, k8, ks, v8, vs, block, scale)`` -> O (n_q, d)
    float32, one head, e4m3 inputs with a scale per block of ``block`` rows."""
    title = "fp8_attention_tiles"
    require_implemented(fp8_attention_tiles, title)
    cases = tile_cases(hidden)
    for i, (n_q, n_k, d, block, kind) in enumerate(cases):
        (q8, qs), (k8, ks), (v8, vs) = (_random_blocks(n, d, block, kind, 200 + 10 * i + j)
                                        for j, n in enumerate((n_q, n_k, n_k)))
        scale = 1 / math.sqrt(d)
        what = f"{title}, n_q={n_q}, n_k={n_k}, d={d}, block {block} ({kind} inputs)"
        o = run_student(fp8_attention_tiles, q8, qs, k8, ks, v8, vs, block, scale, what=what)
        if not isinstance(o, torch.Tensor) or tuple(o.shape) != (n_q, d):
            raise CheckFailure(f"{what}: expected O of shape ({n_q}, {d}), got "
                               f"{tuple(getattr(o, 'shape', ()))}.")
        dq, dk, dv = (t.double() * s.double().repeat_interleave(block)[:, None]
                      for t, s in ((q8, qs), (k8, ks), (v8, vs)))
        want = torch.softmax(dq @ dk.T * scale, dim=-1) @ dv
        err = (o.double() - want).abs().max().item()
        bound = 2.0 ** -4 * dv.abs().max().item()
        if not math.isfinite(err) or err > bound:
            raise CheckFailure(
                f"{what}: max |O - attention of the dequantized inputs| = {err:.3g}; only P's "
                f"rounding to e4m3 may differ (at most 2**-4 of max |V| = {bound:.3g}). S = "
                f"(Q8 K8^T) x Q's block scale x K's block scale x scale; P = exp(S - m) cast to "
                f"e4m3 as it is (it lies in [0, 1]); acc = acc x alpha + (P8 V8) x V's block "
                f"scale; l sums the unrounded P.")
    report(title, len(cases), hidden=hidden)
