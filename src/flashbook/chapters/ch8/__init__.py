"""Chapter 8: the distributed merge: partial softmax states, split-KV decode, reductions over a
mesh, ring attention on torch.distributed.

``state`` holds the merge and its (O, LSE) form, solved (the checks' references) and the wire
precision experiment; ``launch`` launches the split-KV decode kernels (Flash-Decoding) and picks
the split count; ``mesh`` simulates message passing on a 2-D mesh (and runs the mesh kernel's chain);
``ring`` runs a student's ring attention (or Ulysses) in gloo processes, counts their traffic and
tears them down; ``checks`` grades the exercises, ``ulysses_checks`` Exercise 5 (Ulysses);
``cp_traffic`` holds the bytes and steps of the ring, all-gather and Ulysses, as formulas and
as counted; ``figures`` draws the chapter's pictures; ``benchmark`` (one GPU) and
``ring_bench`` (``torchrun``, any number of GPUs, with ``cp_baseline``: PyTorch's prototype
``context_parallel``) measure on GPUs, and ``gpu_run`` runs both after full-size checks;
``recorded`` reads their data back for the prose and figures.
"""
from __future__ import annotations

from flashbook.contract import Chapter

from . import benchmark, mesh, recorded, ring
from .cp_traffic import counted_traffic, cp_traffic, traffic_rows
from .checks import check_chain_reduce, check_merge, check_ring_attention, check_split_kv, \
    check_tree_reduce, check_zigzag, mesh_cases, merge_cases, ring_cases, split_cases
from .figures import cp_costs, plot_cp_costs, plot_mesh_chain, plot_reduction_costs, \
    plot_zigzag_work, reduction_costs
from .launch import MAX_SPLITS, choose_num_splits, launch_combine, launch_split_kv, \
    sequences_per_launch, sm_count, split_config, validate_split_decode
from .mesh import Deadlock, recv, send, seed_chain_reduce, simulate
from .ring import ShardedCase, contiguous_positions, zigzag_positions
from .state import block_attention, identity, merge_lse, merge_states, state_of, \
    wire_roundtrip_error
from .ulysses_checks import check_ulysses, ulysses_cases

__all__ = ["CHAPTER", "mesh", "ring", "check_merge", "check_split_kv", "check_chain_reduce",
           "check_tree_reduce", "check_zigzag", "check_ring_attention", "merge_cases",
           "split_cases", "mesh_cases", "ring_cases", "plot_zigzag_work", "reduction_costs",
           "plot_reduction_costs", "plot_mesh_chain", "cp_costs", "plot_cp_costs", "MAX_SPLITS",
           "choose_num_splits", "launch_split_kv", "launch_combine", "sequences_per_launch",
           "sm_count", "split_config",
           "validate_split_decode", "Deadlock", "send", "recv", "simulate", "seed_chain_reduce",
           "zigzag_positions", "contiguous_positions", "block_attention", "identity",
           "merge_lse", "merge_states", "state_of", "wire_roundtrip_error", "check_ulysses",
           "ulysses_cases", "cp_traffic", "traffic_rows", "counted_traffic", "ShardedCase"]

CHAPTER = Chapter(
    id="ch8",
    title="The distributed merge",
    # ring_attention calls the student's merge too, but a bug in merge must be caught by
    # Exercise 1's own check: the known-wrong variants' test stays that strict
    cells={"ch8_ring_test": ("ch8_ring",)},
    benchmark=benchmark.run,
    graph_timer=benchmark.GRAPH_TIMER,
    figures=recorded.quoted_values,
)
