"""Chapter 6, Exercise 2: the pipeline simulator (``flashbook.chapters.ch6.pipeline``), its graded
checks and its Gantt chart (``pipeline_checks``). CPU only, a few seconds.

Self-contained: the reference schedule below is the text of the exercise's two solution cells, and
the known-wrong variants are edits of that text, each of which must fail a check for its own
reason. The engine's hazard kinds are also provoked one by one with hand-made programs, and the
steady-state utilisation is compared with the FA3 model for several (g, s).
"""

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from flashbook.check import CheckFailure  # noqa: E402
from flashbook.chapters.ch6.pipeline import Pipeline, Timing, lockstep_model, \
    pingpong_model, simulate, single_model  # noqa: E402
from flashbook.chapters.ch6.pipeline_checks import check_pingpong, \
    check_ring_protocol, plot_gantt, steady_utilisation  # noqa: E402
from flashbook import sources  # noqa: E402
from flashbook.sources import exec_cell, fresh_module  # noqa: E402

# The exercise's solution cells, from the chapter's notebook.
_NOTEBOOK = sources.cells_by_id(sources.read(sources.source("ch6").path))
RING_CELL = _NOTEBOOK['ch6_pipeline_ring']

CONSUMER_CELL = _NOTEBOOK['ch6_pipeline_consumer']

# (name, cell, old, new, text the failure must contain): each old occurs once in its cell
VARIANTS = [
    ("consumed_expects_one_arrival", "ring",
     "arrivals=pipe.consumers)", "arrivals=1)", "one arrival per consumer"),
    ("producer_skips_the_consumed_wait", "ring",
     "        yield pipe.wait(consumed[slot], pipe.phase(step) ^ 1)\n", "",
     "did not wait on any barrier"),
    ("release_before_pv_reads_v", "consumer",
     "            yield pipe.pv(k - 1)"
     "                                    # reads V of step k - 1\n"
     "            yield pipe.arrive(consumed[pipe.slot(k - 1)])"
     "           # its slot may be refilled\n",
     "            yield pipe.arrive(consumed[pipe.slot(k - 1)])"
     "           # its slot may be refilled\n"
     "            yield pipe.pv(k - 1)"
     "                                    # reads V of step k - 1\n",
     "before its last read"),
    ("reads_before_the_full_wait", "consumer",
     "            yield pipe.wait(full[pipe.slot(k)], pipe.phase(k))      # step k has landed",
     "            pass", "Data not ready"),
    ("no_pingpong", "consumer",
     "            yield pipe.wait(turn[wg], (k + wg + 1) % 2)"
     "             # my turn (warpgroup 0 first)",
     "            pass", "shared the tensor core"),
    ("turn_not_passed_after_the_last_block", "consumer",
     "        if turn is not None:\n            yield pipe.arrive(turn[1 - wg])",
     "        if turn is not None and k < n:\n            yield pipe.arrive(turn[1 - wg])",
     "deadlock"),
]
CRASH = ("NameError", "SyntaxError", "IndentationError", "TypeError")
_names = iter(range(10**6))


def schedule(ring: str = RING_CELL, consumer: str = CONSUMER_CELL) -> tuple:
    """(make_barriers, producer, consumer) defined by executing the two cells, as a notebook
    would (registered in linecache, so the checks can read the source back)."""
    ns = fresh_module("ch6_pipeline_test").__dict__
    for source in (ring, consumer):
        exec_cell(source, f"<ch6 pipeline test cell {next(_names)}>", ns)
    return ns["make_barriers"], ns["producer"], ns["consumer"]


def first_failure(fns) -> CheckFailure | None:
    """Run the two graded cells' checks (visible, then hidden) as the autograder would: 2a's
    on make_barriers and producer, 2b's on all three."""
    for check, args in ((check_ring_protocol, fns[:2]), (check_pingpong, fns)):
        for hidden in (False, True):
            try:
                check(*args, hidden=hidden)
            except CheckFailure as e:
                return e
    return None


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


# ------------------------------------------------------------------ the exercise's checks

def test_reference_schedule_passes_every_check(capsys):
    assert first_failure(schedule()) is None
    out = capsys.readouterr().out
    assert "PASSED pipeline ring protocol" in out and "27/27" in out
    assert "PASSED ping-pong tensor-core utilisation: 3/3 cases (g = s: 100% with two consumers " \
           "taking turns, 50% with one)" in out


def test_stubs_fail_as_not_implemented():
    stub = ("    # YOUR CODE HERE\n    raise NotImplementedError()\n")
    ring, consumer = (cell.split("    ### BEGIN SOLUTION\n")[0] + stub
                      for cell in (RING_CELL.split("\n\n\ndef producer")[0], CONSUMER_CELL))
    ring += "\n\ndef producer(pipe, full, consumed):\n" + stub
    with pytest.raises(CheckFailure, match="make_barriers: not implemented"):
        check_ring_protocol(*schedule(ring, consumer)[:2])
    with pytest.raises(CheckFailure, match="make_barriers: not implemented"):
        check_pingpong(*schedule(ring, consumer))
    with pytest.raises(CheckFailure, match="consumer: not implemented"):
        check_pingpong(*schedule(RING_CELL, consumer))


def test_a_finished_ring_earns_its_points_with_the_consumer_still_a_stub(capsys):
    """2a is graded with the check's own consumers: a student who has done 2a but not 2b
    keeps 2a's points (and 2b's check says what is missing)."""
    stub = "    # YOUR CODE HERE\n    raise NotImplementedError()\n"
    consumer = CONSUMER_CELL.split("    ### BEGIN SOLUTION\n")[0] + stub
    make_barriers, producer, stubbed = schedule(RING_CELL, consumer)
    check_ring_protocol(make_barriers, producer)
    check_ring_protocol(make_barriers, producer, hidden=True)
    assert "PASSED pipeline ring protocol" in capsys.readouterr().out
    with pytest.raises(CheckFailure, match="consumer: not implemented"):
        check_pingpong(make_barriers, producer, stubbed)


@pytest.mark.parametrize("name, cell, old, new, expect", VARIANTS, ids=[v[0] for v in VARIANTS])
def test_known_wrong_variant_fails_for_its_reason(name, cell, old, new, expect):
    source = RING_CELL if cell == "ring" else CONSUMER_CELL
    assert source.count(old) == 1, f"{name}: the edit does not apply once"
    edited = source.replace(old, new)
    fns = schedule(edited, CONSUMER_CELL) if cell == "ring" else schedule(RING_CELL, edited)
    failure = first_failure(fns)
    assert failure is not None, f"{name} passed every check"
    message = str(failure)
    assert expect in message, message
    assert not any(c in message for c in CRASH), message
    if name == "no_pingpong":      # the ring itself is right: only the utilisation check fails
        check_ring_protocol(*fns[:2], hidden=True)
        assert "66.7%" in message and "100.0%" in message


def test_hardcoded_two_arrivals_deadlock_with_one_consumer_and_say_so():
    fns = schedule(RING_CELL.replace("arrivals=pipe.consumers)", "arrivals=2)"))
    with pytest.raises(CheckFailure, match=r"(?s)one consumer.*deadlock.*pipe\.consumers arrivals"):
        check_ring_protocol(*fns[:2])


# ---------------------------------------------------------------- the utilisation model

@pytest.mark.parametrize("qk, pv, softmax", [(1, 1, 2), (1, 1, 4), (2, 2, 1), (1, 2, 3),
                                             (0.5, 0.5, 5), (3, 3, 1), (1, 3, 2)])
def test_steady_utilisation_follows_the_fa3_model(qk, pv, softmax):
    fns = schedule()
    t = Timing(tma=2, qk=qk, pv=pv, softmax=softmax)
    g, s = t.gemm, t.softmax
    runs = {(consumers, pingpong): simulate(*fns, stages=3, n_steps=14, consumers=consumers,
                                            pingpong=pingpong, timing=t)
            for consumers, pingpong in ((2, True), (2, False), (1, False))}
    assert all(r.error is None for r in runs.values())
    assert steady_utilisation(runs[2, True]) == pytest.approx(pingpong_model(g, s), abs=1e-9)
    assert steady_utilisation(runs[2, False]) == pytest.approx(lockstep_model(g, s), abs=1e-9)
    assert steady_utilisation(runs[1, False]) == pytest.approx(single_model(g, s), abs=1e-9)
    assert not runs[2, True].shared()              # ping-pong: GEMMs never share the tensor cores
    assert runs[2, False].shared()                 # lockstep: every GEMM block is shared
    gemms = runs[2, True].gemm_spans()
    assert all(a.end <= b.start + 1e-9 for a, b in zip(gemms, gemms[1:]))


def test_models_at_g_equal_s():
    assert (pingpong_model(2, 2), single_model(2, 2)) == (1.0, 0.5)
    assert lockstep_model(2, 2) == pytest.approx(2 / 3)


# ------------------------------------------------------------------ the engine, by hazard

def run_programs(stages, n_steps, build, consumers=1, timing=None, **kw):
    """Run hand-made programs: build(pipe) -> {name: generator}."""
    pipe = Pipeline(stages, n_steps, consumers, timing or Timing(tma=3, qk=1, pv=1, softmax=2),
                    **kw)
    return pipe.run(build(pipe))


def parity_run(arrivals_first: int, parity: int):
    """A barrier with one arrival per phase: `arrivals_first` arrivals, then one wait."""
    def build(pipe):
        bar = pipe.barrier("b", 1)

        def arriver():
            for _ in range(arrivals_first):
                yield pipe.arrive(bar)

        def waiter():
            yield pipe.wait(bar, parity)
        return {"producer": arriver(), "consumer 0": waiter()}
    return run_programs(1, 1, build)


@pytest.mark.parametrize("completed, parity, passes", [
    (0, 1, True),       # a fresh barrier: parity 1 counts as completed (the phase "-1")
    (0, 0, False),      # ... and parity 0 waits for the first completion
    (1, 0, True),
    (1, 1, False),
    (2, 0, False),      # two completions later parity 0 waits again: parity is all there is
    (2, 1, True),
])
def test_parity_waits_as_on_hopper(completed, parity, passes):
    run = parity_run(completed, parity)
    if passes:
        assert run.error is None
    else:
        assert run.error.kind == "deadlock"
        assert f"b has completed {completed} phase(s)" in str(run.error)


def test_race_is_reported_even_when_timing_hides_it():
    """The consumer releases slot 0 before its QK reads K; the producer refills the slot at t=6,
    long after the read ended (t=4), but nothing orders the read before the write."""
    def build(pipe):
        full = [pipe.barrier(f"full[{s}]", 1) for s in range(2)]
        consumed = pipe.barrier("consumed[0]", 1)

        def producer():
            yield pipe.load(0, full[0])
            yield pipe.wait(consumed, 0)
            yield pipe.load(1, full[1])
            yield pipe.wait(full[1], 0)             # a delay of one TMA latency
            yield pipe.load(2, full[0])

        def consumer():
            yield pipe.wait(full[0], 0)
            yield pipe.arrive(consumed)             # released too early
            yield pipe.qk(0)
        return {"producer": producer(), "consumer 0": consumer()}

    run = run_programs(2, 3, build)
    assert run.error.kind == "overwrite" and run.error.time == 6
    assert "QK GEMM read at t=3" in str(run.error) and "still running" not in str(run.error)
    assert "before its last read" in str(run.error)


def test_unsynchronised_read_of_landed_data_is_not_ready():
    def build(pipe):
        full = [pipe.barrier(f"full[{s}]", 1) for s in range(2)]

        def producer():
            yield pipe.load(0, full[0])
            yield pipe.load(1, full[1])

        def consumer():
            yield pipe.wait(full[1], 0)             # the wrong slot's barrier
            yield pipe.qk(0)
        return {"producer": producer(), "consumer 0": consumer()}

    run = run_programs(2, 2, build)
    assert run.error.kind == "read before ready"
    assert "had landed (t=3)" in str(run.error) and "had not waited on full[0]" in str(run.error)


def test_read_of_a_step_never_loaded():
    def build(pipe):
        def producer():
            return
            yield

        def consumer():
            yield pipe.qk(0)
        return {"producer": producer(), "consumer 0": consumer()}

    run = run_programs(2, 2, build)
    assert run.error.kind == "read before ready" and "not even been issued" in str(run.error)


def test_phase_overrun():
    def build(pipe):
        bar = pipe.barrier("b", 1)

        def slow():
            yield pipe.wait(bar, 0)
            yield pipe.wait(bar, 1)

        def fast():
            for _ in range(3):                      # completes phases 0, 1, 2 at once
                yield pipe.arrive(bar)
        return {"producer": slow(), "consumer 0": fast()}

    run = run_programs(1, 1, build)
    assert run.error.kind == "phase overrun"
    assert "completed its phase 2" in str(run.error) and "producer" in str(run.error)


def test_deadlock_terminates_and_names_every_waiter():
    def build(pipe):
        a, b = pipe.barrier("a", 1), pipe.barrier("b", 1)

        def one():
            yield pipe.wait(a, 0)
            yield pipe.arrive(b)

        def two():
            yield pipe.wait(b, 0)
            yield pipe.arrive(a)
        return {"producer": one(), "consumer 0": two()}

    run = run_programs(1, 1, build)
    assert run.error.kind == "deadlock"
    assert "the producer waits on a" in str(run.error) and "consumer 0 waits on b" in str(run.error)


def test_runaway_is_capped():
    def build(pipe):
        bar = pipe.barrier("b", 1)

        def forever():
            while True:
                yield pipe.arrive(bar)
        return {"producer": forever()}

    run = run_programs(1, 1, build, max_actions=500)
    assert run.error.kind == "runaway"


def test_protocol_errors():
    def build_yield_number(pipe):
        def bad():
            yield 42
        return {"producer": bad()}
    assert "yielded 42, not an action" in str(run_programs(1, 1, build_yield_number).error)

    def build_unyielded(pipe):
        bar = pipe.barrier("b", 1)

        def forgot():
            pipe.wait(bar, 1)                       # made, not yielded
            yield pipe.arrive(bar)
        return {"producer": forgot()}
    error = run_programs(1, 1, build_unyielded).error
    assert error.kind == "protocol" and "never yielded" in str(error)

    def not_a_generator(pipe, full, consumed):
        return None
    make_barriers, _, consumer = schedule()
    error = simulate(make_barriers, not_a_generator, consumer, stages=2, n_steps=2).error
    assert error.kind == "protocol" and "not a generator" in str(error)


def test_dataflow_pv_needs_the_softmax():
    def build(pipe):
        full = pipe.barrier("full[0]", 1)

        def producer():
            yield pipe.load(0, full)

        def consumer():
            yield pipe.wait(full, 0)
            yield pipe.qk(0)
            yield pipe.pv(0)
        return {"producer": producer(), "consumer 0": consumer()}

    error = run_programs(1, 1, build).error
    assert error.kind == "dataflow" and "before softmax(0)" in str(error)


# ------------------------------------------------------------- early K release (E4.5)

def split_release(stages, n_steps, timing):
    """FA3's separate K and V barriers: K is released after the QK GEMM, V after the PV GEMM,
    and the producer refills each as soon as it is free."""
    pipe = Pipeline(stages, n_steps, 2, timing)
    slots = range(stages)
    k_full = [pipe.barrier(f"k_full[{s}]", 1) for s in slots]
    v_full = [pipe.barrier(f"v_full[{s}]", 1) for s in slots]
    k_free = [pipe.barrier(f"k_consumed[{s}]", 2) for s in slots]
    v_free = [pipe.barrier(f"v_consumed[{s}]", 2) for s in slots]
    turn = [pipe.barrier(f"turn[{wg}]", 1) for wg in range(2)]

    def producer():
        for step in range(n_steps):
            s, parity = pipe.slot(step), pipe.phase(step) ^ 1
            yield pipe.wait(k_free[s], parity)
            yield pipe.load(step, k_full[s], parts=("K",))
            yield pipe.wait(v_free[s], parity)
            yield pipe.load(step, v_full[s], parts=("V",))

    def consumer(wg):
        for k in range(n_steps + 1):
            if k < n_steps:
                yield pipe.wait(k_full[pipe.slot(k)], pipe.phase(k))
            yield pipe.wait(turn[wg], (k + wg + 1) % 2)
            if k > 0:
                yield pipe.wait(v_full[pipe.slot(k - 1)], pipe.phase(k - 1))
                yield pipe.pv(k - 1)
                yield pipe.arrive(v_free[pipe.slot(k - 1)])
            if k < n_steps:
                yield pipe.qk(k)
                yield pipe.arrive(k_free[pipe.slot(k)])
            yield pipe.arrive(turn[1 - wg])
            if k < n_steps:
                yield pipe.softmax(k)
    return pipe.run({"producer": producer(), "consumer 0": consumer(0), "consumer 1": consumer(1)})


def test_early_k_release_never_stalls_the_producer_more():
    fns = schedule()
    strictly = False
    for timing in (Timing(3, 1, 1, 2), Timing(6, 1, 1, 2), Timing(9, 1, 1, 1), Timing(5, 1, 2, 3)):
        for stages in (2, 3):
            combined = simulate(*fns, stages=stages, n_steps=9, timing=timing)
            split = split_release(stages, 9, timing)
            assert combined.error is None and split.error is None, split.error
            assert split.blocked_time("producer") <= combined.blocked_time("producer") + 1e-9
            assert split.end <= combined.end + 1e-9
            strictly |= split.blocked_time("producer") < combined.blocked_time("producer") - 1e-9
    assert strictly        # a TMA-bound 2-stage ring gains


# ---------------------------------------------------------------------------- the chart

def test_gantt_draws_a_panel_per_run_with_every_row():
    fns = schedule()
    t = Timing(tma=2, qk=1, pv=1, softmax=2)
    runs = [simulate(*fns, stages=3, n_steps=6, timing=t, pingpong=p) for p in (True, False)]
    broken = simulate(lambda pipe: _one_arrival(fns[0], pipe), *fns[1:], stages=2, n_steps=6,
                      timing=t)
    assert broken.error.kind == "overwrite"
    fig = plot_gantt(*runs, broken, unit="us")
    axes = fig.axes
    assert len(axes) == 3
    labels = [tick.get_text() for tick in axes[0].get_yticklabels()]
    assert labels == ["producer", "TMA (slots 0-2)", "consumer 0", "consumer 1", "tensor cores"]
    assert axes[-1].get_xlabel() == "time (us)"
    assert "ping-pong" in axes[0].get_title(loc="left")
    assert "no ping-pong" in axes[1].get_title(loc="left")
    assert any(text.get_text().strip() == "overwrite" for text in axes[2].texts)
    assert len(fig.legends) == 1


def _one_arrival(make_barriers, pipe):
    full, consumed, turn = make_barriers(pipe)
    for bar in consumed:
        bar.arrivals = 1
    return full, consumed, turn
