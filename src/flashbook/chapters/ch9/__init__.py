"""Chapter 9: the backward pass: D, recomputation from the LSE, a K/V-stationary dK/dV kernel
and a Q-stationary dQ kernel, and an autograd Function that trains.

The student writes the three Triton kernels (with their loop bodies), the autograd Function and
the dense wrapper; ``launch`` launches the kernels on the packed layout, ``forward`` is Chapter
5's GQA forward, its launch remembered by its inputs' metadata, ``dense`` sees dense tensors as
packed ones without a copy (how, remembered too) and runs the forward alone when autograd
records nothing, ``grads`` holds the float64 reference gradients, ``checks`` grades,
``figures`` and ``train`` make the chapter's table and loss curves, ``benchmark`` times forward
+ backward on a GPU (``flashbook bench ch9``, with the one-kernel designs of the course's
``solutions/extras/ch9_one_kernel.py`` and ``ch9_gluon_bwd.py`` beside the student's), and
``recorded`` reads its H200 record back (and ``ws_recorded`` the warp-specialized Gluon
backward's ablation, ``solutions/extras/ch9_ws_bwd_bench.py``).
"""
from __future__ import annotations


from flashbook.cases import validate_scale
from flashbook.contract import Chapter

from . import benchmark, recorded, ws_recorded
from .checks import GRAD_TOL, autograd_cases, check_autograd, check_dkdv, check_dq, \
    check_preprocess, check_training, kernel_cases, training_cases
from .figures import plot_losses, saved_bytes, saved_bytes_table, when_solved
from .forward import forward
from .dense import dense_forward, dense_offsets, forward_only, from_packed, lse_from_packed, \
    lse_to_packed, packed_views, to_packed
from .grads import attention_grads, backward_inputs, dense_attention
from .launch import BWD_DTYPES, BwdConfig, bwd_config, launch_dkdv, launch_dq, \
    launch_preprocess
from .train import TinyLM, repeat_batch, sdpa_attention, train

__all__ = ["CHAPTER", "forward", "launch_preprocess", "launch_dkdv", "launch_dq",
           "bwd_config", "BwdConfig", "BWD_DTYPES", "validate_scale",
           "check_preprocess", "check_dkdv", "check_dq", "check_autograd", "check_training",
           "kernel_cases", "training_cases", "autograd_cases", "GRAD_TOL", "attention_grads",
           "backward_inputs", "dense_attention", "dense_offsets", "to_packed", "from_packed",
           "lse_from_packed", "lse_to_packed", "packed_views", "forward_only", "dense_forward",
           "saved_bytes", "saved_bytes_table", "plot_losses", "when_solved", "TinyLM", "repeat_batch",
           "sdpa_attention", "train", "benchmark", "recorded", "ws_recorded"]

CHAPTER = Chapter(
    id="ch9",
    title="The backward pass",
    # FlashAttentionFn (and so flash_attention) runs the student's backward kernels through
    # the given tiled_backward_packed, but a bug in them must be caught by their own
    # exercises: the known-wrong variants' test stays that strict
    cells={"ch9_autograd_test": ("ch9_autograd",), "ch9_training_test": ("ch9_dense",)},
    benchmark=benchmark.run,
    graph_timer=benchmark.GRAPH_TIMER,
    figures=recorded.quoted_values,
)

# what ``tune`` records through (the same contract; kept for its callers)
BENCHMARKED = CHAPTER
