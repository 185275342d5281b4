"""Chapter 6 benchmark: the chapter's Gluon FA3 kernel against the students' Pallas kernel, JAX's
shipped FA3 kernel, Chapter 3's two-tile Triton kernel, cuDNN SDPA and the FlashAttention-2
backend, on an H100/H200 (``flashbook bench ch6``).

Cases: (B, H, N, d) = (1,16,16384,128), (4,16,4096,128), (4,16,4096,64), N_q = N_k, causal and
not, in fp16; and (1,16,16384,128) in bf16, causal and not (``BF16_SHAPES``: the headline shape
shows whether bf16 differs; ``run(bf16_shapes=SHAPES)`` measures every shape). Inputs are
``torch.randn``, seeded, (B, H, N, d) contiguous. Rows, in this order for every case:

* ``ch6_gluon_fa3`` (reference): ``gluon_fa3.attention_fa3`` with the planner's config for the
  problem (``gluon_fa3.pick_config``), passed explicitly so the timed call does not re-plan.
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
  (``ch4.benchmark.ours``). Both take fp16 only: their bf16 rows are refusals.
* ``sdpa_cudnn``, ``sdpa_flash`` (baselines): torch SDPA on one backend.

Every row's note gives ``max|O-sdpa_cudnn|`` (cuDNN's O on the same inputs; ``sdpa_flash``'s
where cuDNN refuses) and flags an O further than ``TOLERANCE`` from it as WRONG. A row that fails
(refused input, out of memory, missing module, compile error) has ``ms`` empty and a note
saying why; the run goes on.

Timing. Torch and Triton/Gluon rows: replayed from a CUDA graph (``bench.time_ms(fn,
graph=True)`` through ``ch4.benchmark._timed``; launched from Python where a call cannot be
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
"""
from __future__ import annotations

import dataclasses
import os
import warnings
from typing import Callable

import torch

from flashbook.bench import attention_bytes, free_cuda_cache, gpu_peak, join_notes, sdpa, \
    timed_ms, why_failed
from flashbook.chapters.ch4 import benchmark as ch4
from flashbook.chapters.ch5 import benchmark as ch5
from flashbook.reference import attention_flops
from flashbook.results import Row

GRAPH_TIMER = True
SHAPES = [(1, 16, 16384, 128), (4, 16, 4096, 128), (4, 16, 4096, 64)]
BF16_SHAPES = [(1, 16, 16384, 128)]
CAUSAL = (False, True)
TOLERANCE = 2e-2                  # max|O - cuDNN| above this: the row's O is flagged WRONG
REFERENCES = ("sdpa_cudnn", "sdpa_flash")

OURS, PALLAS, JAX_FA3 = "ch6_gluon_fa3", "ch6_pallas_fa3", "jax_pallas_fa3"
CH3, CH4 = "ch3_two_tiles", "ch4_two_tiles"
# (kernel, role, phase): phase 1 torch-timed, phase 2 JAX. Rows come out in this order per case.
KERNELS = [(OURS, "reference", 1), (PALLAS, "variant", 2), (JAX_FA3, "baseline", 2),
           (CH3, "variant", 1), (CH4, "variant", 1),
           ("sdpa_cudnn", "baseline", 1), ("sdpa_flash", "baseline", 1)]
ORDER = {name: i for i, (name, _, _) in enumerate(KERNELS)}



# ------------------------------------------------------------------ helpers (CPU-testable)

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


def cases(shapes=SHAPES, bf16_shapes=BF16_SHAPES, causal=CAUSAL) -> list[Case]:
    """fp16 at every shape, then bf16 at ``bf16_shapes``; each non-causal then causal."""
    return [Case(*s, dtype, c) for dtype, group in ((torch.float16, shapes),
                                                    (torch.bfloat16, bf16_shapes))
            for s in group for c in causal]


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
    err = ch4.max_err(o, want)
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


def graph_timed(prepare: Callable[[], tuple]):
    """A setup for ``measure`` from ``prepare() -> (fn, note)`` (fn: one forward): timed from a
    CUDA graph, else launched (``ch4.benchmark._timed``)."""
    def setup():
        fn, note = prepare()
        ms, how = timed_ms(fn)
        return ms, join_notes(note, how)
    return setup


# ------------------------------------------------------------------ inputs and references

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
        from flashbook.chapters.ch3.benchmark import compiled, registers
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
        from flashbook.chapters.ch3.launch import pick_config
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
    its argument checks (``ch4.benchmark.ours``)."""
    B, H, N, d = case.shape
    name, want = x.want.get(case.causal, ("", None))
    packed = [t.view(B * N, H, d) for t in (x.q_bnhd, x.k_bnhd, x.v_bnhd)]

    def prepare():
        cu = ch4.cu_seqlens([N] * B, x.q.device)
        return ch4.ours(namespace(namespaces, "ch4"), "attention_varlen", (*packed, cu, cu, N, N),
                        lambda o: err_note(name, want, o.view(B, N, H, d).transpose(1, 2)),
                        causal=case.causal)()
    return prepare


def sdpa_prepare(backend: str, case: Case, x: Inputs):
    """SDPA on one backend; a refusal raises with torch's reason (``ch5.benchmark.refusal``)."""
    def prepare():
        f = sdpa(backend)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                o = f(x.q, x.k, x.v, case.causal)
            except RuntimeError as e:
                raise RuntimeError(ch5.refusal(e, caught)) from None
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
        from .benchmark_jax import jax_rows                 # imports this module
        for case in order:                                # phase 2: JAX
            x = inputs[(case.shape, case.dtype)]
            if not isinstance(x, str):
                rows += jax_rows(case, x, namespaces, kernels)
    inputs.clear()
    free_cuda_cache()
    return sort_rows(rows, order)
