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


def test_the_two_halves_of_one_kv_tensor_are_told_apart():
    """K and V as views of one (total, 2, H, d) tensor interleave in memory: an address is K's
    or V's by its index, not by the span (the guard took a V row past K's span for K's)."""
    kv = torch.zeros(10, 2, 3, 4)
    k, v = kv[:, 0], kv[:, 1]
    rk, rv = oob.region_of("K", k), oob.region_of("V", v)
    item = kv.element_size()
    at = lambda t, *i: np.array([t[i].data_ptr()], dtype=np.int64)  # noqa: E731
    assert rk.holds(at(k, 9, 2, 3), item).all() and not rv.holds(at(k, 9, 2, 3), item).any()
    assert rv.holds(at(v, 9, 2, 3), item).all() and not rk.holds(at(v, 9, 2, 3), item).any()
    assert rv.holds(at(v, 0, 0, 0), item).all() and not rk.holds(at(v, 0, 0, 0), item).any()
    dense = oob.region_of("Q", torch.zeros(10, 3, 4))
    assert dense.gaps == ()                            # no holes: the span alone decides


@triton.jit
def _scaled(x, SCALE: tl.constexpr):
    return x * 2 if SCALE else x


@triton.jit
def _calls_scaled(X, Y, n_scaled, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + offs)
    for i in range(0, n_scaled):
        x = _scaled(x, True)
    x = _scaled(x, False)
    tl.store(Y + offs, x)


def test_counting_calls_counts_a_helpers_calls_per_program_that_match():
    x = torch.ones(32)
    y = torch.empty(32)
    with oob.counting_calls(_calls_scaled, "_scaled", lambda a: bool(a["SCALE"])) as scaled, \
            oob.counting_calls(_calls_scaled, "_scaled") as every:
        _calls_scaled[(2,)](x, y, 3, BLOCK=16)
    assert {pid[:1]: n for pid, n in scaled.items()} == {(0,): 3, (1,): 3}
    assert {pid[:1]: n for pid, n in every.items()} == {(0,): 4, (1,): 4}
    assert torch.equal(y, torch.full((32,), 8.0))
    assert _calls_scaled.fn.__globals__["_scaled"] is _scaled     # put back
