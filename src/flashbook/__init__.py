"""flashbook: the helper package every chapter of the book imports.

Toolkit modules (one job each; they know no chapter):
    device     GPU detection, CPU fallback (Triton interpreter, Numba simulator), size presets
    reference  float64 references: softmax, attention (GQA, causal/window masks, varlen), FLOPs
    cases      AttnCase (one seeded attention problem), its inputs and reference, and the
               argument validators every kernel wrapper runs
    compare    assert_close and CheckFailure: locate wrong values, with a hint
    check      the graded-check harness: run_student (the one stub/failure reporter),
               check_attention (the one attention check)
    oob        out-of-bounds guard and canaries for Triton kernels in CPU mode
    race       SIMT race checker for Numba CUDA kernels in the simulator
    bench      measuring on a GPU: timing, peak memory, TFLOP/s, % of peak, SDPA baselines
    results    benchmark rows (Row): record with provenance, read back, one plot, one table
    viz        figures that are not benchmark rows: roofline
    sources    the chapter sources (solutions/chN_*.py) and running their cells
    contract   Exercise, Variant, Chapter: what a chapter declares about itself
Chapters and the pipeline:
    chapters   one package per chapter (chapters/chN/): its CHAPTER contract, wrappers, checks,
               figures, known-wrong variants and benchmark
    notebooks  release (student notebooks via nbgrader) and execution of chapter sources
    book       the HTML book build and its benchmark appendix
    grade      the instructor CLI's grading back end (imports nothing of the book)
"""
from .device import setup, current, Backend
from . import check, reference, bench, results, viz  # noqa: E402  (none imports triton/numba)

__version__ = "0.1.0"
__all__ = ["setup", "current", "Backend", "__version__"]
