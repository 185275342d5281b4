"""Chapter 6, Exercise 1's check: the K/V ring's producer, run in JAX's Mosaic GPU interpret
mode (``interpret``) with the race detector on, for several ring depths, tile counts and
consumer counts: exact sums, no race, no barrier misuse, no hang. It must also prefetch: in the
producer's order log the copy of tile i may follow the release of tile i - stages, no later."""
from __future__ import annotations

import numpy as np

from flashbook.check import CheckFailure, report, require_implemented
from flashbook.pipeline_types import Ring

from . import interpret, ring

TARGET = "flashbook.chapters.ch6.ring:run_ring"
TITLE = "K/V ring"


def ring_cases(hidden: bool = False) -> list[Ring]:
    cases = [Ring(3, 8, why="slots refilled once or twice: the tiles do not divide evenly"),
             Ring(3, 2, why="fewer tiles than slots: nothing is refilled, the drain waits "
                                "for 2 releases, not 3")]
    if hidden:
        cases += [Ring(2, 5, why="a 2-slot ring, slots refilled twice"),
                  Ring(2, 7, 1, why="one consumer: consumed needs 1 arrival"),
                  Ring(2, 2, 1, why="exactly one tile per slot"),
                  Ring(3, 4, why="one refill")]
    return cases


def _inputs(case: Ring, seed: int) -> np.ndarray:
    """(steps * BLOCK, COLS) float32 small integers: every sum the kernel forms is exact."""
    rng = np.random.default_rng(seed)
    return rng.integers(-4, 5, size=(case.steps * ring.BLOCK, ring.COLS)).astype(np.float32)


def _call(case: Ring, seed: int) -> interpret.Call:
    return interpret.Call(case.describe(), {"kv": _inputs(case, seed)},
                          dict(stages=case.stages, steps=case.steps,
                               num_consumers=case.consumers),
                          thread_names=ring.thread_names(case.consumers),
                          barrier_names=ring.barrier_names(case.stages),
                          smem_names=ring.SMEM_NAMES)


_RULES = ("The producer's rules: (1) tile i goes into slot s = i % stages, copied by "
          "`plgpu.copy_gmem_to_smem(kv_gmem.at[pl.ds(i * block, block)], ring.at[s], "
          "full.at[s])`, so that it arrives on full[s], the barrier the consumers wait on before "
          "they read slot s; (2) before refilling slot s (tile i >= stages), "
          "`plgpu.barrier_wait(consumed.at[s])`: the consumers arrive there when they are done "
          "with tile i - stages; the first `stages` tiles go into empty slots, with nothing to "
          "wait for; (3) after the last copy, drain: wait on consumed[i % stages] for each of "
          "the last min(stages, steps) tiles i.")


def _hint(result: interpret.Run) -> str:
    """The rule the failure points at first, then all three."""
    kinds = {p["kind"] for p in result.problems}
    races = [r for c in result.calls for r in c["races"] if r.get("first")]
    later = {(r["second"]["kind"], r["first"]["kind"]) for r in races}
    error = (result.error or {}).get("message", "")
    if "Out of bound" in error or "out of bounds" in error.lower():
        lead = ("A copy reads past the end of kv_gmem: there are only `steps` tiles, so with "
                "fewer tiles than slots only min(stages, steps) slots are ever filled. ")
    elif ("write", "read") in later:
        lead = ("A copy refilled a slot that a consumer had not released: rule (2), and "
                "check that each wait is on the slot the copy then fills. ")
    elif ("read", "write") in later:
        lead = ("A consumer's read and the copy into that slot are not ordered: the copy "
                "arrives on another slot's full barrier, so the consumer's wait does not cover "
                "it and it reads early (rule 1), or the producer refilled the slot before the "
                "consumers released the tile in it (rule 2). ")
    elif "unobserved-phases" in kinds:
        lead = "The drain is missing or short: rule (3). "
    elif "completed-again" in kinds or "phase-passed" in kinds:
        lead = ("A barrier's arrivals and waits fell out of step: each refill of slot s "
                "waits once on consumed[s], for the release of the tile it replaces. ")
    elif result.status in ("stalled", "timeout", "killed"):
        lead = ("A wait that no arrival will ever complete: waiting on consumed[s] before the "
                "first `stages` copies deadlocks (the consumers are waiting for those tiles), "
                "and the drain waits for exactly min(stages, steps) releases. ")
    else:
        lead = ""
    return lead + _RULES


def check_kv_ring(kv_producer, hidden: bool = False, *, timeout: float | None = None,
                  stall: float | None = interpret.STALL_S):
    """Exercise 1: ``kv_producer`` streams the tiles through the ring (module docstring)."""
    require_implemented(kv_producer, "kv_producer")
    cases = ring_cases(hidden)
    seed = 60 if hidden else 6
    calls = [_call(c, seed + i) for i, c in enumerate(cases)]
    outs = interpret.run_checked(TARGET, {"kv_producer": kv_producer}, calls, title=TITLE,
                                 hint=_hint, timeout=timeout or interpret.TIMEOUT_S,
                                 stall=stall)
    for case, call, out in zip(cases, calls, outs):
        _compare(case, call, out)
        _prefetch(case, out)
    report(f"{TITLE} (Pallas Mosaic GPU, interpret mode, race detector on)", len(cases),
           interpret.unordered(outs, "the prefetch"), hidden=hidden)


def _prefetch(case: Ring, out: dict):
    """The copy of tile i must not wait for the release of a tile after i - stages (one tile in
    flight, not ``stages``). From the producer's order log: a wait on consumed[s] that observed
    completion p releases tile s + (p - 1) * stages; its n-th full arrival is its n-th copy."""
    order = out.get("order")
    if order is None:
        return
    producer = case.consumers                          # the last warpgroup
    released, copies = None, 0                         # the latest release it waited for
    for e in order:
        if e.get("thread") != producer or not e.get("barrier"):
            continue
        slot = int(e["barrier"].split("[")[1].rstrip("]"))
        if e["op"] == "wait" and e["barrier"].startswith("consumed"):
            tile = slot + (e["phase"] - 1) * case.stages
            released = tile if released is None else max(released, tile)
        elif e["op"] == "arrive" and e["barrier"].startswith("full"):
            tile, copies = copies, copies + 1
            if released is not None and released > tile - case.stages:
                raise CheckFailure(
                    f"{TITLE}, case {case.describe()}: the producer did not prefetch. It issued "
                    f"the copy of tile {tile} only after waiting for the consumers to release "
                    f"tile {released}, so at most {tile - released} of the {case.stages} slots "
                    f"of the ring held a tile in flight. The ring exists so that the TMA copies the next "
                    f"tiles while the consumers work on this one: waiting for each release "
                    f"before the next copy puts the whole copy latency back between two tiles, "
                    f"and the consumers stall on every full barrier. Issue the first `stages` "
                    f"copies at once; before copying tile i, wait only for the release of tile "
                    f"i - stages (consumed[i % stages]), and drain after the loop.")


def _compare(case: Ring, call: interpret.Call, out: dict | None):
    what = f"{TITLE}, case {case.describe()}"
    want = ring.reference(call.arrays["kv"], steps=case.steps, num_consumers=case.consumers)
    got = None if out is None else out.get("out")
    if got is None or got.shape != want.shape:
        raise CheckFailure(f"{what}: the kernel returned {None if got is None else got.shape}, "
                           f"expected shape {want.shape}.")
    for c in range(case.consumers):
        bad = np.argwhere(~(got[c] == want[c]))
        if len(bad):
            tiles = call.arrays["kv"].reshape(case.steps, ring.BLOCK, -1)
            w = ring.weights(case.consumers, case.steps)[c]
            culprit = _which_tiles(got[c], tiles, w)
            raise CheckFailure(
                f"{what}: consumer warpgroup {c}'s result is wrong at {len(bad)} of "
                f"{got[c].size} positions (first at row {bad[0][0]}, col {bad[0][1]}: "
                f"{got[c][tuple(bad[0])]:g}, expected {want[c][tuple(bad[0])]:g}).{culprit}\n"
                f"  Hint: consumer c sums (1 + (c + 1) * i) * tile_i over the tiles i in order; "
                f"a wrong sum means a slot held another tile than the one the consumer expected "
                f"when it read it: tile i is rows i * block ... (i + 1) * block - 1 of kv_gmem "
                f"and goes into slot i % stages.")


def _which_tiles(got: np.ndarray, tiles: np.ndarray, w: np.ndarray) -> str:
    """Name the wrong weights when a wrong sum is a weighted sum of the tiles (least squares)."""
    A = tiles.reshape(len(tiles), -1).T.astype(np.float64)
    coef, *_ = np.linalg.lstsq(A, got.reshape(-1).astype(np.float64), rcond=None)
    if not np.allclose(A @ coef, got.reshape(-1), atol=1e-3):
        return ""
    coef = np.round(coef, 3) + 0.0
    diff = [i for i in range(len(w)) if abs(coef[i] - w[i]) > 1e-3]
    if not diff:
        return ""
    shown = ", ".join(f"tile {i}: {coef[i]:g} (expected {w[i]:g})" for i in diff[:4])
    return f" As a sum of the tiles, its weights are wrong for {shown}."
