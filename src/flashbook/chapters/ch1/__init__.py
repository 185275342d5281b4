"""Chapter 1: naive attention, and why it is slow.

The student writes a stable softmax, naive attention with LSE and a causal mask, and a model of
the three-kernel version's HBM traffic; ``checks`` grades them (the known-wrong answers are in
``solutions/variants/ch1.py``), and ``benchmark`` times the naive version against SDPA on a
GPU (``flashbook bench ch1``).
"""
from __future__ import annotations

from flashbook.bench import PEAKS
from flashbook.contract import Chapter

from . import benchmark
from .checks import attention_cases, check_attention, check_softmax, check_traffic, \
    expected_traffic, softmax_cases

__all__ = ["CHAPTER", "check_softmax", "check_attention", "check_traffic", "softmax_cases",
           "attention_cases", "expected_traffic", "traffic_vs_measured", "benchmark"]


def traffic_vs_measured(rows) -> list[tuple[int, float, float, float]]:
    """(N, predicted ms, predicted ms with the scale pass, measured ms) for the recorded
    ``naive_torch`` rows: the three-kernel model's bytes at the H200's datasheet bandwidth, and
    the same plus the separate ``* scale`` pass of ``benchmark.naive_attention`` (read and write
    S once more)."""
    bandwidth = PEAKS["H200"][2] * 1e9
    out = {}
    for r in rows:
        if r.kernel == "naive_torch" and r.role != "public" and r.ms is not None:
            e = 2 if r.dtype in ("float16", "bfloat16") else 4
            nbytes = expected_traffic(r.B, r.H_q, r.N_q, r.d, e)[1]
            extra = 2 * r.B * r.H_q * r.N_q ** 2 * e
            out[r.N_q] = (r.N_q, nbytes / bandwidth * 1e3, (nbytes + extra) / bandwidth * 1e3, r.ms)
    return [out[n] for n in sorted(out)]


def quoted_values(rows) -> dict:
    """The figures Section 5 quotes (``flashbook.quoted``), by glue key: the recorded H200 times
    against the traffic model. ``ch1_model_us_512`` is the model's alone (the bytes of a recorded
    shape at the datasheet bandwidth), not a measurement."""
    table = traffic_vs_measured(rows)
    plain = sorted(ms / p for _, p, _, ms in table)
    scaled = sorted(ms / p for _, _, p, ms in table)
    by_n = {n: (p, ms) for n, p, _, ms in table}
    return {"ch1_growth": by_n[32768][1] / by_n[1024][1],
            "ch1_vs_model_min": plain[0], "ch1_vs_model_max": plain[-1],
            "ch1_vs_scaled_min": scaled[0], "ch1_vs_scaled_max": scaled[-1],
            "ch1_model_us_512": by_n[512][0] * 1e3}


CHAPTER = Chapter(
    id="ch1",
    title="Naive attention, and why it is slow",
    benchmark=benchmark.run,
    figures=quoted_values,
)
