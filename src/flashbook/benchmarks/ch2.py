"""Chapter 2 benchmark: the performance ladder of the Numba kernels against fp32 SDPA.

``flashbook bench ch2`` (GPU only) times, in one process on one GPU, at B=1, H=8, d=64,
N in {1024, 4096}, float32:

* ``fa1_literal``  (variant)   the literal port of flash.cu (grid (B, H), FA1 loop order);
* ``fa1_bounded``  (variant)   the same with the tail guards of Exercise 2;
* ``fa2_rows``     (variant)   FA2 order, one thread per query row (Exercise 4);
* ``fa2_tiled``    (reference) FA2 order with register tiling (Exercise 5);
* ``sdpa_efficient`` and ``sdpa_math`` (baselines), torch SDPA in fp32.

The kernels come from the chapter's solution source through
``notebooks.solution_namespace("ch2")``: there is no second copy of them. Every output is
compared with the float64 reference; the max abs error goes into the ``note`` column, and a
kernel off by more than 1e-5 is marked ``INEXACT``.
"""
from __future__ import annotations

import math
import statistics

import torch

from .. import reference
from ..bench import Measurement, attention_bytes, gpu_peak, measure_attention, sdpa, sdpa_supports
from ..reference import attention_flops

TOLERANCE = 1e-5
ROWS_BC, ROWS_BR = 32, 64   # tile of the one-thread-per-row FA2 kernel
SLOW_MS = 200.0   # kernels slower than this are timed with a few CUDA-event runs, not do_bench


def _slow_measurement(name, role, fn, *, B, H, N, d, reps=2) -> Measurement:
    """Median of ``reps`` runs timed with CUDA events (the caller ran ``fn`` once already)."""
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    ms = statistics.median(times)
    tflops = attention_flops(B, H, N, N, d) / (ms * 1e-3) / 1e12
    gbps = attention_bytes(B, H, N, N, d, 4) / (ms * 1e-3) / 1e9
    peak = gpu_peak()
    pct = 100.0 * tflops / peak.fp32_tflops if peak else None
    return Measurement(name, role, B, H, H, N, N, d, "float32", False, ms, tflops, gbps, pct,
                       note=f"median of {reps} runs")


def kernels_from_solution():
    """The chapter's kernels, executed from solutions/ch2_*.py (no second copy)."""
    from .. import notebooks
    ns = notebooks.solution_namespace("ch2")
    return ns


def ladder(ns, Ns=(1024, 4096), *, B=1, H=8, d=64, seed=0) -> list[Measurement]:
    from ..chapters import ch2

    rows: list[Measurement] = []
    for N in Ns:
        g = torch.Generator(device="cuda").manual_seed(seed + N)
        q, k, v = (torch.randn(B, H, N, d, device="cuda", generator=g) for _ in range(3))
        want = reference.attention(q.double(), k.double(), v.double())
        flat = {name: ch2.as_flat(t) for name, t in (("Q", q), ("K", k), ("V", v))}

        def fa1(kernel):
            O = torch.zeros_like(q)
            l = torch.zeros(B, H, N, device="cuda")
            m = torch.full((B, H, N), -math.inf, device="cuda")
            bufs = dict(flat, O=ch2.as_flat(O), l=ch2.as_flat(l), m=ch2.as_flat(m))

            def run():
                O.zero_()
                l.zero_()
                m.fill_(-math.inf)
                ch2.launch_fa1(kernel, q, k, v, 32, buffers=bufs, check=False)
                return O
            return run

        def fa2(launch, kernel, **kw):
            O = torch.empty_like(q)
            bufs = dict(flat, O=ch2.as_flat(O))

            def run():
                launch(kernel, q, k, v, buffers=bufs, check=False, **kw)
                return O
            return run

        cfg = ch2.tiled_config(d, gpu=True)
        entries = [
            ("fa1_literal", "variant", fa1(ns["fa1_literal_kernel"])),
            ("fa1_bounded", "variant", fa1(ns["fa1_bounded_kernel"])),
            ("fa2_rows", "variant", fa2(ch2.launch_fa2_rows, ns["make_fa2_rows"], Bc=ROWS_BC, Br=ROWS_BR)),
            ("fa2_tiled", "reference", fa2(ch2.launch_fa2_tiled, ns["make_fa2_tiled"], cfg=cfg)),
        ]
        for name in ("sdpa_efficient", "sdpa_math"):
            if sdpa_supports(name, q[:, :, :8], k[:, :, :8], v[:, :, :8]):
                entries.append((name, "baseline", (lambda f: (lambda: f(q, k, v)))(sdpa(name))))

        for name, role, fn in entries:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            fn()                                   # compile (Numba JIT) and warm up
            torch.cuda.synchronize()
            start.record()
            out = fn()
            end.record()
            torch.cuda.synchronize()
            first_ms = start.elapsed_time(end)
            err = (out.double() - want).abs().max().item()
            if first_ms > SLOW_MS:
                r = _slow_measurement(name, role, fn, B=B, H=H, N=N, d=d)
            else:
                r = measure_attention(name, role, fn, B=B, H=H, N_q=N, N_k=N, d=d,
                                      dtype=torch.float32, tensor_cores=False)
            detail = f"max_abs_err={err:.2e}"
            if name == "fa2_tiled":
                detail += f"; tiles BM={cfg.BM} BN={cfg.BN} TM={cfg.TM} TN={cfg.TN}"
            if name.startswith("fa1"):
                detail += "; Bc=Br=32"
            if name == "fa2_rows":
                detail += f"; Bc={ROWS_BC} Br={ROWS_BR}"
            if err > TOLERANCE:
                detail += f"; INEXACT (> {TOLERANCE:g})"
            r.note = "; ".join(x for x in (r.note, detail) if x)
            rows.append(r)
            print(f"N={N:5d} {name:15s} {r.ms:10.3f} ms {r.tflops:8.3f} TFLOP/s  {r.note}", flush=True)
        del q, k, v, want
        torch.cuda.empty_cache()
    return rows


def run() -> list[Measurement]:
    return ladder(kernels_from_solution())
