"""Chapter 6, Exercise 4: the consumer warpgroups of the FA3-shaped Pallas Mosaic GPU kernel
(``flashbook.chapters.ch6.fa3_pallas``), graded in JAX's interpret mode by ``fa3_checks`` on
``flashbook.pallas_interpret``'s harness (a child process with a time limit, a deadlock watchdog
and the race detector, here also told what each wgmma reads up to its wait).

The solution passing and each known-wrong consumer losing points are the chapter contract's
tests (tests/test_chapters.py: a read of K before its barrier and a release of V before the
wgmma's wait are reported as data races there); these test what is this exercise's own: the
float64 simulation of the kernel's arithmetic agrees with the reference and tells the classic
bugs apart, ``run_fa3`` in interpret mode returns a natural-log LSE (slow), and the two checks
that right values cannot pass read their inputs as they should (the ping-pong from an order log,
the fence from the traced kernel's unfenced reads).
"""
from __future__ import annotations

import importlib.util
import itertools
import json
import linecache

import numpy as np
import pytest

from flashbook import pallas_interpret as interpret
from flashbook import sources
from flashbook.check import CheckFailure
from flashbook.chapters.ch6 import fa3_checks, fa3_pallas

needs_jax = pytest.mark.skipif(interpret.jax_problem() is not None,
                               reason=f"needs JAX's interpret mode: {interpret.INSTALL}")
GRADE_ID = "ch6_fa3_consumer"

# The solution cell and its known-wrong variants, as the chapter has them.
SOLUTION = sources.cells_by_id(sources.read(sources.source("ch6").path))[GRADE_ID]
VARIANTS = tuple(v for v in sources.variants("ch6") if v.cell == GRADE_ID)
_CELLS = itertools.count()


def define(source: str, name: str = "fa3_consumer", **globals_):
    """Run ``source`` as a notebook cell would (its text in linecache); return ``name``."""
    filename = f"<test_ch6_fa3 cell {next(_CELLS)}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    ns = {"__name__": "test_ch6_fa3_cells", **globals_}
    exec(compile(source, filename, "exec"), ns)
    return ns[name]


def line_of(code: str, source: str = SOLUTION) -> int:
    """The 1-based line of ``source`` (the solution cell) on which ``code`` first appears."""
    return next(i for i, line in enumerate(source.splitlines(), 1) if code in line)


def variant(name: str) -> str:
    return next(v for v in VARIANTS if v.name == name).apply(SOLUTION)


def test_without_jax_the_check_says_how_to_install_it(monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "jax" else find_spec(name, *a))
    with pytest.raises(CheckFailure) as e:
        fa3_checks.check_fa3_consumer(define(SOLUTION))
    assert "jax is not installed" in str(e.value) and interpret.INSTALL in str(e.value)


def test_every_variant_edits_the_solution_once():
    assert len(VARIANTS) >= 2 and len({v.name for v in VARIANTS}) == len(VARIANTS)
    for v in VARIANTS:
        assert v.apply(SOLUTION) != SOLUTION, v.name      # raises if an edit misses


# ----------------------------------------------------------- the arithmetic and the messages

def _problem(n_k=256, d=64, causal=False, seed=3):
    case = fa3_checks.fa3_case(n_k, d=d, causal=causal)
    q, k, v = (x[0, 0] for x in fa3_checks._inputs(case, seed))
    return case, q, k, v


@pytest.mark.parametrize("causal", [False, True])
def test_the_tiled_simulation_is_the_reference(causal):
    case, q, k, v = _problem(causal=causal)
    o, lse = fa3_checks.simulate(q, k, v, block_kv=64, causal=causal)
    want_o, want_lse = fa3_pallas.reference(q, k, v, causal=causal)
    assert np.allclose(o, want_o, atol=1e-12) and np.allclose(lse, want_lse, atol=1e-12)


def test_reference_lse_is_natural_and_causal_is_bottom_right():
    q = np.zeros((2, 4))
    k = np.zeros((3, 4))
    v = np.arange(12, dtype=float).reshape(3, 4)
    o, lse = fa3_pallas.reference(q, k, v, causal=True)
    assert np.allclose(lse, [np.log(2), np.log(3)])       # row 0 sees keys 0-1, row 1 all 3
    assert np.allclose(o[0], v[:2].mean(0)) and np.allclose(o[1], v.mean(0))


@pytest.mark.parametrize("bug", fa3_checks.BUGS, ids=[b[0] for b in fa3_checks.BUGS])
def test_a_wrong_output_is_named_by_its_bug(bug):
    name, flags, text = bug
    case, q, k, v = _problem()
    call = fa3_checks._call(case, 3)
    got, _ = fa3_checks.simulate(q, k, v, block_kv=64, **flags)
    assert fa3_checks._diagnose(case, call, got).strip() == text
    right, _ = fa3_checks.simulate(q, k, v, block_kv=64)
    assert fa3_checks._diagnose(case, call, right) == ""


def test_a_wrong_lse_is_reported_in_natural_log():
    case, q, k, v = _problem()
    call = fa3_checks._call(case, 3)
    o, lse = fa3_pallas.reference(q, k, v)
    out = {"o": o[None, None].astype(np.float16),
           "lse2": (lse / np.log(2) - 1.0)[None, None].astype(np.float32)}   # off by 1 bit
    with pytest.raises(CheckFailure, match=r"LSE \(your lse2 times ln 2\)"):
        fa3_checks._compare(case, call, out)
    out["lse2"] = (lse / np.log(2))[None, None].astype(np.float32)
    fa3_checks._compare(case, call, out)


@needs_jax
def test_the_kernel_rejects_shapes_it_cannot_tile():
    for kw in (dict(n_q=100, n_k=128), dict(n_q=128, n_k=100), dict(n_q=256, n_k=128,
                                                                      causal=True)):
        with pytest.raises(ValueError):
            fa3_pallas.fa3_kernel(define(SOLUTION), batch=1, heads=1, d=64, **kw)


@needs_jax
def test_on_a_cpu_the_compiled_run_says_why_it_is_skipped():
    problem = fa3_pallas.sm90_problem()
    if problem is None:
        pytest.skip("this machine has a Hopper GPU")
    assert "GPU" in problem


@needs_jax
@pytest.mark.slow
def test_run_fa3_in_interpret_mode_returns_natural_log_lse():
    import math

    import jax.numpy as jnp
    from jax import lax
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu
    consumer = define(SOLUTION, math=math, jnp=jnp, lax=lax, pl=pl, plgpu=plgpu)
    rng = np.random.default_rng(5)
    q = rng.standard_normal((1, 1, 128, 64)).astype(np.float16)
    k, v = (rng.standard_normal((1, 1, 192, 64)).astype(np.float16) for _ in range(2))
    o, lse = fa3_pallas.run_fa3(consumer, q, k, v, causal=True, interpret=True)
    want_o, want_lse = fa3_pallas.reference(q[0, 0], k[0, 0], v[0, 0], causal=True)
    assert np.abs(o[0, 0] - want_o).max() < 2e-3
    assert np.abs(lse[0, 0] - want_lse).max() < 1e-3


# ------------------------------------------------- the schedule and the fence, from the logs

def _consumer_log(wg: int, steps: int, pingpong: bool = True) -> list[dict]:
    """A consumer's entries of an order log, as the solution makes them: its wgmmas and, with
    ``pingpong``, its arrivals and waits on the schedule barrier (the n-th of each counts
    towards, or observed, completion n: both warpgroups arrive equally often)."""
    log, count = [], {"arrive": 0, "wait": 0}

    def on_schedule(*ops):
        for op in ops if pingpong else ():
            count[op] += 1
            log.append(dict(op=op, thread=wg, barrier="schedule", phase=count[op]))

    if wg == 1:
        on_schedule("arrive", "wait")
    for _ in range(steps):
        log.append(dict(op="mma", thread=wg, a="q_smem", b="kT_ring"))
        on_schedule("arrive", "wait")                 # the rendezvous, while QK^T runs
        on_schedule("arrive", "wait")                 # softmax done; my turn
        log.append(dict(op="mma", thread=wg, a="p_smem", b="v_ring"))
    if wg == 0:
        on_schedule("arrive", "wait")
    return log


def test_the_gemm_blocks_must_take_turns_on_the_schedule_barrier():
    case = fa3_checks.fa3_cases()[0]
    fa3_checks._pingpong(case, {"order": _consumer_log(0, 6) + _consumer_log(1, 6)})
    fa3_checks._pingpong(case, {"order": None})               # no log (another JAX): skipped
    lockstep = _consumer_log(0, 6, False) + _consumer_log(1, 6, False)
    with pytest.raises(CheckFailure, match="do not take turns") as e:
        fa3_checks._pingpong(case, {"order": lockstep})
    assert "Consumer warpgroup 1 issued its first GEMM block" in str(e.value)


def test_a_missing_fence_names_the_store_and_the_read():
    case = fa3_checks.fa3_cases()[0]
    fa3_checks._fence(case, {"unfenced": "[]"})
    site = dict(file="<nowhere>", line=3, function="f")
    with pytest.raises(CheckFailure, match="the proxy fence is missing") as e:
        fa3_checks._fence(case, {"unfenced": json.dumps(
            [dict(store=site, read=dict(site, line=5), what="wgmma_ref")]), "shipped": []})
    assert "the wgmma at" in str(e.value) and "plgpu.commit_smem()" in str(e.value)
