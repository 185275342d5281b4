"""flashbook: the helper package every chapter of the book imports.

Modules (one job each):
    device     GPU detection, CPU fallback (Triton interpreter, Numba simulator), size presets
    reference  plain torch references (float64 capable): softmax, logsumexp, attention
    check      the graded-check harness used by visible and hidden tests
    bench      timing, TFLOP/s, GB/s, % of peak, SDPA baselines, plots
    viz        figures: roofline, attention matrices
    book       the chapter registry and the notebook pipeline (release, book pages)
    grade      the instructor CLI's grading back end
"""
from .device import setup, current, Backend
from . import check, reference, bench, viz  # noqa: E402  (setup() needs no triton/numba)

__version__ = "0.1.0"
__all__ = ["setup", "current", "Backend", "__version__"]
