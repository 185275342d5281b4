"""Chapter 3's graded checks: the online-softmax row kernel, the 2-D tile copy (warm-up), the two
functions of the attention loop body on one tile, the attention forward (one and two query tiles
per program) and the merge of two partial states. Every launch runs under the out-of-bounds guard
in CPU mode, with NaN padding around the inputs."""
from __future__ import annotations

import dataclasses
import functools
import itertools
import math

import torch
import triton
import triton.language as tl

from flashbook import oob, reference
from flashbook.case_sweeps import dense_sweep
from flashbook.cases import AttnCase, seeded
from flashbook.check import CheckFailure, assert_close, check_attention, no_nan, report, \
    require_implemented, run_student
from flashbook.device import current

from .launch import LOG2E, Config, attention_forward, copy_tiles, merge_states, pick_config, \
    softmax_rows


def softmax_cases(hidden: bool = False):
    inf = float("inf")
    cases = [
        ("random (4, 50), float32", seeded((4, 50), 0, torch.float32, 3.0)),
        ("one column (3, 1)", seeded((3, 1), 1, torch.float32)),
        ("large logits +-1e4 (2, 40)", torch.cat([seeded((1, 40), 2, torch.float32, 1e4),
                                                  torch.full((1, 40), -1e4).to(current().device)])),
        ("-inf entries (2, 37)", seeded((2, 37), 3, torch.float32).masked_fill(
            torch.arange(37, device=current().device) % 3 == 0, -inf)),
        ("a row of only -inf (2, 20)", torch.cat([torch.full((1, 20), -inf).to(current().device),
                                                 seeded((1, 20), 4, torch.float32, 5.0)])),
    ]
    if hidden:
        cases += [
            ("3-d float16 (2, 3, 45)", seeded((2, 3, 45), 5, torch.float16, 4.0)),
            ("long rows (2, 300), logits up to 1e3", seeded((2, 300), 6, torch.float32, 300.0)),
            ("increasing row (1, 100): the max changes every block",
             torch.linspace(-50, 50, 100, device=current().device)[None].float()),
        ]
    return cases


def check_softmax_kernel(kernel, hidden: bool = False, blocks=(16, 32, 64)):
    """Exercise 1: y = softmax(x) and lse = logsumexp(x) along the last axis, for every block size.

    A row of only -inf must give y = 0 and lse = -inf. Results must not depend on BLOCK.
    """
    n = 0
    for name, x in softmax_cases(hidden):
        x = oob.embed(x.contiguous(), pad=256)
        want_y = reference.softmax(x.double())
        want_l = reference.logsumexp(x.double())
        outs = []
        for block in blocks:
            what = f"softmax kernel, case {name}, BLOCK={block}"
            y, lse = run_student(softmax_rows, kernel, x, block=block, what=what, guard=True)
            if y.dtype != x.dtype:
                raise CheckFailure(f"{what}: y has dtype {y.dtype}, expected {x.dtype}.")
            no_nan(y, what + ", y")
            no_nan(lse, what + ", lse")
            dims = [f"axis{i}" for i in range(x.dim() - 2)] + ["row", "col"]
            assert_close(y, want_y, what=what + ", y", dims=dims, dtype=x.dtype,
                         atol=1e-3 if x.dtype == torch.float16 else None,
                         hint="keep a running max m and a running sum l; when m grows, multiply l "
                              "by exp(m_old - m_new) before adding the new block's terms.")
            assert_close(lse, want_l, what=what + ", lse", dims=dims[:-1], dtype=torch.float32,
                         atol=1e-4, rtol=1e-5,
                         hint="lse = m + log(l) in natural log; a row of only -inf has lse = -inf.")
            outs.append(y)
            n += 1
        for (b1, y1), (b2, y2) in itertools.combinations(zip(blocks, outs), 2):
            diff = (y1.double() - y2.double()).abs().max().item()
            if diff > (1e-3 if x.dtype == torch.float16 else 1e-5):
                raise CheckFailure(f"softmax kernel, case {name}: BLOCK={b1} and BLOCK={b2} differ "
                                   f"by {diff:.3g}; the online softmax is exact, so the block "
                                   "size must not change the result.")
    report("online softmax kernel", n, hidden=hidden)


# ------------------------------------------------------------------ warm-up: a 2-D tile

def tile_cases(hidden: bool = False):
    """(name, x): shapes that are not multiples of the tiles, and a transposed (strided) view."""
    cases = [
        ("(37, 20) float32", seeded((37, 20), 20, torch.float32)),
        ("(5, 70) float16", seeded((5, 70), 21, torch.float16)),
        ("(37, 20) float32, a transposed view: strides (1, 37)",
         seeded((20, 37), 22, torch.float32).t()),
    ]
    if hidden:
        cases += [("(1, 1) float32", seeded((1, 1), 23, torch.float32)),
                  ("(100, 3) float16", seeded((100, 3), 24, torch.float16)),
                  ("(9, 33) float32, every other column of (9, 66): strides (66, 2)",
                   seeded((9, 66), 25, torch.float32)[:, ::2])]
    return cases


def _embedded(x: torch.Tensor) -> torch.Tensor:
    """``x`` (any strides) inside a NaN-padded buffer, with the same strides."""
    if x.is_contiguous():
        return oob.embed(x, pad=256)
    base = oob.embed(torch.empty_strided((x.storage_offset() + sum(
        (n - 1) * st for n, st in zip(x.shape, x.stride())) + 1,), (1,), dtype=x.dtype,
        device=x.device).fill_(float("nan")), pad=256)
    view = base.as_strided(x.shape, x.stride(), x.storage_offset())
    view.copy_(x)
    return view


def check_tile_load(kernel, hidden: bool = False, blocks=((16, 16), (8, 32))):
    """Warm-up: each program copies one (BLOCK_R x BLOCK_C) tile of X into Y, masked to the tensor.

    Shapes are not multiples of the tiles (the tails need the mask), one input is a transposed
    view (the strides must be used), and in CPU mode every address is checked by the guard.
    """
    n = 0
    for name, x in tile_cases(hidden):
        x = _embedded(x)
        for br, bc in blocks:
            what = f"copy_tile_kernel, case {name}, BLOCK_R={br}, BLOCK_C={bc}"
            y = run_student(copy_tiles, kernel, x, block_r=br, block_c=bc, what=what, guard=True)
            no_nan(y, what)
            assert_close(y, x.double(), what=what, dims=("row", "col"), dtype=x.dtype, atol=0.0,
                         rtol=0.0,
                         hint="element (r, c) of X is at X + r * stride_xr + c * stride_xc (and of "
                              "Y at Y + r * stride_yr + c * stride_yc): rows[:, None] times the row "
                              "stride plus cols[None, :] times the column stride; mask with "
                              "(rows[:, None] < n_rows) & (cols[None, :] < n_cols).")
            n += 1
    report("tile copy kernel", n, hidden=hidden)


# ----------------------------------------------- Exercise 2's loop body, one tile at a time

def _scores_probe(Q, K, S, N_k, start_n, SCORES: tl.constexpr, MASKED: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                  DOT_PRECISION: tl.constexpr):
    """Calls the student's attn_scores on one K tile, as attn_fwd_kernel does (K contiguous)."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + offs_m[:, None] * HEAD_DIM + offs_d[None, :])
    k_ptrs = K + (start_n + offs_n)[None, :] * HEAD_DIM + offs_d[:, None]
    s = SCORES(q, k_ptrs, start_n, N_k, offs_n, MASKED, DOT_PRECISION)
    tl.store(S + offs_m[:, None] * BLOCK_N + offs_n[None, :], s)


def _update_probe(S, V, ACC, L, M, N_k, start_n, qk_scale, UPDATE: tl.constexpr,
                  MASKED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Calls the student's attn_update on one state and one V tile; writes the new state back."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    s = tl.load(S + offs_m[:, None] * BLOCK_N + offs_n[None, :])
    acc = tl.load(ACC + offs_m[:, None] * HEAD_DIM + offs_d[None, :])
    l_i = tl.load(L + offs_m)
    m_i = tl.load(M + offs_m)
    v_ptrs = V + (start_n + offs_n)[:, None] * HEAD_DIM + offs_d[None, :]
    acc, l_i, m_i = UPDATE(acc, l_i, m_i, s, v_ptrs, start_n, N_k, qk_scale, offs_n, MASKED,
                           DOT_PRECISION)
    tl.store(ACC + offs_m[:, None] * HEAD_DIM + offs_d[None, :], acc)
    tl.store(L + offs_m, l_i)
    tl.store(M + offs_m, m_i)


@functools.cache
def _probes():
    """The probe kernels, compiled (or interpreted) on first use, after ``flashbook.setup()``."""
    return triton.jit(_scores_probe), triton.jit(_update_probe)


def tile_step_cases(hidden: bool = False):
    """(name, BLOCK_M, BLOCK_N, d, N_k, start_n, dtype, state): one tile of attn_fwd_kernel's loop.
    ``N_k < start_n + BLOCK_N`` is the masked tail (K and V end inside the tile); ``state``:
    "start" (m = -inf, l = 0, acc = 0), "running" (some rows' maximum grows, others' does not)."""
    cases = [
        ("first tile, full (MASKED=False)", 16, 16, 16, 32, 0, torch.float32, "start"),
        ("second tile, running state, full (MASKED=False)", 16, 16, 16, 32, 16, torch.float32,
         "running"),
        ("tail tile: keys 16-20 of N_k=21 (MASKED=True)", 16, 16, 16, 21, 16, torch.float32,
         "running"),
    ]
    if hidden:
        cases += [("float16, d=32, tail of 3 keys (MASKED=True)", 16, 32, 32, 35, 32,
                   torch.float16, "running"),
                  ("float16, d=64, first tile, full", 32, 16, 64, 16, 0, torch.float16, "start")]
    return cases


def _state(kind: str, BM: int, d: int, s_max: torch.Tensor, seed: int):
    """(acc, l, m) before the tile, float32, m in base 2: "running" puts half the rows' maximum
    above this tile's (no growth) and half below (the maximum grows: alpha < 1)."""
    dev = current().device
    if kind == "start":
        return (torch.zeros((BM, d), device=dev), torch.zeros(BM, device=dev),
                torch.full((BM,), -math.inf, device=dev))
    shift = torch.where(torch.arange(BM, device=dev) % 2 == 0, 3.0, -3.0)
    m = (s_max + shift).float()
    return (seeded((BM, d), seed, torch.float32, 4.0),
            (1.0 + seeded((BM,), seed + 1, torch.float32).abs() * 5), m)


def check_attn_tile_step(attn_scores, attn_update, hidden: bool = False):
    """Exercise 2, first cell: ``attn_scores`` and ``attn_update`` on one tile each, launched by
    small probe kernels that call them as attn_fwd_kernel does, and compared with float64.

    attn_scores: S = Q K^T for the keys start_n + offs_n, -inf for keys >= N_k when MASKED (K ends
    inside the tile: its loads must be masked). attn_update, from a given (acc, l, m) and S:
    m' = max(m, rowmax(S) * c), P = exp2(S * c - m'), alpha = exp2(m - m'), l' = l * alpha +
    rowsum(P), acc' = acc * alpha + P V (V masked like K). Each function is checked on its own,
    so the message says which one is wrong.
    """
    require_implemented(attn_scores, "attn_scores")
    require_implemented(attn_update, "attn_update")
    scores_probe, update_probe = _probes()
    n = 0
    for i, (name, BM, BN, d, N_k, start_n, dtype, state) in enumerate(tile_step_cases(hidden)):
        masked = N_k < start_n + BN
        precision = "ieee" if dtype == torch.float32 else "tf32"
        tol = dict(dtype=torch.float32) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
        q = oob.embed(seeded((BM, d), 600 + i, dtype), pad=256)
        k = oob.embed(seeded((N_k, d), 700 + i, dtype), pad=256)
        v = oob.embed(seeded((N_k, d), 800 + i, dtype), pad=256)
        keys = torch.arange(start_n, start_n + BN, device=q.device)
        valid = keys < N_k
        k_tile = torch.zeros((BN, d), dtype=torch.float64, device=k.device)
        v_tile = torch.zeros((BN, d), dtype=torch.float64, device=k.device)
        end = min(N_k, start_n + BN)
        k_tile[valid] = k[start_n:end].double()
        v_tile[valid] = v[start_n:end].double()
        want_s = q.double() @ k_tile.T
        want_s[:, ~valid] = -math.inf
        # ---- attn_scores
        what = f"attn_scores, case '{name}' (BLOCK_M={BM}, BLOCK_N={BN}, d={d}, {dtype})"
        s = torch.empty((BM, BN), dtype=torch.float32, device=q.device)
        run_student(lambda: scores_probe[(1,)](q, k, s, N_k, start_n, SCORES=attn_scores,
                                               MASKED=masked, BLOCK_M=BM, BLOCK_N=BN,
                                               HEAD_DIM=d, DOT_PRECISION=precision),
                    what=what, guard=True)
        if masked and not torch.isneginf(s[:, ~valid]).all():
            raise CheckFailure(
                f"{what}: the scores of keys past N_k={N_k} (columns {int(valid.sum())}-{BN - 1} "
                f"of the tile) must be -inf, got values like "
                f"{float(s[:, ~valid].flatten()[0]):.4g}.\n  Hint: with MASKED, set "
                "them with tl.where(kv_ok[None, :], s, float('-inf')) after the dot, so they get "
                "weight exp2(-inf) = 0.")
        no_nan(s, what + ", S")
        assert_close(s, want_s, what=what + ", S", dims=("row", "key"), **tol,
                     hint="S = tl.dot(q, kT) with kT the (HEAD_DIM, BLOCK_N) tile that k_ptrs "
                          "points at; with MASKED, load it with mask=kv_ok[None, :], other=0.0.")
        # ---- attn_update, from the exact scores
        c = 0.7 * LOG2E
        s_in = want_s.float()
        acc0, l0, m0 = _state(state, BM, d, s_in.amax(1) * c, 900 + i)
        what = f"attn_update, case '{name}', {state} state (BLOCK_M={BM}, BLOCK_N={BN}, d={d}, {dtype})"
        acc, l_i, m_i = acc0.clone(), l0.clone(), m0.clone()
        run_student(lambda: update_probe[(1,)](s_in, v, acc, l_i, m_i, N_k, start_n, c,
                                               UPDATE=attn_update, MASKED=masked, BLOCK_M=BM,
                                               BLOCK_N=BN, HEAD_DIM=d, DOT_PRECISION=precision),
                    what=what, guard=True)
        m_new = torch.maximum(m0.double(), s_in.double().amax(1) * c)
        p = torch.exp2(s_in.double() * c - m_new[:, None])
        alpha = torch.exp2(m0.double() - m_new)
        want_l = l0.double() * alpha + p.sum(1)
        want_acc = acc0.double() * alpha[:, None] + p @ v_tile
        for got, want, label, hint in (
                (m_i, m_new, "running max m", "m_new = max(m_i, rowmax(s) * qk_scale): the "
                 "maximum in base-2 units (qk_scale already holds log2(e))."),
                (l_i, want_l, "running sum l", "l_new = l_i * alpha + rowsum(p) with p = exp2(s * "
                 "qk_scale - m_new[:, None]) and alpha = exp2(m_i - m_new): the old sum must be "
                 "rescaled whenever the maximum grows."),
                (acc, want_acc, "accumulator acc", "acc_new = acc * alpha[:, None] + p @ v: the old "
                 "accumulator is rescaled like l, then tl.dot(p.to(v.dtype), v, acc); with MASKED, "
                 "load V with mask=kv_ok[:, None], other=0.0.")):
            no_nan(got, f"{what}, {label}")
            assert_close(got, want, what=f"{what}, {label}",
                         dims=("row", "col") if got.dim() == 2 else ("row",), hint=hint,
                         **(tol if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)))
        n += 1
    report("attention tile step (attn_scores, attn_update)", n, hidden=hidden)


def attention_cases(hidden: bool = False) -> list[AttnCase]:
    cases = [
        AttnCase("one tile", B=1, H_q=2, N_q=16, N_k=16, d=16),
        AttnCase("tails: N not a multiple of the tile", B=1, H_q=2, N_q=13, N_k=37, d=32),
        AttnCase("float16, d=64", B=2, H_q=1, N_q=64, N_k=64, d=64, dtype=torch.float16),
        AttnCase("N=1", B=1, H_q=1, N_q=1, N_k=1, d=16),
        AttnCase("large logits", B=1, H_q=1, N_q=24, N_k=40, d=16, logit_boost=60.0),
        AttnCase("strided inputs, explicit scale, B=2, H=3", B=2, H_q=3, N_q=19, N_k=21, d=16,
                 layout="bnhd", scale=0.3),
        AttnCase("long rows, float32", B=1, H_q=1, N_q=40, N_k=300, d=16, logit_boost=2.0),
    ]
    if hidden:
        cases += [
            AttnCase("d=128 float16, large logits", B=1, H_q=1, N_q=40, N_k=72, d=128,
                     dtype=torch.float16, logit_boost=6.0),
            AttnCase("d=128 float32", B=1, H_q=1, N_q=17, N_k=33, d=128),
            AttnCase("more queries than keys", B=1, H_q=2, N_q=45, N_k=7, d=32, dtype=torch.float16),
            AttnCase("strided inputs, float16", B=2, H_q=2, N_q=19, N_k=19, d=16, layout="bnhd",
                     dtype=torch.float16),
            AttnCase("float16, d=16, logits x8", B=1, H_q=3, N_q=33, N_k=65, d=16,
                     dtype=torch.float16, logit_boost=8.0),
        ]
    return cases


def _tiles(cfg: Config | None) -> str:
    return f"{cfg.BLOCK_M}x{cfg.BLOCK_N} tiles" if cfg else "the GPU's default tiles"


def _edge_rows(run, configs):
    """Rows the random cases cannot make: every score of a row near -1e5 (a running max started
    at a finite value instead of -inf is wrong there), and no key at all (N_k = 0: O = 0,
    LSE = -inf). Equal scores within a row keep the float32 reference exact."""
    dev = current().device
    B, H, N_q, N_k, d = 1, 2, 40, 20, 16             # 40 rows: both query tiles of a program
    q = oob.embed(torch.full((B, H, N_q, d), -1.0, device=dev), pad=256)
    k = oob.embed(torch.full((B, H, N_k, d), 1.0, device=dev), pad=256)
    v = oob.embed(seeded((B, H, N_k, d), 11, torch.float32), pad=256)
    scale = 6000.0                                   # every score: -16 * 6000 = -96000
    want_o = v.double().mean(dim=2, keepdim=True).expand(B, H, N_q, d)
    want_l = torch.full((B, H, N_q), -16 * scale + math.log(N_k), dtype=torch.float64, device=dev)
    empty = oob.embed(torch.zeros((B, H, 0, d), device=dev), pad=256)
    problems = [
        (f"every score of a row is -96000 (B={B}, H={H}, N_q={N_q}, N_k={N_k}, d={d}, float32, "
         f"scale={scale:g})", (q, k, v, scale), want_o, want_l),
        (f"no key at all: every row is empty (B={B}, H={H}, N_q={N_q}, N_k=0, d={d}, float32)",
         (q, empty, empty, None), torch.zeros((B, H, N_q, d), dtype=torch.float64, device=dev),
         torch.full((B, H, N_q), -math.inf, dtype=torch.float64, device=dev))]
    n = 0
    for name, args, want_o, want_l in problems:
        for cfg in configs:
            what = f"attention forward kernel, case '{name}', {_tiles(cfg)}"
            o, lse = run_student(run, *args, cfg, what=what, guard=True)
            no_nan(o, what + ", O")
            no_nan(lse, what + ", LSE")
            assert_close(o, want_o, what=what + ", output O", dims=("b", "h", "row", "col"),
                         dtype=torch.float32,
                         hint="start the running max at -inf (any finite start is wrong for a row "
                              "whose scores are all below it); a row with no key has l = 0: "
                              "O = 0 and LSE = -inf, with no division 0/0.")
            assert_close(lse, want_l, what=what + ", LSE", dims=("b", "h", "row"),
                         dtype=torch.float32, atol=2e-4, rtol=1e-4,
                         hint="a row has a key exactly when l > 0; LSE = -inf when it has none.")
            n += 1
    return n


def sweep_tile(two_tiles: bool = False) -> Config:
    """The H200's fp16 tile at d <= 64 (two query tiles in BLOCK_M for the two-tile kernel): the
    random shapes run with it in CPU mode as well, so a bug at the edge of a GPU-sized tile
    shows on a CPU."""
    return dataclasses.replace(pick_config(16, torch.float16, (9, 0), two_tiles), num_stages=1)


def check_attention_kernel(kernel, hidden: bool = False, configs=None, two_tiles: bool = False):
    """Exercise 2: the forward kernel returns O and LSE (natural log) that match float64 attention.

    Every case runs with several tile shapes (and must give the same result with each), with its
    inputs surrounded by NaN so an unmasked tail load shows up; in CPU mode every address is
    checked by the out-of-bounds guard. ``two_tiles``: ``kernel`` is ``attn_fwd_two_tiles``,
    whose BLOCK_M holds two query tiles.
    """
    if configs is None:
        configs = [None, Config(32, 32, 4, 2), Config(64, 16, 4, 2)] if current().gpu else \
            [Config(16, 16, 4, 1), Config(32, 16, 4, 1), Config(16, 64, 4, 1)]
        if two_tiles:
            configs = [cfg and dataclasses.replace(cfg, BLOCK_M=2 * cfg.BLOCK_M) for cfg in configs]

    def run(q, k, v, case, cfg):
        return attention_forward(kernel, q, k, v, scale=case.scale, config=cfg, two_tiles=two_tiles)

    hints = dict(
        hint="rescale acc and l by alpha = exp2(m_old - m_new) whenever the running max grows, "
             "mask keys >= N_k to -inf in the last tile, and divide by l once after the loop.",
        lse_hint="the kernel works in base 2: m and log2(l) are base-2 numbers, so LSE = "
                 "(m + log2(l)) * ln(2) in natural log.")
    n = check_attention(
        run, attention_cases(hidden), title="attention forward kernel", configs=configs,
        describe_config=_tiles, guard=True, pad=4096, seed=7 if hidden else 0, lse_tol=(2e-4, 1e-4),
        quiet=True, **hints)
    # seeded random shapes with the H200's tile, in CPU mode too: lengths next to its edges
    tile = sweep_tile(two_tiles)
    n += check_attention(
        run, dense_sweep("random", seed=70 if hidden else 7, n=3 if hidden else 2,
                         block_m=tile.BLOCK_M, block_n=tile.BLOCK_N, tiles=2,
                         dtypes=(torch.float32, torch.float16)),
        title="attention forward kernel, random shapes",
        configs=[None] if current().gpu else [tile], describe_config=_tiles, guard=True,
        pad=4096, seed=17 if hidden else 1, lse_tol=(2e-4, 1e-4), quiet=True, **hints)
    n += _edge_rows(lambda q, k, v, scale, cfg: attention_forward(
        kernel, q, k, v, scale=scale, config=cfg, two_tiles=two_tiles), configs)
    report("attention forward kernel", n, hidden=hidden)


def merge_cases(hidden: bool = False):
    """(name, (B, H, N, d), keys in a, keys in b, dtype, shift): ``shift`` is added to both
    LSEs (the scores' scale: lse ~ 1000 overflows a naive log(exp(a) + exp(b)))."""
    cases = [("B=1, H=2, N=20, d=16, keys split 9 + 14", (1, 2, 20, 16), 9, 14, torch.float32, 0.0),
             ("B=2, H=1, N=7, d=32, keys split 30 + 3", (2, 1, 7, 32), 30, 3, torch.float32, 0.0),
             ("large LSE (about 1000), N=6, keys split 4 + 5", (1, 1, 6, 16), 4, 5, torch.float32,
              1000.0),
             ("both sides empty", (1, 1, 5, 16), 0, 0, torch.float32, 0.0)]
    if hidden:
        cases += [("float16, N=33, d=64, keys split 5 + 50", (1, 2, 33, 64), 5, 50, torch.float16,
                   0.0),
                  ("one side empty (N_k=0) for every row", (1, 1, 11, 16), 0, 12, torch.float32,
                   0.0)]
    return cases


def _partial(q, k, v):
    B, H, N, d = q.shape
    if k.shape[2] == 0:
        return (torch.zeros_like(q),
                torch.full((B, H, N), float("-inf"), dtype=torch.float32, device=q.device))
    o, lse = reference.attention(q.double(), k.double(), v.double(), return_lse=True,
                                 scale=1.0 / math.sqrt(d))
    return o.to(q.dtype), lse.float()


def check_merge_kernel(kernel, hidden: bool = False, blocks=(16, 8)):
    """Exercise 3: merging the results for keys [0, s) and [s, N_k) gives attention over all keys.

    Runs under the out-of-bounds guard: rows are not a multiple of BLOCK_R.
    """
    n = 0
    for i, (name, (B, H, N, d), n_a, n_b, dtype, shift) in enumerate(merge_cases(hidden)):
        q = seeded((B, H, N, d), 300 + i, dtype, 2.0)
        k = seeded((B, H, n_a + n_b, d), 400 + i, dtype)
        v = seeded((B, H, n_a + n_b, d), 500 + i, dtype)
        o_a, l_a = _partial(q, k[:, :, :n_a], v[:, :, :n_a])
        o_b, l_b = _partial(q, k[:, :, n_a:], v[:, :, n_a:])
        if n_a + n_b:
            want_o, want_l = reference.attention(q.double(), k.double(), v.double(),
                                                 return_lse=True)
        else:
            want_o, want_l = torch.zeros_like(q, dtype=torch.float64), torch.full(
                (B, H, N), float("-inf"), dtype=torch.float64, device=q.device)
        l_a, l_b, want_l = l_a + shift, l_b + shift, want_l + shift
        for block in blocks:
            what = f"merge kernel, case '{name}', BLOCK_R={block}"
            o, lse = run_student(merge_states, kernel, o_a, l_a, o_b, l_b, block_r=block, what=what,
                                 guard=True)
            no_nan(o, what + ", O")
            no_nan(lse, what + ", LSE")
            assert_close(o, want_o, what=what + ", O", dims=("b", "h", "row", "col"), dtype=dtype,
                         hint="weights w_a = exp(lse_a - lse) and w_b = exp(lse_b - lse) with "
                              "lse = log(exp(lse_a) + exp(lse_b)), computed from the larger one.")
            assert_close(lse, want_l, what=what + ", LSE", dims=("b", "h", "row"),
                         dtype=torch.float32, atol=1e-4, rtol=1e-5,
                         hint="lse = m + log(exp(lse_a - m) + exp(lse_b - m)) with m the larger one "
                              "(exp(1000) overflows); if both sides are empty (-inf), the result is "
                              "O = 0, LSE = -inf.")
            n += 1
    report("merge of two partial states", n, hidden=hidden)
