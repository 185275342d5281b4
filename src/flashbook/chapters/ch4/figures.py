"""Chapter 4's pictures: which K/V tiles a program loads under causal and sliding-window masks,
and what packing a variable-length batch saves over padding it.

The tile classes are computed by brute force from ``reference.visible_mask``: they are read off
the element mask, tile by tile, never from the loop bounds a kernel computes (those are the
chapter's exercise). That costs O(seqlen_q * seqlen_k) memory: fine at teaching sizes.
"""
from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import torch
from matplotlib.collections import PatchCollection
from matplotlib.colors import ListedColormap
from matplotlib.patches import Patch, Rectangle
from matplotlib.ticker import MaxNLocator

from flashbook import reference

SKIPPED, PARTIAL, FULL = 0, 1, 2
COLORS = {SKIPPED: "#e4e4e4", PARTIAL: "C1", FULL: "C0"}
LABELS = {SKIPPED: "skipped (not loaded)", PARTIAL: "partial (loaded, masked)",
          FULL: "full (loaded, no mask)"}
WASTED = "C3"                                   # a padded sweep's tile that holds no real pair


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def tile_classes(seqlen_q: int, seqlen_k: int, block_m: int, block_n: int,
                 causal: bool = False, window: tuple | None = None) -> torch.Tensor:
    """int8 (cdiv(seqlen_q, block_m), cdiv(seqlen_k, block_n)): entry [i, j] says what program i
    (query rows i*block_m ...) does with K tile j: SKIPPED (0) if none of its (real row, key)
    pairs is visible, FULL (2) if all are and the tile lies wholly inside seqlen_k, else PARTIAL
    (1: loaded, and the mask applied). Masks as ``reference.visible_mask`` (bottom-right)."""
    tq, tk = _cdiv(seqlen_q, block_m), _cdiv(seqlen_k, block_n)
    if tq == 0 or tk == 0:
        return torch.zeros(tq, tk, dtype=torch.int8)
    vis = reference.visible_mask(seqlen_q, seqlen_k, causal, window)    # (seqlen_q, seqlen_k)
    # Pad the mask to whole tiles twice. For "any pair visible?" nothing past either end counts.
    # For "all pairs visible?" rows past seqlen_q do not exist (True: they never spoil a tile),
    # but keys past seqlen_k are lanes the kernel must mask (False: a tail tile is never full).
    seen = torch.zeros(tq * block_m, tk * block_n, dtype=torch.bool)
    seen[:seqlen_q, :seqlen_k] = vis
    every = seen.clone()
    every[seqlen_q:] = True
    any_ = seen.view(tq, block_m, tk, block_n).any(dim=3).any(dim=1)      # (tq, tk)
    all_ = every.view(tq, block_m, tk, block_n).all(dim=3).all(dim=1)
    return torch.where(all_, FULL, torch.where(any_, PARTIAL, SKIPPED)).to(torch.int8)


def _as_case(case, block_m: int, block_n: int) -> dict:
    """A case as a dict. Tuples read (title, seqlen_q, seqlen_k, causal, window[, block_m,
    block_n]); seqlen_q may be a list of lengths (a packed batch; seqlen_k None: the same)."""
    keys = ("title", "seqlen_q", "seqlen_k", "causal", "window", "block_m", "block_n")
    c = dict(case) if isinstance(case, dict) else dict(zip(keys, case))
    c.setdefault("causal", False)
    c.setdefault("window", None)
    c["block_m"] = c.get("block_m") or block_m
    c["block_n"] = c.get("block_n") or block_n
    if c.get("seqlen_k") is None:
        c["seqlen_k"] = c["seqlen_q"]
    return c


def _canvas(seqlens_q, seqlens_k, bm, bn, causal, window):
    """Each sequence's tile grid placed block-diagonally, in tile units; -1 where no program
    looks (another sequence's keys). Returns (canvas, tiles in the full per-sequence sweeps)."""
    grids = [tile_classes(q, k, bm, bn, causal, window) for q, k in zip(seqlens_q, seqlens_k)]
    canvas = torch.full((sum(g.shape[0] for g in grids), sum(g.shape[1] for g in grids)), -1,
                        dtype=torch.int8)
    r = c = 0
    for g in grids:
        canvas[r:r + g.shape[0], c:c + g.shape[1]] = g
        r, c = r + g.shape[0], c + g.shape[1]
    return canvas, sum(g.numel() for g in grids)


def _legend(fig, extra=()):
    handles = [Patch(color=COLORS[k], label=LABELS[k]) for k in (FULL, PARTIAL, SKIPPED)]
    fig.legend(handles=handles + list(extra), loc="lower center", ncol=len(handles) + len(extra),
               fontsize=8, frameon=False)


def plot_tile_visits(cases, block_m: int = 64, block_n: int = 64):
    """One panel per case: the (query tile x key tile) grid coloured skipped / partial / full,
    titled with the tiles loaded against the full sweep. A case may set its own block sizes."""
    cases = [_as_case(c, block_m, block_n) for c in cases]
    fig, axes = plt.subplots(1, len(cases), figsize=(3.8 * len(cases), 4.2), squeeze=False)
    cmap = ListedColormap(["white", COLORS[SKIPPED], COLORS[PARTIAL], COLORS[FULL]])
    for ax, c in zip(axes[0], cases):
        packed = isinstance(c["seqlen_q"], (list, tuple))
        lq = list(c["seqlen_q"]) if packed else [c["seqlen_q"]]
        lk = list(c["seqlen_k"]) if packed else [c["seqlen_k"]]
        canvas, sweep = _canvas(lq, lk, c["block_m"], c["block_n"], c["causal"], c["window"])
        ax.imshow(canvas.numpy(), cmap=cmap, vmin=-1.5, vmax=2.5, interpolation="nearest")
        tq, tk = canvas.shape
        if max(tq, tk) <= 64:                    # tile borders, while they are still visible
            ax.set_xticks(np.arange(-0.5, tk), minor=True)
            ax.set_yticks(np.arange(-0.5, tq), minor=True)
            ax.grid(which="minor", color="white", lw=0.8)
            ax.tick_params(which="minor", length=0)
        loaded = int((canvas > 0).sum())
        ax.set_title(f"{c['title']}: {loaded} of {sweep} tiles\n"
                     f"({c['block_m']}x{c['block_n']} tiles)", fontsize=9)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("key tile")
        ax.set_ylabel("query tile (program)")
    _legend(fig)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    return fig


def _tile_patches(ax, cells, offsets, fills):
    """Draw rectangles (x, y, w, h) in token units with the given face colours."""
    ax.add_collection(PatchCollection([Rectangle(xy[:2], *xy[2:]) for xy in cells],
                                      facecolors=fills, edgecolors="white", linewidths=0.3))
    for o, n in offsets:                          # each sequence's own (n x n) block
        ax.add_patch(Rectangle((o, o), n, n, fill=False, ec="black", lw=0.8))


def plot_varlen_tiles(seqlens, block_m: int, block_n: int, causal: bool = False):
    """A packed batch (left): each sequence's programs visit only that sequence's K tiles, so the
    visits form blocks on the diagonal of the packed token axis. The same batch padded to the
    longest (right): every sequence sweeps max_len x max_len, and tiles holding only padding
    (red) are wasted work. Draws one rectangle per tile: keep batches small."""
    seqlens = [int(n) for n in seqlens]
    top = max(seqlens)
    padded_cls = tile_classes(top, top, block_m, block_n, causal)       # the dense kernel's view
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 5.2))
    counts = []
    for ax, pad in ((left, False), (right, True)):
        cells, fills, offsets, off, loaded = [], [], [], 0, 0
        for n in seqlens:
            real = tile_classes(n, n, block_m, block_n, causal)    # (cdiv(n, bm), cdiv(n, bn))
            grid = padded_cls if pad else real
            extent = top if pad else n
            for i, j in np.ndindex(*grid.shape):
                mine = i < real.shape[0] and j < real.shape[1]
                cls = int(real[i, j]) if mine else SKIPPED
                visited = int(grid[i, j]) != SKIPPED
                x, y = j * block_n, i * block_m           # tile corner, clipped at extent
                cells.append((off + x, off + y, min(block_n, extent - x), min(block_m, extent - y)))
                fills.append(WASTED if visited and cls == SKIPPED else COLORS[cls])
                loaded += visited
            offsets.append((off, n))
            off += extent
        counts.append(loaded)
        _tile_patches(ax, cells, offsets, fills)
        ax.set_xlim(0, off)
        ax.set_ylim(off, 0)
        ax.set_aspect("equal")
        ax.set_xlabel(f"key ({'padded' if pad else 'packed'} token index)")
        ax.set_ylabel(f"query ({'padded' if pad else 'packed'} token index)")
    mask = "causal" if causal else "non-causal"
    left.set_title(f"packed ({mask}): {counts[0]} tiles loaded\n{len(seqlens)} sequences, "
                   f"{sum(seqlens)} tokens", fontsize=9)
    right.set_title(f"padded to {top}: {counts[1]} tiles loaded "
                    f"({counts[1] / max(counts[0], 1):.3g}x)\n{len(seqlens)} x {top} tokens",
                    fontsize=9)
    _legend(fig, [Patch(color=WASTED, label="padding only (wasted)")])
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    return fig


def padding_stats(seqlens) -> dict:
    """Tokens and attention pairs of a batch packed vs padded to its longest sequence.

    Causal pairs count the diagonal, n(n+1)/2 per sequence: about half the non-causal n^2."""
    lens = [int(n) for n in seqlens]
    b, top, total = len(lens), max(lens, default=0), sum(lens)
    real, real_c = sum(n * n for n in lens), sum(n * (n + 1) // 2 for n in lens)
    pad, pad_c = b * top * top, b * top * (top + 1) // 2

    def ratio(p, r):
        return p / r if r else float("nan")
    return dict(sequences=b, max_len=top, total_tokens=total, padded_tokens=b * top,
                padding_ratio=ratio(b * top, total),
                pairs_real=real, pairs_padded=pad, pairs_ratio=ratio(pad, real),
                pairs_real_causal=real_c, pairs_padded_causal=pad_c,
                pairs_ratio_causal=ratio(pad_c, real_c))


def plot_padding(seqlens):
    """Left: the lengths, sorted, inside the padded rectangle (grey: padding). Right: attention
    pairs computed, padded against packed, non-causal and causal, each labelled with its ratio."""
    s = padding_stats(seqlens)
    lens = sorted((int(n) for n in seqlens), reverse=True)
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8),
                                      gridspec_kw=dict(width_ratios=(1.6, 1)))
    x = np.arange(len(lens))
    left.bar(x, [s["max_len"]] * len(lens), width=0.9, color=COLORS[SKIPPED], label="padding")
    left.bar(x, lens, width=0.9, color="C0", label="real tokens")
    left.set_xlabel("sequence (sorted by length)")
    left.set_ylabel("tokens")
    left.set_title(f"{s['sequences']} sequences, {s['total_tokens']} tokens; padded: "
                   f"{s['padded_tokens']} ({s['padding_ratio']:.3g}x)", fontsize=9)
    left.legend(fontsize=8)
    for k, (mask, suffix) in enumerate((("non-causal", ""), ("causal", "_causal"))):
        pad, real = s["pairs_padded" + suffix], s["pairs_real" + suffix]
        right.bar(k - 0.2, pad, width=0.38, color="grey", label="padded" if k == 0 else None)
        right.bar(k + 0.2, real, width=0.38, color="C0", label="packed" if k == 0 else None)
        right.annotate(f"{s['pairs_ratio' + suffix]:.3g}x", (k - 0.2, pad), ha="center",
                       va="bottom", fontsize=9)
    right.set_xticks([0, 1], ["non-causal", "causal"])
    right.set_ylabel("attention pairs (q, k) per head")
    right.set_title("pairs computed", fontsize=9)
    right.legend(fontsize=8)
    fig.tight_layout()
    return fig


def lognormal_lengths(n_tokens: int, seed: int = 0, mean: float = 6.4, sigma: float = 2.5,
                      lo: int = 1, hi: int = 16384) -> list[int]:
    """Sequence lengths summing to exactly ``n_tokens``, long-tailed like a real corpus.

    Draws round(exp(N(mean, sigma^2))) clipped to [lo, hi] from numpy's ``default_rng(seed)``
    (PCG64: the same numbers on every machine) until the total reaches ``n_tokens``; the last
    draw is trimmed to what is left. Should that remainder be shorter than ``lo``, it is added to
    the shortest earlier sequence instead. The defaults give, for 65536 tokens, 29 sequences,
    the longest 16384 (clipped), a padding ratio of 7.25.
    """
    if not 1 <= lo <= hi or 0 < n_tokens < lo:
        raise ValueError(f"cannot split {n_tokens} tokens into lengths in [{lo}, {hi}]")
    rng, lens, left = np.random.default_rng(seed), [], n_tokens
    while left > 0:
        n = min(int(np.clip(round(rng.lognormal(mean, sigma)), lo, hi)), left)
        if n < lo:                                # only the trimmed remainder can be this short
            k = lens.index(min(lens))
            if lens[k] + n > hi:
                raise ValueError(f"cannot split {n_tokens} tokens into lengths in [{lo}, {hi}]")
            lens[k] += n
        else:
            lens.append(n)
        left -= n
    return lens
