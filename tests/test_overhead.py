"""flashbook.overhead: the host time a public function adds to its launches. The measurer's
clock is the test's (``Clock``): no figure depends on how busy the host is."""
import functools
import types

import pytest

import flashbook as fb

fb.setup()

from flashbook import overhead  # noqa: E402


def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def one(X):
        tl.store(X + tl.arange(0, 16), tl.arange(0, 16).to(tl.float32))
    return one


class Clock:
    """``time.perf_counter`` for the measurer, moved only by ``spend``: every figure it reports
    is then an exact sum of the costs a test gives each step, whatever else runs on the host."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def spend(self, us: float) -> None:
        self.now += us * 1e-6


class Costed:
    """A Triton kernel whose every launch (``kernel[grid](...)``) costs ``us`` on ``clock``."""

    def __init__(self, kernel, clock: Clock, us: float):
        self.kernel, self.clock, self.us = kernel, clock, us

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.clock.spend(self.us)
            return self.kernel[grid](*args, **kwargs)
        return launch


LAUNCH_US, CHECKS_US, ALLOC_US, AUTOGRAD_US = 40.0, 3000.0, 500.0, 70.0


@pytest.fixture
def clock(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(overhead, "time", types.SimpleNamespace(perf_counter=clock))
    return clock


def test_time_outside_the_launch_is_what_the_wrapper_adds(clock):
    import torch
    from flashbook.plans import Launch
    x = torch.empty(16, device=fb.current().device)
    launch = Launch(Costed(_kernel(), clock, LAUNCH_US), (1,))

    def slow_wrapper():            # 3 ms of "checks", then one launch
        clock.spend(CHECKS_US)
        launch(x)
    row = overhead.measure("slow", slow_wrapper, reps=3)
    assert row["launches"] == 1
    assert row["host_us"] == pytest.approx(CHECKS_US + LAUNCH_US)
    assert row["launch_us"] == row["direct_us"] == pytest.approx(LAUNCH_US)   # replayed, checks not
    assert row["added_us"] == row["wrapper_us"] == pytest.approx(CHECKS_US)  # the checks' alone
    bare = overhead.measure("bare", lambda: launch(x), reps=3)
    assert bare["host_us"] == pytest.approx(LAUNCH_US) and bare["added_us"] == pytest.approx(0)

    def two_launches():
        launch(x)
        launch(x)
    two = overhead.measure("two", two_launches, reps=2)
    assert two["launches"] == 2 and two["launch_us"] == pytest.approx(2 * LAUNCH_US)


def test_the_floor_allocates_the_outputs_and_applies_autograd_for_a_differentiable_call(
        clock, monkeypatch):
    import torch
    from flashbook.plans import Launch
    launch = Launch(Costed(_kernel(), clock, LAUNCH_US), (1,))
    empty, allocated = torch.empty, []

    def costed_empty(*args, **kwargs):
        clock.spend(ALLOC_US)
        allocated.append(args[0])
        return empty(*args, **kwargs)
    monkeypatch.setattr(torch, "empty", costed_empty)

    def wrapper():                     # allocates its output, then launches: adds nothing
        out = torch.empty((4, 16), device=fb.current().device)
        launch(out)
        return out
    row = overhead.measure("alloc", wrapper, reps=5)
    assert row["autograd_us"] is None
    assert row["alloc_us"] == pytest.approx(ALLOC_US)                  # one output, one empty
    assert row["launch_us"] == pytest.approx(ALLOC_US + LAUNCH_US)     # the floor allocates it
    assert row["added_us"] == pytest.approx(0)
    assert set(allocated) == {(4, 16), torch.Size((4, 16))}           # the output's own shape

    applied = []

    class CostedNothing:               # the floor's empty autograd op, with its inputs seen
        @staticmethod
        def apply(*inputs):
            clock.spend(AUTOGRAD_US)
            applied.append(inputs)
    monkeypatch.setattr(overhead, "_Nothing", CostedNothing)
    x = empty(16, device=fb.current().device)
    grad_row = overhead.measure("grad", lambda: launch(x), reps=5, inputs=(x,))
    assert grad_row["autograd_us"] == pytest.approx(AUTOGRAD_US)
    assert grad_row["launch_us"] == pytest.approx(AUTOGRAD_US + LAUNCH_US)
    assert applied and all(len(a) == 1 and a[0] is x for a in applied)


def test_the_profile_ranks_the_functions_a_call_spends_its_time_in(clock, monkeypatch):
    import cProfile
    monkeypatch.setattr(cProfile, "Profile", functools.partial(cProfile.Profile, timer=clock))

    def checks():                  # the costly part of a wrapper
        clock.spend(2000)

    def wrapper():
        checks()
        sum(range(10))
    rows = overhead.profile(wrapper, reps=3, top=5)
    assert len(rows) <= 5 and rows == sorted(rows, key=lambda r: -r["own_us"])
    mine = {r["function"].split("(")[-1].rstrip(")"): r for r in rows}
    assert mine["wrapper"]["total_us"] == pytest.approx(2000)
    assert mine["checks"]["total_us"] == pytest.approx(2000)
    assert mine["wrapper"]["own_us"] == mine["checks"]["own_us"] == pytest.approx(0)
    assert rows[0]["function"].endswith("(spend)") and rows[0]["own_us"] == pytest.approx(2000)


@pytest.mark.slow
def test_every_public_function_is_measured_in_quick_mode(tmp_path):
    out = tmp_path / "o.json"
    assert overhead.main(["--quick", "--reps", "1", "--out", str(out), "--only", "ch3"]) == 0
    import json
    rows = json.loads(out.read_text())["rows"]
    assert [r["function"] for r in rows] == ["ch3.attention", "ch3.attention_two_tiles"]
    assert all(r["launches"] == 1 and r["launch_us"] > 0 for r in rows)
    assert "| ch3.attention |" in overhead.summary(rows)


def test_the_benchmarks_page_shows_each_record_and_names_the_functions_over_target(
        tmp_path, monkeypatch):
    import json
    from flashbook import book
    rows = [dict(function="f", host_us=40.0, launch_us=30.0, added_us=10.0, launches=1,
                 syncs=False, reps=200),
            dict(function="g", host_us=90.0, launch_us=30.0, added_us=60.0, launches=2,
                 syncs=True, reps=200)]
    (tmp_path / "h200.json").write_text(json.dumps(dict(
        provenance=dict(gpu="NVIDIA H200", command="python -m flashbook.overhead",
                        commit="abc1234", target_us=10.0), rows=rows)))
    monkeypatch.setattr(book, "OVERHEAD_DIR", tmp_path)
    page = "\n".join(book.overhead_section())
    assert "## Host time per call: NVIDIA H200" in page and "`abc1234`" in page
    assert "| f | 40.0 | 30.0 | 10.0 | - | 1 | no |" in page
    assert "| g | 90.0 | 30.0 | 60.0 | - | 2 | yes |" in page
    assert "µs added per call: `g`." in page          # f is at the target, not over it


def test_the_speed_table_is_drawn_when_the_record_has_one(tmp_path, monkeypatch):
    import json
    from flashbook import book
    speed = [dict(function="ch5.decode", shape=[32, 32, 8, 8192, 128], causal=True,
                  ms_public=0.26, ms_launch=0.25, ratio=0.25 / 0.26)]
    (tmp_path / "h200.json").write_text(json.dumps(dict(
        provenance=dict(gpu="NVIDIA H200", commit="abc1234"), speed=speed,
        rows=[dict(function="f", host_us=1.0, launch_us=1.0, added_us=0.0, launches=1,
                   syncs=False, reps=5)])))
    monkeypatch.setattr(book, "OVERHEAD_DIR", tmp_path)
    page = "\n".join(book.overhead_section())
    assert "| ch5.decode | 32x32x8x8192x128 | True | 0.2600 | 0.2500 | 0.962 |" in page
