"""Chapter 6, Exercise 1: the K/V ring, the given kernel around the student's producer.

FlashAttention-3's memory warpgroup streams K and V tiles from GMEM into a ring of SMEM slots;
the compute warpgroups read them. Two arrays of mbarriers keep the ring honest:

* ``full[s]`` (1 arrival: the TMA copy's) completes when the tile copied into slot ``s`` has
  landed; a consumer waits on it before reading the slot;
* ``consumed[s]`` (one arrival per consumer warpgroup) completes when every consumer is done
  with the tile in slot ``s``; the producer waits on it before refilling the slot.

Tile ``i`` of ``steps`` goes into slot ``i % stages``. Here the "tiles" are ``(block, cols)``
float32 blocks of one GMEM array ``kv`` of shape ``(steps * block, cols)``, and consumer ``c``
computes ``sum_i (1 + (c + 1) * i) * tile_i`` (exact in float32 for the small integers the checks
use), so a tile read from the wrong step changes the answer. The kernel is a single CTA with
``num_consumers + 1`` warpgroups: ``0 .. num_consumers - 1`` consume, the last one produces.

The student writes ``kv_producer(kv_gmem, ring, full, consumed, *, stages, steps, block)``.
Everything here runs in the check's child process (``pallas_interpret``): JAX is imported inside
the functions, so the module imports without it.
"""
from __future__ import annotations

import numpy as np

BLOCK, COLS = 64, 64        # one tile: (BLOCK, COLS) float32
SMEM_NAMES = ("ring", "out_smem")        # the SMEM scratch, in allocation order


def weights(num_consumers: int, steps: int) -> np.ndarray:
    """(num_consumers, steps): consumer c weighs tile i by 1 + (c + 1) * i."""
    c = np.arange(num_consumers)[:, None]
    return (1 + (c + 1) * np.arange(steps)[None, :]).astype(np.float32)


def reference(kv: np.ndarray, *, steps: int, num_consumers: int, block: int = BLOCK,
              **_) -> np.ndarray:
    """What the kernel must return: (num_consumers, block, cols)."""
    tiles = kv.reshape(steps, block, -1).astype(np.float64)
    return np.einsum("ci,ijk->cjk", weights(num_consumers, steps).astype(np.float64), tiles)


def barrier_names(stages: int) -> list[str]:
    """The kernel's barriers in allocation order (the scratch order below)."""
    return [f"full[{s}]" for s in range(stages)] + [f"consumed[{s}]" for s in range(stages)]


def thread_names(num_consumers: int) -> dict[int, str]:
    names = {c: f"consumer warpgroup {c}" for c in range(num_consumers)}
    names[num_consumers] = f"the producer (warpgroup {num_consumers})"
    return names


def kv_consumer(ring, full, consumed, out_smem, wg, *, stages: int, steps: int):
    """A consumer warpgroup: for each tile, wait until it has landed (``full``), read it into
    registers, fence (the read before the TMA's refill: two proxies), release the slot at once
    (``consumed``: like FA3's early K release), then accumulate. Returns the accumulator."""
    import jax.numpy as jnp
    from jax import lax
    import jax.experimental.pallas.mosaic_gpu as plgpu

    scale = (wg + 1).astype(jnp.float32)

    def step_fn(step, acc):
        slot = lax.rem(step, stages)
        plgpu.barrier_wait(full.at[slot])             # tile `step` has landed in `slot`
        tile = ring[slot]                             # SMEM -> registers (generic proxy)
        # The refill is a TMA write (the async proxy): a proxy fence orders this thread's read
        # before it, or the copy may overwrite the slot under the read (JAX >= 0.11 checks it).
        plgpu.commit_smem()
        plgpu.barrier_arrive(consumed.at[slot])       # done with the slot: it may be refilled
        return acc + tile * (1.0 + scale * step.astype(jnp.float32))

    acc = lax.fori_loop(0, steps, step_fn, jnp.zeros(out_smem.shape, jnp.float32))
    out_smem[...] = acc
    return acc


def ring_kernel(kv_producer, *, stages: int, steps: int, num_consumers: int = 2,
                block: int = BLOCK, cols: int = COLS, consumer=None, interpret=None):
    """``kv (steps * block, cols) -> (num_consumers, block, cols)``; ``consumer`` replaces
    ``kv_consumer`` (tests pass broken ones); ``interpret``: ``InterpretGPUParams`` or None."""
    import jax
    import jax.numpy as jnp
    from jax import lax
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    consume = consumer or kv_consumer

    def body(kv_gmem, out_gmem, ring, out_smem, full, consumed):
        wg = lax.axis_index("wg")

        @pl.when(wg == num_consumers)                 # the producer warpgroup
        def _produce():
            kv_producer(kv_gmem, ring, full, consumed, stages=stages, steps=steps, block=block)

        @pl.when(wg < num_consumers)                  # the consumer warpgroups
        def _consume():
            mine = out_smem.at[wg]
            consume(ring, full, consumed, mine, wg, stages=stages, steps=steps)
            plgpu.commit_smem()                       # registers -> SMEM visible to the TMA
            plgpu.copy_smem_to_gmem(mine, out_gmem.at[wg])
            plgpu.wait_smem_to_gmem(0)

    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((num_consumers, block, cols), jnp.float32),
        scratch_types=[
            plgpu.SMEM((stages, block, cols), jnp.float32),           # the ring
            plgpu.SMEM((num_consumers, block, cols), jnp.float32),    # output staging
            plgpu.Barrier(num_barriers=stages),                       # full[s]: 1 arrival (TMA)
            plgpu.Barrier(num_arrivals=num_consumers, num_barriers=stages),   # consumed[s]
        ],
        num_threads=num_consumers + 1, thread_name="wg", interpret=interpret)
    return kernel


def run_ring(kv_producer, kv, *, stages: int, steps: int, num_consumers: int = 2,
             consumer=None, detect_races: bool = True, tma_threads: int = 4) -> dict:
    """The check's target (run in the child process by ``pallas_interpret.run``)."""
    import jax
    import jax.numpy as jnp

    from ... import pallas_interpret as interpret

    kv = np.asarray(kv, np.float32)
    params = interpret.params(num_consumers + 1, detect_races, tma_threads)
    fn = ring_kernel(kv_producer, stages=stages, steps=steps, num_consumers=num_consumers,
                     block=kv.shape[0] // steps, cols=kv.shape[1], consumer=consumer,
                     interpret=params)
    return {"out": np.asarray(jax.block_until_ready(fn(jnp.asarray(kv))))}
