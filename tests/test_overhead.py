"""flashbook.overhead: the host time a public function adds to its launches."""
import time

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


def test_time_outside_the_launch_is_what_the_wrapper_adds():
    import torch
    from flashbook.plans import Launch
    kernel = _kernel()
    x = torch.empty(16, device=fb.current().device)
    launch = Launch(kernel, (1,))

    def slow_wrapper():            # 3 ms of "checks", then one launch
        time.sleep(0.003)
        launch(x)
    row = overhead.measure("slow", slow_wrapper, reps=3)
    assert row["launches"] == 1
    assert row["added_us"] >= 3000 and row["wrapper_us"] >= 3000   # the sleep is the wrapper's
    assert row["host_us"] == pytest.approx(row["added_us"] + row["launch_us"], rel=0.2)
    assert overhead.measure("bare", lambda: launch(x), reps=3)["added_us"] < 1000

    def two_launches():
        launch(x)
        launch(x)
    assert overhead.measure("two", two_launches, reps=2)["launches"] == 2


def test_the_floor_allocates_the_outputs_and_applies_autograd_for_a_differentiable_call():
    import torch
    from flashbook.plans import Launch
    launch = Launch(_kernel(), (1,))
    big = (64, 1024, 1024)            # a costly allocation on any host: 256 MiB of float32

    def wrapper():                     # allocates its output, then launches: adds nothing
        out = torch.empty(big, device=fb.current().device)
        launch(out)
        return out
    row = overhead.measure("alloc", wrapper, reps=5)
    assert row["alloc_us"] > 0 and row["autograd_us"] is None
    assert row["launch_us"] >= row["alloc_us"]
    x = torch.empty(16, device=fb.current().device)
    grad_row = overhead.measure("grad", lambda: launch(x), reps=5, inputs=(x,))
    assert grad_row["autograd_us"] > 0
    assert grad_row["launch_us"] >= grad_row["autograd_us"]


def test_the_profile_ranks_the_functions_a_call_spends_its_time_in():
    def checks():                  # the costly part of a wrapper
        time.sleep(0.002)

    def wrapper():
        checks()
        sum(range(10))
    rows = overhead.profile(wrapper, reps=3, top=5)
    assert len(rows) <= 5 and rows == sorted(rows, key=lambda r: -r["own_us"])
    mine = {r["function"].split("(")[-1].rstrip(")"): r for r in rows}
    assert mine["wrapper"]["total_us"] >= 2000 > mine["wrapper"]["own_us"]
    assert any(r["own_us"] >= 2000 and "sleep" in r["function"] for r in rows)


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
