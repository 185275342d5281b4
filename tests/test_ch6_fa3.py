"""Chapter 6, Exercise 4: the consumer warpgroups of the FA3-shaped Pallas Mosaic GPU kernel
(``flashbook.chapters.ch6.fa3_pallas``), graded in JAX's interpret mode by ``fa3_checks`` on
``interpret.py``'s harness (a child process with a time limit, a deadlock watchdog and the race
detector, here also told what each wgmma reads up to its wait).

The solution passes the visible and the hidden check; each known-wrong consumer fails for its
own reason (a numeric bug the check names, a data race on K^T or V, a deadlock); a hang fails
within the time limit even without the deadlock detector; the float64 simulation of the kernel's
arithmetic agrees with the reference and tells the classic bugs apart. The solution and the
variants are the notebook's (grade id ``ch6_fa3_consumer``) once the chapter carries the cell;
until then this file carries its own copy. Slow tests (``-m slow``): every variant, the hidden
cases, the time limit, ``run_fa3`` in interpret mode.
"""
from __future__ import annotations

import importlib.util
import itertools
import linecache
import time

import numpy as np
import pytest

from flashbook import sources
from flashbook.check import CheckFailure
from flashbook.contract import Variant
from flashbook.chapters.ch6 import fa3_checks, fa3_pallas, interpret

needs_jax = pytest.mark.skipif(interpret.jax_problem() is not None,
                               reason=f"needs JAX's interpret mode: {interpret.INSTALL}")
GRADE_ID = "ch6_fa3_consumer"

# A copy of the solution cell, used until the chapter's notebook has it.
_OWN_SOLUTION = '''\
def fa3_consumer(wg, q_smem, p_smem, kT_ring, v_ring, k_full, v_full, k_consumed, v_consumed,
                 schedule, *, steps: int, stages: int, scale: float, mask):
    """One consumer warpgroup of the FA3-shaped kernel.

    wg:          this warpgroup's index, 0 or 1 (a traced int32)
    q_smem:      SMEM ref (64, d): this warpgroup's Q tile (loaded)
    p_smem:      SMEM ref (64, block_kv): this warpgroup's staging buffer for P (fp16)
    kT_ring:     SMEM ref (stages, d, block_kv): K^T tiles; step j is in slot j % stages
    v_ring:      SMEM ref (stages, block_kv, d): V tiles, same slots
    k_full, v_full:          `stages` barriers each: the slot's K^T (V) tile has landed
    k_consumed, v_consumed:  `stages` barriers each, 2 arrivals: release the slot's K^T (V)
    schedule:    one barrier of 2 arrivals: the ping-pong between the two consumers
    steps, stages: Python ints; scale: float (applied to S = Q K^T in fp32)
    mask(s, step): s with -inf where a query may not see a key (causal), else s unchanged
    Returns (o, lse2): o (64, d) float32 = softmax(S) V for this tile's rows, and lse2 (64,)
    float32 = log2 of sum_j 2^(s_j), s in log2 units (the LSE in base 2).
    """
    ### BEGIN SOLUTION
    block_q, d = q_smem.shape
    block_kv = kT_ring.shape[2]
    log2e = math.log2(math.e)

    def schedule_barrier():                        # a rendezvous with the other consumer
        plgpu.barrier_arrive(schedule)
        plgpu.barrier_wait(schedule)

    pl.when(wg == 1)(schedule_barrier)             # warpgroup 1 starts half a step behind

    def step_fn(step, carry):
        acc, m, l = carry                          # (64, d), (64,), (64,): fp32, m in log2 units
        slot = lax.rem(step, stages)
        plgpu.barrier_wait(k_full.at[slot])        # K^T of this step has landed

        def qk(acc_ref):
            plgpu.wgmma(acc_ref, q_smem, kT_ring.at[slot])   # issue S = Q K^T (async)
            schedule_barrier()                     # the other's softmax ends while it runs
            return acc_ref[...]                    # wait for the wgmma, read S
        s = pl.run_scoped(qk, plgpu.ACC((block_q, block_kv), jnp.float32))
        plgpu.barrier_arrive(k_consumed.at[slot])  # K is free: the producer may refill it

        s = mask(s * (scale * log2e), step)        # log2 units: exp2(s) = e^(scale * S)
        m_new = jnp.maximum(m, s.max(axis=1))
        alpha = jnp.exp2(m - m_new)                # rescales what was summed with the old max
        p = jnp.exp2(s - m_new[:, None])
        l = l * alpha + p.sum(axis=1)
        acc = acc * alpha[:, None]
        p_smem[...] = p.astype(p_smem.dtype)       # P via SMEM (FA3 keeps it in registers)
        plgpu.commit_smem()                        # visible to the wgmma that reads it

        plgpu.barrier_arrive(schedule)             # my softmax is done
        plgpu.barrier_wait(v_full.at[slot])        # V of this step has landed
        plgpu.barrier_wait(schedule)               # the other has issued its GEMMs: my turn

        def pv(acc_ref):
            plgpu.wgmma(acc_ref, p_smem, v_ring.at[slot])    # issue P V (async)
            return acc_ref[...]                    # wait: V is no longer read after this
        acc = acc + pl.run_scoped(pv, plgpu.ACC((block_q, d), jnp.float32))
        plgpu.barrier_arrive(v_consumed.at[slot])  # V is free
        return acc, m_new, l

    init = (jnp.zeros((block_q, d), jnp.float32), jnp.full((block_q,), -jnp.inf, jnp.float32),
            jnp.zeros((block_q,), jnp.float32))
    acc, m, l = lax.fori_loop(0, steps, step_fn, init)
    pl.when(wg == 0)(schedule_barrier)             # balance warpgroup 1's extra rendezvous
    return acc / l[:, None], m + jnp.log(l) * log2e       # O, and log2(l) = ln(l) log2(e)
    ### END SOLUTION'''


# (name, edits, text the failure must contain): the notebook's known-wrong variants (a copy of
# those in the chapter's variants.py, used until it has them)
_OWN_VARIANTS = (
    Variant('fa3_no_rescale', GRADE_ID, (
        ('        acc = acc * alpha[:, None]\n', ''),
    ), expect='not rescaled'),
    Variant('fa3_natural_exp', GRADE_ID, (
        ('p = jnp.exp2(s - m_new[:, None])', 'p = jnp.exp(s - m_new[:, None])'),
    ), expect='P = exp(s - m)'),
    Variant('fa3_no_log2e', GRADE_ID, (
        ('s * (scale * log2e)', 's * scale'),
    ), expect='not multiplied by log2(e)'),
    Variant('fa3_skips_k_full_wait', GRADE_ID, (
        ('        plgpu.barrier_wait(k_full.at[slot])        # K^T of this step has landed\n',
         ''),
    ), expect='data race on kT_ring'),
    Variant('fa3_releases_v_before_pv_wait', GRADE_ID, (
        ('            plgpu.wgmma(acc_ref, p_smem, v_ring.at[slot])    # issue P V (async)\n',
         '            plgpu.wgmma(acc_ref, p_smem, v_ring.at[slot])    # issue P V (async)\n'
         '            plgpu.barrier_arrive(v_consumed.at[slot])\n'),
        ('        plgpu.barrier_arrive(v_consumed.at[slot])  # V is free\n', ''),
    ), expect='data race on v_ring'),
    Variant('fa3_unbalanced_schedule', GRADE_ID, (
        ('    pl.when(wg == 0)(schedule_barrier)', '    pass'),
    ), expect='deadlock'),
    Variant('fa3_no_normalisation', GRADE_ID, (
        ('return acc / l[:, None],', 'return acc,'),
    ), expect='not divided by l'),
)


def _from_the_notebook():
    cells = sources.cells_by_id(sources.read(sources.source("ch6").path))
    if GRADE_ID not in cells:
        return _OWN_SOLUTION, _OWN_VARIANTS
    from flashbook.chapters.ch6 import variants
    mine = tuple(v for v in variants.VARIANTS if v.cell == GRADE_ID)
    return cells[GRADE_ID], mine or _OWN_VARIANTS


SOLUTION, VARIANTS = _from_the_notebook()
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


# ------------------------------------------------------------------ the solution and the stub

@needs_jax
def test_solution_passes_the_visible_check(capsys):
    start = time.monotonic()
    fa3_checks.check_fa3_consumer(define(SOLUTION))
    assert "PASSED FA3 consumer" in capsys.readouterr().out
    assert time.monotonic() - start < 60          # about 6-10 s on two busy cores


@needs_jax
@pytest.mark.slow
def test_solution_passes_the_hidden_check(capsys):
    fa3_checks.check_fa3_consumer(define(SOLUTION), hidden=True)
    assert capsys.readouterr().out == ""          # hidden runs are silent when they pass


def test_the_stub_is_not_implemented():
    stub = define(SOLUTION.split("    ### BEGIN")[0] + "    raise NotImplementedError()\n")
    with pytest.raises(CheckFailure, match="not implemented"):
        fa3_checks.check_fa3_consumer(stub)


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


# ------------------------------------------------------------------------- known-wrong

@needs_jax
def test_reading_k_before_its_barrier_is_a_race_naming_both_lines():
    source = variant("fa3_skips_k_full_wait")
    with pytest.raises(CheckFailure) as e:
        fa3_checks.check_fa3_consumer(define(source))
    message = str(e.value)
    assert message.startswith("FA3 consumer, case '"), message
    assert "data race on kT_ring[" in message, message
    wgmma = "plgpu.wgmma(acc_ref, q_smem, kT_ring.at[slot])"
    assert f"line {line_of(wgmma, source)} of your `fa3_consumer`: `{wgmma}`" in message, message
    assert "fa3_pallas.py line" in message and "plgpu.copy_gmem_to_smem(kT_gmem" in message
    assert "Hint: The QK^T wgmma read a K^T slot" in message, message


@needs_jax
@pytest.mark.slow
@pytest.mark.parametrize("v", VARIANTS, ids=[v.name for v in VARIANTS])
def test_known_wrong_consumer_fails_for_its_reason(v):
    with pytest.raises(CheckFailure) as e:
        fa3_checks.check_fa3_consumer(define(v.apply(SOLUTION)), hidden=True)
    message = str(e.value)
    assert v.expect in message, message
    assert message.startswith("FA3 consumer, case '"), message
    assert "NameError" not in message and "TypeError" not in message, message


@needs_jax
@pytest.mark.slow
def test_a_release_between_the_wgmma_and_its_wait_is_a_race():
    """The interpreter runs a wgmma at once; the check still flags a V release before the
    wgmma's wait (reading its accumulator), because on a GPU the tensor cores read V until then
    (``fa3_pallas.track_wgmma_reads``)."""
    with pytest.raises(CheckFailure) as e:
        fa3_checks.check_fa3_consumer(define(variant("fa3_releases_v_before_pv_wait")))
    message = str(e.value)
    wgmma = "plgpu.wgmma(acc_ref, p_smem, v_ring.at[slot])"
    assert "data race on v_ring[" in message and f"`{wgmma}`" in message, message
    assert "v_consumed was arrived on before the PV result was read" in message, message
    assert " O: " not in message                 # the values are right: only the race shows


@needs_jax
@pytest.mark.slow
def test_a_hang_fails_within_the_time_limit_without_the_deadlock_detector():
    consumer = define(variant("fa3_unbalanced_schedule"))
    start = time.monotonic()
    with pytest.raises(CheckFailure) as e:
        fa3_checks.check_fa3_consumer(consumer, timeout=12, stall=None)
    assert time.monotonic() - start < 50
    message = str(e.value)
    assert "did not finish within the time limit" in message, message
    assert "`plgpu.barrier_wait(schedule)`" in message, message


# ----------------------------------------------------------- the arithmetic and the messages

def _problem(n_k=256, d=64, causal=False, seed=3):
    case = fa3_checks.Fa3Case(n_k, d=d, causal=causal)
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
