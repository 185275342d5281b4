"""Chapter 6 benchmark: the chapter's Gluon FA3 kernel against the students' Pallas kernel, JAX's
shipped FA3 kernel, Chapter 3's two-tile Triton kernel, cuDNN SDPA and the FlashAttention-2
backend, on an H100/H200 (``flashbook bench ch6``).

Cases: (B, H, N, d) = (1,16,16384,128), (4,16,4096,128), (4,16,4096,64), N_q = N_k, causal and
not, in fp16; and (1,16,16384,128) in bf16, causal and not (``BF16_SHAPES``: the headline shape
shows whether bf16 differs; ``run(bf16_shapes=SHAPES)`` measures every shape). Inputs are
``torch.randn``, seeded, (B, H, N, d) contiguous. Rows, in this order for every case:

* ``ch6_gluon_fa3`` (reference): ``gluon_fa3.attention_fa3`` with the planner's config for the
  problem (``gluon_fa3.pick_config``), passed explicitly so the timed call does not re-plan.
* a ``public`` row beside it: ``attention_fa3(q, k, v, causal)`` as a reader calls it (no
  config: the plan is looked up; checks on), launched (``bench.public_row``).
* ``ch6_pallas_fa3`` (variant): the students' Pallas Mosaic GPU kernel at full size, compiled
  for the GPU: ``fa3_pallas.fa3_kernel`` around the Exercise 4 consumer of the ch6 solution,
  with ``fa3_pallas.default_config``, as ``fa3_pallas.run_fa3`` builds it (run_fa3 itself is
  not timed: it transposes K and copies O to the host inside the call). ``fa3_pallas`` is
  imported on demand: a missing module, function or consumer is a row whose note says so.
* ``jax_pallas_fa3`` (baseline): ``jax.experimental.pallas.ops.gpu.attention_mgpu.attention``
  on (B, N, H, d) copies, with the tuning of JAX's own benchmark (its ``main``): block_q = 64,
  max_concurrent_steps = 2, the first block_kv of (256, 128, 64) that fits in shared memory.
  The kernel applies no softmax scale: it gets q * (1/sqrt(d)) (made once, not timed).
* ``ch3_two_tiles`` (variant, non-causal): Chapter 3's ``attention_two_tiles``, as
  ``ch3.benchmark`` calls it. Chapter 3 has no causal mask, so the causal rows are
  ``ch4_two_tiles`` (variant): Chapter 4's ``attention_varlen``, the same two-tile kernel with
  its mask, on the batch packed as (B*N, H, d), timed without its host-side argument checks
  (``bench_setups.ours``). Both take fp16 only: their bf16 rows are refusals.
* ``sdpa_cudnn``, ``sdpa_flash`` (baselines): torch SDPA on one backend.

Every row's note gives ``max|O-sdpa_cudnn|`` (cuDNN's O on the same inputs; ``sdpa_flash``'s
where cuDNN refuses) and flags an O further than ``TOLERANCE`` from it as WRONG. A row that fails
(refused input, out of memory, missing module, compile error) has ``ms`` empty and a note
saying why; the run goes on.

Timing. Torch and Triton/Gluon rows: replayed from a CUDA graph (``bench.time_ms(fn,
graph=True)`` through ``bench.timed_ms``; launched from Python where a call cannot be
captured, the note saying so), the protocol ``results.GRAPH_TIMER`` that the provenance
records. JAX rows cannot be captured into a torch CUDA graph (JAX launches on its own stream,
through XLA), and torch's CUDA events cannot be recorded on that stream. They are timed with
JAX's own method, the one its FA3 benchmark uses: ``jax.experimental.mosaic.gpu.profiler
.measure`` (CUPTI), which sums the durations of the GPU kernels each call of the jitted function
launches, ``n`` calls in a row (n fills about 300 ms, 10 to 200 calls), median. That is GPU time
without launch overhead, the quantity the CUDA-graph rows measure. As a cross-check the note adds
``triton.testing.do_bench`` (``results.GPU_TIMER``) of ``lambda: jax.block_until_ready(f(...))``,
which also counts JAX's dispatch and the host synchronisation of each call (tens of us); where
CUPTI fails, that wall-clock time is the row's time and the note says so. Each JAX function is
compiled once per case (its first call, which is also the checked call), outside the timing.
Inputs reach JAX through DLPack without copies (``jax.dlpack.from_dlpack(t, copy=False)``; the
note confirms the buffer is shared), and O comes back the same way for the check.

The torch rows of every case run first, then the JAX rows (phase 2, ``benchmark_jax``): so no
torch CUDA graph is
captured while JAX's runtime (its threads, CUPTI) is live in the process. JAX's GPU client is
started without preallocation (``XLA_PYTHON_CLIENT_PREALLOCATE=false``), else it would take 75%
of the GPU's memory beside torch's. The rows are returned in case order.

FLOPs: ``reference.attention_flops`` (4 B H N^2 d, halved causal); GB/s: compulsory traffic
(``bench.attention_bytes``); ``pct_peak``: of the datasheet tensor peak.

What both phases share (the kernels, ``Case``, ``Inputs``, ``measure`` and the rows' notes) is in
``benchmark_rows``; this module re-exports it.
"""
from __future__ import annotations

import functools
import warnings
from typing import Callable

import torch

from flashbook.bench import free_cuda_cache, join_notes, public_row, sdpa, timed_ms
from flashbook.bench_setups import cu_seqlens, ours, refusal
from flashbook.results import Row

from .benchmark_rows import (CH3, CH4, JAX_FA3, KERNELS, ORDER, OURS, PALLAS, TOLERANCE, Case,
                             Inputs, err_note, make_row, measure, namespace, refused, sort_rows,
                             why, wrong)

GRAPH_TIMER = True
SHAPES = [(1, 16, 16384, 128), (4, 16, 4096, 128), (4, 16, 4096, 64)]
BF16_SHAPES = [(1, 16, 16384, 128)]
CAUSAL = (False, True)
REFERENCES = ("sdpa_cudnn", "sdpa_flash")


# ------------------------------------------------------------------ helpers (CPU-testable)

def cases(shapes=SHAPES, bf16_shapes=BF16_SHAPES, causal=CAUSAL) -> list[Case]:
    """fp16 at every shape, then bf16 at ``bf16_shapes``; each non-causal then causal."""
    return [Case(*s, dtype, c) for dtype, group in ((torch.float16, shapes),
                                                    (torch.bfloat16, bf16_shapes))
            for s in group for c in causal]


def graph_timed(prepare: Callable[[], tuple]):
    """A setup for ``measure`` from ``prepare() -> (fn, note)`` (fn: one forward): timed from a
    CUDA graph, else launched (``bench.timed_ms``)."""
    def setup():
        fn, note = prepare()
        ms, how = timed_ms(fn)
        return ms, join_notes(note, how)
    return setup


# ------------------------------------------------------------------ inputs and references

def make_inputs(B, H, N, d, dtype, device="cuda", seed=0) -> Inputs:
    g = torch.Generator(device=device).manual_seed(seed)
    q, k, v = (torch.randn(B, H, N, d, device=device, dtype=dtype, generator=g)
               for _ in range(3))
    return Inputs(q, k, v, *(t.transpose(1, 2).contiguous() for t in (q, k, v)))


def reference(q, k, v, causal, backends=REFERENCES) -> tuple[str, torch.Tensor | None]:
    """(name, O) of the first SDPA backend that accepts these inputs: the rows' check."""
    for name in backends:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return name, sdpa(name)(q, k, v, causal)
        except Exception:  # noqa: BLE001 - refused or out of memory: try the next
            free_cuda_cache()
    return "", None


# ------------------------------------------------------------------ phase 1: torch-timed rows

def gluon_prepare(case: Case, x: Inputs):
    """``attention_fa3`` with the planner's config for this problem, checked once."""
    def prepare():
        from flashbook.bench import compiled, registers
        from flashbook.chapters.ch6.gluon_fa3 import attention_fa3, fa3_kernel, pick_config
        B, H, N, d = case.shape
        cfg = pick_config(d, case.dtype, case.causal, B, H, N, N)
        before = compiled(fa3_kernel)
        o, _ = attention_fa3(x.q, x.k, x.v, case.causal, config=cfg)
        new = {key: c for key, c in compiled(fa3_kernel).items() if key not in before}
        name, want = x.want.get(case.causal, ("", None))
        note = join_notes(f"BLOCK_M={cfg.BLOCK_M} BLOCK_N={cfg.BLOCK_N} STAGES={cfg.STAGES} "
                         f"OVERLAP={cfg.OVERLAP}", registers(new) if new else "",
                         err_note(name, want, o))
        return (lambda: attention_fa3(x.q, x.k, x.v, case.causal, config=cfg)), note
    return prepare


def ch3_prepare(case: Case, x: Inputs, namespaces: dict):
    """Chapter 3's two-tile kernel (non-causal only), as ``ch3.benchmark`` calls it."""
    def prepare():
        from flashbook.tiles import pick_config
        from flashbook.device import current
        attention = namespace(namespaces, "ch3")["attention_two_tiles"]
        o, _ = attention(x.q, x.k, x.v)
        cfg = pick_config(case.d, case.dtype, current().capability, two_tiles=True)
        name, want = x.want.get(case.causal, ("", None))
        note = join_notes(f"BLOCK_M={cfg.BLOCK_M} BLOCK_N={cfg.BLOCK_N} warps={cfg.num_warps} "
                         f"stages={cfg.num_stages}", err_note(name, want, o))
        return (lambda: attention(x.q, x.k, x.v)), note
    return prepare


def ch4_prepare(case: Case, x: Inputs, namespaces: dict):
    """Chapter 4's two-tile ``attention_varlen`` (causal) on the packed batch, timed without
    its argument checks (``bench_setups.ours``)."""
    B, H, N, d = case.shape
    name, want = x.want.get(case.causal, ("", None))
    packed = [t.view(B * N, H, d) for t in (x.q_bnhd, x.k_bnhd, x.v_bnhd)]

    def prepare():
        cu = cu_seqlens([N] * B, x.q.device)
        return ours(namespace(namespaces, "ch4"), "attention_varlen", (*packed, cu, cu, N, N),
                    lambda o: err_note(name, want, o.view(B, N, H, d).transpose(1, 2)),
                    causal=case.causal)()
    return prepare


def sdpa_prepare(backend: str, case: Case, x: Inputs):
    """SDPA on one backend; a refusal raises with torch's reason (``bench_setups.refusal``)."""
    def prepare():
        f = sdpa(backend)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                o = f(x.q, x.k, x.v, case.causal)
            except RuntimeError as e:
                raise RuntimeError(refusal(e, caught)) from None
        name, want = x.want.get(case.causal, ("", None))
        note = err_note(name, want, o) if name != backend else ""
        return (lambda: f(x.q, x.k, x.v, case.causal)), note
    return prepare


def torch_rows(case: Case, x: Inputs, namespaces: dict, kernels) -> list[Row]:
    rows = []
    for kernel, role, phase in KERNELS:
        if phase != 1 or kernel not in kernels:
            continue
        if kernel == OURS:
            setup = graph_timed(gluon_prepare(case, x))
        elif kernel == CH3:
            if case.causal:
                continue                       # no causal mask in Chapter 3: see ch4_two_tiles
            setup = graph_timed(ch3_prepare(case, x, namespaces))
        elif kernel == CH4:
            if not case.causal:
                continue                       # non-causal: ch3_two_tiles is the same kernel
            setup = graph_timed(ch4_prepare(case, x, namespaces))
        else:
            setup = graph_timed(sdpa_prepare(kernel, case, x))
        rows.append(measure(kernel, role, case, setup))
        if kernel == OURS:              # the call as a reader makes it: no config, launched
            from flashbook.chapters.ch6.gluon_fa3 import attention_fa3
            rows.append(public_row(rows[-1], functools.partial(
                attention_fa3, x.q, x.k, x.v, case.causal), "attention_fa3(q, k, v, causal)"))
        free_cuda_cache()
    return rows


def solutions(kernels) -> dict:
    """The solution namespaces of Chapters 3 and 4 (their Triton kernels), as the rows need
    them, or why one did not load (``"<id> error"``)."""
    out: dict = {}
    for chapter, kernel in (("ch3", CH3), ("ch4", CH4)):
        if kernel in kernels:
            try:
                namespace(out, chapter)
            except RuntimeError:
                pass                                       # kept in out: its rows say why
    return out


# ------------------------------------------------------------------------------ the run

def run(shapes=SHAPES, bf16_shapes=BF16_SHAPES, causal=CAUSAL, kernels=None,
        device="cuda") -> list[Row]:
    """Every row (module docstring). ``kernels``: names to measure (default: all of
    ``KERNELS``); a case's inputs stay on the GPU from phase 1 to phase 2 (about 0.4 GiB
    a shape)."""
    kernels = set(kernels or ORDER)
    order = cases(shapes, bf16_shapes, causal)
    namespaces = solutions(kernels)
    inputs: dict = {}
    rows: list[Row] = []
    for case in order:                                    # phase 1: torch, CUDA graphs
        key = (case.shape, case.dtype)
        if key not in inputs:
            try:
                inputs[key] = make_inputs(*case.shape, case.dtype, device=device,
                                          seed=len(inputs))
            except Exception as e:  # noqa: BLE001 - e.g. out of memory: every row says so
                free_cuda_cache()
                inputs[key] = f"not measured: inputs: {why(e)}"
        x = inputs[key]
        if isinstance(x, str):
            rows += [make_row(k, role, case, None, x) for k, role, _ in KERNELS if k in kernels]
            continue
        x.want[case.causal] = reference(x.q, x.k, x.v, case.causal)
        rows += torch_rows(case, x, namespaces, kernels)
    if any(phase == 2 and k in kernels for k, _, phase in KERNELS):
        from .benchmark_jax import jax_rows                 # phase 2, loaded when it runs
        for case in order:                                # phase 2: JAX
            x = inputs[(case.shape, case.dtype)]
            if not isinstance(x, str):
                rows += jax_rows(case, x, namespaces, kernels)
    inputs.clear()
    free_cuda_cache()
    return sort_rows(rows, order)
