"""Chapter 2 benchmark: the performance ladder of the Numba kernels against fp32 SDPA.

``flashbook bench ch2`` (GPU only) times, in one process on one GPU, at B=1, H=8, d=64,
N in {1024, 4096}, float32:

* ``fa1_literal``  (variant)   the literal port of flash.cu (grid (B, H), FA1 loop order);
* ``fa1_bounded``  (variant)   the same with the tail guards of Exercise 2;
* ``fa2_rows``     (variant)   FA2 order, one thread per query row (Exercise 4);
* ``fa2_tiled``    (reference) FA2 order with register tiling (Exercise 5);
* ``fa2_tiled`` (public) the chapter's ``fa2_tiled(q, k, v)`` as a reader calls it: its checks,
  its config chosen, its output allocated (``bench.public_row``);
* ``sdpa_efficient`` and ``sdpa_math`` (baselines), torch SDPA in fp32. On compute capability
  8.0 and later ``sdpa_efficient`` runs fp32 on the tensor cores (3xTF32), so its ``pct_peak``,
  taken against the fp32 FMA peak like every fp32 row, is not a fraction of its own ceiling: its
  note says so, and the book's benchmark appendix marks the row (``book.FP32_ON_TENSOR_CORES``).

The kernels come from the chapter's solution source through ``sources.solution_namespace("ch2")``:
there is no second copy of them. Every row is timed by ``bench.measure_attention`` (do_bench:
a kernel of seconds, FA1 at N = 4096, is timed in a single run after its estimate runs). Every
output is compared with the float64 reference; the max abs error goes into the ``note`` column,
and a kernel off by more than 1e-5 is marked ``INEXACT``.
"""
from __future__ import annotations

import math

import torch

from flashbook import bench, reference, sources

from .launch import as_flat, launch_fa1, launch_fa2_rows, launch_fa2_tiled, tiled_config

TOLERANCE = 1e-5
ROWS_BC, ROWS_BR = 32, 64   # tile of the one-thread-per-row FA2 kernel
FA1_BC = 32                 # flash.cu's Bc = Br


def kernels_from_solution() -> dict:
    """The chapter's definitions, executed from solutions/ch2_*.py (no second copy)."""
    return sources.solution_namespace("ch2")


def ladder(ns, Ns=(1024, 4096), *, B=1, H=8, d=64, seed=0) -> list:
    """Time the four rungs (kernels from ``ns``) and the SDPA baselines at each N."""
    rows = []
    for N in Ns:
        g = torch.Generator(device="cuda").manual_seed(seed + N)
        q, k, v = (torch.randn(B, H, N, d, device="cuda", generator=g) for _ in range(3))  # (B, H, N, d)
        want = reference.attention(q.double(), k.double(), v.double())
        flat = {name: as_flat(t) for name, t in (("Q", q), ("K", k), ("V", v))}

        def fa1(kernel):
            # buffers allocated once, reset per call (flash.cu needs O = 0, l = 0, m = -inf)
            O = torch.zeros_like(q)
            l = torch.zeros(B, H, N, device="cuda")
            m = torch.full((B, H, N), -math.inf, device="cuda")
            bufs = dict(flat, O=as_flat(O), l=as_flat(l), m=as_flat(m))

            def run():
                O.zero_()
                l.zero_()
                m.fill_(-math.inf)
                launch_fa1(kernel, q, k, v, FA1_BC, buffers=bufs, check=False)
                return O
            return run

        def fa2(launch, factory, **kw):
            O = torch.empty_like(q)
            bufs = dict(flat, O=as_flat(O))

            def run():
                launch(factory, q, k, v, buffers=bufs, check=False, **kw)
                return O
            return run

        cfg = tiled_config(d, gpu=True)
        entries = [
            ("fa1_literal", "variant", fa1(ns["fa1_literal_kernel"]), f"Bc=Br={FA1_BC}"),
            ("fa1_bounded", "variant", fa1(ns["fa1_bounded_kernel"]), f"Bc=Br={FA1_BC}"),
            ("fa2_rows", "variant", fa2(launch_fa2_rows, ns["make_fa2_rows"], Bc=ROWS_BC, Br=ROWS_BR),
             f"Bc={ROWS_BC} Br={ROWS_BR}"),
            ("fa2_tiled", "reference", fa2(launch_fa2_tiled, ns["make_fa2_tiled"], cfg=cfg),
             f"tiles BM={cfg.BM} BN={cfg.BN} TM={cfg.TM} TN={cfg.TN}"),
        ]
        tc = torch.cuda.get_device_capability() >= (8, 0)
        for name in ("sdpa_efficient", "sdpa_math"):
            if bench.sdpa_supports(name, q[:, :, :8], k[:, :, :8], v[:, :, :8]):
                what = ("fp32 on tensor cores (3xTF32): pct_peak is against the FMA peak"
                        if name == "sdpa_efficient" and tc else "")
                entries.append((name, "baseline", (lambda f: (lambda: f(q, k, v)))(bench.sdpa(name)),
                                what))

        for name, role, fn, tiles in entries:
            out = fn()                                   # compiles (Numba JIT); checked below
            err = (out.double() - want).abs().max().item()
            r = bench.measure_attention(name, role, fn, B=B, H=H, N_q=N, N_k=N, d=d,
                                        dtype=torch.float32, tensor_cores=False)
            detail = "; ".join(x for x in (f"max_abs_err={err:.2e}", tiles) if x)
            if err > TOLERANCE:
                detail += f"; INEXACT (> {TOLERANCE:g})"
            r.note = "; ".join(x for x in (r.note, detail) if x)
            rows.append(r)
            if name == "fa2_tiled" and r.ms is not None:
                rows.append(bench.public_row(r, lambda: ns["fa2_tiled"](q, k, v),
                                             "fa2_tiled(q, k, v)"))
            speed = f"{r.ms:10.3f} ms {r.tflops:8.3f} TFLOP/s" if r.ms is not None else f"{'-':>28}"
            print(f"N={N:5d} {name:15s} {speed}  {r.note}", flush=True)
        del q, k, v, want
        torch.cuda.empty_cache()
    return rows


def run() -> list:
    """The rows ``flashbook bench ch2`` records (bench.measure_attention's)."""
    return ladder(kernels_from_solution())
