"""The race checker (flashbook.race): a correct kernel passes and computes, a missing barrier and
barriers that not every thread reaches are reported, with the threads and the line."""
import numpy as np
import pytest
from numba import cuda, float32   # conftest switched on the simulator before this import

from flashbook.check import CheckFailure
from flashbook.race import RaceError, race_check


@cuda.jit
def _reverse_ok(a, n):
    s = cuda.shared.array(0, dtype=float32)
    t = cuda.threadIdx.x
    s[t] = a[t]
    cuda.syncthreads()
    v = s[n - 1 - t]
    cuda.syncthreads()
    a[t] = v


@cuda.jit
def _reverse_no_barrier(a, n):
    s = cuda.shared.array(0, dtype=float32)
    t = cuda.threadIdx.x
    s[t] = a[t]
    a[t] = s[n - 1 - t]


@cuda.jit
def _divergent_barrier(a, n):
    t = cuda.threadIdx.x
    if t < n // 2:
        cuda.syncthreads()
    a[t] = 1.0


@cuda.jit
def _two_barrier_sites(a, n):
    t = cuda.threadIdx.x
    if t < n // 2:
        cuda.syncthreads()
    else:
        cuda.syncthreads()
    a[t] = 1.0


def test_a_correct_kernel_passes_and_computes():
    a = np.arange(8, dtype=np.float32)
    race_check(_reverse_ok, (1,), (8,), (a, 8), 32)
    assert a.tolist() == list(range(7, -1, -1))


def test_a_missing_barrier_is_a_race():
    with pytest.raises(RaceError, match=r"thread 4 writes dynamic\[4\] which thread 3 read") as e:
        race_check(_reverse_no_barrier, (1,), (8,), (np.arange(8, dtype=np.float32), 8), 32)
    assert isinstance(e.value, CheckFailure)      # a failed check, for the graded cells


def test_threads_that_return_while_others_wait_at_a_barrier():
    with pytest.raises(RaceError, match="returned while threads .* wait"):
        race_check(_divergent_barrier, (1,), (8,), (np.zeros(8, np.float32), 8), 0)


def test_threads_waiting_at_different_barriers():
    with pytest.raises(RaceError, match="waits at the cuda.syncthreads"):
        race_check(_two_barrier_sites, (1,), (8,), (np.zeros(8, np.float32), 8), 0)
