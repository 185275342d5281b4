"""Chapter 5's numbers and pictures: how big the KV cache of real models is, why decode is
memory-bound (the roofline), the M-fold that lets G query heads share one K/V tile load, and a
paged KV cache mapped through its block table.

Shapes: h_q query heads share h_kv K/V heads in groups of G = h_q / h_kv (MHA: G = 1; MQA:
h_kv = 1). The cache holds K and V, each (layers, h_kv, tokens, head_dim), per sequence.
"""
from __future__ import annotations

import dataclasses

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import Patch, Rectangle

GIB = 2 ** 30


@dataclasses.dataclass(frozen=True)
class Model:
    name: str
    layers: int      # config.json num_hidden_layers
    h_q: int         # num_attention_heads
    h_kv: int        # num_key_value_heads (1 for Falcon's multi_query)
    head_dim: int    # head_dim, else hidden_size // num_attention_heads
    source: str      # the official Hugging Face repository whose config.json this follows

    @property
    def G(self) -> int:
        return self.h_q // self.h_kv


# Every number below was checked against the sources named in its comment (looked up with the
# code/docs search over public repositories; the official config.json pages themselves were not
# all in the index, so each row cites what was).
MODELS = (
    # MHA. Meta's model card (meta-llama/llama-models, models/llama2/MODEL_CARD.md): GQA only in
    # 70B, not 7B, so h_kv = h_q. 32 layers, 32 heads, hidden 4096: transformers
    # src/transformers/models/llama/configuration_llama.py (defaults, docs checkpoint
    # meta-llama/Llama-2-7b-hf) and configs whose _name_or_path is meta-llama/Llama-2-7b-hf
    # (num_key_value_heads 32). NB models/sku_list.py in llama-models lists n_kv_heads 8 for
    # Llama 2 7B, which Meta's own card contradicts; we follow the card and the HF configs.
    Model("Llama-2-7B", 32, 32, 32, 128, "meta-llama/Llama-2-7b-hf"),
    # meta-llama/llama-models models/sku_list.py (Llama-3.1-8B: dim 4096, n_layers 32, n_heads
    # 32, n_kv_heads 8); HF configs derived from meta-llama/Llama-3.1-8B give head_dim 128.
    Model("Llama-3.1-8B", 32, 32, 8, 128, "meta-llama/Llama-3.1-8B"),
    # meta-llama/llama-models models/sku_list.py (Llama-3.1-70B: dim 8192, n_layers 80, n_heads
    # 64, n_kv_heads 8); HF configs derived from Llama-3.1-70B-Instruct: head_dim 128.
    Model("Llama-3.1-70B", 80, 64, 8, 128, "meta-llama/Llama-3.1-70B"),
    # transformers src/transformers/models/mistral/configuration_mistral.py (defaults = Mistral
    # 7B v0.1: 32 layers, 32 heads, 8 K/V heads, hidden 4096); HF configs from mistralai/...-v0.1.
    Model("Mistral-7B-v0.1", 32, 32, 8, 128, "mistralai/Mistral-7B-v0.1"),
    # Qwen's model card (copy: ZHUI/paddlenlp_model_readme, Qwen/Qwen2.5-7B/index.md): 28 layers,
    # "28 for Q and 4 for KV"; hidden_size 3584 (HF configs derived from Qwen/Qwen2.5-7B) / 28.
    Model("Qwen2.5-7B", 28, 28, 4, 128, "Qwen/Qwen2.5-7B"),
    # MQA. transformers src/transformers/models/falcon/configuration_falcon.py (defaults = falcon
    # -7b: hidden 4544, 32 layers, 71 heads, multi_query=True) and modeling_falcon.py
    # (multi_query -> num_kv_heads = 1); head_dim 4544 / 71 = 64.
    Model("Falcon-7B", 32, 71, 1, 64, "tiiuae/falcon-7b"),
)


def kv_cache_bytes(model, tokens: int, dtype_bytes: int = 2) -> int:
    """Bytes of K and V cached for one sequence of ``tokens`` tokens, all layers:
    2 (K and V) * layers * h_kv * head_dim * tokens * dtype_bytes. ``model``: a Model or name."""
    m = model if isinstance(model, Model) else next(m for m in MODELS if m.name == model)
    return 2 * m.layers * m.h_kv * m.head_dim * tokens * dtype_bytes


def kv_table(tokens: int = 8192, batch: int = 32, dtype_bytes: int = 2, models=MODELS) -> list:
    """One dict per model: its heads, G, and the KV cache in GiB per sequence, for ``batch``
    sequences, and for the batch had the model used MHA (h_kv = h_q: G times more)."""
    def gib(m):
        return kv_cache_bytes(m, tokens, dtype_bytes) / GIB
    return [dict(model=m.name, h_q=m.h_q, h_kv=m.h_kv, G=m.G, kv_seq_gib=gib(m),
                 kv_batch_gib=gib(m) * batch,
                 mha_batch_gib=gib(dataclasses.replace(m, h_kv=m.h_q)) * batch) for m in models]


def kv_table_markdown(tokens: int = 8192, batch: int = 32, dtype_bytes: int = 2,
                      models=MODELS) -> str:
    """``kv_table`` as a markdown table for the book."""
    lines = [f"| model | h_q | h_kv | G | KV per sequence of {tokens} tokens (GiB) "
             f"| KV x {batch} (GiB) | MHA x {batch} (GiB) |", "|---|--:|--:|--:|--:|--:|--:|"]
    for r in kv_table(tokens, batch, dtype_bytes, models):
        lines.append(f"| {r['model']} | {r['h_q']} | {r['h_kv']} | {r['G']} "
                     f"| {r['kv_seq_gib']:.4g} | {r['kv_batch_gib']:.4g} "
                     f"| {r['mha_batch_gib']:.4g} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------- roofline

def decode_intensity(h_q: int, h_kv: int, n_new: int, context: int, d: int,
                     dtype_bytes: int = 2) -> float:
    """FLOPs per byte of K/V read for one attention step of ``n_new`` new tokens per query head
    against ``context`` cached tokens: 4*h_q*n_new*context*d FLOPs (QK^T and PV, 2 each) over
    2*h_kv*context*d*dtype_bytes bytes (K and V read once). Simplifies to G*n_new*2/dtype_bytes:
    the context cancels; Q and O traffic (n_new rows, small in decode) is left out."""
    return (4 * h_q * n_new * context * d) / (2 * h_kv * context * d * dtype_bytes)


def prefill_intensity(h_q: int, h_kv: int, n: int, d: int, dtype_bytes: int = 2) -> float:
    """The same measure for a non-causal prefill of ``n`` tokens: every token is new, and K/V
    (n tokens) is read once: G*n*2/dtype_bytes."""
    return decode_intensity(h_q, h_kv, n, n, d, dtype_bytes)


def ridge_point(peak_tflops: float, hbm_gbps: float) -> float:
    """FLOP/byte at which the roof turns: peak / bandwidth (TFLOP/s over GB/s is 1e3 FLOP/B)."""
    return peak_tflops * 1e3 / hbm_gbps


def attainable_tflops(intensity, peak_tflops: float, hbm_gbps: float):
    """The roofline: min(peak, intensity * bandwidth), in TFLOP/s."""
    return np.minimum(peak_tflops, np.asarray(intensity, dtype=float) * hbm_gbps / 1e3)


def example_points(context: int = 8192, n_prefill: int = 16384, d: int = 128) -> list:
    """The chapter's points, with Llama-3.1-8B heads (32 query heads; MHA would be 32 K/V)."""
    return [("decode MHA (G=1)", decode_intensity(32, 32, 1, context, d)),
            ("decode GQA G=4", decode_intensity(32, 8, 1, context, d)),
            ("decode G=4, 4 new tokens", decode_intensity(32, 8, 4, context, d)),
            (f"prefill N={n_prefill}, G=4", prefill_intensity(32, 8, n_prefill, d))]


def plot_roofline(peak_tflops: float, hbm_gbps: float, points=(), gpu: str = ""):
    """Log-log roofline with the ridge marked. ``points``: (label, intensity) placed on the roof,
    or (label, intensity, achieved TFLOP/s) for a measured kernel, drawn as a star."""
    ridge = ridge_point(peak_tflops, hbm_gbps)
    xs = [p[1] for p in points] + [ridge]
    x = np.logspace(np.log10(min(xs) / 4), np.log10(max(xs) * 4), 256)
    fig, ax = plt.subplots(figsize=(7.5, 4.6))
    ax.loglog(x, attainable_tflops(x, peak_tflops, hbm_gbps), color="black", lw=1.5)
    ax.axvline(ridge, color="grey", ls=":", lw=1)
    ax.annotate(f"ridge {ridge:.0f} FLOP/B", (ridge, peak_tflops), xytext=(4, -14),
                textcoords="offset points", fontsize=8, color="grey")
    for i, p in enumerate(points):
        label, inten = p[0], float(p[1])
        measured = len(p) > 2 and p[2] is not None
        y = float(p[2]) if measured else float(attainable_tflops(inten, peak_tflops, hbm_gbps))
        ax.plot(inten, y, "*" if measured else "o", ms=11 if measured else 7, color=f"C{i % 10}")
        ax.annotate(f"{label}\n{inten:,.6g} FLOP/B, {y:.3g} TFLOP/s", (inten, y), xytext=(6, -4),
                    textcoords="offset points", fontsize=7, va="top")
    ax.set_xlabel("arithmetic intensity (FLOP per byte of K/V read)")
    ax.set_ylabel("attainable TFLOP/s")
    ax.set_ylim(top=peak_tflops * 3)
    ax.set_title(f"{gpu + ' ' if gpu else ''}roofline: {peak_tflops:g} TFLOP/s fp16 tensor, "
                 f"{hbm_gbps:g} GB/s HBM\nridge {ridge:.0f} FLOP/B: left of it memory-bound, right "
                 "compute-bound",
                 fontsize=9)
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------------------------- M-fold

def mfold_rows(G: int, rows_per_head: int, block_m: int) -> list:
    """Which query head owns each row of the folded Q tile(s): row i is head i // rows_per_head,
    token i % rows_per_head; -1 pads the last tile to ``block_m`` rows (masked, not computed)."""
    used = G * rows_per_head
    return [i // rows_per_head if i < used else -1 for i in range(-(-used // block_m) * block_m)]


def _tile(ax, y0, heads, x0=0.0, w=2.0):
    """A Q tile: one band per row, coloured by head, hatched where the row is padding."""
    for r, h in enumerate(heads):
        ax.add_patch(Rectangle((x0, y0 + r), w, 1, lw=0, hatch=None if h >= 0 else "///",
                               facecolor=f"C{h % 10}" if h >= 0 else "white", edgecolor="0.7"))
    ax.add_patch(Rectangle((x0, y0), w, len(heads), fill=False, ec="black", lw=1))


def _kv(ax, y0, h, text):
    ax.add_patch(Rectangle((4, y0), 2, h, facecolor="0.85", ec="black"))
    ax.annotate("", (2.1, y0 + h / 2), (3.9, y0 + h / 2), arrowprops=dict(arrowstyle="->"))
    ax.text(5, y0 + h / 2, text, ha="center", va="center", fontsize=7)


def plot_mfold(G: int, rows_per_head: int, block_m: int):
    """Left: the M-fold. The G query heads that share a K/V head are stacked into the rows of one
    (block_m x d) Q tile, so each K/V tile is loaded once for all G heads. Right: one Q tile per
    head (each mostly padding at decode sizes), so the same K/V tile is loaded G times."""
    if not 1 <= rows_per_head <= block_m:
        raise ValueError(f"rows_per_head={rows_per_head} must be in [1, block_m={block_m}]")
    folded = mfold_rows(G, rows_per_head, block_m)
    n_tiles, gap = len(folded) // block_m, block_m * 0.25
    once = "once" if n_tiles == 1 else f"{n_tiles} times"
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 5.5))
    for t in range(n_tiles):
        y0 = t * (block_m + gap)
        _tile(left, y0, folded[t * block_m:(t + 1) * block_m])
        _kv(left, y0, block_m, f"K/V tile\nloaded {once}\nfor G heads")
    per_head = [h if r < rows_per_head else -1 for h in range(G) for r in range(block_m)]
    for h in range(G):
        y0 = h * (block_m + gap)
        _tile(right, y0, per_head[h * block_m:(h + 1) * block_m])
        _kv(right, y0, block_m, f"same K/V tile\n(load {h + 1} of {G})")
    left.set_title(f"M-fold: {G} heads x {rows_per_head} rows in {n_tiles} Q tile(s) of "
                   f"{block_m}\nK/V tile loaded {once} for G={G} heads", fontsize=9)
    right.set_title(f"per head: {G} Q tiles, {rows_per_head} of {block_m} rows used\n"
                    f"K/V tile loaded G={G} times", fontsize=9)
    for ax, n in ((left, n_tiles), (right, G)):
        ax.set_xlim(-0.5, 6.5)
        ax.set_ylim(n * (block_m + gap), -gap / 2)
        ax.set_xticks([1, 5], ["Q tile (block_m x d)", "K/V tile"])
        ax.set_yticks([])
    heads = [Patch(color=f"C{h % 10}", label=f"head {h}") for h in range(min(G, 10))]
    fig.legend(handles=heads + [Patch(facecolor="white", edgecolor="0.5", hatch="///",
                                      label="padding row (masked)")],
               loc="lower center", ncol=min(G, 10) + 1, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    return fig


# ---------------------------------------------------------------------------------- paged KV

def _list(x) -> list:
    return x.tolist() if hasattr(x, "tolist") else list(x)     # a tensor or array, or a list


def page_map(block_table, cache_seqlens, page_size: int) -> list:
    """Per sequence, (logical page, physical page, tokens held) for the pages its length uses;
    block_table entries past cdiv(seqlen, page_size) are not used (padding, or spare pages)."""
    out = []
    for row, n in zip(_list(block_table), _list(cache_seqlens)):
        pages = -(-int(n) // page_size)
        if pages > len(row):
            raise ValueError(f"{n} tokens need {pages} pages; the block table row has {len(row)}")
        if any(int(p) < 0 for p in row[:pages]):
            raise ValueError(f"a sequence of {n} tokens maps a used page to {row[:pages]}")
        out.append([(j, int(row[j]), min(page_size, int(n) - j * page_size))
                    for j in range(pages)])
    return out


def plot_paged_cache(block_table, cache_seqlens, page_size: int, num_pages: int | None = None):
    """Top row: the pool of physical pages, coloured by the sequence that owns them (grey: free).
    Below: each sequence's logical pages, labelled with the pool page the block table maps them
    to, an arrow to it; slots past cache_seqlens in a last, partial page are hatched."""
    pmap = page_map(block_table, cache_seqlens, page_size)
    used = {p for seq in pmap for _, p, _ in seq}
    num_pages = max(num_pages or 0, max(used, default=-1) + 1)
    width = max(num_pages, max((len(s) for s in pmap), default=0))
    fig, ax = plt.subplots(figsize=(max(6.0, 0.8 * width + 2), 1.6 + 1.1 * (len(pmap) + 1)))

    def page(x, y, color, held, text):
        ax.add_patch(Rectangle((x, y), 0.8 * held / page_size, 0.6, color=color, lw=0))
        if held < page_size:                            # the slots no token fills yet
            ax.add_patch(Rectangle((x + 0.8 * held / page_size, y), 0.8 * (1 - held / page_size),
                                   0.6, fill=False, hatch="///", ec="0.6", lw=0))
        ax.add_patch(Rectangle((x, y), 0.8, 0.6, fill=False, ec="black", lw=0.8))
        ax.text(x + 0.4, y + 0.3, text, ha="center", va="center", fontsize=7)

    owner = {p: (b, held) for b, seq in enumerate(pmap) for _, p, held in seq}
    for p in range(num_pages):
        b, held = owner.get(p, (None, page_size))
        page(p, 0, "0.85" if b is None else f"C{b % 10}", held, f"p{p}")
    ax.text(-0.2, 0.3, "pool", ha="right", va="center", fontsize=8)
    for b, seq in enumerate(pmap):
        y = -1.5 - 1.2 * b
        ax.text(-0.2, y + 0.3, f"seq {b}: {_list(cache_seqlens)[b]} tok", ha="right", va="center",
                fontsize=8)
        for j, p, held in seq:
            page(j, y, f"C{b % 10}", held, f"L{j}->p{p}")
            ax.annotate("", (p + 0.4, 0), (j + 0.4, y + 0.6), arrowprops=dict(
                arrowstyle="->", color=f"C{b % 10}", lw=0.8, alpha=0.7))
    ax.set_xlim(-2.6, width + 0.2)
    ax.set_ylim(-1.5 - 1.2 * len(pmap) + 0.7, 1.0)
    ax.axis("off")
    ax.set_title(f"paged KV cache: {num_pages} pages of {page_size} tokens; the block table maps "
                 "each sequence's\nlogical pages (L) to pool pages (p); hatched: slots past "
                 "cache_seqlens", fontsize=9)
    fig.tight_layout()
    return fig
