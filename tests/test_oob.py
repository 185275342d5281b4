"""The Triton out-of-bounds guard and the canaries (toolkit: flashbook.oob): the guard names the
access, the tensor and the program of an out-of-bounds load or store before it happens, passes
correct kernels and removes its patches; canaries notice a write past a tensor."""
import pytest
import torch
import triton  # conftest switched on the interpreter
import triton.language as tl

from flashbook import oob
from flashbook.check import CheckFailure


@triton.jit
def _copy_unmasked_load(X, Y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + offs)
    tl.store(Y + offs, x, mask=offs < n)


@triton.jit
def _copy_unmasked_store(X, Y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + offs, mask=offs < n, other=0.0)
    tl.store(Y + offs, x)


@triton.jit
def _copy_far_away(X, Y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + offs + 1_000_000_000)           # would segfault without the guard
    tl.store(Y + offs, x, mask=offs < n)


@triton.jit
def _copy_masked(X, Y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(Y + offs, tl.load(X + offs, mask=offs < n), mask=offs < n)


def _copy(kernel, n=37):
    x = torch.randn(n)
    y = torch.zeros(n)
    kernel[(triton.cdiv(n, 16),)](x, y, n, BLOCK=16)
    return x, y


@pytest.mark.parametrize("kernel, op, line, tensor", [
    (_copy_unmasked_load, "load", "x = tl.load(X + offs)", "`X`"),
    (_copy_unmasked_store, "store", "tl.store(Y + offs, x)", "`Y`"),
    (_copy_far_away, "load", "x = tl.load(X + offs + 1_000_000_000)", "none of the kernel's tensors"),
])
def test_guard_reports_the_offending_access(kernel, op, line, tensor):
    with pytest.raises(CheckFailure) as e:
        oob.call(_copy, kernel, what="copy")
    msg = str(e.value)
    assert f"out-of-bounds {op}" in msg and line in msg and tensor in msg, msg
    assert "program id (2, 0, 0)" in msg or "program id (0, 0, 0)" in msg, msg


def test_guard_passes_correct_kernels_and_unpatches():
    from triton.runtime import interpreter
    with oob.Guard() as g:
        x, y = _copy(_copy_masked)
    assert torch.equal(x, y) and g.checked >= 2
    assert "create_masked_load" not in vars(interpreter.interpreter_builder)


def test_guard_catches_lanes_that_land_in_a_neighbouring_tensor():
    # X and Y share one buffer: an overrun of X lands in Y; only the lane count tells.
    buf = torch.randn(64)
    x, y = buf[:37], buf[40:]

    def run():
        _copy_unmasked_load[(3,)](x, y, 24, BLOCK=16)
    with pytest.raises(CheckFailure, match="out-of-bounds load"):
        oob.call(run, what="neighbour")


def test_canaries():
    t = oob.embed(torch.arange(6.0).view(2, 3), pad=4)
    assert oob.canaries_intact(t) and torch.equal(t, torch.arange(6.0).view(2, 3))
    t._flashbook_canary[0][-1] = 1.0
    assert not oob.canaries_intact(t)
