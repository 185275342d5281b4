"""Chapter 6, Exercise 4: a FlashAttention-3-shaped forward kernel in Pallas Mosaic GPU, the
given code around the student's consumer warpgroups.

One CTA computes two 64-row query tiles of one (batch, head) with three warpgroups:

* warpgroup 2, the **producer** (given), streams K^T and V tiles of ``block_kv`` keys through
  rings of ``stages`` SMEM slots, each slot with a *full* barrier (the TMA copy arrives) and a
  *consumed* barrier (two arrivals, one per consumer), separately for K and V, so K can be
  released early (right after the QK^T GEMM) and refilled while the PV GEMM still reads V;
* warpgroups 0 and 1, the **consumers**, each load their own Q tile (given), then run the
  student's ``consumer``: per K/V step, S = Q K^T (wgmma), the online softmax in base 2, P to
  SMEM, O += P V (wgmma), ping-ponged by one *schedule* barrier; it returns the normalised O tile
  and the base-2 LSE of its rows, which the given epilogue stores (O through the Q tile's SMEM).

Conventions: tensors are ``(B, H, N, d)`` fp16 (the book's), K is passed **transposed**,
``(B, H, d, N_k)`` (``plgpu.transpose_ref`` is not supported by JAX 0.10.2's interpret mode, so
the host transposes it, for both modes); ``scale`` (default 1/sqrt(d)) is applied in fp32 to S;
causal masks are aligned bottom-right (query i sees key j iff j <= i + N_k - N_q, which needs
N_k >= N_q here: no row is empty). Inside, the kernel works in base 2: the consumer returns
``lse2 = log2(sum_j 2^(s_ij log2 e))``; ``run_fa3`` and the check convert it to the book's natural
log at the boundary (``lse = lse2 * ln 2``).

Two ways to run it: ``run_fa3_interpret`` is the target of the Exercise 4 check (in a child
process, ``pallas_interpret``: one CTA, JAX's GPU interpret mode, the race detector on) and
``run_fa3`` compiles it for an sm_90 GPU (H100, H200) at full size. Differences from
FlashAttention-3 that interpret mode forces (JAX 0.10.2): K^T comes from the host; the PV wgmma
reads P from SMEM (the interpreter wants an SMEM A operand; FA3 keeps P in registers); the
accumulator is a scoped ``plgpu.ACC`` plus an add (``pl.run_state`` is not interpreted); the
producer drains the final consumed phases (the interpreter insists every phase be observed).

JAX is imported inside the functions: the module imports without it.
"""
from __future__ import annotations

import json
import math
import os

import numpy as np

BLOCK_Q = 64                 # rows of Q per consumer warpgroup (one wgmma M = 64 tile)
CONSUMERS = 2                # consumer warpgroups; the producer is warpgroup CONSUMERS
LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
# The SMEM scratch and the barriers in allocation order (the race and barrier reports name them).
SMEM_NAMES = ("q_smem (the Q tiles, then O)", "kT_ring", "v_ring", "p_smem", "lse_smem")


def barrier_names(stages: int) -> list[str]:
    return ([f"q_loaded[{w}]" for w in range(CONSUMERS)]
            + [f"k_full[{s}]" for s in range(stages)] + [f"v_full[{s}]" for s in range(stages)]
            + [f"k_consumed[{s}]" for s in range(stages)]
            + [f"v_consumed[{s}]" for s in range(stages)] + ["schedule"])


def thread_names() -> dict[int, str]:
    names = {w: f"consumer warpgroup {w}" for w in range(CONSUMERS)}
    names[CONSUMERS] = f"the producer (warpgroup {CONSUMERS})"
    return names


def default_config(d: int) -> tuple[int, int]:
    """(block_kv, stages) for the compiled kernel: 64-key tiles in a 2-slot ring, the
    configuration the interpret-mode checks use (``smem_bytes``: 113 KB of SMEM at d = 128)."""
    return 64, 2


def smem_bytes(d: int, block_kv: int, stages: int, itemsize: int = 2) -> int:
    q = CONSUMERS * BLOCK_Q * d * itemsize
    kv = 2 * stages * block_kv * d * itemsize
    p = CONSUMERS * BLOCK_Q * block_kv * itemsize
    return q + kv + p + CONSUMERS * BLOCK_Q * 4


# ------------------------------------------------------------------------------ the given kernel

def kv_producer(kT_gmem, v_gmem, kT_ring, v_ring, k_full, v_full, k_consumed, v_consumed, *,
                stages: int, steps: int, block_kv: int):
    """The producer warpgroup (Exercise 1's ring, twice): K^T tile ``step`` is columns
    ``step * block_kv ...`` of ``kT_gmem`` (d, N_k), V tile ``step`` the same rows of ``v_gmem``;
    both go into slot ``step % stages``. K and V have their own barriers, so a slot's K is
    refilled as soon as both consumers have finished their QK^T GEMM."""
    from jax import lax
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    @pl.loop(0, steps)
    def _load(step):
        slot = lax.rem(step, stages)
        keys = pl.ds(step * block_kv, block_kv)

        @pl.when(step >= stages)
        def _k_free():
            plgpu.barrier_wait(k_consumed.at[slot])
        plgpu.copy_gmem_to_smem(kT_gmem.at[:, keys], kT_ring.at[slot], k_full.at[slot])

        @pl.when(step >= stages)
        def _v_free():
            plgpu.barrier_wait(v_consumed.at[slot])
        plgpu.copy_gmem_to_smem(v_gmem.at[keys], v_ring.at[slot], v_full.at[slot])

    for step in range(max(0, steps - stages), steps):     # drain the last releases
        plgpu.barrier_wait(k_consumed.at[step % stages])
        plgpu.barrier_wait(v_consumed.at[step % stages])


def causal_mask(q_start, *, n_q: int, n_k: int, block_kv: int, causal: bool,
                compiled: bool = False):
    """``mask(s, step)``: the (BLOCK_Q, block_kv) scores of step ``step`` with -inf where a query
    may not see a key (bottom-right causal). Compiled, the index grids take the wgmma
    accumulator's register layout (interpret mode has no layouts)."""
    import jax.numpy as jnp
    from jax import lax
    import jax.experimental.pallas.mosaic_gpu as plgpu

    def iota(shape, axis):
        if compiled:
            return plgpu.broadcasted_iota(jnp.int32, shape, axis, layout=plgpu.Layout.WGMMA)
        return lax.broadcasted_iota(jnp.int32, shape, axis)

    def mask(s, step):
        if not causal:
            return s
        rows = q_start + iota(s.shape, 0)                       # query index
        cols = step * block_kv + iota(s.shape, 1)               # key index
        return jnp.where(cols <= rows + (n_k - n_q), s, -jnp.inf)
    return mask


def fa3_kernel(consumer, *, batch: int, heads: int, n_q: int, n_k: int, d: int,
               block_kv: int = 64, stages: int = 2, causal: bool = False,
               scale: float | None = None, dtype="float16", interpret=None, producer=None,
               swizzle: bool | None = None):
    """``(q (B,H,N_q,d), kT (B,H,d,N_k), v (B,H,N_k,d)) -> (o, lse2 (B,H,N_q) float32, base 2)``.
    ``interpret``: ``InterpretGPUParams`` (one CTA: B = H = 1, N_q = 128) or None to compile
    for sm_90. ``swizzle`` (compiled only, not yet run on a GPU): FA3's SMEM layout, 8 x 64
    tiles with a 128-byte swizzle, so the wgmma and the register stores hit distinct banks."""
    import jax
    import jax.numpy as jnp
    from jax import lax
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    rows_per_cta = CONSUMERS * BLOCK_Q
    if n_q % rows_per_cta or n_k % block_kv or block_kv % 64 or d % 64:
        raise ValueError(f"N_q={n_q} must be a multiple of {rows_per_cta}, N_k={n_k} of "
                         f"block_kv={block_kv}, block_kv and d={d} of 64")
    if causal and n_k < n_q:
        raise ValueError("causal needs N_k >= N_q here (no query row without keys)")
    steps = n_k // block_kv
    scale = float(1.0 / math.sqrt(d) if scale is None else scale)
    dtype = jnp.dtype(dtype)
    grid = (heads, n_q // rows_per_cta, batch)
    if interpret is not None and grid != (1, 1, 1):
        raise ValueError(f"interpret mode runs one CTA: B = H = 1 and N_q = {rows_per_cta}")
    produce = producer or kv_producer

    def body(q_gmem, kT_gmem, v_gmem, o_gmem, lse_gmem, q_smem, kT_ring, v_ring, p_smem,
             lse_smem, q_loaded, k_full, v_full, k_consumed, v_consumed, schedule):
        wg = lax.axis_index("wg")
        h, t, b = lax.axis_index("heads"), lax.axis_index("q_tiles"), lax.axis_index("batch")

        @pl.when(wg == CONSUMERS)
        def _producer():
            produce(kT_gmem.at[b, h], v_gmem.at[b, h], kT_ring, v_ring, k_full, v_full,
                    k_consumed, v_consumed, stages=stages, steps=steps, block_kv=block_kv)

        @pl.when(wg < CONSUMERS)
        def _consumer():
            q_start = t * rows_per_cta + wg * BLOCK_Q
            rows = pl.ds(q_start, BLOCK_Q)
            q_tile = q_smem.at[wg]
            plgpu.copy_gmem_to_smem(q_gmem.at[b, h, rows], q_tile, q_loaded.at[wg])
            plgpu.barrier_wait(q_loaded.at[wg])
            mask = causal_mask(q_start, n_q=n_q, n_k=n_k, block_kv=block_kv, causal=causal,
                               compiled=interpret is None)
            o, lse2 = consumer(wg, q_tile, p_smem.at[wg], kT_ring, v_ring, k_full, v_full,
                               k_consumed, v_consumed, schedule, steps=steps, stages=stages,
                               scale=scale, mask=mask)
            q_tile[...] = o.astype(dtype)          # epilogue: O through the Q tile's SMEM
            lse_smem.at[wg][...] = lse2
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(q_tile, o_gmem.at[b, h, rows])
            plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_gmem.at[b, h, rows])
            plgpu.wait_smem_to_gmem(0)

    two = CONSUMERS
    swizzle = bool(swizzle)
    if swizzle and interpret is not None:
        raise ValueError("interpret mode has no SMEM layout transforms: swizzle=False")
    tiled = dict(transforms=(plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))) \
        if swizzle else {}
    return plgpu.kernel(
        body,
        out_type=(jax.ShapeDtypeStruct((batch, heads, n_q, d), dtype),
                  jax.ShapeDtypeStruct((batch, heads, n_q), jnp.float32)),
        scratch_types=[
            plgpu.SMEM((two, BLOCK_Q, d), dtype, **tiled),            # Q tiles, then O
            plgpu.SMEM((stages, d, block_kv), dtype, **tiled),        # K^T ring
            plgpu.SMEM((stages, block_kv, d), dtype, **tiled),        # V ring
            plgpu.SMEM((two, BLOCK_Q, block_kv), dtype, **tiled),     # P, one per consumer
            plgpu.SMEM((two, BLOCK_Q), jnp.float32),                  # LSE (base 2)
            plgpu.Barrier(num_barriers=two),                          # q_loaded[wg]
            plgpu.Barrier(num_barriers=stages),                       # k_full[s]
            plgpu.Barrier(num_barriers=stages),                       # v_full[s]
            plgpu.Barrier(num_arrivals=two, num_barriers=stages),     # k_consumed[s]
            plgpu.Barrier(num_arrivals=two, num_barriers=stages),     # v_consumed[s]
            plgpu.Barrier(num_arrivals=two),                          # schedule (ping-pong)
        ],
        grid=grid, grid_names=("heads", "q_tiles", "batch"),
        num_threads=CONSUMERS + 1, thread_name="wg", interpret=interpret)


# ------------------------------------------------------------ interpret mode (the check's target)

def run_fa3_interpret(consumer, q, kT, v, *, causal: bool = False, stages: int = 2,
                      block_kv: int = 64, scale: float | None = None, detect_races: bool = True,
                      tma_threads: int = 4, producer=None) -> dict:
    """The check's target (``pallas_interpret.run``): one CTA on fp16 ``q (1,1,128,d)``,
    ``kT (1,1,d,N_k)``, ``v (1,1,N_k,d)``; returns ``o``, ``lse2`` (base 2),
    ``wgmma_reads_checked`` (``pallas_instruments.track_wgmma_reads`` installed) and
    ``unfenced`` (JSON of ``pallas_child.unfenced_reads`` of the traced kernel)."""
    import jax
    import jax.numpy as jnp

    from ... import pallas_interpret as interpret
    from ...pallas_child import unfenced_reads
    from ...pallas_instruments import share_thread_compiles, track_wgmma_reads

    share_thread_compiles()
    tracked = track_wgmma_reads() if detect_races else False
    _, _, n_q, d = q.shape
    fn = fa3_kernel(consumer, batch=1, heads=1, n_q=n_q, n_k=v.shape[2], d=d,
                    block_kv=block_kv, stages=stages, causal=causal, scale=scale,
                    dtype=q.dtype, producer=producer,
                    interpret=interpret.params(CONSUMERS + 1, detect_races, tma_threads))
    args = [jnp.asarray(x) for x in (q, kT, v)]
    unfenced = unfenced_reads(jax.make_jaxpr(fn)(*args))     # statically: the traced kernel
    o, lse2 = jax.block_until_ready(fn(*args))
    return {"o": np.asarray(o), "lse2": np.asarray(lse2),
            "wgmma_reads_checked": np.asarray(tracked),
            "unfenced": np.asarray(json.dumps(unfenced))}


def reference(q, k, v, *, causal: bool = False, scale: float | None = None):
    """Attention in float64 NumPy, ``(..., N, d)`` inputs (K not transposed): ``(o, lse)``, LSE
    in natural log; causal bottom-right."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = np.einsum("...id,...jd->...ij", q, k) * scale
    if causal:
        n_q, n_k = q.shape[-2], k.shape[-2]
        keep = np.arange(n_k)[None, :] <= np.arange(n_q)[:, None] + (n_k - n_q)
        s = np.where(keep, s, -np.inf)
    m = s.max(-1, keepdims=True)
    p = np.exp(s - m)
    l = p.sum(-1, keepdims=True)
    return np.einsum("...ij,...jd->...id", p / l, v), (m + np.log(l))[..., 0]


# ------------------------------------------------------------------ compiled, on an sm_90 GPU

def import_jax():
    """``jax``, sharing a GPU with torch: no preallocation of 75% of its memory (effective
    when JAX has not used the GPU yet in this process)."""
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jax
    return jax


def sm90_problem() -> str | None:
    """None when JAX sees a Hopper GPU (sm_90) to compile for; otherwise why not."""
    try:
        jax = import_jax()
    except ImportError:
        return "JAX is not installed"
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        gpus = []
    if not gpus:
        return "JAX sees no GPU (this runtime has none, or JAX was installed without CUDA)"
    cc = str(getattr(gpus[0], "compute_capability", "9.0"))
    if not cc.startswith("9"):
        return (f"the GPU ({gpus[0].device_kind}, compute capability {cc}) is not a Hopper GPU: "
                "wgmma and this kernel need sm_90 (H100, H200)")
    return None


def run_fa3(consumer, q, k, v, *, causal: bool = False, scale: float | None = None,
            block_kv: int | None = None, stages: int | None = None, interpret: bool = False,
            swizzle: bool | None = None):
    """The kernel with ``consumer``, compiled for sm_90 (``interpret=True``: interpreted here,
    with no time limit, one CTA). ``q (B, H, N_q, d)``, ``k, v (B, H, N_k, d)`` fp16 (NumPy,
    JAX or torch; the host transposes K). Returns NumPy ``(o, lse)``, LSE in natural log."""
    jax = import_jax()
    import jax.numpy as jnp

    from ...pallas_interpret import params as interpret_params

    q, k, v = (_to_jax(x) for x in (q, k, v))
    B, H, n_q, d = q.shape
    d_block_kv, d_stages = default_config(d)
    params = interpret_params(CONSUMERS + 1) if interpret else None
    fn = fa3_kernel(consumer, batch=B, heads=H, n_q=n_q, n_k=k.shape[2], d=d,
                    block_kv=block_kv or d_block_kv, stages=stages or d_stages, causal=causal,
                    scale=scale, dtype=q.dtype, interpret=params, swizzle=swizzle)
    o, lse2 = jax.block_until_ready(jax.jit(fn)(q, jnp.swapaxes(k, -1, -2), v))
    return np.asarray(o), np.asarray(lse2) * LN2


def time_fa3(consumer, B: int, H: int, N: int, d: int, *, causal: bool = False,
             block_kv: int | None = None, stages: int | None = None, reps: int = 20,
             swizzle: bool | None = None) -> dict:
    """On sm_90: the median time (ms) and TFLOP/s of the compiled kernel at ``(B, H, N, d)``
    fp16 (K^T made once, outside the timing)."""
    import time

    jax = import_jax()
    import jax.numpy as jnp

    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(kk, (B, H, N, d), jnp.float16) for kk in keys)
    kT = jnp.swapaxes(k, -1, -2).copy()
    d_block_kv, d_stages = default_config(d)
    fn = jax.jit(fa3_kernel(consumer, batch=B, heads=H, n_q=N, n_k=N, d=d,
                            block_kv=block_kv or d_block_kv, stages=stages or d_stages,
                            causal=causal, swizzle=swizzle))
    jax.block_until_ready(fn(q, kT, v))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(q, kT, v))
        times.append(time.perf_counter() - t0)
    ms = float(np.median(times)) * 1e3
    flops = 4 * B * H * N * N * d * (0.5 if causal else 1.0)
    return {"ms": ms, "tflops": flops / ms / 1e9}


def _to_jax(x):
    import jax.numpy as jnp
    return jnp.asarray(x.detach().cpu().numpy() if type(x).__module__.startswith("torch") else x)
