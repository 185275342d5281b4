"""Chapter 7, Exercise 4: the five-role simulator (``flashbook.chapters.ch7.roles``, a
configuration of the toolkit's pipeline engine that Chapter 6 teaches), its graded check and its Gantt chart (``roles_checks``). CPU only, seconds.

The reference schedule is the exercise's solution cell: the chapter notebook's cell
``ch7_roles_schedule`` when the notebook has it, else the copy below (the text the cell was
written from). The known-wrong variants are edits of that text, each of which must fail the check
for its own reason. The engine's hazards are provoked one by one with hand-made roles, and the
steady-state utilisation is compared with the model for many timings.
"""

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from flashbook import sources  # noqa: E402
from flashbook.check import CheckFailure  # noqa: E402
from flashbook.chapters.ch6 import pipeline as ch6_pipeline  # noqa: E402
from flashbook.chapters.ch7 import roles  # noqa: E402
from flashbook.pipeline_model import BasePipeline  # noqa: E402
from flashbook.chapters.ch7.roles import RolePipeline, Timing, fa4_model, serial_model, \
    simulate  # noqa: E402
from flashbook.chapters.ch7.roles_checks import check_roles_schedule, plot_schedule, \
    protocol_cases, steady_utilisation, utilisation_cases  # noqa: E402
from flashbook.sources import exec_cell, fresh_module  # noqa: E402


def _schedule_cell() -> str:
    """The solution cell, as the chapter's notebook has it."""
    return sources.cells_by_id(sources.read(sources.source("ch7").path))['ch7_roles_schedule']


SCHEDULE_CELL = _schedule_cell()

# (name, old, new, text the failure must contain): each old occurs once in the cell
VARIANTS = [(v.name, *v.edits[0], v.expect) for v in sources.variants("ch7")
            if v.cell == 'ch7_roles_schedule']
CRASH = ("NameError", "SyntaxError", "IndentationError", "TypeError")
_names = iter(range(10**6))


def schedule(cell: str = SCHEDULE_CELL) -> tuple:
    """(KV_STAGES, mma, correction) defined by executing the cell, as a notebook would."""
    ns = fresh_module("ch7_roles_test").__dict__
    exec_cell(cell, f"<ch7 roles test cell {next(_names)}>", ns)
    return ns["KV_STAGES"], ns["mma"], ns["correction"]


def first_failure(fns) -> CheckFailure | None:
    for hidden in (False, True):
        try:
            check_roles_schedule(*fns, hidden=hidden)
        except CheckFailure as e:
            return e
    return None


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


# ------------------------------------------------------------------ the exercise's check

def test_reference_schedule_passes_every_check(capsys):
    assert first_failure(schedule()) is None
    out = capsys.readouterr().out
    assert "PASSED five-role Blackwell schedule" in out and "21/21 cases" in out
    assert "tensor core busy 100% with KV_STAGES = 2" in out


def test_stubs_fail_as_not_implemented():
    stub = "    # YOUR CODE HERE\n    raise NotImplementedError()\n"
    cell = SCHEDULE_CELL
    while "    ### BEGIN SOLUTION\n" in cell:
        head, rest = cell.split("    ### BEGIN SOLUTION\n", 1)
        cell = head + stub + rest.split("    ### END SOLUTION", 1)[1].lstrip("\n")
    with pytest.raises(CheckFailure, match="mma: not implemented"):
        check_roles_schedule(*schedule(cell))


@pytest.mark.parametrize("name, old, new, expect", VARIANTS, ids=[v[0] for v in VARIANTS])
def test_known_wrong_variant_fails_for_its_reason(name, old, new, expect):
    assert SCHEDULE_CELL.count(old) == 1, f"{name}: the edit does not apply once"
    fns = schedule(SCHEDULE_CELL.replace(old, new))
    failure = first_failure(fns)
    assert failure is not None, f"{name} passed every check"
    message = str(failure)
    assert expect in message, message
    assert not any(c in message for c in CRASH), message


def test_one_slot_is_hazard_free_but_slow():
    """A one-slot ring is a correct protocol (the protocol cases run it): only the utilisation
    check fails it, with the numbers of the model."""
    _, mma, correction = schedule()
    run = simulate(mma, correction, stages=1, n_steps=14, timing=Timing())
    assert run.error is None
    assert steady_utilisation(run) == pytest.approx(2 / 3)
    with pytest.raises(CheckFailure, match=r"busy 66\.7%.*model's 100\.0%.*waited 40 time units "
                                           r"on v_full"):
        check_roles_schedule(1, mma, correction)


def test_kv_stages_must_be_a_positive_int():
    _, mma, correction = schedule()
    for bad in (0, 2.0, "2", True):
        with pytest.raises(CheckFailure, match="KV_STAGES must be a positive int"):
            check_roles_schedule(bad, mma, correction)


# ---------------------------------------------------------------- the utilisation model

@pytest.mark.parametrize("timing", [
    Timing(), Timing(tma=2, exp=3.5), Timing(tma=4, qk=2, pv=2, exp=1),
    Timing(exp=1, rescale=2), Timing(exp=0.5, rescale=2.5), Timing(tma=1, qk=0.5, pv=0.5),
    Timing(tma=6, qk=2, pv=1, exp=4), Timing(tma=9, qk=3, pv=1, rowmax=1, exp=0.5, rescale=0.5),
    Timing(tma=2, qk=1, pv=2, rowmax=0.25, exp=5, rescale=3)])
def test_steady_utilisation_is_the_model_when_the_ring_is_deep_enough(timing):
    _, mma, correction = schedule()
    run = simulate(mma, correction, stages=4, n_steps=16, timing=timing)
    assert run.error is None, run.error
    assert steady_utilisation(run, skip=4) == pytest.approx(fa4_model(timing), abs=1e-9)
    assert fa4_model(timing) >= serial_model(timing)


def test_the_check_timings_are_reached_with_two_slots_and_not_with_one():
    _, mma, correction = schedule()
    for timing in utilisation_cases(hidden=True):
        two = simulate(mma, correction, stages=2, n_steps=14, timing=timing)
        assert steady_utilisation(two) == pytest.approx(fa4_model(timing), abs=1e-9), timing
    for timing in utilisation_cases(hidden=False):     # every visible one needs the 2nd slot
        one = simulate(mma, correction, stages=1, n_steps=14, timing=timing)
        assert steady_utilisation(one) < fa4_model(timing) - 0.05, timing


def test_models():
    t = Timing()                                        # g = s = 2
    assert fa4_model(t) == 1.0 and serial_model(t) == 0.5
    assert fa4_model(Timing(exp=1, rescale=2)) == pytest.approx(4 / 4.5)
    assert fa4_model(Timing(exp=0.5, rescale=2.5)) == pytest.approx(0.8)   # correction-bound
    assert fa4_model(Timing(tma=2, exp=3.5)) == pytest.approx(4 / 7)        # exp-unit-bound
    assert len(protocol_cases()) == 18 and len(protocol_cases(hidden=True)) == 144


# ------------------------------------------------------------- the shared exponential unit

def _exp_unit(run):
    return sorted((s for s in run.spans if s.row == "exp unit"), key=lambda s: s.start)


def test_two_softmax_exps_at_once_take_the_sum_on_the_one_exp_unit():
    """Section 2: the SM has one exponential unit (16 a clock) for both softmax warpgroups.
    With short MMAs both tiles' scores are ready almost together: softmax 1's exp waits for
    softmax 0's, so the pair takes 2 exp, not exp (one unit per warpgroup would overlap them)."""
    timing = Timing(qk=0.25, pv=0.25, rowmax=0.5, exp=4)
    _, mma, correction = schedule()
    run = simulate(mma, correction, stages=2, n_steps=1, timing=timing)
    assert run.error is None, run.error
    e0, e1 = run.done[("exp", 0, 0)], run.done[("exp", 1, 0)]
    ready1 = run.done[("rowmax", 1, 0)][1]
    assert ready1 < e0[1]                        # softmax 1 wanted the unit while it was busy
    assert e1[0] == pytest.approx(e0[1])         # ... and got it when softmax 0's exp ended
    assert max(e0[1], e1[1]) - min(e0[0], e1[0]) == pytest.approx(2 * timing.exp)
    waits = [s for s in run.spans if s.row == "softmax 1" and s.kind == "exp wait"]
    assert [(w.start, w.end) for w in waits] == [(ready1, e0[1])]


def test_the_exp_unit_runs_one_exp_at_a_time_and_sets_the_pace_when_it_is_busiest():
    _, mma, correction = schedule()
    for stages, n_steps, timing in protocol_cases(hidden=True)[::7]:
        run = simulate(mma, correction, stages=stages, n_steps=n_steps, timing=timing)
        spans = _exp_unit(run)
        assert len(spans) == 2 * n_steps
        assert all(a.end <= b.start + 1e-9 for a, b in zip(spans, spans[1:])), timing
    timing = Timing(tma=2, exp=3.5)              # 2 exp = 7 > g + rowmax + exp = 6
    run = simulate(mma, correction, stages=2, n_steps=14, timing=timing)
    spans = _exp_unit(run)
    t0, t1 = spans[6].start, spans[-6].start     # the steady state: the unit never idles
    assert sum(min(s.end, t1) - max(s.start, t0) for s in spans
               if s.end > t0 and s.start < t1) == pytest.approx(t1 - t0)
    assert steady_utilisation(run) == pytest.approx(4 / 7)        # not 4 / 6


# ------------------------------------------------------------------ the engine, by hazard

def run_roles(n_steps=2, stages=2, timing=None, **replace):
    """The reference schedule with some roles replaced: name -> fn(pipe, bars)."""
    _, mma, correction = schedule()
    return simulate(replace.pop("mma", mma), replace.pop("correction", correction),
                    stages=stages, n_steps=n_steps, timing=timing or Timing(),
                    roles={k.replace("_", " "): v for k, v in replace.items()})


def test_the_engine_is_chapter_6s():
    run = run_roles()
    assert run.error is None
    assert isinstance(run, ch6_pipeline.Run)
    assert all(isinstance(b, ch6_pipeline.Barrier) for b in run.barriers)
    assert roles.Hazard is ch6_pipeline.Hazard
    assert isinstance(roles.RolePipeline(2, 2), BasePipeline)


def test_softmax_that_skips_its_wait_reads_s_before_the_qk_finished():
    def softmax0(pipe, bars):
        for j in range(pipe.n_steps):
            yield pipe.rowmax(0, j)                      # no wait on s_ready
            yield pipe.arrive(bars.stats[0])
            yield pipe.exp(0, j)
            yield pipe.arrive(bars.p_ready[0])
        yield pipe.rowsum(0)
        yield pipe.arrive(bars.l_ready[0])
    error = run_roles(softmax_0=softmax0).error
    assert error.kind == "read before ready" and error.time == 0
    assert "reads S_0 (TMEM) expecting the scores S of step 0, but it holds nothing yet" \
        in str(error)


def test_a_race_is_reported_even_when_the_timing_hides_it():
    """The MMA warp issues PV1(j-1) without waiting for o_ready: with a short rescale it always
    finished first, but nothing orders it before the PV."""
    cell = SCHEDULE_CELL.replace(VARIANTS[1][1], VARIANTS[1][2])
    _, mma, _ = schedule(cell)
    run = run_roles(n_steps=3, mma=mma, timing=Timing(rescale=0.25))
    assert run.error.kind == "read before ready", run.error
    assert "no barrier orders that write before this read" in str(run.error)
    assert "the timing of this run hid it" in str(run.error)


def test_commit_arrives_when_the_mmas_before_it_finish():
    """A commit with MMAs in flight arrives when the last of them finishes; with none, at
    once. The tensor core runs MMAs in issue order, one at a time."""
    run = run_roles(n_steps=3)
    assert run.error is None
    mmas = run.gemm_spans()
    assert all(a.end <= b.start + 1e-9 for a, b in zip(mmas, mmas[1:]))
    order = [(s.kind, s.lane, s.step) for s in mmas]
    assert order[:4] == [("QK", 0, 0), ("QK", 1, 0), ("PV", 0, 0), ("QK", 0, 1)]
    s_ready0 = next(b for b in run.barriers if b.name == "s_ready[0]")
    qk0 = [s for s in mmas if s.kind == "QK" and s.lane == 0]
    assert [t for t, _ in s_ready0.phases] == [s.end for s in qk0]
    assert all(arrivals == [("MMA warp", t)] for t, arrivals in s_ready0.phases)


def test_a_role_may_only_do_its_own_actions():
    def epilogue(pipe, bars):
        yield pipe.qk(0, 0)
    error = run_roles(epilogue_warp=epilogue).error
    assert error.kind == "protocol" and "which only the MMA warp does" in str(error)


def test_an_action_twice_and_a_rescale_of_step_0_are_protocol_errors():
    def twice(pipe, bars):
        for t in (0, 1):
            yield pipe.wait(bars.epi_ready[t], 0)
            yield pipe.store(t)
            yield pipe.store(t)
    assert "a second time" in str(run_roles(epilogue_warp=twice).error)

    def rescale0(pipe, bars):
        yield pipe.rescale(0, 0)
    error = run_roles(correction=rescale0).error
    assert error.kind == "protocol" and "step 0 has nothing to rescale" in str(error)

    def out_of_range(pipe, bars):
        yield pipe.rowmax(0, 7)
    assert "the key steps are 0..1" in str(run_roles(softmax_0=out_of_range).error)


def test_made_but_not_yielded_and_not_an_action():
    def forgot(pipe, bars):
        for t in (0, 1):
            yield pipe.wait(bars.epi_ready[t], 0)
            pipe.store(t)                                 # made, never yielded
    error = run_roles(epilogue_warp=forgot).error
    assert error.kind == "protocol" and "never yielded" in str(error)

    def number(pipe, bars):
        yield 42
    assert "yielded 42, not an action" in str(run_roles(epilogue_warp=number).error)


def test_deadlock_names_every_waiter():
    def silent(pipe, bars):                              # never finishes a tile
        yield pipe.wait(bars.stats[0], 0)
    error = run_roles(correction=silent).error
    assert error.kind == "deadlock"
    text = str(error)
    assert "the MMA warp waits on o_ready[0]" in text and "the epilogue warp waits on " \
        "epi_ready[0]" in text and "a commit by the MMA warp" in text


def test_a_wait_that_skips_step_0s_phase_reads_the_wrong_step():
    """A correction that waits on stats only from step 1 on: on a fresh barrier a wait for
    parity 1 passes at once, so it reads step 0's row max where it wanted step 1's."""
    def correction(pipe, bars):
        for j in range(1, pipe.n_steps):
            for t in (0, 1):
                yield pipe.wait(bars.stats[t], j % 2)
                yield pipe.wait(bars.o_done[t], (j - 1) % 2)
                yield pipe.rescale(t, j)
                yield pipe.arrive(bars.o_ready[t])
    error = run_roles(n_steps=4, correction=correction).error
    assert error.kind == "read before ready"
    assert "expecting the row max of step 1, but it holds the row max of step 0" in str(error)


def test_runaway_is_capped():
    def forever(pipe, bars):
        while True:
            yield pipe.arrive(bars.stats[0])
    pipe = RolePipeline(2, 2, max_actions=300)
    bars = roles.make_barriers(pipe)
    run = pipe.run({"correction": forever(pipe, bars)})
    assert run.error.kind == "runaway"


def test_unknown_role_names_are_rejected():
    pipe = RolePipeline(2, 2)
    with pytest.raises(ValueError, match="unknown role"):
        pipe.run({"producer": iter(())})


# ---------------------------------------------------------------------------- the chart

def test_plot_schedule_draws_every_role_and_marks_a_hazard():
    _, mma, correction = schedule()
    good = simulate(mma, correction, stages=2, n_steps=5)
    cell = SCHEDULE_CELL.replace(VARIANTS[0][1], VARIANTS[0][2])
    _, bad_mma, _ = schedule(cell)
    bad = simulate(bad_mma, correction, stages=2, n_steps=5)
    assert bad.error is not None
    fig = plot_schedule(good, bad)
    assert len(fig.axes) == 2
    labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert labels == ["load warp", "TMA (Q, K, V)", "MMA warp", "tensor core (tile 0, 1)",
                      "exp unit, MUFU (tile 0, 1)", "softmax 0", "softmax 1", "correction",
                      "epilogue warp"]
    assert any(t.get_text().strip() == bad.error.kind for t in fig.axes[1].texts)
    assert "tensor core busy" in fig.axes[0].get_title(loc="left")
