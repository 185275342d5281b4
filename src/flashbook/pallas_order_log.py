"""The order log of the Pallas interpret-mode checks (``pallas_child.ORDER_DOC``), through JAX's
public API only, so it is the same on every JAX the checks run on.

``install(child)`` wraps ``plgpu.barrier_wait``, ``barrier_arrive``, ``copy_gmem_to_smem`` (its
barrier's arrival, counted to the issuing warpgroup) and ``wgmma`` with an *ordered*
``jax.debug.callback`` (in interpret mode each warpgroup is a thread that runs its callbacks in
program order), and ``plgpu.kernel``, to name the scratch refs by each ``Call``'s
``barrier_names`` and ``smem_names``. Phases are counted per warpgroup (its k-th wait on
``full[s]`` observed completion k), which holds for the book's kernels: a warpgroup that
arrives on a barrier arrives once per completion.
"""
from __future__ import annotations

import functools
import threading

__all__ = ["install", "base_names"]


def base_names(names) -> list[str]:
    """``["full[0]", "full[1]", "consumed[0]", "schedule"]`` -> ``["full", "consumed",
    "schedule"]``: one name per barrier array, in allocation order."""
    return list(dict.fromkeys(n.split("[", 1)[0] for n in names))


class _Names:
    """id(scratch ref traced in the kernel body) -> its name (the refs kept alive: their ids
    must not be reused while a kernel is traced)."""

    def __init__(self):
        self.refs: dict[int, tuple[object, str]] = {}
        self.thread_name = None

    def of(self, ref):
        base = getattr(ref, "ref", ref)          # a TransformedRef (``full.at[s]``) or the ref
        hit = self.refs.get(id(base))
        return None if hit is None or hit[0] is not base else hit[1]


def _slot(ref):
    """The barrier's index in its array (``full.at[slot]``), a traced or Python int, or None."""
    for t in getattr(ref, "transforms", ()) or ():
        indices = getattr(t, "indices", None)
        if indices:
            i = indices[0]
            return None if hasattr(i, "start") and hasattr(i, "size") else i   # a Slice
    return None


def install(child) -> bool:
    """Wrap the four operations and ``plgpu.kernel`` (module attributes, looked up at call
    time). Returns False where this JAX lacks one of them (no log then)."""
    try:
        import jax
        import jax.numpy as jnp
        from jax import lax
        import jax.experimental.pallas.mosaic_gpu as plgpu
        originals = {n: getattr(plgpu, n) for n in
                     ("kernel", "barrier_wait", "barrier_arrive", "copy_gmem_to_smem", "wgmma")}
    except Exception:  # noqa: BLE001 - no JAX, or another API: no order log
        return False
    try:     # the messages name the student's line, not these wrappers' (where JAX has it)
        from jax._src import source_info_util
        source_info_util.register_exclusion(__file__)
    except Exception:  # noqa: BLE001
        pass
    names, lock, counts = _Names(), threading.Lock(), {}

    def record(op, name, thread, slot, **extra):
        thread, slot = int(thread), int(slot)
        barrier = None if name is None else name if slot < 0 else f"{name}[{slot}]"
        entry = dict(op=op, thread=thread, **extra)
        if op != "mma":
            with lock:
                key = (child.call, op, thread, barrier)      # counted per call
                counts[key] = counts.get(key, 0) + 1
            entry.update(barrier=barrier, phase=counts[key])
        child.log(**entry)

    def note(op, ref=None, **extra):
        """Trace an ordered callback that logs ``op`` on the barrier ``ref``."""
        try:
            if names.thread_name is None or child.order is None:
                return
            name = None if ref is None else names.of(ref)
            slot = None if ref is None else _slot(ref)
            slot = jnp.asarray(-1 if slot is None else slot, jnp.int32)
            jax.debug.callback(functools.partial(record, op, name, **extra),
                               lax.axis_index(names.thread_name), slot, ordered=True)
        except Exception:  # noqa: BLE001 - bookkeeping must never break the kernel
            pass

    def kernel(body, *args, scratch_types=(), thread_name=None, **kw):
        scratch = list(scratch_types or ())
        kinds = ["barrier" if type(t).__name__ == "Barrier" else "smem" for t in scratch]

        @functools.wraps(body)
        def named_body(*refs):
            call = child.job["calls"][child.call] if child.call is not None else {}
            given = {"barrier": iter(base_names(call.get("barrier_names", []))),
                     "smem": iter(call.get("smem_names", []))}
            names.refs.clear()
            names.thread_name = thread_name
            for ref, kind in zip(refs[len(refs) - len(scratch):], kinds):
                names.refs[id(ref)] = (ref, next(given[kind], None))
            return body(*refs)

        return originals["kernel"](named_body, *args, scratch_types=scratch_types,
                                   thread_name=thread_name, **kw)

    def barrier_wait(barrier, *a, **k):
        out = originals["barrier_wait"](barrier, *a, **k)
        note("wait", barrier)
        return out

    def barrier_arrive(barrier, *a, **k):
        note("arrive", barrier)
        return originals["barrier_arrive"](barrier, *a, **k)

    def copy_gmem_to_smem(src, dst, barrier=None, *a, **k):
        if barrier is not None:
            note("arrive", barrier)
        return originals["copy_gmem_to_smem"](src, dst, barrier, *a, **k)

    def wgmma(acc, a, b=None, *rest, **k):
        note("mma", None, a=names.of(a), b=names.of(b))
        return originals["wgmma"](acc, a, b, *rest, **k)

    for fn in (kernel, barrier_wait, barrier_arrive, copy_gmem_to_smem, wgmma):
        functools.update_wrapper(fn, originals[fn.__name__], updated=())
        setattr(plgpu, fn.__name__, fn)
    return True
