"""Chapter 6, Exercise 1: the K/V ring's producer in Pallas Mosaic GPU interpret mode, and the
harness that runs it (``flashbook.pallas_interpret``): a fresh process from the fork server,
with a time limit and a deadlock detector, the race detector on.

The solution passing and each known-wrong producer losing points are the chapter contract's
tests (tests/test_chapters.py); these test the harness: a race report names both lines, a
consumer that reads before its barrier is caught, a hang becomes a failed check within the
time limit even with the deadlock detector off, an error names the student's line, without
JAX the check says how to install it, the prefetch check reads the producer's order log, and a
script that runs the check as it is imported is told to guard it.
"""
from __future__ import annotations

import importlib.util
import itertools
import linecache
import subprocess
import sys
from multiprocessing import forkserver

import numpy as np
import pytest

from flashbook import pallas_interpret as interpret
from flashbook import sources
from flashbook.chapters.ch6 import ring, ring_checks
from flashbook.check import CheckFailure
from flashbook.pipeline_types import Ring

needs_jax = pytest.mark.skipif(interpret.jax_problem() is not None,
                               reason=f"needs JAX's interpret mode: {interpret.INSTALL}")

# The solution cell, from the chapter's notebook: defined from source with no JAX import in
# this process (the check's child process provides pl, plgpu and lax).
_CELLS_OF_THE_NOTEBOOK = sources.cells_by_id(sources.read(sources.source("ch6").path))
SOLUTION = _CELLS_OF_THE_NOTEBOOK['ch6_ring_producer']


def line_of(code: str) -> int:
    """The 1-based line of the solution cell on which ``code`` first appears."""
    return next(i for i, line in enumerate(SOLUTION.splitlines(), 1) if code in line)

# (name, old, new, text the failure must contain): the notebook's known-wrong variants
VARIANTS = [
    ("skips_consumed_wait", "plgpu.barrier_wait(consumed.at[slot])", "pass", "data race"),
    ("waits_on_wrong_slot", "consumed.at[slot]", "consumed.at[lax.rem(step + 1, stages)]",
     "hung"),
    ("waits_before_first_fill", "@pl.when(step >= stages)", "@pl.when(step >= 0)",
     "deadlock"),
    ("no_drain", "plgpu.barrier_wait(consumed.at[step % stages])", "pass",
     "must wait for every one of its phases"),
    ("copy_signals_wrong_barrier", "ring.at[slot], full.at[slot])",
     "ring.at[slot], full.at[lax.rem(step + 1, stages)])", "data race"),
    ("loads_wrong_tile", "pl.ds(step * block, block)", "pl.ds(slot * block, block)",
     "result is wrong"),
]

_CELLS = itertools.count()


def define(source: str, name: str = "kv_producer", **globals_):
    """Run ``source`` as a notebook cell would (its text in linecache); return ``name``."""
    filename = f"<test_ch6_ring cell {next(_CELLS)}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    ns = {"__name__": "test_ch6_ring_cells", **globals_}
    exec(compile(source, filename, "exec"), ns)
    return ns[name]


def variant(old: str, new: str) -> str:
    assert SOLUTION.count(old) == 1, old
    return SOLUTION.replace(old, new)


@needs_jax
def test_race_report_names_both_lines():
    with pytest.raises(CheckFailure) as e:
        ring_checks.check_kv_ring(define(variant(*VARIANTS[0][1:3])))
    message = str(e.value)
    assert f"line {line_of('plgpu.copy_gmem_to_smem(')} of your `kv_producer`: " \
        "`plgpu.copy_gmem_to_smem(" in message, message
    assert "ring.py line" in message and "`tile = ring[slot]`" in message, message
    assert "Hint:" in message and "consumed" in message


EARLY_CONSUMER = '''\
def early_consumer(ring, full, consumed, out_smem, wg, *, stages, steps):
    def step_fn(step, acc):
        slot = lax.rem(step, stages)
        tile = ring[slot]                      # read before the barrier says it has landed
        plgpu.barrier_wait(full.at[slot])
        plgpu.barrier_arrive(consumed.at[slot])
        return acc + tile * (1.0 + (wg + 1).astype(jnp.float32) * step.astype(jnp.float32))
    out_smem[...] = lax.fori_loop(0, steps, step_fn, jnp.zeros(out_smem.shape, jnp.float32))
'''


@needs_jax
def test_a_consumer_that_reads_early_is_caught():
    """Exercise 4 hands the consumer to the student: the same harness catches an early read,
    even though the copy (eager in the interpreter) usually lands before it."""
    case = Ring(2, 4)
    call = ring_checks._call(case, 0)
    functions = {"kv_producer": define(SOLUTION),
                 "consumer": define(EARLY_CONSUMER, "early_consumer")}
    with pytest.raises(CheckFailure) as e:
        interpret.run_checked(ring_checks.TARGET, functions, [call], title="consumer")
    message = str(e.value)
    assert "data race on ring[" in message, message
    assert "line 4 of your `early_consumer`: `tile = ring[slot]`" in message, message


@needs_jax
@pytest.mark.timeout(120)        # a hang that the check's own limit misses fails here, not in CI's
def test_a_hang_fails_within_the_time_limit_without_the_deadlock_detector():
    producer = define(variant(*VARIANTS[2][1:3]))              # waits before the first fill
    # 3 s: the job reaches the wait about 1 s after it starts on a quiet machine, 1.5 s beside
    # two busy processes. On a machine so loaded that the job was still tracing the kernel when
    # its time ran out (no wait to report), once more with 10 s.
    for limit in (3, 10):
        with pytest.raises(CheckFailure) as e:
            ring_checks.check_kv_ring(producer, timeout=limit, stall=None)
        if " waits at line " in str(e.value):
            break
    message = str(e.value)
    assert "did not finish within the time limit" in message, message
    assert f"waits at line {line_of('plgpu.barrier_wait(consumed.at[slot])')} of your " \
        "`kv_producer`: `plgpu.barrier_wait(consumed.at[slot])`" in message, message
    # the fork server that forked the hung job (killed) forks the next one
    server = forkserver._forkserver._forkserver_pid
    assert server is not None
    ring_checks.check_kv_ring(define(SOLUTION))
    assert forkserver._forkserver._forkserver_pid == server


@needs_jax
def test_an_error_in_the_students_code_names_its_line():
    producer = define(variant("slot = lax.rem(step, stages)", "slot = lax.rem(step, n_slots)"))
    with pytest.raises(CheckFailure,
                       match=rf"line {line_of('slot = lax.rem(step, stages)')} of your "
                             r"`kv_producer`.*n_slots"):
        ring_checks.check_kv_ring(producer)


def test_without_jax_the_check_says_how_to_install_it(monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "jax" else find_spec(name, *a))
    with pytest.raises(CheckFailure) as e:
        ring_checks.check_kv_ring(define(SOLUTION))
    assert "jax is not installed" in str(e.value) and interpret.INSTALL in str(e.value)


def test_the_messages_quote_the_function_and_the_helpers_it_calls():
    helper = define("def tile_rows(i, block):\n    return i * block\n", "tile_rows")
    fn = define("def producer(x):\n    return np_(tile_rows(x, 2)) + CONST\n", "producer",
                np_=np.asarray, tile_rows=helper, CONST=1)
    sources = interpret.sources({"kv_producer": fn})
    assert [(s.name, s.defines) for s in sources] == [("kv_producer", "producer"),
                                                      ("tile_rows", "tile_rows")]
    first = sources[0]
    assert first.line(first.firstlineno + 1) == "return np_(tile_rows(x, 2)) + CONST"
    assert interpret.where(dict(file=first.filename, line=2), sources) == \
        "line 2 of your `producer`: `return np_(tile_rows(x, 2)) + CONST`"


def test_reference_is_the_weighted_sum():
    kv = np.arange(3 * 2 * 2, dtype=np.float32).reshape(6, 2)
    out = ring.reference(kv, steps=3, num_consumers=2, block=2)
    tiles = kv.reshape(3, 2, 2)
    assert np.array_equal(out[0], tiles[0] + 2 * tiles[1] + 3 * tiles[2])
    assert np.array_equal(out[1], tiles[0] + 3 * tiles[1] + 5 * tiles[2])



# ------------------------------------------------------------- the producer's order

def _producer_log(stages: int, steps: int, prefetch: bool = True) -> list[dict]:
    """The producer's entries of an order log: its waits on consumed and its copies (arrivals
    on full), in its program order; ``prefetch=False`` waits for each tile's release right
    after copying it."""
    log = []
    for i in range(steps):
        slot, copy = i % stages, dict(op="arrive", thread=2, barrier=f"full[{i % stages}]",
                                      phase=i // stages + 1)
        release = dict(op="wait", thread=2, barrier=f"consumed[{slot}]")
        if prefetch:
            if i >= stages:
                log.append(dict(release, phase=(i - stages) // stages + 1))
            log.append(copy)
        else:
            log += [copy, dict(release, phase=i // stages + 1)]
    return log


def test_a_producer_that_waits_after_each_copy_did_not_prefetch():
    case = Ring(3, 8)
    ring_checks._prefetch(case, {"order": _producer_log(3, 8)})
    ring_checks._prefetch(case, {"order": None})              # no log (another JAX): skipped
    with pytest.raises(CheckFailure, match="the producer did not prefetch") as e:
        ring_checks._prefetch(case, {"order": _producer_log(3, 8, prefetch=False)})
    assert "copy of tile 1 only after waiting for the consumers to release tile 0" in \
        str(e.value)


@needs_jax
def test_the_order_log_of_a_real_run_is_the_producers_program_order():
    """The order log comes from the interpreter's run itself (``pallas_order_log``: ordered debug
    callbacks beside the public barrier operations, the same on every JAX): the solution's
    producer logs its copies and waits in program order, with the slots and phases the
    schedule gives them, then its drain; each consumer logs one wait per tile."""
    case = Ring(3, 8)
    call = ring_checks._call(case, 6)
    (out,) = interpret.run_checked(ring_checks.TARGET, {"kv_producer": define(SOLUTION)}, [call],
                                   title="order log", hint=lambda *a: "",
                                   timeout=interpret.TIMEOUT_S, stall=interpret.STALL_S)
    order = out["order"]
    producer = [e for e in order if e["thread"] == 2]
    want = _producer_log(3, 8)
    assert producer[:len(want)] == want
    assert producer[len(want):] == [dict(op="wait", thread=2, barrier=f"consumed[{i % 3}]",
                                         phase=i // 3 + 1) for i in range(5, 8)]   # the drain
    for c in (0, 1):
        waits = [e for e in order if e["thread"] == c and e["op"] == "wait"]
        assert [(e["barrier"], e["phase"]) for e in waits] == \
            [(f"full[{i % 3}]", i // 3 + 1) for i in range(8)]


UNGUARDED_SCRIPT = '''
import flashbook as fb
fb.setup(verbose=False)
from flashbook.chapters.ch6 import ring_checks
from flashbook.check import CheckFailure


def kv_producer(*args):
    pass


try:
    ring_checks.check_kv_ring(kv_producer)
except CheckFailure as e:
    print("CHECK FAILED:", e)
'''


@needs_jax
@pytest.mark.slow
def test_a_script_that_runs_the_check_unguarded_is_told_to_guard_it(tmp_path):
    """A plain script that calls the check as it is imported: the fork server imports it again
    and stops; the check says to put the call under ``if __name__ == "__main__":``."""
    script = tmp_path / "my_ring.py"
    script.write_text(UNGUARDED_SCRIPT)
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                         text=True, timeout=300).stdout
    assert "CHECK FAILED: K/V ring: the check's process ended before it ran your kernel" in out
    assert 'if __name__ == "__main__":' in out
