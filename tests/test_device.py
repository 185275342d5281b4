"""flashbook.setup()'s CPU mode: the Triton interpreter turns a loaded scalar into a loop bound
(Triton 3.6 keeps it as an array of shape (1,), which NumPy 2.4 will not convert with int()),
and patches triton.language once per launch, not again at every call of a helper."""
import operator

import numpy as np
import triton
import triton.language as tl
from triton.runtime import interpreter

import flashbook


def test_a_scalar_of_shape_one_is_an_index_under_the_interpreter():
    flashbook.setup(verbose=False)
    scope = interpreter._LangPatchScope()
    interpreter._patch_lang_tensor(tl.tensor, scope)
    try:
        t = tl.tensor(interpreter.TensorHandle(np.array([5], dtype=np.int32), tl.int32), tl.int32)
        assert operator.index(t) == 5
        assert list(range(t)) == [0, 1, 2, 3, 4]
    finally:
        scope.restore()


def test_a_kernel_loops_up_to_a_loaded_length_in_cpu_mode():
    import torch
    flashbook.setup(verbose=False)

    @triton.jit
    def count_up_to(n_ptr, out_ptr):
        n = tl.load(n_ptr)
        total = 0
        for i in range(0, n):
            total += i
        tl.store(out_ptr, total)

    out = torch.zeros(1, dtype=torch.int32)
    count_up_to[(1,)](torch.tensor([5], dtype=torch.int32), out)
    assert out.item() == 10


@triton.jit
def _scaled(x, factor):
    return x * factor


@triton.jit
def _helper_in_a_loop(x_ptr, out_ptr, N: tl.constexpr, CALLS: tl.constexpr):
    offs = tl.arange(0, N)
    x = tl.load(x_ptr + offs)
    for _ in range(CALLS):
        x = _scaled(x, 2.0)
    tl.store(out_ptr + offs, x)


def test_a_helper_called_in_a_kernel_loop_does_not_patch_the_language_again(monkeypatch):
    """CPU mode patches triton.language once per launch: a launch whose kernel calls a helper
    four times patches as much as one that calls it never; the kernel still computes, and after
    the launch the language is Triton's again."""
    import torch
    flashbook.setup(verbose=False)
    original_load = tl.load
    patched = []
    inner = interpreter._patch_builtin
    monkeypatch.setattr(interpreter, "_patch_builtin",
                        lambda pkg, *a: (patched.append(pkg), inner(pkg, *a))[1])
    x, out = torch.arange(8, dtype=torch.float32), torch.empty(8)
    _helper_in_a_loop[(1,)](x, out, N=8, CALLS=0)
    torch.testing.assert_close(out, x)
    without_calls = len(patched)
    assert without_calls > 0                        # the launch patched the language
    _helper_in_a_loop[(1,)](x, out, N=8, CALLS=4)
    torch.testing.assert_close(out, x * 16)
    assert len(patched) == 2 * without_calls        # per launch, never per helper call
    assert tl.load is original_load                 # restored when each launch ended


@triton.jit
def _times_2_to_the_20(x_ptr, out_ptr):
    tl.store(out_ptr, tl.load(x_ptr) * 1048576)


def test_no_unread_overflow_check_on_each_integer_op():
    """With debug off the interpreter drops its int32 overflow assert, so CPU mode skips the
    int64 arithmetic that fed it; integer results are unchanged: 2**12 * 2**20 wraps to 0, as
    in a GPU build."""
    import torch
    flashbook.setup(verbose=False)
    options = interpreter.interpreter_builder.options
    assert not options.debug and not options.sanitize_overflow
    out = torch.ones(1, dtype=torch.int32)
    _times_2_to_the_20[(1,)](torch.tensor([4096], dtype=torch.int32), out)
    assert out.item() == 0
