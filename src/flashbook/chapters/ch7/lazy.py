"""Chapter 7, Exercise 2: lazy rescaling (FlashAttention-4's first trick) in Chapter 3's Triton
kernel ``attn_fwd_lazy`` (``flashbook.lazy_kernels``, generated from the chapter's cell, with the
student's ``lazy_update`` as ``UPDATE`` and an exponential as ``EXP2``; it stores each program's
rescale count): its launcher, the check, the rule replayed in float64 (``simulate_rescales``)
and the picture.
"""
from __future__ import annotations

import math

import matplotlib.pyplot as plt
import numpy as np
import torch

from flashbook.cases import cdiv, seeded, validate_qkv, validate_scale
from flashbook.check import CheckFailure, assert_close, report, require_implemented, run_student
from flashbook.device import current
from flashbook.lazy_kernels import attn_fwd_lazy, hw_exp2
from flashbook.plans import Launch, Plans, contiguous_strides, key
from flashbook.reference import attention
from flashbook.tiles import DTYPES, HEAD_DIMS, HEAD_DIMS_WHY, LOG2E, Config, \
    pick_config as tile_config


def pick_config(d: int, dtype: torch.dtype, capability: tuple | None) -> Config:
    """Chapter 3's one-tile configs; 16 x 16 tiles in CPU mode (many steps per row)."""
    return Config(16, 16, 4, 1) if capability is None else tile_config(d, dtype, capability)


_LAZY_PLANS = Plans()


def launch_lazy(update, q, k, v, *, tau: float, scale: float | None = None, exp2=None,
                config: Config | None = None):
    """Run ``attn_fwd_lazy`` with ``UPDATE=update`` on q (B, H, N_q, d), k and v (B, H, N_k, d),
    ``tau`` in base 2. Returns O (B, H, N_q, d), LSE (B, H, N_q) natural log, and the int32
    rescale counts (B, H, cdiv(N_q, BLOCK_M)), one a program. Planned once per metadata."""
    plan_key = key(update, q, k, v, tau, scale, exp2, config, current().capability)
    counts_shape, launch = _LAZY_PLANS.get(plan_key) or _LAZY_PLANS.remember(
        plan_key, _lazy_plan(update, q, k, v, tau, scale, exp2, config))
    o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    if launch is None:
        return o, lse, torch.zeros(counts_shape, dtype=torch.int32, device=q.device)
    counts = torch.empty(counts_shape, dtype=torch.int32, device=q.device)
    launch(q, k, v, o, lse, counts)
    return o, lse, counts


def _lazy_plan(update, q, k, v, tau, scale, exp2, config):
    """launch_lazy's checks, config and grid: (the counts' shape, the ``Launch`` or None)."""
    B, H, _, N_q, N_k, d = validate_qkv(q, k, v, name="attention_lazy", dtypes=DTYPES,
                                        head_dims=HEAD_DIMS, head_dims_why=HEAD_DIMS_WHY)
    scale = validate_scale(scale, d)
    if not (isinstance(tau, (int, float)) and tau >= 0 and math.isfinite(tau)):
        raise ValueError(f"attention_lazy: tau must be a finite number >= 0, got {tau!r}.")
    if q.dtype == torch.float16 and tau >= 15.9:
        raise ValueError(f"attention_lazy: tau={tau:g} lets an exponential reach 2^{tau:g}, past "
                         "float16's largest value 65504 (2^15.9) when P is cast to float16.")
    cfg = config or pick_config(d, q.dtype, current().capability)
    m_blocks = cdiv(N_q, cfg.BLOCK_M)
    if B * H * N_q == 0:
        return (B, H, m_blocks), None
    o_strides = contiguous_strides(q.shape)
    return (B, H, m_blocks), Launch(
        attn_fwd_lazy, (m_blocks, B * H),
        (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
         v.stride(0), v.stride(1), v.stride(2), *o_strides[:3], H, N_q, N_k, scale * LOG2E,
         float(tau)),
        dict(UPDATE=update, EXP2=exp2 or hw_exp2, HEAD_DIM=d, BLOCK_M=cfg.BLOCK_M,
             BLOCK_N=cfg.BLOCK_N, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
             num_warps=cfg.num_warps, num_stages=cfg.num_stages))


# --------------------------------------------------------------------- the rule, replayed
def simulate_rescales(q, k, *, tau: float, scale: float | None = None, block_m: int,
                      block_n: int) -> tuple[torch.Tensor, float]:
    """The rescale counts (B, H, m_blocks) of the lazy rule in float64 with the kernel's tiling
    (padded query rows score 0, as their Q rows load as 0), and the smallest |growth - tau| met:
    how close a decision came to the threshold."""
    q, k = q.cpu(), k.cpu()
    B, H, N_q, d = q.shape
    N_k = k.shape[2]
    c = (scale if scale is not None else 1 / math.sqrt(d)) * LOG2E
    s = torch.matmul(q.double(), k.double().transpose(-1, -2)) * c      # (B, H, N_q, N_k)
    m_blocks = cdiv(N_q, block_m)
    s = torch.cat([s, s.new_zeros(B, H, m_blocks * block_m - N_q, N_k)], 2)
    s = s.view(B, H, m_blocks, block_m, N_k)
    counts = torch.zeros(B, H, m_blocks, dtype=torch.int32)
    margin = math.inf
    ref = torch.full((B, H, m_blocks, block_m), -math.inf, dtype=torch.float64)
    for start in range(0, N_k, block_n):
        new = torch.maximum(ref, s[..., start:start + block_n].amax(-1))
        grow = (new - ref).amax(-1)                                      # (B, H, m_blocks)
        finite = torch.isfinite(grow)
        if finite.any():
            margin = min(margin, float((grow[finite] - tau).abs().min()))
        move = grow > tau
        counts += move.to(torch.int32)
        ref = torch.where(move[..., None], new, ref)
    return counts, margin


# ------------------------------------------------------------------------ the check
def _growing(B, H, N, d, per_tile, block_n, seed, dtype):
    """Logits that grow along the keys by about ``per_tile`` (base 2) per key tile, in every
    row: the running max rises on every tile, so Chapter 3's kernel rescales on every one."""
    q = seeded((B, H, N, d), seed, scale=0.1, device="cpu")
    k = seeded((B, H, N, d), seed + 1, scale=0.1, device="cpu")
    v = seeded((B, H, N, d), seed + 2, device="cpu")
    q[..., 0] = 1.0
    c = 1 / math.sqrt(d) * LOG2E
    k[..., 0] = torch.arange(N, dtype=torch.float32) * per_tile / (block_n * c)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def lazy_cases(hidden: bool = False):
    """(name, q, k, v, max_growth)"""
    bn = pick_config(16, torch.float32, current().capability).BLOCK_N
    dev = current().device
    f32, f16 = torch.float32, torch.float16
    cases = [
        ("random logits", *(seeded((1, 2, 40, 16), 7 + i, device="cpu") for i in range(3)), 256.),
        ("logits growing 3 (base 2) per key tile", *_growing(1, 2, 96, 16, 3., bn, 11, f32), 256.),
        ("a huge logit late in the row (key 70 of 77)", *_spike(1, 2, 33, 16, 70, 21, f32, 77),
         256.),
        ("a huge logit first, then normal ones", *_spike(1, 1, 32, 16, 0, 31, f32), 256.),
        ("max_growth 16: logits growing 1.5 per tile", *_growing(1, 2, 64, 16, 1.5, bn, 61, f32),
         16.)]
    if hidden:
        cases += [
            ("float16, logits growing 5 per key tile", *_growing(2, 1, 64, 32, 5., bn, 41, f16),
             256.),
            ("float16, a huge logit in the middle", *_spike(1, 2, 48, 32, 40, 51, f16), 256.),
            ("max_growth 4096, growing 5 per tile", *_growing(1, 1, 80, 64, 5., bn, 71, f32),
             4096.)]
    return [(name, q.to(dev), k.to(dev), v.to(dev), g) for name, q, k, v, g in cases]


def _spike(B, H, N, d, at, seed, dtype, N_k=None, size=800.0):
    """Normal logits, then one key (``at``) whose logits are huge for (almost) every row: in base
    2 far past 128, so an exponential taken from a stale max overflows float32."""
    N_k = N_k or N
    q = seeded((B, H, N, d), seed, device="cpu")
    k = seeded((B, H, N_k, d), seed + 1, device="cpu")
    v = seeded((B, H, N_k, d), seed + 2, device="cpu")
    direction = q.mean(2)
    direction = direction / direction.norm(dim=-1, keepdim=True)
    q = q + 2 * direction[:, :, None, :]                 # every row leans towards the spike key
    k[:, :, at] = direction * size                       # q.k of about 2 * size for every row
    return q.to(dtype), k.to(dtype), v.to(dtype)


def check_lazy_attention(attention_lazy, hidden: bool = False):
    """Exercise 2: ``attention_lazy(q, k, v, max_growth=...) -> (O, LSE, rescales)``: O and LSE
    exact on adversarial logits, the rescale counts those of the lazy rule."""
    require_implemented(attention_lazy, "attention_lazy")
    cfg = pick_config(16, torch.float32, current().capability)
    steps = avoided = n = 0
    for name, q, k, v, growth in lazy_cases(hidden):
        what = f"attention_lazy, case '{name}' ({tuple(q.shape)}, N_k={k.shape[2]}, " \
               f"{str(q.dtype).replace('torch.', '')}, max_growth={growth:g})"
        out = run_student(attention_lazy, q, k, v, max_growth=growth, config=cfg, what=what)
        if not (isinstance(out, tuple) and len(out) == 3):
            raise CheckFailure(f"{what}: expected (O, LSE, rescales), got {type(out).__name__}.")
        o, lse, counts = out
        if not torch.isfinite(o).all():
            raise CheckFailure(
                f"{what}: O is not finite ({int((~torch.isfinite(o)).sum())} values inf or NaN): "
                "an exponential overflowed. With a reference max that lags the true max, "
                "p = 2^(s*c - m_ref) grows with every larger logit; past 2^128 it is inf in "
                "float32. The reference max must follow any growth beyond tau, however late "
                "it comes.")
        want_o, want_lse = attention(q.double(), k.double(), v.double(), return_lse=True)
        assert_close(o, want_o, what=f"{what}, output O", dims=("b", "h", "row", "col"),
                     dtype=q.dtype,
                     hint="acc and l must always share one reference max: a step that skips the "
                          "rescale keeps the old reference for the exponentials of this tile "
                          "too, and a step that rescales multiplies both acc and l by "
                          "2^(m_old - m_new).")
        assert_close(lse, want_lse, what=f"{what}, LSE", dims=("b", "h", "row"),
                     dtype=torch.float32, atol=2e-4, rtol=1e-4,
                     hint="LSE = (m_ref + log2 l) * ln 2 with the reference max the kernel kept.")
        want, margin = simulate_rescales(q, k, tau=math.log2(growth), block_m=cfg.BLOCK_M,
                                         block_n=cfg.BLOCK_N)
        assert margin > 0.05, f"internal: case '{name}' decides within {margin} of tau"
        counts = counts.cpu()
        if counts.shape != want.shape or counts.dtype != torch.int32:
            raise CheckFailure(f"{what}: rescales should be a {tuple(want.shape)} int32 tensor "
                               f"(one count per program), got {tuple(counts.shape)} {counts.dtype}.")
        if not torch.equal(counts, want):
            bad = torch.nonzero(counts != want).tolist()
            b, h, m = bad[0]
            raise CheckFailure(f"{what}: wrong rescale counts: program (b={b}, h={h}, query tile "
                               f"{m}) rescaled {int(counts[b, h, m])} times, expected "
                               f"{int(want[b, h, m])}; programs off: {len(bad)} of "
                               f"{counts.numel()}." + _diagnose(q, k, counts, growth, cfg))
        tiles = -(-k.shape[2] // cfg.BLOCK_N)
        steps += counts.numel() * tiles
        avoided += counts.numel() * tiles - int(counts.sum())
        n += 1
    report("lazy rescaling", n, hidden=hidden,
           extra=f" (exact; {avoided} of {steps} rescales avoided: Chapter 3's kernel rescales "
                 f"on every step)")


def _diagnose(q, k, counts, growth, cfg) -> str:
    """Name the bug when the counts are those of another rule."""
    tiles = -(-k.shape[2] // cfg.BLOCK_N)
    if torch.equal(counts, torch.full_like(counts, tiles)):
        return (" Your kernel rescaled on every tile: the threshold never lets a step skip "
                "(compare the growth with tau, not with 0, and skip when it is within tau).")
    if torch.equal(counts, torch.ones_like(counts)):
        return (" Your kernel moved its reference max only on the first tile: it never "
                "rescales after that.")
    alternatives = {f"tau = ln({growth:g}) = {math.log(growth):.3g}: the threshold is in natural-"
                    "log units, but m and qk_scale are in base 2 (tau = log2(max_growth))":
                    math.log(growth),
                    f"tau = {growth:g} itself: max_growth is a factor, tau its base-2 logarithm":
                    growth}
    for text, tau in alternatives.items():
        sim, _ = simulate_rescales(q, k, tau=tau, block_m=cfg.BLOCK_M, block_n=cfg.BLOCK_N)
        if torch.equal(counts, sim):
            return f" Your counts are those of {text}."
    return (" A step must rescale exactly when some row's max has grown by more than tau since "
            "the reference was last moved (grow = max over rows of m_new - m_ref > tau).")


# -------------------------------------------------------------------------- picture
def lazy_trace(logits_log2: np.ndarray, block_n: int, tau: float):
    """One row: (running max per tile, reference max per tile, steps that rescaled)."""
    ref, refs, runs, moved, run = -np.inf, [], [], [], -np.inf
    for t, start in enumerate(range(0, len(logits_log2), block_n)):
        run = max(run, float(logits_log2[start:start + block_n].max()))
        if run - ref > tau:
            ref = run
            moved.append(t)
        runs.append(run)
        refs.append(ref)
    return np.array(runs), np.array(refs), moved


def plot_lazy_trace(tau: float = 8.0, block_n: int = 128, tiles: int = 24, seed: int = 0):
    """A row whose logits drift upwards with a jump: the running max (what Chapter 3's kernel
    rescales to, on every tile it grows), the lazy reference max, and the largest exponential
    2^(max - ref) each tile then computes."""
    rng = np.random.default_rng(seed)
    n = tiles * block_n
    x = rng.normal(0, 1.0, n) + np.linspace(0, 30, n)
    x[int(n * 0.62)] += 25.0
    runs, refs, moved = lazy_trace(x, block_n, tau)
    grew = int(np.sum(np.diff(runs) > 0)) + 1
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(8, 4.6), sharex=True,
                                  gridspec_kw=dict(height_ratios=(2, 1)))
    t = np.arange(tiles)
    ax.step(t, runs, where="post", label="running max (eager: rescale when it grows)")
    ax.step(t, refs, where="post", label=f"reference max (lazy, tau = {tau:g})")
    ax.plot(moved, refs[moved], "o", color="C1", label=f"lazy rescales: {len(moved)}")
    ax.set_ylabel("max logit (base 2)")
    ax.set_title(f"One row over {tiles} key tiles: the max grows on {grew} of them; "
                 f"the lazy rule rescales {len(moved)} times", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    ax2.bar(t, np.exp2(runs - refs), color="C2")
    ax2.axhline(2 ** tau, color="C3", ls="--", lw=1)
    ax2.text(0, 2 ** tau * 1.05, f"2^tau = {2 ** tau:g}", color="C3", fontsize=8)
    ax2.set_ylabel("largest p")
    ax2.set_xlabel("key tile")
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    return fig
