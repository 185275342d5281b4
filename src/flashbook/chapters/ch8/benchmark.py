"""Chapter 8 benchmark (one GPU): a batch-1 decode step against a long cache, split-KV
(Exercise 2's kernels) against Chapter 5's decode kernel without splits, torch SDPA, compiled
FlexAttention and the GPU's read ceiling, all in one process.

Case: (B, h_q, h_kv, context, d) = (1, 32, 8, 131072, 128), fp16, one new token, the whole cache
valid (``cache_seqlens`` = 131072). Rows:

* ``ch8_split_kv`` (reference): ``launch_split_kv`` with the solution's ``split_kv_kernel`` and
  ``combine_kernel``, the split count from ``choose_num_splits`` for this GPU's SMs (note
  ``num_splits=S (chosen)``); then (variant) the same kernels with ``num_splits`` in
  ``SPLIT_SWEEP`` (note ``num_splits=S``): the heuristic against its neighbours; and with the
  chosen count, the tile configs of ``TILE_SWEEP`` (BLOCK_N, num_warps, num_stages).
* ``ch5_decode`` (variant): Chapter 5's decode kernel, one program per (sequence, K/V head):
  8 programs for 132 SMs.
* ``sdpa_cudnn``, ``sdpa_flash`` (baselines): SDPA with ``enable_gqa=True`` on q (1, 32, 1, d),
  K/V (1, 8, 131072, d), ``is_causal=False``; ``sdpa_cudnn`` on K/V expanded to 32 heads where it
  refuses ``enable_gqa`` (as Chapter 5 does); ``flex_attention`` (compiled, ``enable_gqa=True``).
* ``hbm_read``, ``d2d_copy`` (baselines, Chapter 5's ``ceiling_rows``): the read ceiling in the
  same run.

Every row is timed replayed from a CUDA graph (``graph_timer``) through Chapter 4's
``measure`` (a failure becomes a noted row). ``gbps``: bytes of K and V read per second
(``bench_setups.kv_bytes``); ``pct_peak``: of the datasheet HBM bandwidth. Notes carry
``max|O-sdpa_cudnn|`` (our kernels' O against cuDNN's on the same inputs).

Record it with ``flashbook bench ch8`` (``CHAPTER.benchmark``), or with
``python -m flashbook.chapters.ch8.benchmark --out DIR``, the same record (``DIR/ch8/<gpu>.csv``
and its provenance) followed by ``summary``'s lines against the chapter's targets.
A ``public`` row beside the reference one times ``decode_split_kv(q, k_cache, v_cache,
cache_seqlens)`` as a reader calls it (checks on, the split count its own, launched).
"""
from __future__ import annotations

import argparse
import functools
import shlex
import sys

import torch

from flashbook import bench_setups, sources
from flashbook.bench import flex_compile_limits, free_cuda_cache, public_row
from flashbook.bench_setups import ceiling_rows, decode_flops, err_note, expanded_note, expect, \
    kv_bytes, ours, quiet, sdpa_setup
from flashbook.results import Row

GRAPH_TIMER = True
DTYPE = torch.float16
LONG = (1, 32, 8, 131072, 128)            # (B, h_q, h_kv, context, d), one new token
SPLIT_SWEEP = (8, 16, 24, 48, 64, 128)
TILE_SWEEP = ((128, 4, 3), (128, 8, 2), (64, 4, 4), (64, 4, 2))   # beside split_config's
READ_BYTES, COPY_BYTES = bench_setups.READ_BYTES, bench_setups.COPY_BYTES


def measure(kernel, role, setup, **kw) -> Row:
    """``bench_setups.measure`` of this chapter's fp16 rows."""
    return bench_setups.measure(kernel, role, setup, dtype=DTYPE, **kw)


def split_setup(ns, q, k, v, lens, num_splits, check, tiles=None):
    """A setup for ``measure``: one checked call, then the launch timed (no host-side checks).
    ``tiles``: (BLOCK_N, num_warps, num_stages), default ``split_config``'s."""
    from flashbook.chapters.ch8.launch import launch_split_kv
    bn, warps, stages = tiles or (None, None, None)

    def setup():
        f = functools.partial(launch_split_kv, ns["split_kv_kernel"], ns["combine_kernel"], q, k,
                              v, lens, num_splits, block_n=bn, num_warps=warps,
                              num_stages=stages)
        return f, check(f()[0])
    return setup


def run(shape=LONG, sweep=SPLIT_SWEEP, read_bytes=READ_BYTES, copy_bytes=COPY_BYTES,
        device="cuda", ns=None, ns5=None, compile_flex=True, tile_sweep=TILE_SWEEP) -> list[Row]:
    """Every row (module docstring). ``ns``, ``ns5``: the ch8 and ch5 solution namespaces."""
    from torch.nn.attention.flex_attention import flex_attention
    from flashbook.chapters.ch8.launch import choose_num_splits, sm_count, split_config
    ns = ns if ns is not None else sources.solution_namespace("ch8")
    ns5 = quiet(ns5 if ns5 is not None else sources.solution_namespace("ch5"))
    flex = functools.partial(torch.compile(flex_attention, dynamic=False) if compile_flex
                             else flex_attention, enable_gqa=True)
    B, h_q, h_kv, context, d = shape
    q = torch.randn(B, 1, h_q, d, device=device, dtype=DTYPE)
    kc, vc = (torch.randn(B, context, h_kv, d, device=device, dtype=DTYPE) for _ in range(2))
    lens = torch.full((B,), context, dtype=torch.int32, device=device)
    q4, k4, v4 = (t.transpose(1, 2).contiguous() for t in (q, kc, vc))
    kw = dict(B=B, H_q=h_q, H_kv=h_kv, N_q=1, N_k=context, d=d, causal=True, hbm=True,
              flops=decode_flops(B, h_q, 1, context, d),
         nbytes=kv_bytes(B, context, h_kv, d, DTYPE.itemsize))
    name, want = expect(q4, k4, v4, False, ("sdpa_cudnn", "sdpa_flash", "sdpa_math"))

    def check(o):                                          # o (B, 1, h_q, d)
        return err_note(name, want)(o.transpose(1, 2))
    from flashbook.device import current
    chosen = choose_num_splits(B, h_kv, context, sm_count(), split_config(current().capability)[0])
    rows = []
    with flex_compile_limits():
        rows.append(measure("ch8_split_kv", "reference",
                            split_setup(ns, q, kc, vc, lens, chosen, check),
                            note=f"num_splits={chosen} (chosen for {sm_count()} SMs)", **kw))
        rows.append(public_row(rows[-1], functools.partial(ns["decode_split_kv"], q, kc, vc,
                                                           lens),
                               "decode_split_kv(q, k_cache, v_cache, cache_seqlens)"))
        for s in sweep:
            if s != chosen:
                rows.append(measure("ch8_split_kv", "variant",
                                    split_setup(ns, q, kc, vc, lens, s, check),
                                    note=f"num_splits={s}", **kw))
        for tiles in tile_sweep:
            rows.append(measure("ch8_split_kv", "variant",
                                split_setup(ns, q, kc, vc, lens, chosen, check, tiles),
                                note=f"num_splits={chosen}; BLOCK_N, num_warps, num_stages "
                                     f"= {tiles}", **kw))
        free_cuda_cache()
        rows.append(measure("ch5_decode", "variant",
                            ours(ns5, "decode", (q, kc, vc, lens), check),
                            note="no split: one program per (sequence, K/V head)", **kw))
        free_cuda_cache()
        for backend in ("sdpa_cudnn", "sdpa_flash"):
            rows.append(measure(backend, "baseline",
                                sdpa_setup(backend, q4, k4, v4, False),
                                note="enable_gqa=True; is_causal=False", **kw))
            if backend == "sdpa_cudnn" and rows[-1].ms is None:
                rows.append(measure(backend, "baseline",
                                    sdpa_setup(backend, q4, k4, v4, False, expand=True),
                                    note=expanded_note(k4, h_q // h_kv), **kw))
            free_cuda_cache()

        def flex_setup():
            fn = lambda: flex(q4, k4, v4)  # noqa: E731
            return fn, err_note(name, want)(fn())
        rows.append(measure("flex_attention", "baseline", flex_setup,
                            note="enable_gqa=True; no block mask", **kw))
        free_cuda_cache()
    want = None
    rows += ceiling_rows(read_bytes, copy_bytes, B, h_q, h_kv, context, d, device=device)
    return rows


def summary(rows) -> str:
    """One line per row: kernel, note, GB/s, and split-KV against cuDNN and hbm_read."""
    by = {}
    lines = []
    for r in rows:
        gb = f"{r.gbps:7.0f} GB/s" if r.gbps else "   (not measured)"
        lines.append(f"{r.kernel:16s} {r.role:9s} {gb}  {r.note}")
        if r.gbps and (r.kernel, r.role) not in by:
            by[r.kernel, r.role] = r.gbps
    ours = by.get(("ch8_split_kv", "reference"))
    cudnn = by.get(("sdpa_cudnn", "baseline"))
    read = by.get(("hbm_read", "baseline"))
    if ours and cudnn and read:
        lines.append(f"split-KV: {ours / cudnn:.2f}x cuDNN, {100 * ours / read:.0f} % of hbm_read "
                     f"(targets: >= 0.95x, >= 85 %)")
    return "\n".join(lines)


def main(argv=None) -> int:
    """``python -m flashbook.chapters.ch8.benchmark --out DIR``: ``flashbook bench ch8``'s record,
    then its summary."""
    from flashbook import results
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(results.DATA_DIR))
    args = p.parse_args(argv)
    command = "python -m flashbook.chapters.ch8.benchmark " + " ".join(
        shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    path = results.record_benchmark("ch8", run, args.out, command, GRAPH_TIMER)   # CHAPTER's
    print(f"wrote {path}")
    print(summary(results.read(path)))
    return 0


if __name__ == "__main__":
    import flashbook
    flashbook.setup()
    sys.exit(main())
