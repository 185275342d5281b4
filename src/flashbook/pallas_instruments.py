"""Child-side instruments of JAX's GPU interpret mode (JAX 0.10.2, whose private modules they
wrap; on another JAX each declines to install): a check's target (``pallas_interpret``; Chapter
6's ``fa3_pallas.run_fa3_interpret``) installs them in the job process before it runs a kernel.
``share_thread_compiles`` compiles each interpreted kernel once, not once per warpgroup;
``track_wgmma_reads`` tells the race detector what a wgmma reads. Neither changes what runs.
"""
from __future__ import annotations

_INSTALLED: set = set()            # the child-side instruments installed in this process


def share_thread_compiles() -> bool:
    """(Child side.) Compile each interpreted kernel once, not once per warpgroup: JAX 0.10.2's
    interpret mode has every warpgroup's thread XLA-compile the same jaxpr for itself
    (``thread_map._run_jaxpr``: three ~1 s compiles on two cores against ~0.5 s of
    interpreting); here the others reuse the first's executable (the warpgroup id is an
    argument). What runs is unchanged. Returns whether installed."""
    if "share" in _INSTALLED:
        return True
    try:
        import inspect
        import threading
        import jax
        import jax.core as jax_core
        from jax._src.pallas.mosaic.interpret import thread_map
        run0 = thread_map._run_jaxpr
        if list(inspect.signature(run0).parameters) != ["jaxpr", "consts", "args"] or \
                ".lower().compile()" not in inspect.getsource(run0):
            return False
    except Exception:  # noqa: BLE001 - another JAX: leave it alone
        return False
    compiled: dict = {}
    lock = threading.Lock()

    def _eval(jaxpr, consts, *args):
        jax_core.eval_jaxpr(jaxpr, consts, *args)

    def _run_jaxpr(jaxpr, consts, *args):
        with lock:
            entry = compiled.get(id(jaxpr))
            if entry is None:           # keep ``jaxpr`` alive so that its id is not reused
                exe = jax.jit(_eval, static_argnums=(0,)).trace(jaxpr, consts, *args) \
                    .lower().compile()
                entry = compiled[id(jaxpr)] = (exe, jaxpr)
        entry[0](consts, *args)

    thread_map._run_jaxpr = _run_jaxpr
    _INSTALLED.add("share")
    return True


def track_wgmma_reads() -> bool:
    """(Child side.) Race-check what a wgmma reads: JAX 0.10.2's interpret mode reads its SMEM
    operands without telling the race detector (a TODO in ``gpu_callbacks.wgmma``), so a QK^T
    before K's wait or a V release under its PV would pass unseen. A wgmma may read its operands
    until the warpgroup waits for it (in Pallas: reads the accumulator), so each operand is
    checked as a read at the issue and again at that wait. Values and barriers are unchanged.
    Returns whether installed (False on another JAX: those races then go unseen)."""
    if "track" in _INSTALLED:
        return True
    try:
        import inspect
        import threading
        import jax
        from jax._src.pallas.mosaic.interpret import vector_clock as vc
        from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks as gc
        issue0, wait0 = gc.wgmma, gc.wgmma_accumulator_deref
        want_issue = {"token", "device_id", "thread_id", "a_allocation_key_as_array",
                      "a_transforms", "b_allocation_key_as_array", "b_transforms", "source_info"}
        if not (want_issue <= set(inspect.signature(issue0).parameters)
                and {"device_id", "thread_id"} <= set(inspect.signature(wait0).parameters)
                and hasattr(gc, "_remove_noop_transforms") and hasattr(gc, "HostAllocationKey")
                and hasattr(gc.interpret_utils, "to_range")):
            return False
    except Exception:  # noqa: BLE001 - another JAX
        return False

    pending: dict = {}                      # (device, thread) -> [(key, range, source_info)]
    lock = threading.Lock()

    def check(device_id, thread_id, reads):
        mem = gc._get_shared_memory()
        if not mem.detect_races:
            return
        gtid = mem.get_global_thread_id(device_id, thread_id)
        with mem.lock:
            vc.inc_vector_clock(mem.clocks[gtid], gtid)
            clock = vc.copy_vector_clock(mem.clocks[gtid])
        for key, rnge, info in reads:
            gc.get_races().check_read(device_id, thread_id, clock, key, rnge, source_info=info)

    def wgmma(**kw):
        try:
            device_id, thread_id = int(kw["device_id"]), int(kw["thread_id"])
            reads = []
            for x in ("a", "b"):
                key = gc.HostAllocationKey.from_array(kw[f"{x}_allocation_key_as_array"])
                noop_free = gc._remove_noop_transforms(kw[f"{x}_transforms"])
                transforms = jax.tree.map(int, noop_free)
                reads.append((key, gc.interpret_utils.to_range(transforms),
                              kw.get("source_info")))
            check(device_id, thread_id, reads)                     # read at the issue
            with lock:
                pending.setdefault((device_id, thread_id), []).extend(reads)
        except Exception:  # noqa: BLE001 - bookkeeping must never break the kernel
            pass
        return issue0(**kw)

    def wgmma_accumulator_deref(**kw):
        try:
            device_id, thread_id = int(kw["device_id"]), int(kw["thread_id"])
            with lock:
                reads = pending.pop((device_id, thread_id), [])
            check(device_id, thread_id, reads)                     # ... and up to the wait
        except Exception:  # noqa: BLE001
            pass
        return wait0(**kw)

    gc.wgmma, gc.wgmma_accumulator_deref = wgmma, wgmma_accumulator_deref
    _INSTALLED.add("track")
    return True
