"""What both phases of Chapter 6's benchmark share (``benchmark``, phase 1 and the run;
``benchmark_jax``, phase 2): the kernels and their order, a case, a case's inputs, a row measured
under one guard with its note and its check against the reference, and the solution namespaces
the rows run. ``benchmark`` re-exports these names.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Callable

import torch

from flashbook.bench import attention_bytes, free_cuda_cache, gpu_peak, join_notes, why_failed
from flashbook.bench_setups import max_err
from flashbook.reference import attention_flops
from flashbook.results import Row

__all__ = ["OURS", "PALLAS", "JAX_FA3", "CH3", "CH4", "KERNELS", "ORDER", "TOLERANCE", "Case",
           "Inputs", "make_row", "measure", "why", "err_note", "wrong", "sort_rows", "refused",
           "namespace"]

TOLERANCE = 2e-2                  # max|O - cuDNN| above this: the row's O is flagged WRONG

OURS, PALLAS, JAX_FA3 = "ch6_gluon_fa3", "ch6_pallas_fa3", "jax_pallas_fa3"
CH3, CH4 = "ch3_two_tiles", "ch4_two_tiles"
# (kernel, role, phase): phase 1 torch-timed, phase 2 JAX. Rows come out in this order per case.
KERNELS = [(OURS, "reference", 1), (PALLAS, "variant", 2), (JAX_FA3, "baseline", 2),
           (CH3, "variant", 1), (CH4, "variant", 1),
           ("sdpa_cudnn", "baseline", 1), ("sdpa_flash", "baseline", 1)]
ORDER = {name: i for i, (name, _, _) in enumerate(KERNELS)}


@dataclasses.dataclass(frozen=True)
class Case:
    """One problem: q, k, v (B, H, N, d) of ``dtype``, N_q = N_k = N."""
    B: int
    H: int
    N: int
    d: int
    dtype: torch.dtype
    causal: bool

    @property
    def shape(self) -> tuple:
        return (self.B, self.H, self.N, self.d)

    @property
    def flops(self) -> float:
        """The two matmuls, 4 B H N^2 d, halved causal (``reference.attention_flops``)."""
        return attention_flops(self.B, self.H, self.N, self.N, self.d, self.causal)

    @property
    def nbytes(self) -> float:
        """Compulsory HBM traffic: read Q, K, V and write O once."""
        return attention_bytes(self.B, self.H, self.N, self.N, self.d, self.dtype.itemsize)

    def columns(self) -> dict:
        """The shape columns of this case's rows."""
        return dict(B=self.B, H_q=self.H, H_kv=self.H, N_q=self.N, N_k=self.N, d=self.d,
                    dtype=str(self.dtype).replace("torch.", ""), causal=self.causal)


def make_row(kernel: str, role: str, case: Case, ms: float | None, note: str = "",
             peak=None) -> Row:
    """A row of ``case``: TFLOP/s, GB/s and % of the tensor peak (``peak``, a ``bench.Peak``;
    default this GPU's, None on CPU) from ``ms``; ``ms`` None: nothing measured (``note`` why)."""
    if ms is None:
        return Row(kernel=kernel, role=role, **case.columns(), ms=None, tflops=None, gbps=None,
                   pct_peak=None, note=note)
    peak = peak if peak is not None else gpu_peak()
    tflops = case.flops / (ms * 1e-3) / 1e12
    return Row(kernel=kernel, role=role, **case.columns(), ms=ms, tflops=tflops,
               gbps=case.nbytes / (ms * 1e-3) / 1e9,
               pct_peak=100.0 * tflops / peak.tensor_tflops if peak else None, note=note)


def measure(kernel: str, role: str, case: Case, setup: Callable[[], tuple], note: str = "",
            peak=None) -> Row:
    """One row, under one guard: ``setup()`` builds, checks and times the call and returns
    (ms, note); any exception it raises (refused input, out of memory, missing module,
    compile error, ...) becomes a row with ``ms`` empty and a note saying why."""
    try:
        ms, extra = setup()
    except Exception as e:  # noqa: BLE001 - one failing kernel never stops the run
        free_cuda_cache()
        return make_row(kernel, role, case, None, join_notes(note, f"not measured: {why(e)}"),
                        peak)
    return make_row(kernel, role, case, ms, join_notes(note, extra), peak)


def why(e: BaseException) -> str:
    """One line on a failure: 'out of memory', or 'Type: first line of the message' (for an
    exception without a message, e.g. a bare assert: where it was raised)."""
    text = why_failed(e)
    if text.rstrip().endswith(":"):
        import traceback
        frames = traceback.extract_tb(e.__traceback__)
        if frames:
            last = frames[-1]
            where = f"{os.path.basename(last.filename)}:{last.lineno}"
            text = f"{text.rstrip().rstrip(':')} at {where} ({last.line or ''})"
    return text.strip()


def err_note(name: str, want, o) -> str:
    """``max|O-name|=...`` of ``o`` against ``want`` (both (B, H, N, d)), with ``WRONG`` when it
    passes ``TOLERANCE`` (or is NaN); no note without a reference."""
    if want is None or not name:
        return ""
    err = max_err(o, want)
    flag = "" if err <= TOLERANCE else f" WRONG (> {TOLERANCE:g})"
    return f"max|O-{name}|={err:.1e}{flag}"


def wrong(row: Row) -> bool:
    """Whether a row's O was flagged as far from cuDNN's (``err_note``)."""
    return "WRONG" in (row.note or "")


def sort_rows(rows: list[Row], order: list[Case]) -> list[Row]:
    """Rows in case order (``order``), then in ``KERNELS`` order within a case."""
    def case_key(B, H, N, d, dtype, causal):
        return (B, H, N, d, dtype, causal)
    index = {case_key(*c.shape, c.columns()["dtype"], c.causal): i for i, c in enumerate(order)}

    def key(r):
        return (index.get(case_key(r.B, r.H_q, r.N_q, r.d, r.dtype, r.causal), len(index)),
                ORDER.get(r.kernel, len(ORDER)))
    return sorted(rows, key=key)


def refused(reason: str):
    """A setup that refuses with ``reason`` (a row with that note)."""
    def setup():
        raise RuntimeError(reason)
    return setup


@dataclasses.dataclass
class Inputs:
    """One shape and dtype's tensors, shared by its causal and non-causal cases."""
    q: torch.Tensor            # (B, H, N, d) contiguous
    k: torch.Tensor
    v: torch.Tensor
    q_bnhd: torch.Tensor       # (B, N, H, d) contiguous copies: JAX's layout, and viewed as
    k_bnhd: torch.Tensor       # (B*N, H, d) Chapter 4's packed one
    v_bnhd: torch.Tensor
    want: dict = dataclasses.field(default_factory=dict)   # causal -> (name, O (B, H, N, d))
    extra: dict = dataclasses.field(default_factory=dict)  # e.g. the pre-scaled q for JAX


def namespace(namespaces: dict, chapter: str) -> dict:
    """A chapter's solution namespace, loaded once into ``namespaces``; a RuntimeError saying
    why where it does not load."""
    if chapter not in namespaces and f"{chapter} error" not in namespaces:
        try:
            from flashbook import sources
            namespaces[chapter] = sources.solution_namespace(chapter)
        except Exception as e:  # noqa: BLE001 - its rows say why
            namespaces[f"{chapter} error"] = f"the {chapter} solution did not load: {why(e)}"
    if chapter not in namespaces:
        raise RuntimeError(namespaces[f"{chapter} error"])
    return namespaces[chapter]

