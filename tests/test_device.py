"""flashbook.setup()'s CPU mode: the Triton interpreter turns a loaded scalar into a loop bound
(Triton 3.6 keeps it as an array of shape (1,), which NumPy 2.4 will not convert with int())."""
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
