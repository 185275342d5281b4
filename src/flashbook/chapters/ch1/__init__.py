"""Chapter 1: naive attention, and why it is slow.

The student writes a stable softmax, naive attention with LSE and a causal mask, and a model of
the three-kernel version's HBM traffic; ``checks`` grades them, ``variants`` lists known-wrong
answers, and ``benchmark`` times the naive version against SDPA on a GPU (``flashbook bench ch1``).
"""
from __future__ import annotations

import functools

from flashbook.contract import Chapter, Exercise

from . import benchmark
from .checks import attention_cases, check_attention, check_softmax, check_traffic, \
    expected_traffic, softmax_cases
from .variants import VARIANTS

__all__ = ["CHAPTER", "check_softmax", "check_attention", "check_traffic", "softmax_cases",
           "attention_cases", "expected_traffic", "benchmark"]


CHAPTER = Chapter(
    id="ch1",
    title="Naive attention, and why it is slow",
    exercises=(
        Exercise("ch1_softmax_test", ("ch1_softmax",), ("softmax",), check_softmax),
        # naive_attention calls the student's softmax: both cells are graded through it
        Exercise("ch1_attention_test", ("ch1_softmax", "ch1_attention"), ("naive_attention",),
                 functools.partial(check_attention, causal=False)),
        Exercise("ch1_attention_causal_test", ("ch1_softmax", "ch1_attention"),
                 ("naive_attention",), functools.partial(check_attention, causal=True)),
        Exercise("ch1_traffic_test", ("ch1_traffic",), ("naive_traffic",), check_traffic),
    ),
    variants=VARIANTS,
    benchmark=benchmark.run,
)
