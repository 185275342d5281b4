"""Chapter 6 benchmark, phase 2: the setups of the rows JAX times (``benchmark`` describes the
run and measures them). The students' Pallas Mosaic GPU kernel at full size and JAX's shipped
FA3 kernel, compiled for the GPU, on the torch inputs shared through DLPack (a ``benchmark.Case``
and its ``Inputs``), timed with JAX's own CUPTI profiler (``jax_time``)."""
from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import os
import statistics
import time

import torch

from flashbook.bench import join_notes, why_failed
from flashbook.results import GPU_TIMER

__all__ = ["jax_calls", "jax_block_kv", "jax_module", "to_jax", "to_torch", "jax_time",
           "jax_fa3_setup", "pallas_module", "find_consumer", "pallas_setup"]

# JAX's FA3 kernel, tuned as its own benchmark (attention_mgpu.main) tunes it
JAX_BLOCK_Q, JAX_BLOCK_KV, JAX_STEPS = 64, (256, 128, 64), 2
# JAX rows: CUPTI-timed calls to fill about JAX_TARGET_MS, at least/most JAX_CALLS
JAX_TARGET_MS, JAX_CALLS = 300.0, (10, 200)


def jax_calls(estimate_ms: float, target_ms: float | None = None, limits=None) -> int:
    """How many calls the CUPTI timing makes: enough to fill ``target_ms`` (default
    ``JAX_TARGET_MS``), within ``limits`` (default ``JAX_CALLS``)."""
    target_ms = JAX_TARGET_MS if target_ms is None else target_ms
    lo, hi = limits or JAX_CALLS
    if not estimate_ms > 0 or math.isinf(estimate_ms):
        return hi
    return int(min(hi, max(lo, round(target_ms / estimate_ms))))


def jax_block_kv(N: int, candidates=JAX_BLOCK_KV) -> list[int]:
    """The block_kv values JAX's FA3 kernel can take for N keys (N % block_kv == 0), in the
    order its benchmark tries them."""
    return [b for b in candidates if N % b == 0]


# ------------------------------------------------------------------ phase 2: JAX rows

def jax_module():
    """``jax``, its GPU client started without preallocating 75% of the GPU's memory."""
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jax
    import jax.dlpack  # noqa: F401
    return jax


def to_jax(t: torch.Tensor):
    """(JAX array on t's memory, shared) through DLPack, without a copy (copy=False raises if
    one would be needed); ``shared``: the buffer pointers agree."""
    import jax.dlpack
    try:
        x = jax.dlpack.from_dlpack(t, copy=False)
    except TypeError:                              # a JAX without the copy argument
        x = jax.dlpack.from_dlpack(t)
    try:
        shared = x.unsafe_buffer_pointer() == t.data_ptr()
    except Exception:  # noqa: BLE001 - only for the note
        shared = False
    return x, shared


def to_torch(o) -> torch.Tensor:
    """A JAX array (or a torch tensor, or the first of a tuple) as a torch tensor, no copy."""
    if isinstance(o, (tuple, list)):
        o = o[0]
    if isinstance(o, torch.Tensor):
        return o
    return torch.from_dlpack(o)


def jax_time(call: functools.partial) -> tuple[float, str]:
    """(ms, note) of ``call``, the jitted f (compiled already) with its arguments: CUPTI kernel
    time, median of n calls (``jax.experimental.mosaic.gpu.profiler.measure``), and do_bench of
    the blocking call as a cross-check; where CUPTI fails, the blocking call's time. The timer
    of the JAX rows' ``bench_setups.measure``."""
    import triton.testing
    f, args = call.func, call.args
    jax = jax_module()
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
        jax = jax_module()
        from jax.experimental.pallas.ops.gpu import attention_mgpu as am
        if "q_scaled" not in x.extra:            # the kernel applies no softmax scale
            x.extra["q_scaled"] = (x.q_bnhd * (1.0 / math.sqrt(case.d))).contiguous()
        if x.q.is_cuda:
            torch.cuda.synchronize()
        conv = [to_jax(t) for t in (x.extra["q_scaled"], x.k_bnhd, x.v_bnhd)]
        args = [a for a, _ in conv]
        fields = {f.name for f in dataclasses.fields(am.TuningConfig)}
        tried = []
        for bkv in jax_block_kv(case.N, block_kv):
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
            raise RuntimeError("; ".join(tried) or f"no block_kv of {block_kv} divides N={case.N}")
        check = x.check(case.causal)(to_torch(o).transpose(1, 2))
        del o
        return functools.partial(f, *args), join_notes(
            f"block_q={JAX_BLOCK_Q} block_kv={bkv} max_concurrent_steps={JAX_STEPS} (JAX's "
            "first fit)", "; ".join(tried), "(B, N, H, d) via DLPack, "
            + ("zero-copy" if all(s for _, s in conv) else "COPIED"),
            "q pre-scaled by 1/sqrt(d)", check)
    return setup


CONSUMER_KEYWORDS = {"steps", "stages", "scale", "mask"}   # what fa3_kernel passes its consumer


def pallas_module():
    """``fa3_pallas`` (the students' kernel around its given code), or a RuntimeError saying
    why not."""
    import importlib
    name = "flashbook.chapters.ch6.fa3_pallas"
    try:
        mod = importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name == name:
            raise RuntimeError("src/flashbook/chapters/ch6/fa3_pallas.py does not exist (yet)") \
                from None
        raise RuntimeError(f"fa3_pallas did not import: {why_failed(e)}") from None
    except Exception as e:  # noqa: BLE001 - its own import failed
        raise RuntimeError(f"fa3_pallas did not import: {why_failed(e)}") from None
    missing = [f for f in ("run_fa3", "fa3_kernel", "default_config")
               if not callable(getattr(mod, f, None))]
    if missing:
        raise RuntimeError(f"fa3_pallas has no {', '.join(missing)}")
    return mod


def find_consumer(*namespaces: dict):
    """The Exercise 4 consumer: the first function of these namespaces (the ch6 solution's,
    then ``fa3_pallas``'s) that takes the keywords ``fa3_kernel`` passes its consumer
    (``CONSUMER_KEYWORDS``); a name with "consumer" in it first. None if there is none."""
    for ns in namespaces:
        found = []
        for name, f in ns.items():
            if not inspect.isfunction(f) or name.startswith("_"):
                continue
            try:
                params = set(inspect.signature(f).parameters)
            except (TypeError, ValueError):
                continue
            if CONSUMER_KEYWORDS <= params:
                found.append((("consumer" not in name), name, f))
        if found:
            return sorted(found, key=lambda t: t[:2])[0][2]
    return None


def pallas_setup(case, x, solution):
    """The students' kernel at full size, compiled for the GPU: ``fa3_pallas.fa3_kernel`` with
    the ch6 solution's consumer and ``fa3_pallas.default_config``, as ``fa3_pallas.run_fa3``
    builds it; run_fa3 itself is not timed (it transposes K and copies O and the LSE to the
    host inside the call). K^T (B, H, d, N), which the kernel takes, is made once, not timed."""
    def setup():
        mod = pallas_module()
        consumer = find_consumer(solution(), vars(mod))
        if consumer is None:
            raise RuntimeError("no Exercise 4 consumer (a function taking "
                               f"{', '.join(sorted(CONSUMER_KEYWORDS))}) in the ch6 solution "
                               "or fa3_pallas")
        jax = jax_module()
        B, H, N, d = case.shape
        block_kv, stages = mod.default_config(d)
        f = jax.jit(mod.fa3_kernel(consumer, batch=B, heads=H, n_q=N, n_k=N, d=d,
                                   block_kv=block_kv, stages=stages, causal=case.causal,
                                   dtype=str(case.dtype).replace("torch.", "")))
        if "kT" not in x.extra:
            x.extra["kT"] = x.k.transpose(2, 3).contiguous()          # (B, H, d, N)
        if x.q.is_cuda:
            torch.cuda.synchronize()
        conv = [to_jax(t) for t in (x.q, x.extra["kT"], x.v)]
        args = [a for a, _ in conv]
        o = to_torch(jax.block_until_ready(f(*args)))            # compiles: once per case
        check = x.check(case.causal)(o)
        del o
        return functools.partial(f, *args), join_notes(
            f"block_kv={block_kv} stages={stages} (fa3_pallas.default_config); consumer "
            f"{consumer.__name__}", "(B, H, N, d) and K^T via DLPack, "
            + ("zero-copy" if all(s for _, s in conv) else "COPIED"), check)
    return setup
