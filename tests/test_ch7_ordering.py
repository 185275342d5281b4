"""Chapter 7, Exercise 6: the tcgen05 waits and fences in the five-role simulator
(``flashbook.chapters.ch7.ordering``), and the cycle model of the exponential unit the two
softmax warpgroups share (``design.step_cycles``). CPU only, under a second.

The reference softmax is the exercise's solution cell, run beside Exercise 4's solution cell;
each ordering rule is broken by hand and must be reported as a hazard whose message names the
role, the instruction, the missing wait or fence and what could go wrong.
"""

import pytest

from flashbook import sources
from flashbook.check import CheckFailure
from flashbook.chapters.ch7 import design, roles
from flashbook.chapters.ch7.ordering import OrderedRolePipeline, check_ordering, \
    simulate_ordered
from flashbook.pipeline_model import BasePipeline
from flashbook.sources import exec_cell, fresh_module

CELLS = sources.cells_by_id(sources.read(sources.source("ch7").path))
VARIANTS = [v for v in sources.variants("ch7") if v.cell == "ch7_ordering"]
_names = iter(range(10**6))


def solution(ordering_cell: str = CELLS["ch7_ordering"]) -> tuple:
    """(softmax_ordered, mma, correction) from the cells, as the notebook defines them."""
    ns = fresh_module("ch7_ordering_test").__dict__
    exec_cell(CELLS["ch7_roles_schedule"], f"<ch7 roles cell {next(_names)}>", ns)
    exec_cell(ordering_cell, f"<ch7 ordering cell {next(_names)}>", ns)
    return ns["softmax_ordered"], ns["mma"], ns["correction"]


def run_with(edit, n_steps: int = 3):
    """The reference softmax with ``edit(actions) -> actions`` applied to its action list."""
    softmax, mma, correction = solution()

    def role(pipe, t, bars):
        yield from edit(list(softmax(pipe, t, bars)), pipe, bars)
    return simulate_ordered(role, mma, correction, stages=2, n_steps=n_steps)


def without(pred, count: int = 10**6):
    """An edit that leaves out the first ``count`` actions for which ``pred(str(action))``."""
    def edit(actions, pipe, bars):
        left = count
        for a in actions:
            if left and pred(str(a)):
                left -= 1
                continue
            yield a
    return edit


def test_reference_passes_visible_and_hidden(capsys):
    softmax, mma, correction = solution()
    check_ordering(softmax, mma, correction)
    check_ordering(softmax, mma, correction, hidden=True)
    assert "PASSED tcgen05 ordering" in capsys.readouterr().out


def test_the_reference_keeps_exercise_4s_utilisation():
    softmax, mma, correction = solution()
    for timing in (roles.Timing(), roles.Timing(tma=2, exp=3.5)):
        plain = roles.simulate(mma, correction, stages=2, n_steps=14, timing=timing)
        ordered = simulate_ordered(softmax, mma, correction, stages=2, n_steps=14,
                                   timing=timing)
        assert ordered.error is None and plain.error is None
        assert ordered.end == pytest.approx(plain.end)     # fences and waits take no time


@pytest.mark.parametrize("v", VARIANTS, ids=lambda v: v.name)
def test_known_wrong_variant_fails_for_its_reason(v):
    fns = solution(v.apply(CELLS["ch7_ordering"]))
    with pytest.raises(CheckFailure) as e:
        check_ordering(*fns)
    assert v.expect in str(e.value)
    assert "HAZARD (ordering)" in str(e.value)


def test_variants_cover_the_two_halves_of_the_hand_off():
    assert len(VARIANTS) >= 2
    expects = " ".join(v.expect for v in VARIANTS)
    assert "tcgen05.wait::st" in expects and "fence::after_thread_sync" in expects


def test_arrive_before_wait_st_names_the_store_and_the_harm():
    r = run_with(without(lambda a: a == "wait_st()", 1))
    assert r.error.kind == "ordering"
    m = r.error.message
    assert m.startswith("Softmax 0 arrives on stats[0] before tcgen05.wait::st")
    assert "tcgen05.st of the row max (rowmax(0, 0))" in m
    assert "rescale O by a stale factor" in m and "yield pipe.wait_st()" in m


def test_p_published_before_its_store_landed_warns_of_the_pv():
    def edit(actions, pipe, bars):                  # drop the wait_st that follows each exp
        after_exp = False
        for a in actions:
            if str(a).startswith("exp("):
                after_exp = True
            elif str(a) == "wait_st()" and after_exp:
                after_exp = False
                continue
            yield a
    m = run_with(edit).error.message
    assert "arrives on p_ready[0] before tcgen05.wait::st" in m and "by V" in m


def test_missing_fence_before_is_reported_at_the_arrive():
    m = run_with(without(lambda a: a == "fence_before()", 1)).error.message
    assert "arrives on stats[0] after" in m
    assert "no tcgen05.fence::before_thread_sync since" in m and "tcgen05.wait::st" in m


def test_consumer_without_fence_after_reads_before_the_qk_landed():
    # the first fence_after is the allocation handshake's; the second follows s_ready
    def edit(actions, pipe, bars):
        seen = 0
        for a in actions:
            if str(a) == "fence_after()":
                seen += 1
                if seen == 2:
                    continue
            yield a
    r = run_with(edit)
    assert r.error.kind == "ordering"
    m = r.error.message
    assert "Softmax 0 issues load_s(0, 0) (tcgen05.ld) after its wait on s_ready[0]" in m
    assert "no tcgen05.fence::after_thread_sync" in m and "yield pipe.fence_after()" in m


def test_registers_before_wait_ld_and_a_max_without_a_load():
    m = run_with(without(lambda a: a == "wait_ld()", 1)).error.message
    assert "computes rowmax(0, 0) from the registers" in m and "tcgen05.wait::ld" in m
    m = run_with(without(lambda a: a.startswith("load_s("), 1)).error.message
    assert "without a tcgen05.ld of S_0 of step 0" in m


def test_an_arrive_with_a_load_in_flight_needs_wait_ld():
    def edit(actions, pipe, bars):                  # publish the stats right after the load
        for a in actions:
            yield a
            if str(a) == "load_s(0, 0)":
                yield pipe.arrive(bars.stats[0])
                return
    m = run_with(edit).error.message
    assert "arrives on stats[0] before tcgen05.wait::ld" in m and "overwrite S" in m


def test_the_allocation_handshake_wait_and_fence():
    m = run_with(without(lambda a: a.startswith("wait(tmem_ready"))).error.message
    assert "before the allocation handshake: it never waited on tmem_ready" in m
    # one after-fence after both waits would order the load after both: leave out the two
    m = run_with(without(lambda a: a == "fence_after()", 2)).error.message
    assert "it waited on tmem_ready but executed no tcgen05.fence::after_thread_sync" in m
    assert "garbage address" in m


def test_roles_other_than_the_softmax_keep_exercise_4s_level():
    softmax, mma, correction = solution()
    pipe = OrderedRolePipeline(2, 2)
    assert pipe.ordered == ("softmax 0", "softmax 1")
    assert BasePipeline(1, 1).in_order("x", None, 0.0) is None       # the engine's default
    # the MMA warp may fence (the allocation prologue does) without being checked
    assert simulate_ordered(softmax, mma, correction, stages=1, n_steps=1).error is None


def test_the_check_wants_both_exercises():
    softmax, mma, correction = solution()

    def stub(pipe, t, bars):
        raise NotImplementedError()
    with pytest.raises(CheckFailure, match="not implemented"):
        check_ordering(stub, mma, correction)

    def no_mma(pipe, bars):
        yield pipe.wait(bars.q_full[0], 0)
    with pytest.raises(CheckFailure, match="pass Exercise 4 first"):
        check_ordering(softmax, no_mma, correction)


# --------------------------------------------------------------------------- the cycle model
def test_the_shared_exp_unit_makes_the_polynomial_pay_on_a_b200():
    step = design.step_cycles(design.B200, 64)
    assert (step["mma"], step["exp"], step["unshared_exp"]) == (1024, 2048, 1024)
    assert round(design.best_emulated_fraction(design.B200), 2) == 0.32
    emulated = design.step_cycles(design.B200, 64, design.best_emulated_fraction(design.B200))
    assert round(emulated["exp"]) == round(emulated["fma"]) == 1390
    assert round(design.emulation_gain(design.B200, 64), 2) == 1.47
    assert design.emulation_gain(design.B200, 128) == pytest.approx(1.0)


def test_the_b300_doubles_the_exp_unit_and_the_polynomial_buys_nothing():
    assert design.B300.mufu == 2 * design.B200.mufu
    assert design.B300.mma_flops == design.B200.mma_flops
    assert not design.B300.poly and design.B200.poly
    assert design.step_cycles(design.B300, 64)["exp"] == 1024
    assert round(design.best_emulated_fraction(design.B300), 2) == 0.05
    for d in (64, 128):
        assert design.emulation_gain(design.B300, d) == pytest.approx(1.0)
    table = design.exp_unit_table()
    assert "| B200 (sm_100) | 64 | 1,024 | 2,048 |" in table and "1.47x | on |" in table
    assert table.count("| off |") == 2
