"""flashbook.plans: what a wrapper remembers by its inputs' metadata, and the direct launch."""
import inspect

import pytest
import torch

import flashbook as fb

fb.setup()

from flashbook import launcher, plans  # noqa: E402


def test_the_key_tells_apart_what_changes_a_launch():
    x = torch.zeros(4, 8)
    base = plans.key("k", x, 1.0, None)
    assert base == plans.key("k", torch.ones(4, 8), 1.0, None)        # values do not count
    others = [plans.key("k", x.t().contiguous().t(), 1.0, None),        # strides
              plans.key("k", x.double(), 1.0, None),                     # dtype
              plans.key("k", torch.zeros(4, 9)[:, 1:], 1.0, None),       # 4-byte, not 16-byte
              plans.key("k", x, 2.0, None), plans.key("j", x, 1.0, None)]
    assert all(o != base for o in others)
    table = plans.Plans()
    unhashable = plans.key("k", [1, 2])                                  # a list: no plan
    assert table.get(unhashable) is None and table.remember(unhashable, 1) == 1 and not table


def test_contiguous_strides_are_torchs():
    for shape in [(2, 3, 4), (0, 3, 4), (2, 0, 5), (1,), (4, 1, 1, 7)]:
        assert plans.contiguous_strides(shape) == torch.empty(shape).stride()


def test_a_full_table_is_emptied_not_grown():
    table = plans.Plans(size=2)
    for i in range(5):
        table.remember(i, i)
    assert len(table) <= 2 and table[4] == 4
    table.remember(None, "x")
    assert None not in table


class _Compiled:
    """What Triton's CompiledKernel offers a Launch: ``packed_metadata`` and ``[grid]``."""
    packed_metadata = object()

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda *args: self.calls.append((grid, args))


class _Kernel:
    """A JITFunction's surface: ``[grid](...)`` (returns its compiled kernel), ``arg_names``
    and ``signature``."""

    def __init__(self):
        def fn(X, Y, n, scale, BLOCK, FLAG=True):
            pass
        self.signature = inspect.signature(fn)
        self.arg_names = list(self.signature.parameters)
        self.compiled = _Compiled()
        self.ordinary = []

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.ordinary.append((grid, args, kwargs))
            return self.compiled
        return run


def test_a_launch_goes_through_the_compiled_kernel_after_the_first_call():
    kernel = _Kernel()
    launch = plans.Launch(kernel, (3, 2), (7, 0.5), dict(BLOCK=16, num_warps=4))
    x, y = torch.zeros(2), torch.ones(2)
    launch(x, y)                                    # Triton's path, which compiles
    launch(y, x)
    assert len(kernel.ordinary) == 1 and kernel.ordinary[0][2] == dict(BLOCK=16, num_warps=4)
    grid, args = kernel.compiled.calls[0]
    # parameter order, defaults filled in, launch options (num_warps) left out
    assert grid == (3, 2, 1) and args[0] is y and args[1] is x and args[2:] == (7, 0.5, 16, True)


def test_an_interpreted_kernel_always_takes_tritons_path():
    kernel = _Kernel()
    kernel.compiled = None                         # the interpreter returns nothing
    launch = plans.Launch(kernel, (1,))
    for _ in range(3):
        launch(torch.zeros(1), torch.zeros(1))
    assert len(kernel.ordinary) == 3 and launch.runner is None


def test_the_recorded_launches_replay_both_ways():
    kernel = _Kernel()
    launch = plans.Launch(kernel, (1,), (1, 1.0), dict(BLOCK=4))
    x = torch.zeros(1)
    with plans.recorded_launches() as made:
        launch(x, x)
    assert [(m[0], len(m[1])) for m in made] == [(launch, 2)]
    plans.triton_launch(*made[0])
    plans.direct_launch(*made[0])
    assert len(kernel.ordinary) == 2 and len(kernel.compiled.calls) == 1
    launch(x, x)
    assert len(made) == 1                           # recording stopped at the block's end


def test_a_workspace_is_kept_per_stream_but_fresh_where_checks_poison_outputs():
    space = plans.Workspace([(2, 3), (2,)], torch.float32)
    first = space.get(torch.device("cpu"))
    assert [tuple(t.shape) for t in first] == [(2, 3), (2,)]
    assert all(a is b for a, b in zip(first, space.get(torch.device("cpu"))))
    with launcher.poisoned_outputs():
        fresh = space.get(torch.device("cpu"))
    assert fresh[0] is not first[0] and torch.isnan(fresh[0]).all()


def test_validate_once_skips_only_metadata_that_passed_and_never_where_values_are_checked():
    seen = []

    def validate(t, n):
        seen.append(n)
        if n < 0:
            raise ValueError("n must be >= 0")
    t = torch.zeros(3)
    with launcher.check_values(False):
        plans.validate_once(validate, t, 1)
        plans.validate_once(validate, torch.ones(3), 1)     # same metadata: skipped
        plans.validate_once(validate, t, 2)                 # another argument: run
        for _ in range(2):                                  # a failure is never remembered
            with pytest.raises(ValueError):
                plans.validate_once(validate, t, -1)
    assert seen == [1, 2, -1, -1]
    with launcher.check_values(True):                       # values checked: always run
        plans.validate_once(validate, t, 1)
    assert seen[-1] == 1 and len(seen) == 5


def test_a_launcher_plans_once_per_metadata_and_still_refuses_what_is_new(monkeypatch):
    from flashbook.chapters.ch3 import launch as ch3
    kernel = _Kernel()
    kernel.compiled = None
    q, k, v = (torch.randn(1, 2, 32, 16) for _ in range(3))
    calls = []
    real = ch3.validate_qkv
    monkeypatch.setattr(ch3, "validate_qkv", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    ch3.attention_forward(kernel, q, k, v)
    ch3.attention_forward(kernel, torch.randn(1, 2, 32, 16), k, v)   # same metadata
    assert len(calls) == 1
    kt = torch.randn(1, 32, 2, 16).transpose(1, 2)                    # new strides
    ch3.attention_forward(kernel, q, kt, v)
    assert len(calls) == 2
    assert kernel.ordinary[2][1][8:11] == kt.stride()[:3]             # k's strides passed
    with pytest.raises(ValueError, match="dtype"):
        ch3.attention_forward(kernel, q.double(), k, v)
    assert len(kernel.ordinary) == 3
