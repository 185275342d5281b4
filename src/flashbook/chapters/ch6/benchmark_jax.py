"""Chapter 6 benchmark, phase 2 (``benchmark`` describes the run): the setups of the rows JAX
times, the students' Pallas kernel and JAX's FA3, compiled, on the torch inputs shared through
DLPack, timed with JAX's CUPTI profiler (``jax_time``)."""
from __future__ import annotations

import dataclasses
import functools
import math
import statistics
import time

import torch

from flashbook.bench import join_notes, why_failed
from flashbook.results import GPU_TIMER

from .fa3_pallas import import_jax

# JAX's FA3 kernel, tuned as its own benchmark (attention_mgpu.main) tunes it
JAX_BLOCK_Q, JAX_BLOCK_KV, JAX_STEPS = 64, (256, 128, 64), 2
# JAX rows: CUPTI-timed calls to fill about JAX_TARGET_MS, at least/most JAX_CALLS
JAX_TARGET_MS, JAX_CALLS = 300.0, (10, 200)


def jax_calls(estimate_ms: float, target_ms: float = JAX_TARGET_MS, limits=JAX_CALLS) -> int:
    """The CUPTI timing's calls: enough to fill ``target_ms`` within ``limits``."""
    lo, hi = limits
    if not estimate_ms > 0 or math.isinf(estimate_ms):
        return hi
    return int(min(hi, max(lo, round(target_ms / estimate_ms))))


def jax_block_kv(N: int, candidates=JAX_BLOCK_KV) -> list[int]:
    """The block_kv values JAX's FA3 kernel can take for N keys, in its benchmark's order."""
    return [b for b in candidates if N % b == 0]


def to_jax(*tensors: torch.Tensor) -> tuple[list, str]:
    """JAX arrays on the memory of ``tensors`` through DLPack (once the GPU is done writing
    them), and the note's word: "zero-copy" where the buffer pointers agree, else "COPIED"."""
    import jax.dlpack
    if tensors[0].is_cuda:
        torch.cuda.synchronize()
    arrays = [jax.dlpack.from_dlpack(t, copy=False) for t in tensors]
    try:
        shared = all(x.unsafe_buffer_pointer() == t.data_ptr() for x, t in zip(arrays, tensors))
    except Exception:  # noqa: BLE001 - only for the note
        shared = False
    return arrays, "zero-copy" if shared else "COPIED"


def to_torch(o) -> torch.Tensor:
    """A JAX array (or the first of a tuple) as a torch tensor, no copy."""
    return torch.from_dlpack(o[0] if isinstance(o, (tuple, list)) else o)


def jax_time(call: functools.partial) -> tuple[float, str]:
    """(ms, note) of ``call`` (a compiled jitted f with its arguments): the median CUPTI kernel
    time of n calls (``mosaic.gpu.profiler.measure``), do_bench of the blocking call as the
    cross-check, and that time where CUPTI fails. The JAX rows' timer."""
    import triton.testing
    f, args = call.func, call.args
    jax = import_jax()
    t0 = time.perf_counter()
    jax.block_until_ready(f(*args))
    n = jax_calls((time.perf_counter() - t0) * 1e3)
    wall = float(triton.testing.do_bench(lambda: jax.block_until_ready(f(*args)), **GPU_TIMER))
    wall_note = (f"do_bench(block_until_ready) {wall:.4g} ms incl. dispatch and sync; "
                 f"jax {jax.__version__}")
    try:
        from jax.experimental.mosaic.gpu import profiler
        _, times = profiler.measure(f, iterations=n)(*args)
        if times is None:
            raise RuntimeError("CUPTI saw no kernel")
        times = times if isinstance(times, list) else [times]
        return (float(statistics.median(times)),
                f"timed: CUPTI kernel time, median of {len(times)} calls; {wall_note}")
    except Exception as e:  # noqa: BLE001 - fall back to the blocking call's time
        cupti = why_failed(e)[:100]
    return wall, (f"timed: do_bench(block_until_ready), incl. JAX dispatch and host sync "
                  f"(CUPTI failed: {cupti}); jax {jax.__version__}")


def jax_fa3_setup(case, x, block_kv=JAX_BLOCK_KV):
    """JAX's shipped FA3 kernel on (B, N, H, d) copies, q pre-scaled by 1/sqrt(d)."""
    def setup():
        jax = import_jax()
        from jax.experimental.pallas.ops.gpu import attention_mgpu as am
        if "q_scaled" not in x.extra:            # the kernel applies no softmax scale
            x.extra["q_scaled"] = (x.q_bnhd * (1.0 / math.sqrt(case.d))).contiguous()
        args, copied = to_jax(x.extra["q_scaled"], x.k_bnhd, x.v_bnhd)
        fields = {f.name for f in dataclasses.fields(am.TuningConfig)}
        tried = []
        for bkv in jax_block_kv(case.N_q, block_kv):
            kw = dict(block_q=JAX_BLOCK_Q, block_kv=bkv, max_concurrent_steps=JAX_STEPS,
                      causal=case.causal)
            cfg = am.TuningConfig(**{k: v for k, v in kw.items() if k in fields})
            f = jax.jit(functools.partial(am.attention, config=cfg))
            try:
                o = jax.block_until_ready(f(*args))          # compiles: once per case
            except Exception as e:  # noqa: BLE001 - too much shared memory: the next block_kv
                if "shared memory" not in str(e):
                    raise
                tried.append(f"block_kv={bkv} does not fit")
                continue
            break
        else:
            raise RuntimeError("; ".join(tried) or f"no block_kv of {block_kv} divides N={case.N_q}")
        check = x.check(case.causal)(to_torch(o).transpose(1, 2))
        del o
        return functools.partial(f, *args), join_notes(
            f"block_q={JAX_BLOCK_Q} block_kv={bkv} max_concurrent_steps={JAX_STEPS} (JAX's "
            "first fit)", "; ".join(tried), f"(B, N, H, d) via DLPack, {copied}",
            "q pre-scaled by 1/sqrt(d)", check)
    return setup


def pallas_setup(case, x, solution):
    """The students' kernel at full size, compiled: ``fa3_pallas.fa3_kernel`` around the ch6
    solution's ``fa3_consumer`` with ``default_config``, as ``run_fa3`` builds it (run_fa3 is
    not timed: it transposes K and copies O to the host). K^T (B, H, d, N) is made once."""
    def setup():
        from . import fa3_pallas as mod
        consumer = solution().get("fa3_consumer")
        if consumer is None:
            raise RuntimeError("no Exercise 4 consumer (fa3_consumer) in the ch6 solution")
        jax = import_jax()
        B, H, N, d = case.B, case.H_q, case.N_q, case.d
        block_kv, stages = mod.default_config(d)
        f = jax.jit(mod.fa3_kernel(consumer, batch=B, heads=H, n_q=N, n_k=N, d=d,
                                   block_kv=block_kv, stages=stages, causal=case.causal,
                                   dtype=str(case.dtype).replace("torch.", "")))
        if "kT" not in x.extra:
            x.extra["kT"] = x.k.transpose(2, 3).contiguous()          # (B, H, d, N)
        args, copied = to_jax(x.q, x.extra["kT"], x.v)
        o = to_torch(jax.block_until_ready(f(*args)))            # compiles: once per case
        check = x.check(case.causal)(o)
        del o
        return functools.partial(f, *args), join_notes(
            f"block_kv={block_kv} stages={stages} (fa3_pallas.default_config); consumer "
            f"{consumer.__name__}", f"(B, H, N, d) and K^T via DLPack, {copied}", check)
    return setup
