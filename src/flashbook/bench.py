"""Measuring on a GPU (introduced in Chapter 1): timing, peak memory, TFLOP/s, GB/s and % of
the datasheet peak, and torch SDPA as a baseline. ``measure_attention`` returns a
``results.Row``; ``results`` records, reads, plots and prints rows.

On a GPU, time with ``triton.testing.do_bench`` (CUDA events, L2 flushed between runs), or
with ``do_bench_cudagraph`` (the calls replayed from a CUDA graph: GPU time without the Python
launch overhead), both with ``results.GPU_TIMER``/``GRAPH_TIMER`` (the protocol the provenance
records), and measure memory with the CUDA caching allocator's peak counter. On CPU, time with
``torch.utils.benchmark`` and measure the process's peak resident memory; CPU numbers show
trends at small sizes only, and a cell that needs a GPU says so instead of printing numbers.
"""
from __future__ import annotations

import dataclasses
import os
import traceback
from typing import Callable

import torch

from .device import current
from .reference import attention_flops
from .results import GPU_TIMER, GRAPH_TIMER, QUICK_ENV, Row, quick

# Vendor datasheet peaks (dense, no sparsity): fp16/bf16 tensor-core TFLOP/s, fp32 (non-tensor)
# TFLOP/s, HBM GB/s. Keys are matched as substrings of torch.cuda.get_device_name().
PEAKS = {
    "T4": (65.0, 8.1, 320.0),
    "L4": (121.0, 30.3, 300.0),
    "A10G": (70.0, 31.2, 600.0),
    "A100": (312.0, 19.5, 2039.0),
    "H100": (989.0, 67.0, 3350.0),
    "H200": (989.0, 67.0, 4800.0),
    "B200": (2250.0, 75.0, 8000.0),
}


@dataclasses.dataclass(frozen=True)
class Peak:
    name: str
    tensor_tflops: float   # fp16/bf16 tensor cores
    fp32_tflops: float     # plain fp32 FMA units
    hbm_gbps: float


def gpu_peak(device_name: str | None = None) -> Peak | None:
    """Datasheet peaks for the current (or named) GPU, or None if it is not in the table."""
    if device_name is None:
        if not torch.cuda.is_available():
            return None
        device_name = torch.cuda.get_device_name(0)
    tokens = device_name.replace("-", " ").split()
    for key, (tc, f32, bw) in PEAKS.items():
        if key in tokens:
            return Peak(key, tc, f32, bw)
    return None


def needs_gpu(what: str) -> bool:
    """True on a GPU; on CPU prints why ``what`` is skipped and returns False."""
    if current().gpu:
        return True
    print(f"Skipped: {what} needs a CUDA GPU (this runtime is CPU-only, so kernels run in the "
          "Triton interpreter / Numba simulator, which are 1000x slower and say nothing about "
          "GPU speed). The book shows numbers measured on a real GPU below.")
    return False


# FLASHBOOK_QUICK_BENCH=1 (``results.QUICK_ENV``, set by `flashbook selftest`): time with a few
# milliseconds of runs, enough to show that a benchmark cell runs, not to measure anything
# (results.record refuses).
QUICK_GPU_TIMER = dict(warmup=2, rep=5, return_mode="median")
QUICK_GRAPH_TIMER = dict(rep=5, return_mode="median")


def gpu_timer(graph: bool = False) -> dict:
    """The keyword arguments of triton.testing.do_bench (``graph``: do_bench_cudagraph)."""
    if quick():
        return QUICK_GRAPH_TIMER if graph else QUICK_GPU_TIMER
    return GRAPH_TIMER if graph else GPU_TIMER


def time_ms(fn: Callable[[], object], graph: bool = False) -> float:
    """Median run time of ``fn()`` in milliseconds; ``graph``: replayed from a CUDA graph (GPU)."""
    if current().gpu:
        import triton.testing
        if graph:
            return float(triton.testing.do_bench_cudagraph(fn, **gpu_timer(graph=True)))
        return float(triton.testing.do_bench(fn, **gpu_timer()))
    from torch.utils import benchmark
    m = benchmark.Timer(stmt="fn()", globals={"fn": fn}).blocked_autorange(
        min_run_time=0.01 if quick() else 0.2)
    return m.median * 1e3


def _cpu_rss_peak_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise OSError("VmHWM not found")


def _cpu_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise OSError("VmRSS not found")


def peak_memory_bytes(fn: Callable[[], object]) -> int:
    """Extra memory ``fn()`` needs at its peak, beyond what was allocated before the call.

    GPU: the caching allocator's peak counter. CPU (Linux): the rise of the process's peak
    resident set, reset through /proc/self/clear_refs (approximate, page granular).
    """
    if current().gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    base = _cpu_rss_bytes()
    fn()
    return max(0, _cpu_rss_peak_bytes() - base)


def attention_bytes(B, H, N_q, N_k, d, element_size, H_kv=None) -> float:
    """Compulsory HBM traffic of an attention forward: read Q, K, V once, write O once."""
    H_kv = H_kv or H
    return float(element_size) * B * (2 * H * N_q * d + 2 * H_kv * N_k * d)


def measure_attention(kernel: str, role: str, fn: Callable[[], object], *, B, H, N_q, N_k, d,
                      dtype: torch.dtype, causal=False, H_kv=None, memory=False,
                      tensor_cores=True, graph=False) -> Row:
    """Time ``fn`` (one attention forward) and derive TFLOP/s, GB/s and % of the GPU's peak.
    ``graph``: time it replayed from a CUDA graph (see ``time_ms``).

    An out-of-memory error becomes a row with ``note='out of memory'`` instead of a crash.
    """
    dt = str(dtype).replace("torch.", "")
    row = dict(kernel=kernel, role=role, B=B, H_q=H, H_kv=H_kv or H, N_q=N_q, N_k=N_k, d=d,
               dtype=dt, causal=causal)
    try:
        peak_mib = peak_memory_bytes(fn) / 2**20 if memory else None
        ms = time_ms(fn, graph=graph)
    except torch.OutOfMemoryError:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return Row(**row, ms=None, tflops=None, gbps=None, pct_peak=None, note="out of memory")
    flops = attention_flops(B, H, N_q, N_k, d, causal)
    tflops = flops / (ms * 1e-3) / 1e12
    gbps = attention_bytes(B, H, N_q, N_k, d, torch.empty((), dtype=dtype).element_size(),
                           H_kv) / (ms * 1e-3) / 1e9
    peak = gpu_peak() if current().gpu else None
    pct = None
    if peak is not None:
        ceiling = peak.tensor_tflops if tensor_cores and dtype != torch.float32 else peak.fp32_tflops
        pct = 100.0 * tflops / ceiling
    return Row(**row, ms=ms, tflops=tflops, gbps=gbps, pct_peak=pct, peak_mib=peak_mib)


SDPA_BACKENDS = {
    "sdpa_cudnn": "CUDNN_ATTENTION",
    "sdpa_flash": "FLASH_ATTENTION",
    "sdpa_efficient": "EFFICIENT_ATTENTION",
    "sdpa_math": "MATH",
}


def sdpa(backend: str | None = None, *, gqa: bool = False, mask=None) -> Callable:
    """torch SDPA restricted to one backend (a key of SDPA_BACKENDS; None: torch's choice), as
    f(q, k, v, causal=False), with ``enable_gqa`` and an optional ``attn_mask``: the one SDPA
    call of every benchmark and check."""
    import torch.nn.functional as F

    def run(q, k, v, causal=False):
        if backend is None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                                  enable_gqa=gqa)
        from torch.nn.attention import SDPBackend, sdpa_kernel
        with sdpa_kernel(getattr(SDPBackend, SDPA_BACKENDS[backend])):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                                  enable_gqa=gqa)
    return run


def sdpa_supports(backend: str, q, k, v, causal=False) -> bool:
    """Whether this SDPA backend accepts these inputs on this GPU (not every GPU has cuDNN/flash)."""
    import warnings
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")   # torch explains each refusal in a UserWarning
            sdpa(backend)(q, k, v, causal)
        return True
    except RuntimeError:
        return False


# ------------------------------------------------------------ what every chapter benchmark shares

def why_failed(e: BaseException) -> str:
    """One line for a row's note: why a kernel or baseline was not measured (an exception
    without a message, e.g. a bare assert: where it was raised)."""
    if isinstance(e, torch.OutOfMemoryError):
        return "out of memory"
    first = (str(e).strip().splitlines() or [""])[0][:160]
    if first:
        return f"{type(e).__name__}: {first}"
    frames = traceback.extract_tb(e.__traceback__)
    if not frames:
        return f"{type(e).__name__}:"
    last = frames[-1]
    return f"{type(e).__name__} at {os.path.basename(last.filename)}:{last.lineno} " \
           f"({last.line or ''})"


def free_cuda_cache() -> None:
    """Give cached GPU memory back between cases (a no-op without CUDA)."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def timed_ms(fn) -> tuple[float, str]:
    """(median ms, note): from a CUDA graph when the call can be captured, else launched."""
    try:
        return time_ms(fn, graph=True), ""
    except Exception as e:  # noqa: BLE001 - e.g. a host sync or nested tensors in the capture
        free_cuda_cache()
        return time_ms(fn, graph=False), f"timed without CUDA graph ({why_failed(e)[:80]})"


def join_notes(*parts) -> str:
    """A row's note from its non-empty parts."""
    return "; ".join(p for p in parts if p)


def flex_compile_limits():
    """Dynamo settings for a benchmark run: flex_attention compiles once per shape and mask,
    and a call past the recompile limit must fail (a noted row), not fall back to eager."""
    cfg = torch._dynamo.config
    want = {"recompile_limit": 64, "fail_on_recompile_limit_hit": True}
    return cfg.patch(**{k: v for k, v in want.items() if hasattr(cfg, k)})


def public_row(row: Row, fn: Callable[[], object], call: str) -> Row:
    """The ``public`` companion of a chapter's ``row``: the same problem through the entry
    point as the book shows it, ``fn`` (no config, checks on), timed launched as a reader calls
    it (``time_ms``, never replayed from a graph). Its rates are ``row``'s scaled by the two
    times (the same FLOPs and bytes); ``call`` (the call as the book writes it) goes in the
    note. A failure is a noted row, as in ``measure_attention``."""
    fields = dict(dataclasses.asdict(row), role="public", peak_mib=None)
    try:
        ms = time_ms(fn)
    except Exception as e:  # noqa: BLE001 - recorded as a row that says why
        free_cuda_cache()
        return Row(**{**fields, "ms": None, "tflops": None, "gbps": None, "pct_peak": None,
                      "note": join_notes(call, f"not measured: {why_failed(e)}")})
    scale = row.ms / ms if row.ms else None          # same FLOPs and bytes, another time
    rate = {name: None if scale is None or getattr(row, name) is None else
            getattr(row, name) * scale for name in ("tflops", "gbps", "pct_peak")}
    return Row(**{**fields, **rate, "ms": ms, "note": call})


# The forward shapes (B, H, N, d) Chapter 3 times its kernels at, and Chapter 7 its tricks.
FORWARD_SHAPES = [(1, 16, 16384, 128), (4, 16, 4096, 128), (4, 16, 4096, 64), (4, 16, 1024, 64)]


def compiled(kernel) -> dict:
    """{cache key: compiled kernel} of a Triton kernel's variants compiled so far."""
    return {key: c for cache in getattr(kernel, "device_caches", {}).values()
            for key, c in cache[0].items()}


def registers(new: dict) -> str:
    """'regs=R spills=S' of newly compiled variants: what ptxas allotted per thread."""
    found = {(getattr(c, "n_regs", None), getattr(c, "n_spills", None)) for c in new.values()}
    return "; ".join(f"regs={r} spills={s}" for r, s in sorted(found, key=str)) or "regs n/a"
