"""What the checks of the packed ("varlen") kernels share (Chapters 4 and 5): the batch with a
NaN *canary* sequence after each real one (``with_canaries``), so a kernel that reads one key
or query past its own sequence reads NaN and ``name_leaks`` names the sequence that leaked;
and, for a launch's layout, which K tiles each program must load (``expected_loads``:
``program_tile``'s order, G (sequence, head) pairs per section, the last tile first)."""
from __future__ import annotations

import math

import torch

from . import oob
from .cases import AttnCase
from .compare import CheckFailure
from .launcher import cdiv

CANARY = (3, 40)       # (queries, keys) of the NaN sequence after every real one (keys >
                       # BLOCK_N: a tile that runs past its sequence lands in NaN)


def tiles(cfg) -> str:
    """How a check names a tile config (a ``tiles.Config`` or None: the GPU's default)."""
    return f"{cfg.BLOCK_M}x{cfg.BLOCK_N} tiles" if cfg else "the GPU's default tiles"


def with_canaries(case: AttnCase, q, k, v, trailing: bool = True):
    """The packed batch with a NaN canary sequence after each real sequence:
    (q, k, v, cu_q, cu_k, real query rows of the augmented batch, index of each real sequence).
    ``trailing``: NaN rows after the last canary that belong to no sequence (a wrapper that
    checks ``cu_seqlens[-1]`` against the token count refuses them)."""
    lens_q, lens_k = case.seqlens, case.seqlens_k or case.seqlens
    cu_q, cu_k = case.cu_seqlens().tolist(), case.cu_seqlens(keys=True).tolist()
    parts = {"q": [], "k": [], "v": []}
    rows, new_q, new_k, seq_index = [], [0], [0], []
    for b, (nq, nk) in enumerate(zip(lens_q, lens_k)):
        seq_index.append(len(new_q) - 1)
        rows.append(torch.arange(new_q[-1], new_q[-1] + nq))
        for name, t, a, n in (("q", q, cu_q[b], nq), ("k", k, cu_k[b], nk), ("v", v, cu_k[b], nk)):
            parts[name].append(t[a:a + n])
        new_q.append(new_q[-1] + nq)
        new_k.append(new_k[-1] + nk)
        for name, t, n in (("q", q, CANARY[0]), ("k", k, CANARY[1]), ("v", v, CANARY[1])):
            parts[name].append(torch.full((n, *t.shape[1:]), math.nan, dtype=t.dtype,
                                          device=t.device))
        new_q.append(new_q[-1] + CANARY[0])
        new_k.append(new_k[-1] + CANARY[1])
    for name, t in (("q", q), ("k", k), ("v", v)) if trailing else ():
        parts[name].append(torch.full((CANARY[1], *t.shape[1:]), math.nan, dtype=t.dtype,
                                      device=t.device))  # the last canary has NaN after it too
    packed = [oob.embed(torch.cat(parts[n]), pad=256) for n in ("q", "k", "v")]
    dev = q.device
    cu = [torch.tensor(c, dtype=torch.int32, device=dev) for c in (new_q, new_k)]
    return (*packed, *cu, torch.cat(rows).to(dev), seq_index)


def name_leaks(case: AttnCase, o, sections: int = 1):
    """NaN in a real sequence that has keys came from a canary: say which sequence leaked."""
    lens_q, lens_k = case.seqlens, case.seqlens_k or case.seqlens
    start = 0
    for b, (nq, nk) in enumerate(zip(lens_q, lens_k)):
        bad = torch.isnan(o[start:start + nq].float()).flatten(1).any(1)
        if nk and bad.any():
            first = int(bad.nonzero()[0])
            raise CheckFailure(
                f"case {case.describe()}: rows of sequence {b} (lengths q={nq}, k={nk}) contain "
                f"NaN, first at row {first} of the sequence. A sequence of NaN (a canary) follows "
                "every sequence in this batch: the kernel read keys or queries past its own "
                f"sequence, or never wrote some of its rows (O is pre-filled with NaN).\n"
                "  Hint: offsets come from CU_Q[seq] and CU_K[seq]; lengths are "
                "CU[seq + 1] - CU[seq]; every load and store is masked to the sequence's length."
                + (f" This launch walks {sections} (sequence, head) pairs per section: each "
                   "program takes its tile from `m_block, pid_bh = program_tile("
                   "heads_per_section)`, not from the raw program ids." if sections > 1 else ""))
        start += nq


def tile_sets(vis, m0, BM, BN, seqlen_q, seqlen_k):
    """(tiles with a visible pair, fully visible tiles) of rows m0..m0+BM-1 (real rows only)."""
    band = vis[m0:min(m0 + BM, seqlen_q)]
    seen, full = set(), set()
    for n0 in range(0, seqlen_k, BN):
        block = band[:, n0:n0 + BN]
        if block.any():
            seen.add(n0)
        if block.numel() and block.all() and n0 + BN <= seqlen_k:
            full.add(n0)
    return seen, full


def programs(layout, H: int, BM: int, BN: int):
    """(program id, sequence, head, real_rows, tiles with a visible pair, fully visible tiles)
    of each program of the launch ``layout`` (from _run_packed), with program ids as
    ``program_tile`` assigns them (G pairs per section, last tile first); ``real_rows``: the
    program's tile holds no padding row."""
    cu_q, cu_k, max_q, _, (left, right), G = layout
    n_m = cdiv(max_q, BM)
    for seq in range(len(cu_q) - 1):
        sq, sk = cu_q[seq + 1] - cu_q[seq], cu_k[seq + 1] - cu_k[seq]
        i = torch.arange(sq)[:, None] + (sk - sq)
        j = torch.arange(sk)[None, :]
        vis = (j >= i - left) & (j <= i + right)
        for m_block in range(cdiv(sq, BM)):
            seen, full = tile_sets(vis, m_block * BM, BM, BN, sq, sk)
            for h in range(H):
                bh = seq * H + h
                yield ((n_m - 1 - m_block) * G + bh % G, bh // G), seq, h, \
                    (m_block + 1) * BM <= sq, seen, full


def expected_loads(layout, H: int, BM: int, BN: int) -> dict:
    """{program id: (K tiles with a visible pair, sequence * H + head)} for the launch
    ``layout`` (from _run_packed)."""
    return {pid: (len(seen), seq * H + h)
            for pid, seq, h, _, seen, _ in programs(layout, H, BM, BN)}
