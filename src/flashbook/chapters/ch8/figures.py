"""Chapter 8's own pictures: causal work per rank (contiguous against zig-zag shards), the
critical path of a chain and a tree reduction on a mesh, and what context parallelism holds and
moves per GPU as N grows (arithmetic, no measurement)."""
from __future__ import annotations


import matplotlib.pyplot as plt
import torch

from . import mesh, ring
from .state import merge_states

__all__ = ["plot_zigzag_work", "reduction_costs", "plot_reduction_costs", "cp_costs",
           "plot_cp_costs"]


def plot_zigzag_work(world_size: int = 4, n: int = 64):
    """Bars: the (query, key) pairs each rank computes under a causal mask, with contiguous
    shards and with zig-zag shards, and the chunks each rank holds under zig-zag."""
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10, 3.4))
    ranks = range(world_size)
    for off, layout, f in ((-0.2, "contiguous", ring.contiguous_positions),
                           (0.2, "zig-zag", ring.zigzag_positions)):
        work = [ring.causal_work(f(n, world_size, r)) for r in ranks]
        ax.bar([r + off for r in ranks], work, width=0.4, label=layout)
    ax.set_xticks(list(ranks))
    ax.set_xlabel("rank")
    ax.set_ylabel("causal (query, key) pairs")
    ax.set_title(f"work per rank, N={n}, {world_size} ranks")
    ax.legend()
    c = n // (2 * world_size)
    for r in ranks:
        for pos in ring.zigzag_positions(n, world_size, r).tolist()[::c]:
            ax2.broken_barh([(pos, c)], (r - 0.4, 0.8), color=f"C{r}")
    ax2.set_yticks(list(ranks))
    ax2.set_ylabel("rank")
    ax2.set_xlabel("sequence position")
    ax2.set_title(f"zig-zag: rank r holds chunks r and {2 * world_size - 1} - r")
    fig.tight_layout()
    return fig


def reduction_costs(programs: dict, sizes, cols: int = 4) -> dict:
    """{name: [(n, messages, steps, hops), ...]} of each reduce program on groups of n PEs
    (states are scalars merged by ``merge_states``)."""
    out = {}
    for name, program in programs.items():
        rows = []
        for n in sizes:
            states = [(torch.zeros(1, dtype=torch.float64), torch.ones(1, dtype=torch.float64),
                       torch.zeros(1, 1, dtype=torch.float64)) for _ in range(n)]
            r = mesh.simulate(program, states, cols, merge=merge_states)
            rows.append((n, r.messages, r.steps, r.hops))
        out[name] = rows
    return out


def plot_reduction_costs(costs: dict, cols: int = 4):
    """Sequential steps (the critical path) and mesh hops against the group size."""
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10, 3.4))
    for name, rows in costs.items():
        ns = [r[0] for r in rows]
        ax.plot(ns, [r[2] for r in rows], "o-", label=name)
        ax2.plot(ns, [r[3] for r in rows], "o-", label=name)
    ax.set_xlabel("PEs in the group")
    ax.set_ylabel("sequential messages (critical path)")
    ax.set_title(f"latency, mesh {cols} columns wide")
    ax2.set_xlabel("PEs in the group")
    ax2.set_ylabel("mesh hops, all messages")
    ax2.set_title("link traffic")
    for a in (ax, ax2):
        a.legend()
        a.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def cp_costs(N: int, P: int, H: int = 16, H_kv: int = 16, d: int = 128, itemsize: int = 2,
             causal: bool = True) -> dict:
    """Per GPU, ring attention over P GPUs on one sequence of N tokens: bytes held (Q, K, V, O
    shards, the K/V block in flight, fp32 O and LSE accumulators), bytes sent per step and in
    all, FLOPs per step, and FLOPs per byte sent (what the link must keep up with)."""
    n = N // P
    shard = n * d * itemsize
    held = shard * (2 * H + 2 * H_kv) + 2 * n * H_kv * d * itemsize + n * H * (d + 1) * 4
    per_step = 2 * n * H_kv * d * itemsize
    flops = 4 * n * n * d * H * (0.5 if causal else 1.0)
    return dict(N=N, P=P, held_gib=held / 2**30, sent_per_step_mib=per_step / 2**20,
                sent_total_gib=per_step * (P - 1) / 2**30, flops_per_step=flops,
                flops_per_byte=flops / per_step)


def plot_cp_costs(P: int = 8, sizes=(8192, 32768, 131072, 524288, 1048576), peak_tflops=None,
                  link_gbps=None):
    """Memory per GPU and FLOPs per byte sent against N; with a GPU's peak TFLOP/s and its link
    bandwidth (GB/s), the line above which a ring step's transfer hides behind its compute."""
    rows = [cp_costs(N, P) for N in sizes]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10, 3.4))
    ax.loglog(sizes, [r["held_gib"] for r in rows], "o-", label=f"ring, {P} GPUs")
    ax.loglog(sizes, [cp_costs(N, 1)["held_gib"] for N in sizes], "s--", label="one GPU")
    ax.set_xlabel("sequence length N")
    ax.set_ylabel("GiB per GPU (H=16, d=128, fp16)")
    ax.set_title("memory: O(N / P) per GPU")
    ax.legend()
    ax2.loglog(sizes, [r["flops_per_byte"] for r in rows], "o-", label="ring step: FLOPs / byte")
    if peak_tflops and link_gbps:
        ax2.axhline(peak_tflops * 1e12 / (link_gbps * 1e9), color="k", ls=":",
                    label=f"peak FLOP/s / link B/s = {peak_tflops * 1e3 / link_gbps:.0f}")
    ax2.set_xlabel("sequence length N")
    ax2.set_title(f"compute per byte sent, causal, {P} GPUs")
    ax2.legend()
    for a in (ax, ax2):
        a.grid(alpha=0.3, which="both")
    fig.tight_layout()
    return fig


def plot_mesh_chain(n: int = 6, cols: int = 4):
    """The mesh kernel's chain on a group of n PEs in rows of ``cols``: row chains flowing west, the
    column bridge flowing north to PE 0; in red, the east neighbours the mesh kernel waits on that are
    not in the group (its deadlock when n is not a multiple of cols)."""
    cols = min(cols, n)
    rows = -(-n // cols)
    fig, ax = plt.subplots(figsize=(1.3 * cols + 1, 1.2 * rows + 0.8))
    for pe in range(n):
        r, c = divmod(pe, cols)
        ax.add_patch(plt.Rectangle((c - 0.3, -r - 0.3), 0.6, 0.6, color="C0" if pe else "C2"))
        ax.text(c, -r, f"PE {pe}", ha="center", va="center", color="white", fontsize=9)
        if c < cols - 1:                                   # the mesh kernel receives from the east
            missing = pe + 1 >= n
            ax.annotate("", xy=(c + 0.32, -r), xytext=(c + 0.68, -r),
                        arrowprops=dict(arrowstyle="->", color="red" if missing else "k",
                                        ls="--" if missing else "-"))
            if missing:
                ax.text(c + 1, -r, f"PE {pe + 1}?\n(not in\nthe group)", ha="center",
                        va="center", color="red", fontsize=8)
        if c == 0 and r < rows - 1:
            ax.annotate("", xy=(0, -r - 0.32), xytext=(0, -r - 0.68),
                        arrowprops=dict(arrowstyle="->", color="k"))
    ax.set_xlim(-0.6, cols - 0.4 + (1 if n % cols else 0))
    ax.set_ylim(-rows + 0.4, 0.6)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(f"the mesh kernel's chain: {n} PEs, {cols} columns (PE 0, green, is the root)")
    fig.tight_layout()
    return fig
