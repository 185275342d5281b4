"""Chapter 5's graded checks: the M-fold prefill (with Chapter 4's canary sequences, and the K
tiles it loads counted in CPU mode) and, optional, its two-tile kernel, the cache row lookup
(contiguous and paged), the decode kernel on contiguous and shuffled paged caches whose unused
slots hold NaN, and the decode wrapper's argument checks."""
from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from flashbook import oob, reference
from flashbook.case_sweeps import decode_sweep, sweep
from flashbook.cases import AttnCase, kv_packed, make_inputs, seeded
from flashbook.check import CheckFailure, assert_close, check_argument_errors, check_attention, \
    no_nan, report, require_implemented, run_student
from flashbook.cpu_child import on_cpu
from flashbook.device import current
from flashbook.packed import CANARY, expected_loads, name_leaks, tiles, with_canaries
from flashbook.varlen import window_bounds

from .launch import Config, decode_block_m, decode_config, launch_decode, launch_gqa, paged_cache

_HINT = ("row r of tile m_block is folded row f = m_block * BLOCK_M + r: query head "
         "kv_head * GROUP + f % GROUP at position f // GROUP; K and V come from head "
         "kv_head = pid_bh % H_KV; masks and tile ranges as in Chapter 4.")


def gqa_cases(hidden: bool = False) -> list[AttnCase]:
    # First the cases that isolate the window's left band (Chapter 4's checks say why).
    cases = [AttnCase("G=2, window (300, 0), 700 tokens: partial tiles at the window's left "
                      "edge of a GPU's 128-row tiles", seqlens=(700,), H_q=4, H_kv=2, d=16,
                      window=(300, 0), layout="kvpacked")] if current().gpu else []
    cases += [
        AttnCase("G=2, window (40, 0): partial tiles at its left edge, K/V own strides",
                 seqlens=(100,), H_q=4, H_kv=2, d=16, window=(40, 0), layout="kvpacked"),
        AttnCase("G=4, causal, packed, N_q != N_k", seqlens=(5, 0, 33), seqlens_k=(9, 4, 40),
                 H_q=8, H_kv=2, d=16, causal=True),
        AttnCase("MQA (h_kv=1), G=4", seqlens=(20, 7), H_q=4, H_kv=1, d=16),
        AttnCase("G=2, window (5, 0)", seqlens=(30,), H_q=4, H_kv=2, d=16, window=(5, 0)),
        AttnCase("G=1 (MHA)", seqlens=(17, 1), H_q=2, H_kv=2, d=16, causal=True),
        AttnCase("G=4, causal, every score -96000", seqlens=(20,), seqlens_k=(30,), H_q=4,
                 H_kv=1, d=16, causal=True, scale=6000.0, constant_scores=True),
        AttnCase("G=8, causal", seqlens=(9, 20), H_q=8, H_kv=1, d=16, causal=True),
        # G does not divide the tile: most tiles start part-way into a position's G rows
        AttnCase("G=3, causal, packed: tiles that start part-way into a position",
                 seqlens=(25, 6), seqlens_k=(25, 9), H_q=3, H_kv=1, d=16, causal=True),
    ]
    if hidden:
        cases += [AttnCase("G=8, causal, float16", seqlens=(3, 25), seqlens_k=(3, 30), H_q=8,
                           H_kv=1, d=32, causal=True, dtype=torch.float16, logit_boost=4.0),
                  AttnCase("G=2, h_kv=3, d=64, scale 0.2", seqlens=(19,), H_q=6, H_kv=3, d=64,
                           scale=0.2),
                  # PackGQA's group sizes: Qwen2.5-7B's 7, Falcon-7B's 71 (MQA), and 3 and 5
                  AttnCase("G=3, h_kv=2, window (6, 2)", seqlens=(11,), seqlens_k=(14,), H_q=6,
                           H_kv=2, d=16, window=(6, 2)),
                  AttnCase("G=5, causal, packed", seqlens=(7, 4), seqlens_k=(7, 10), H_q=5,
                           H_kv=1, d=16, causal=True),
                  AttnCase("G=7, causal, float16", seqlens=(9,), H_q=14, H_kv=2, d=16,
                           causal=True, dtype=torch.float16),
                  AttnCase("G=71 (MQA), causal", seqlens=(3,), seqlens_k=(5,), H_q=71, H_kv=1,
                           d=16, causal=True)]
    return cases


def _configs(two_tiles: bool = False):
    """Tile configs the checks run (``two_tiles``: BLOCK_M holds both tiles of 16 rows or more)."""
    if current().gpu:
        return [None, Config(64, 32, 4, 2)]
    return [Config(32, 16, 4, 1), Config(64, 16, 4, 1)] if two_tiles else \
        [Config(16, 16, 4, 1), Config(32, 16, 4, 1)]


# The random sweep runs with the H200's tile (128 x 64) in CPU mode too: a bug at the edge of a
# tile of 128 rows (G query heads each at 128 / G positions) needs lengths around that tile.
SWEEP_TILE = Config(128, 64, 4, 1)


def sweep_cases(hidden: bool = False) -> list[AttnCase]:
    # first, short sequences against long ones in that tall tile: its padding rows outnumber
    # the real ones, and the key tiles a program visits start with a partial left band
    edge = AttnCase("a few queries, many keys", seqlens=(1, 30), seqlens_k=(135, 200), H_q=2,
                    H_kv=1, d=16)
    return [edge] + sweep("random", seed=50 if hidden else 5, n=6 if hidden else 2,
                          block_m=SWEEP_TILE.BLOCK_M, block_n=SWEEP_TILE.BLOCK_N, tiles=2,
                          fold=True)


def _run_prefill(wrapper, case: AttnCase, cfg, q, k, v, counter=None):
    """The wrapper on the case's batch with canary sequences; the real rows' (O, LSE)."""
    qc, kc, vc, cu_q, cu_k, rows, seq_index = with_canaries(case, q, k, v, trailing=False)
    if case.layout == "kvpacked":
        kc, vc = kv_packed(kc, vc)
    max_q = max(max(case.seqlens), CANARY[0])
    max_k = max(max(case.seqlens_k or case.seqlens), CANARY[1])
    o, lse = wrapper(qc, kc, vc, cu_q, cu_k, max_q, max_k, causal=case.causal,
                     window_size=case.window or (-1, -1), softmax_scale=case.scale, config=cfg)
    if counter is not None:
        counter.layout = (cu_q.tolist(), cu_k.tolist(), max_q, seq_index)
    o, lse = o[rows], lse[:, rows]
    name_leaks(case, o)
    return o, lse


def count_prefill_loads(wrapper, hidden: bool = False) -> str:
    """The K tiles loaded in all must be each K/V head's visible tiles once. The counter needs
    the interpreter: on a GPU runtime this runs in a CPU-mode child process (``cpu_child``)."""
    if current().gpu:
        return on_cpu("flashbook.chapters.ch5.checks:count_prefill_loads",
                      {"attention_gqa": wrapper}, hidden=hidden)
    return _count_loads(wrapper)


def _count_loads(wrapper, per_tile: int = 1) -> str:
    """``per_tile``: the query tiles of a program (each loads every K tile the program visits)."""
    cfg = Config(32, 16, 4, 1)
    case = AttnCase("G=4, causal, N=64", seqlens=(64,), H_q=8, H_kv=2, d=16, causal=True)
    q, k, v = make_inputs(case, 3)
    counter = oob.Guard()
    what = f"{'two-tile ' if per_tile > 1 else ''}GQA prefill, case {case.describe()}, " \
           f"{tiles(cfg)}"
    with counter:
        run_student(_run_prefill, wrapper, case, cfg, q, k, v, counter=counter, what=what,
                    guard=True)
    cu_q, cu_k, max_q, seq_index = counter.layout
    G = case.H_q // case.h_kv
    max_k = max(b - a for a, b in zip(cu_k, cu_k[1:]))
    window = window_bounds(case.window or (-1, -1), case.causal, max_q, max_k)
    want = expected_loads((cu_q, cu_k, max_q, seq_index, window, 1), case.h_kv,
                          cfg.BLOCK_M // G, cfg.BLOCK_N)
    need = per_tile * sum(t for t, _ in want.values())
    got = sum(c for (_, name), c in counter.loads.items() if name == "K")
    if got != need and per_tile > 1:
        raise CheckFailure(
            f"{what}: the kernel loaded {got} K tiles in all; each K/V head's visible tiles, "
            f"once for each of a program's {per_tile} query tiles, is {need}. "
            + ("It loads tiles that hold no visible pair: loop over key_tiles' ranges only, "
               "for the program's POS positions." if got > need else
               "It skips tiles with visible pairs (or loads K outside attn_two_tile_step)."))
    if got != need:
        raise CheckFailure(
            f"{what}: the kernel loaded {got} K tiles in all; each K/V head's visible tiles "
            f"once is {need}." + (f" That is {got / need:.1f}x: K and V are read once per query "
                                  "head (a repeat_interleave, or one program per query head), "
                                  "not once per group of G heads." if got > need else ""))
    return f" (K tiles loaded: {got}, each K/V head's once for its {G} query heads" + \
        (f" in each of the {per_tile} query tiles)" if per_tile > 1 else ")")


def check_gqa_prefill(attention_gqa, hidden: bool = False):
    """Exercise 1: the M-fold GQA forward matches float64 attention per query head, with
    Chapter 4's masks and packed batches, and loads each K/V tile once per group."""
    require_implemented(attention_gqa, "attention_gqa")
    def run(q, k, v, case, cfg):
        return _run_prefill(attention_gqa, case, cfg, q, k, v)
    n = check_attention(run, gqa_cases(hidden), title="GQA prefill", configs=_configs(),
                        describe_config=tiles, guard=True, seed=21 if hidden else 0,
                        lse_tol=(2e-4, 1e-4), hint=_HINT, quiet=True)
    n += check_attention(run, sweep_cases(hidden), title="GQA prefill, random shapes",
                         configs=[None] if current().gpu else [SWEEP_TILE],
                         describe_config=tiles, guard=True, seed=31 if hidden else 1,
                         lse_tol=(2e-4, 1e-4), hint=_HINT, quiet=True)
    report("GQA prefill (M-fold)", n, extra=count_prefill_loads(attention_gqa, hidden),
           hidden=hidden)


# --------------------------------------------------- Exercise 1b (optional): two query tiles

_HINT_TWO = ("tile A holds the program's first HALF folded rows (row r: f = m_block * BLOCK_M "
             "+ r, position f // GROUP, query head kv_head * GROUP + f % GROUP), tile B the "
             "next HALF; each tile's partial key tiles take visible_pairs of its own positions.")


def two_tile_wrapper(kernel):
    """The two-tile kernel behind ``attention_gqa``'s signature, launched as the chapter's
    ``attention_gqa_two_tiles`` launches it (the check's inputs are valid: no argument checks)."""
    def attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=False,
                  window_size=(-1, -1), softmax_scale=None, config=None):
        window = window_bounds(window_size, causal, max_seqlen_q, max_seqlen_k)
        return launch_gqa(kernel, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                          max_seqlen_k, window=window, scale=softmax_scale, config=config,
                          two_tiles=True)
    return attention


def count_two_tile_loads(kernel, hidden: bool = False) -> str:
    """``count_prefill_loads`` for the two-tile kernel, whose two query tiles each load every K
    tile of their program (in a CPU-mode child on a GPU runtime)."""
    if current().gpu:
        return on_cpu("flashbook.chapters.ch5.checks:count_two_tile_loads",
                      {"attn_gqa_two_tiles": kernel}, hidden=hidden)
    return _count_loads(two_tile_wrapper(kernel), per_tile=2)


def check_gqa_two_tiles(attn_gqa_two_tiles, hidden: bool = False):
    """Exercise 1b (optional): the two-tile M-fold kernel matches float64 attention on Exercise
    1's cases and random shapes, with tiles of two halves, and loads each K/V head's visible
    tiles once for each query tile."""
    require_implemented(attn_gqa_two_tiles, "attn_gqa_two_tiles")
    attention = two_tile_wrapper(attn_gqa_two_tiles)
    def run(q, k, v, case, cfg):
        return _run_prefill(attention, case, cfg, q, k, v)
    n = check_attention(run, gqa_cases(hidden), title="two-tile GQA prefill",
                        configs=_configs(two_tiles=True), describe_config=tiles, guard=True,
                        seed=23 if hidden else 2, lse_tol=(2e-4, 1e-4), hint=_HINT_TWO,
                        quiet=True)
    n += check_attention(run, sweep_cases(hidden), title="two-tile GQA prefill, random shapes",
                         configs=[None] if current().gpu else [SWEEP_TILE],
                         describe_config=tiles, guard=True, seed=33 if hidden else 3,
                         lse_tol=(2e-4, 1e-4), hint=_HINT_TWO, quiet=True)
    report("two-tile GQA prefill", n,
           extra=count_two_tile_loads(attn_gqa_two_tiles, hidden), hidden=hidden)


# ------------------------------------------------------------- Exercise 2: the row lookup

def _rows_probe(OUT, BLOCK_TABLE, b, start_n, cache_len, rows_per_seq, stride_bt,
                CACHE_ROWS: tl.constexpr, PAGED: tl.constexpr, BLOCK_N: tl.constexpr):
    offs_n = tl.arange(0, BLOCK_N)
    tl.store(OUT + offs_n, CACHE_ROWS(BLOCK_TABLE, b, start_n + offs_n, cache_len, rows_per_seq,
                                      stride_bt, PAGED))


@functools.cache
def _rows_probe_kernel():
    return triton.jit(_rows_probe)


def check_cache_rows(cache_rows, hidden: bool = False):
    """Exercise 2: the rows of a contiguous cache (b * max_len + key) and of a paged one
    (block_table[b, key // page] * page + key % page) for every key below the sequence's
    length, tile by tile, with tiles that span pages and run past the last page. The page
    table is exactly (B, max_pages): a lookup for a key past the length reads past its end,
    which the guard reports."""
    require_implemented(cache_rows, "cache_rows")
    probe = _rows_probe_kernel()
    dev = current().device
    g = torch.Generator().manual_seed(5)
    # (name, lengths, rows_per_seq, pages per sequence (None: contiguous), BLOCK_N)
    layouts = [("contiguous, max_len=64", (64, 21, 1), 64, None, 16),
               ("paged, pages of 16, tiles of 16", (40, 48, 3), 16, 3, 16),
               ("paged, pages of 16, tiles of 64 (four pages a tile)", (40, 17, 48), 16, 3, 64)]
    if hidden:
        layouts += [("paged, pages of 32, tiles of 128", (100, 33, 1, 64), 32, 4, 128),
                    ("paged, pages of 64, tiles of 32", (128, 70), 64, 2, 32)]
    n = 0
    for name, lengths, rows_per_seq, pages, BN in layouts:
        B = len(lengths)
        table = torch.randperm(B * (pages or 1), generator=g).view(B, -1).to(torch.int32)
        table = table.to(dev) if pages else torch.zeros((B, 1), dtype=torch.int32, device=dev)
        for b, length in enumerate(lengths):
            for start_n in range(0, length, BN):
                out = torch.empty(BN, dtype=torch.int32, device=dev)
                what = f"cache_rows, {name}, sequence {b} (length {length}), keys " \
                       f"{start_n}-{start_n + BN - 1}"
                run_student(lambda: probe[(1,)](out, table, b, start_n, length, rows_per_seq,
                                                table.stride(0), CACHE_ROWS=cache_rows,
                                                PAGED=pages is not None, BLOCK_N=BN),
                            what=what, guard=True)
                key = torch.arange(start_n, min(start_n + BN, length))
                want = (table[b, key // rows_per_seq].cpu() * rows_per_seq + key % rows_per_seq
                        if pages else b * rows_per_seq + key)
                got = out.cpu()[:len(key)].long()
                if not torch.equal(got, want.long()):
                    raise CheckFailure(
                        f"{what}: rows {got.tolist()[:6]}..., expected "
                        f"{want.tolist()[:6]}...\n  Hint: " + (
                            "each key's page is block_table[b, key // page_size] (a tile may "
                            "span pages), its row page * page_size + key % page_size."
                            if pages else "sequence b's keys start at row b * rows_per_seq."))
                n += 1
    report("cache_rows (contiguous and paged)", n, hidden=hidden)


# ---------------------------------------------------------------- Exercise 3: decode

# A decode case whose every score is -96000 (q all 1, valid keys all -1, d = 16, scale 6000):
# a running max that starts at a finite -1e4 instead of -inf stays above every score, and a max
# rounded to float16 has no such value (its largest finite magnitude is 65504).
CONSTANT_SCORE_CASE = "contiguous, G=4, every score -96000"
CONSTANT_SCALE = 6000.0


_HINT_DECODE = ("row r of the tile is query head kv_head * GROUP + r % GROUP at position new "
                "token r // GROUP; K and V come from head kv_head = pid_bh % H_KV; masks and "
                "tile ranges as in Chapter 4. Keys: cache_seqlens[b] of them, through "
                "cache_rows.")


def decode_cases(hidden: bool = False):
    """(name, B, n_new, h_q, h_kv, d, lengths, max_len, page_size or None, dtype, BLOCK_N or
    None: the launcher's)."""
    cases = [("contiguous, G=4, one new token", 3, 1, 8, 2, 16, (40, 1, 64), 64, None,
              torch.float32, None),
             ("paged (16), G=4, two new tokens", 3, 2, 8, 2, 16, (40, 2, 33), 48, 16,
              torch.float32, None),
             ("paged (16), tiles of 32 keys spanning pages", 2, 1, 4, 2, 16, (45, 64), 64, 16,
              torch.float32, 32),
             ("MQA, paged (32), float16", 2, 1, 4, 1, 32, (64, 17), 64, 32, torch.float16, None),
             (CONSTANT_SCORE_CASE, 2, 2, 8, 2, 16, (40, 9), 48, None, torch.float32, None)]
    if hidden:
        cases += [("contiguous, G=8, 3 new tokens, d=64", 2, 3, 8, 1, 64, (19, 3), 32, None,
                   torch.float32, None),
                  ("paged (16), G=1, lengths at page edges", 3, 1, 2, 2, 16, (16, 32, 17), 48,
                   16, torch.float32, None),
                  ("paged (16), tiles of 64 keys over 4 pages", 2, 2, 8, 2, 16, (50, 64), 64,
                   16, torch.float32, 64),
                  # G x n_new = 160 rows: the launcher runs chunks of at most DECODE_MAX_ROWS,
                  # each causal-aligned to its own last token
                  ("paged (16), G=4, 40 new tokens (two launches)", 2, 40, 8, 2, 16, (40, 75),
                   80, 16, torch.float32, None)]
    # then seeded random problems with the H200's key tile (in CPU mode too): cache lengths next
    # to its edges, G 1-8, 1-3 new tokens, contiguous or in pages smaller than the tile
    block_n = decode_config((9, 0))[0]
    cases += [(c.name, c.B, c.n_new, c.h_q, c.h_kv, 16, c.lengths, c.max_len, c.page,
               torch.float32, block_n)
              for c in decode_sweep("random", seed=60 if hidden else 6, n=3 if hidden else 2,
                                    block_n=block_n, tiles=2, new_tokens=(1, 2, 3),
                                    pages=(None, 16, 64))]
    return cases


def _cache(B, max_len, h_kv, d, lengths, dtype, seed):
    """A contiguous cache with NaN in every slot past a sequence's length (canaries)."""
    k = seeded((B, max_len, h_kv, d), seed, dtype)
    v = seeded((B, max_len, h_kv, d), seed + 1, dtype)
    for b, n in enumerate(lengths):
        k[b, n:], v[b, n:] = math.nan, math.nan
    return k, v


def _decode_reference(q, k, v, lengths, scale=None):
    o = torch.zeros(q.shape, dtype=torch.float64)
    lse = torch.zeros(q.shape[0], q.shape[2], q.shape[1], dtype=torch.float64)
    for b, n in enumerate(lengths):
        ob, lb = reference.attention(q[b].transpose(0, 1)[None].double().cpu(),
                                     k[b, :n].transpose(0, 1)[None].double().cpu(),
                                     v[b, :n].transpose(0, 1)[None].double().cpu(), causal=True,
                                     return_lse=True, scale=scale)
        o[b], lse[b] = ob[0].transpose(0, 1), lb[0]
    return o, lse


def check_decode_kernel(kernel, hidden: bool = False):
    """Exercise 3: decode with the M-fold against contiguous and shuffled paged caches; slots
    past a sequence's length hold NaN, so reading one poisons the output."""
    require_implemented(kernel, "decode_kernel")
    n = 0
    for i, (name, B, n_new, h_q, h_kv, d, lengths, max_len, page, dtype, block_n) in \
            enumerate(decode_cases(hidden)):
        q = seeded((B, n_new, h_q, d), 40 + i, dtype)
        k, v = _cache(B, max_len, h_kv, d, lengths, dtype, 50 + 2 * i)
        scale = None
        if name == CONSTANT_SCORE_CASE:              # every score q . k * scale = -96000
            q, k, scale = torch.ones_like(q), torch.where(k.isnan(), k, -1.0), CONSTANT_SCALE
        seqlens = torch.tensor(lengths, dtype=torch.int32, device=q.device)
        want_o, want_lse = _decode_reference(q, k, v, lengths, scale)
        table = None
        if page:
            k, v, table = paged_cache(k, v, page, seed=i, spare=2)
            table = table.to(q.device)
        rows = decode_block_m(h_q // h_kv, n_new)
        what = (f"decode kernel, case '{name}' (B={B}, n_new={n_new}, h_q={h_q}, h_kv={h_kv}, "
                f"d={d}, lengths {list(lengths)}, {str(dtype)[6:]}; {rows} rows per tile"
                + (f", {block_n} keys" if block_n else "") + ")")
        o, lse = run_student(launch_decode, kernel, q, k, v, seqlens, table, block_n=block_n,
                             scale=scale, what=what, guard=True)
        no_nan(o, what + ", O (NaN: a slot past cache_seqlens was read, or a wrong page)")
        assert_close(o, want_o.to(o.device), what=what + ", O", dims=("b", "new", "head", "col"),
                     dtype=dtype, hint=_HINT_DECODE)
        assert_close(lse, want_lse.to(lse.device), what=what + ", LSE",
                     dims=("b", "head", "new"), dtype=torch.float32, atol=2e-4, rtol=1e-4,
                     hint="LSE (B, h_q, n_new) at (b * h_q + head) * n_new + t, natural log.")
        n += 1
    report("decode kernel (contiguous and paged caches)", n, hidden=hidden)


# ------------------------------------------------------------ Exercise 4: argument checks

def _valid_decode(dtype=torch.float32, paged=False):
    dev = current().device
    q = seeded((2, 1, 4, 16), 1, dtype)
    k, v = seeded((2, 32, 2, 16), 2, dtype), seeded((2, 32, 2, 16), 3, dtype)
    seqlens = torch.tensor([32, 5], dtype=torch.int32, device=dev)
    call = dict(q=q, k_cache=k, v_cache=v, cache_seqlens=seqlens, block_table=None)
    if paged:
        k, v, table = paged_cache(k, v, 16, seed=0)
        call.update(k_cache=k, v_cache=v, block_table=table.to(dev))
    return call


def _pages_of_8(paged: dict) -> dict:
    """The paged call's pools cut into pages of 8 slots (page j of 16 -> pages 2j, 2j + 1)."""
    k, v, table = paged["k_cache"], paged["v_cache"], paged["block_table"]
    halves = torch.stack((2 * table, 2 * table + 1), dim=-1).flatten(1)
    return dict(k_cache=k.reshape(-1, 8, *k.shape[2:]), v_cache=v.reshape(-1, 8, *v.shape[2:]),
                block_table=halves.to(torch.int32))


def _unused_pages_marked(paged: dict) -> dict:
    """The paged call with -1 in every block_table entry past a sequence's used pages (the
    second sequence, 5 keys, uses one page of 16), as serving engines leave them."""
    table = paged["block_table"].clone()
    table[1, 1:] = -1
    return dict(block_table=table)


def validate_decode_cases(hidden: bool = False):
    """(what is wrong, paged?, changes to a valid call, the argument the message must name)."""
    dev = current().device
    i32 = dict(dtype=torch.int32, device=dev)
    base, paged = _valid_decode(), _valid_decode(paged=True)
    cases = [
        ("h_q=3 is not a multiple of h_kv=2", False, dict(q=base["q"][:, :, :3]), "k_cache"),
        ("a cache length beyond the cache", False,
         dict(cache_seqlens=torch.tensor([33, 5], **i32)), "cache_seqlens"),
        ("cache_seqlens is int64", False, dict(cache_seqlens=base["cache_seqlens"].long()),
         "cache_seqlens"),
        ("a page table entry out of range", True,
         dict(block_table=paged["block_table"] + 10), "block_table"),
        ("k_cache is float16, q float32", False, dict(k_cache=base["k_cache"].half()), "k_cache"),
        ("v_cache holds fewer slots than k_cache", False,
         dict(v_cache=base["v_cache"][:, :16].contiguous()), "v_cache"),
        ("a length beyond the paged capacity (max_pages x page_size = 16)", True,
         dict(block_table=paged["block_table"][:, :1].contiguous()), "cache_seqlens"),
        ("q is 3-d", False, dict(q=base["q"][:, 0]), "q"),
    ]
    if hidden:
        cases += [
            ("block_table is int64", True, dict(block_table=paged["block_table"].long()),
             "block_table"),
            ("a length shorter than the new tokens", False,
             dict(cache_seqlens=torch.tensor([32, 0], **i32)), "cache_seqlens"),
            ("a cache for another batch size", False,
             dict(k_cache=base["k_cache"][:1], v_cache=base["v_cache"][:1]), "k_cache"),
            ("the cache's last dimension is strided", False,
             dict(k_cache=base["k_cache"].repeat(1, 1, 1, 2)[..., ::2]), "k_cache"),
            ("head dimension 24 (not a power of two)", False,
             {n: seeded(base[n].shape[:-1] + (24,), 7 + i, torch.float32)
              for i, n in enumerate(("q", "k_cache", "v_cache"))}, "q"),
            ("pages of 8 slots (not a multiple of 16)", True,
             _pages_of_8(paged), "k_cache"),
        ]
    return cases


def check_validate_decode(validate, hidden: bool = False):
    """Exercise 4: every bad call raises a ValueError naming the argument; valid calls pass,
    one of them while a CUDA graph is (as if) captured, reading nothing on the host."""
    require_implemented(validate, "validate_decode")
    paged = _valid_decode(paged=True)
    valid = [("a valid contiguous call", _valid_decode()),
             ("a valid paged call", paged),
             ("float16, paged", _valid_decode(torch.float16, paged=True)),
             ("paged, -1 in the entries past a sequence's used pages",
              {**paged, **_unused_pages_marked(paged)})]
    invalid = [(name, {**_valid_decode(paged=paged), **change}, arg)
               for name, paged, change, arg in validate_decode_cases(hidden)]
    n = check_argument_errors(validate, valid, invalid, title="validate_decode",
                              consequence="The kernel would read outside the cache or return "
                                          "wrong numbers.",
                              captured=_valid_decode(paged=True),
                              capture_hint="Read cache_seqlens and block_table with "
                                           "host_values(t): it returns None while a graph is "
                                           "captured; skip the value checks then.")
    report("validate_decode", n, hidden=hidden)
