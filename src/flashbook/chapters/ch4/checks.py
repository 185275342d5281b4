"""Chapter 4's graded checks: the varlen forward, the mask and tile-range helpers, the masked
kernel (whose K-tile loads are counted in CPU mode); the wrapper's argument checks are in
``validate_checks``, and the optional two-tile kernel's check (``two_tiles``) runs these with
two query tiles a program.

Every packed batch the kernels see has a *canary* sequence of NaN after each real one: a
kernel that reads one key or query past its own sequence reads NaN, and the check names the
sequence that leaked. O and LSE are pre-filled with NaN, so a row the kernel never writes is
caught too. In CPU mode every launch runs under the out-of-bounds guard.
"""
from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from flashbook import oob, reference
from flashbook.case_sweeps import sweep
from flashbook.cases import AttnCase, kv_packed, make_inputs
from flashbook.check import CheckFailure, check_attention, report, require_implemented, \
    run_student
from flashbook.cpu_child import on_cpu
from flashbook.device import current
from flashbook.packed import CANARY, expected_loads, name_leaks, programs, tile_sets, tiles, \
    with_canaries

from .launch import Config, default_sections, launch_varlen, window_bounds


def _configs(two_tiles: bool = False):
    """Tile configs the checks run (``two_tiles``: BLOCK_M holds both tiles of 16 rows or more)."""
    if current().gpu:
        return [None, Config(64, 32, 4, 2)]
    return [Config(32, 16, 4, 1), Config(64, 16, 4, 1)] if two_tiles else \
        [Config(16, 16, 4, 1), Config(32, 16, 4, 1)]


# ----------------------------------------------------------------- packed batches, canaries

def _run_packed(kernel, case: AttnCase, cfg, q, k, v, *, masked: bool, two_tiles=False,
                counter: oob.Guard | None = None, sections: int | None = None):
    """Launch ``kernel`` on the case's batch with canaries; return the real rows' (O, LSE)."""
    qc, kc, vc, cu_q, cu_k, rows, seq_index = with_canaries(case, q, k, v)
    if case.layout == "kvpacked":
        kc, vc = kv_packed(kc, vc)
    max_q = max(max(case.seqlens), CANARY[0])
    max_k = max(max(case.seqlens_k or case.seqlens), CANARY[1])
    window = window_bounds(case.window or (-1, -1), case.causal, max_q, max_k) if masked else None
    # the pairs per section this launch walks (a GPU's L2 picks it): named when rows leak
    sections = sections or default_sections((cu_q.numel() - 1) * qc.shape[1], max_k, kc)
    o = torch.full(qc.shape, math.nan, dtype=qc.dtype, device=qc.device)
    lse = torch.full((qc.shape[1], qc.shape[0]), math.nan, dtype=torch.float32, device=qc.device)
    launch_varlen(kernel, qc, kc, vc, cu_q, cu_k, max_q, max_k, window=window, scale=case.scale,
                  config=cfg, two_tiles=two_tiles, out=(o, lse), sections=sections)
    o, lse = o[rows], lse[:, rows]
    name_leaks(case, o, sections)
    if counter is not None:
        counter.layout = (cu_q.tolist(), cu_k.tolist(), max_q, seq_index, window, sections)
    return o, lse


def _varlen_cases(hidden: bool, masked: bool) -> list[AttnCase]:
    v = dict(H_q=2, d=16)
    if not masked:
        cases = [
            AttnCase("lengths 0, 1, a tile, not a tile, N_q != N_k", seqlens=(5, 0, 1, 16, 21),
                     seqlens_k=(7, 3, 1, 16, 40), **v),
            AttnCase("a sequence with queries but no keys", seqlens=(6, 9), seqlens_k=(0, 12), **v),
            AttnCase("float16, d=32, strided heads", seqlens=(33, 10), seqlens_k=(20, 50), H_q=3,
                     d=32, dtype=torch.float16),
            AttnCase("K and V with their own strides", seqlens=(20, 7), seqlens_k=(30, 18),
                     layout="kvpacked", **v),
            AttnCase("every score -96000: a finite start of the running max is wrong",
                     seqlens=(20, 7), seqlens_k=(30, 5), scale=6000.0, constant_scores=True, **v),
        ]
        if hidden:
            cases += [AttnCase("8 sequences, float16, large logits", seqlens=(1, 2, 17, 31, 0, 5,
                                                                            16, 40),
                               seqlens_k=(3, 1, 17, 9, 4, 0, 33, 40), H_q=2, d=16,
                               dtype=torch.float16, logit_boost=8.0),
                      AttnCase("d=64, explicit scale", seqlens=(20, 37), H_q=1, d=64, scale=0.2)]
        return cases
    # First the cases that isolate the window's left band [lo, full_lo), which is empty unless
    # the window is wider than a tile of rows plus a tile of keys: 40 for the CPU's 16-32 row
    # tiles, 300 for a GPU's 128-row ones; a wrong left band fails there first, and says so.
    cases = [AttnCase("window (300, 0), 700 tokens: partial tiles at the window's left edge "
                      "of a GPU's 128-row tiles", seqlens=(700,), window=(300, 0),
                      layout="kvpacked", **v)] if current().gpu else []
    cases += [
        AttnCase("window (40, 0): partial tiles at the window's left edge, K/V own strides",
                 seqlens=(100,), window=(40, 0), layout="kvpacked", **v),
        AttnCase("causal, N_q = N_k", seqlens=(40, 17), causal=True, **v),
        AttnCase("causal, N_q < N_k (bottom-right)", seqlens=(2, 9), seqlens_k=(5, 37),
                 causal=True, **v),
        AttnCase("causal, N_q > N_k: the first rows see no key", seqlens=(30,), seqlens_k=(11,),
                 causal=True, **v),
        AttnCase("window (5, 0)", seqlens=(50,), window=(5, 0), **v),
        AttnCase("causal, every score -96000", seqlens=(30,), seqlens_k=(40,), causal=True,
                 scale=6000.0, constant_scores=True, **v),
        AttnCase("window (3, 7), N_q != N_k, lengths 0 and 1", seqlens=(0, 1, 33),
                 seqlens_k=(4, 1, 45), window=(3, 7), **v),
    ]
    if hidden:
        cases += [
            AttnCase("causal, 8 sequences, float16", seqlens=(1, 16, 17, 0, 33, 5, 2, 40),
                     seqlens_k=(1, 16, 20, 3, 33, 9, 0, 64), causal=True, H_q=2, d=32,
                     dtype=torch.float16, logit_boost=4.0),
            AttnCase("window (0, 0): each row sees one key", seqlens=(23,), window=(0, 0), **v),
            AttnCase("window (16, -1): unlimited right", seqlens=(35,), seqlens_k=(20,),
                     window=(16, -1), **v),
            AttnCase("causal window (20, 0), d=64", seqlens=(70,), window=(20, 0), causal=True,
                     H_q=1, d=64),
        ]
    return cases


# The random sweep runs with the H200's tile (128 x 64) in CPU mode too: a bug at the edge of a
# tall tile (a short sequence whose padding rows outnumber its real ones) needs that tile.
SWEEP_TILE = Config(128, 64, 4, 1)


def sweep_cases(hidden: bool, masked: bool) -> list[AttnCase]:
    """A few queries against many keys in the tall tile (the key tiles a program visits then
    start with a partial left band), then seeded random shapes."""
    edge = AttnCase("a few queries, many keys", seqlens=(1, 30), seqlens_k=(135, 200), H_q=1,
                    d=16, causal=masked)
    seed = (40 if hidden else 4) + masked
    return [edge] + sweep("random", seed=seed, n=4 if hidden else 2, block_m=SWEEP_TILE.BLOCK_M,
                          block_n=SWEEP_TILE.BLOCK_N, tiles=2, groups=(1,), masks=masked)


def _check_packed(kernel, hidden: bool, masked: bool, title: str, hint: str,
                  counter=None, cases=None, configs=None, two_tiles: bool = False) -> int:
    configs = configs or _configs(two_tiles)

    def run(q, k, v, case, cfg):
        # A CPU gives heads_per_section 1: the second config walks 2 pairs per section (the
        # canaries make batch * H even), so a kernel must decode its tile with program_tile.
        sections = 2 if not current().gpu and cfg is configs[-1] and len(configs) > 1 else None
        return _run_packed(kernel, case, cfg, q, k, v, masked=masked, counter=counter,
                           two_tiles=two_tiles, sections=sections)
    n = check_attention(run, cases or _varlen_cases(hidden, masked), title=title,
                        configs=configs, describe_config=tiles, guard=True,
                        seed=11 if hidden else 0, lse_tol=(2e-4, 1e-4), hint=hint, quiet=True)
    if cases is None:
        n += check_attention(run, sweep_cases(hidden, masked), title=f"{title}, random shapes",
                             configs=[None] if current().gpu else [SWEEP_TILE],
                             describe_config=tiles, guard=True, seed=13 if hidden else 3,
                             lse_tol=(2e-4, 1e-4), hint=hint, quiet=True)
    return n


def check_varlen_kernel(kernel, hidden: bool = False):
    """Exercise 1: the packed forward (no mask) matches float64 attention per sequence."""
    require_implemented(kernel, "attn_varlen_kernel")
    n = _check_packed(kernel, hidden, False, "varlen forward kernel",
                      "each program takes its sequence's start and length from CU_Q / CU_K "
                      "(pid_bh // H) and masks every load and store to that length; a sequence "
                      "without keys gives O = 0 and LSE = -inf.")
    report("varlen forward kernel", n, hidden=hidden)


# ------------------------------------------------------------- Exercise 2a: the two helpers

def _visible_probe(OUT, rows0, cols0, seqlen_q, seqlen_k, window_left, window_right,
                   VISIBLE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = rows0 + tl.arange(0, BLOCK_M)
    cols = cols0 + tl.arange(0, BLOCK_N)
    vis = VISIBLE(rows, cols, seqlen_q, seqlen_k, window_left, window_right)
    tl.store(OUT + tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :],
             vis.to(tl.int32))


def _tiles_probe(OUT, seqlen_q, seqlen_k, window_left, window_right, KEY_TILES: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    lo, full_lo, full_hi, hi = KEY_TILES(pid * BLOCK_M, seqlen_q, seqlen_k, window_left,
                                         window_right, BLOCK_M, BLOCK_N)
    tl.store(OUT + pid * 4 + tl.arange(0, 4),
             tl.where(tl.arange(0, 4) == 0, lo, tl.where(tl.arange(0, 4) == 1, full_lo,
                      tl.where(tl.arange(0, 4) == 2, full_hi, hi))))


@functools.cache
def _probes():
    """The probe kernels, compiled (or interpreted) on first use, after ``flashbook.setup()``."""
    return triton.jit(_visible_probe), triton.jit(_tiles_probe)


def mask_cases(hidden: bool = False):
    """(name, seqlen_q, seqlen_k, causal, window, BLOCK_M, BLOCK_N)."""
    cases = [("causal, N_q = N_k = 40", 40, 40, True, None, 16, 16),
             ("causal, N_q = 2, N_k = 5 (bottom-right)", 2, 5, True, None, 16, 16),
             ("causal, N_q = 37, N_k = 11", 37, 11, True, None, 16, 16),
             ("window (5, 2), N = 48", 48, 48, False, (5, 2), 16, 16),
             ("window (3, 0), N_q = 20, N_k = 45", 20, 45, False, (3, 0), 16, 16),
             ("no mask, N_q = 18, N_k = 35", 18, 35, False, None, 16, 16)]
    if hidden:
        cases += [("causal, 64x16 tiles, N_q = 100, N_k = 130", 100, 130, True, None, 64, 16),
                  ("window (0, 0), 16x32 tiles", 50, 50, False, (0, 0), 16, 32),
                  ("window (40, -1), N_q = 33, N_k = 17", 33, 17, False, (40, -1), 16, 16),
                  ("causal window (7, 0), 32x16 tiles, N = 90", 90, 90, True, (7, 0), 32, 16)]
    return cases


def check_mask_helpers(visible_pairs, key_tiles, hidden: bool = False):
    """Exercise 2a: ``visible_pairs`` against the reference mask, then ``key_tiles`` program by
    program: the tiles it visits must be exactly those with a visible pair, its full range may
    hold only fully visible tiles, and (for a tile of real rows) every fully visible tile."""
    require_implemented(visible_pairs, "visible_pairs")
    require_implemented(key_tiles, "key_tiles")
    vis_probe, tiles_probe = _probes()
    dev = current().device
    n = 0
    for name, sq, sk, causal, window, BM, BN in mask_cases(hidden):
        left, right = window_bounds(window or (-1, -1), causal, sq, sk)
        want = reference.visible_mask(sq, sk, causal=causal, window=window, device="cpu")
        spec = f"case '{name}' (window_left={left}, window_right={right})"
        # ---- visible_pairs on a grid of tiles that covers the matrix and sticks out of it
        got = torch.zeros((triton.cdiv(sq, BM) * BM, triton.cdiv(sk, BN) * BN + BN),
                          dtype=torch.int32, device=dev)
        for r0 in range(0, got.shape[0], BM):
            for c0 in range(0, got.shape[1], BN):
                out = torch.empty((BM, BN), dtype=torch.int32, device=dev)
                run_student(lambda: vis_probe[(1,)](out, r0, c0, sq, sk, left, right,
                                                    VISIBLE=visible_pairs, BLOCK_M=BM, BLOCK_N=BN),
                            what=f"visible_pairs, {spec}", guard=True)
                got[r0:r0 + BM, c0:c0 + BN] = out
        got = got.cpu().bool()
        expect_full = torch.zeros_like(got)
        expect_full[:sq, :sk] = want
        wrong = (got[:sq] != expect_full[:sq]).nonzero()
        if len(wrong):
            i, j = (int(x) for x in wrong[0])
            raise CheckFailure(
                f"visible_pairs, {spec}: {len(wrong)} (row, key) pairs are wrong, the first at "
                f"row {i}, key {j}: got {bool(got[i, j])}, expected {bool(expect_full[i, j])}.\n"
                "  Hint: row i sits at position i + (seqlen_k - seqlen_q) (bottom-right) and sees "
                "key j iff pos - window_left <= j <= pos + window_right and j < seqlen_k.")
        # ---- key_tiles, one program per query tile
        n_prog = triton.cdiv(sq, BM)
        out = torch.zeros((n_prog, 4), dtype=torch.int32, device=dev)
        run_student(lambda: tiles_probe[(n_prog,)](out, sq, sk, left, right, KEY_TILES=key_tiles,
                                                    BLOCK_M=BM, BLOCK_N=BN),
                    what=f"key_tiles, {spec}", guard=True)
        for p, (lo, full_lo, full_hi, hi) in enumerate(out.cpu().tolist()):
            m0 = p * BM
            what = (f"key_tiles, {spec}, {BM}x{BN} tiles, rows {m0}-{m0 + BM - 1}: returned "
                    f"(lo, full_lo, full_hi, hi) = ({lo}, {full_lo}, {full_hi}, {hi})")
            seen, full = tile_sets(want, m0, BM, BN, sq, sk)
            if any(x % BN for x in (lo, full_lo, full_hi)) or not lo <= full_lo <= full_hi \
                    or full_hi > max(lo, hi):
                raise CheckFailure(f"{what}: lo, full_lo and full_hi must be multiples of BLOCK_N "
                                   f"with lo <= full_lo <= full_hi <= max(lo, hi).")
            visited = set(range(lo, hi, BN))
            if visited != seen:
                extra, missing = sorted(visited - seen), sorted(seen - visited)
                raise CheckFailure(
                    f"{what}: the tiles visited start at {sorted(visited) or 'none'}, but the "
                    f"tiles holding visible pairs start at {sorted(seen) or 'none'}"
                    + (f"; {missing} hold visible pairs and would be skipped (wrong output)"
                       if missing else "")
                    + (f"; {extra} are wholly masked and would be loaded for nothing"
                       if extra else "") + ".\n  Hint: lo comes from the first row's left edge "
                    "(rounded down to a tile), hi from the last row's right edge + 1 (clamped "
                    "to seqlen_k).")
            marked = set(range(full_lo, full_hi, BN))
            if not marked <= full:
                raise CheckFailure(f"{what}: tiles {sorted(marked - full)} are in [full_lo, "
                                   "full_hi) but not every pair in them is visible: they would "
                                   "run without a mask.\n  Hint: a tile is full when its first "
                                   "key is visible to the last row and its last key to the first "
                                   "row (and it ends inside seqlen_k).")
            if m0 + BM <= sq and marked != full:
                raise CheckFailure(f"{what}: tiles {sorted(full - marked)} are fully visible "
                                   "but not in [full_lo, full_hi): they would pay for a mask "
                                   "they do not need.")
        n += 1
    report("mask helpers (visible_pairs, key_tiles)", n, hidden=hidden)


# --------------------------------------------------- Exercise 2b: the masked kernel, counted

def _check_masked_tiles(masked, layout, case, cfg, what, per_tile: int = 1):
    """Each program of a tile of real rows may take the masked path (attn_scores with
    MASKED=True, ``per_tile`` calls a K tile) only for its partial tiles: a fully visible tile
    needs no mask arithmetic."""
    by_program = {}
    for pid, n in masked.items():                       # the interpreter's ids are (x, y, z)
        by_program[pid[:2]] = by_program.get(pid[:2], 0) + n
    for pid, seq, h, real_rows, seen, full in programs(layout, case.H_q, cfg.BLOCK_M,
                                                         cfg.BLOCK_N):
        if real_rows and by_program.get(pid, 0) > per_tile * len(seen - full):
            raise CheckFailure(
                f"{what}: program {pid} (sequence {seq}, head {h}) ran the masked path "
                f"(MASKED=True) for {by_program[pid]} K tiles{_per_tile(per_tile)}, but it "
                f"needs {len(seen)}: {len(seen - full)} partial, {len(full)} fully visible. "
                "Full tiles run with MASKED=False: no mask arithmetic. Loop over "
                "key_tiles' three ranges.")


def _per_tile(per_tile: int) -> str:
    return f" (each of its {per_tile} query tiles counted)" if per_tile > 1 else ""


def count_masked_loads(kernel, hidden: bool = False, two_tiles: bool = False) -> str:
    """Run one long causal and one windowed sequence under a load counter (``two_tiles``: the
    two-tile kernel, each of whose query tiles loads the K tiles of its program). The counter
    needs the interpreter: on a GPU runtime this runs in a CPU-mode child (``cpu_child``)."""
    if current().gpu:
        target = "two_tiles:count_two_tile_loads" if two_tiles else "checks:count_masked_loads"
        return on_cpu(f"flashbook.chapters.ch4.{target}", {"kernel": kernel}, hidden=hidden)
    cfg, per_tile = (Config(32, 16, 4, 1), 2) if two_tiles else (Config(16, 16, 4, 1), 1)
    lines = []
    for case in (AttnCase("causal, N = 128", seqlens=(128,), causal=True, H_q=1, d=16),
                 AttnCase("window (16, 0), N = 112", seqlens=(112,), window=(16, 0), H_q=1,
                          d=16)) + ((AttnCase("causal, two sequences, N_q != N_k",
                                              seqlens=(40, 64), seqlens_k=(70, 64), causal=True,
                                              H_q=2, d=16),) if hidden else ()):
        q, k, v = make_inputs(case, 5)
        counter = oob.Guard()
        what = f"{'two-tile' if two_tiles else 'masked'} kernel, case {case.describe()}, " \
               f"{tiles(cfg)}"
        with counter, oob.counting_calls(kernel, "attn_scores",
                                         lambda args: bool(args.get("MASKED"))) as masked:
            run_student(_run_packed, kernel, case, cfg, q, k, v, masked=True, counter=counter,
                        two_tiles=two_tiles, sections=2 if case.H_q == 2 else None, what=what,
                        guard=True)
        want = expected_loads(counter.layout, case.H_q, cfg.BLOCK_M, cfg.BLOCK_N)
        seq_index, cu_k = counter.layout[3], counter.layout[1]
        got = {tuple(pid[:2]): c for (pid, name), c in counter.loads.items() if name == "K"}
        for pid, (n_tiles, bh) in sorted(want.items()):
            if got.get(pid, 0) != per_tile * n_tiles:
                raise CheckFailure(
                    f"{what}: program {pid} (sequence {bh // case.H_q}, head {bh % case.H_q}) "
                    f"loaded {got.get(pid, 0)} K tiles{_per_tile(per_tile)}; {n_tiles} hold a "
                    "visible pair. "
                    + ("It loaded tiles that are wholly masked: the mask is applied but "
                       "nothing is skipped. Loop over key_tiles' ranges only."
                       if got.get(pid, 0) > per_tile * n_tiles else
                       "It skipped tiles with visible pairs (or loaded K outside attn_step)."))
        _check_masked_tiles(masked, counter.layout, case, cfg, what, per_tile)
        real = [bh for _, bh in want.values() if bh // case.H_q in seq_index]
        loaded = sum(n for n, bh in want.values() if bh // case.H_q in seq_index)
        sweep = sum(triton.cdiv(cu_k[bh // case.H_q + 1] - cu_k[bh // case.H_q], cfg.BLOCK_N)
                    for bh in real)
        lines.append(f"{case.name}: {loaded} of {sweep} K tiles loaded")
    return " (" + "; ".join(lines) + ")"


def check_masked_kernel(kernel, hidden: bool = False):
    """Exercise 2b: causal and windowed varlen attention matches float64, and (CPU mode) each
    program loads exactly the K tiles that hold a visible pair."""
    require_implemented(kernel, "attn_masked_kernel")
    n = _check_packed(kernel, hidden, True, "masked kernel",
                      "masks are aligned bottom-right: row i sees key j iff i + N_k - N_q - left "
                      "<= j <= i + N_k - N_q + right; partial tiles need visible_pairs, full "
                      "tiles none; a row that sees no key gives O = 0 and LSE = -inf.")
    counts = count_masked_loads(kernel, hidden)
    report("masked kernel", n, extra=counts, hidden=hidden)
