"""flashbook: the helper package every chapter of the book imports.

Toolkit modules (one job each; they know no chapter):
    device     GPU detection, CPU fallback (Triton interpreter, Numba simulator), size presets
    versions   the toolchain versions the book needs (pyproject's lower bounds) and has here
    reference  float64 references: softmax, attention (GQA, causal/window masks, varlen), FLOPs
    cases      AttnCase (one seeded attention problem), its inputs and reference, and the
               argument validators every kernel wrapper runs
    launcher   what a wrapper does at call time: output buffers, grid arithmetic, index values
               read without a GPU sync (re-exported by cases)
    compare    assert_close and CheckFailure: locate wrong values, with a hint
    check      the graded-check harness: run_student (the one stub/failure reporter),
               check_attention (the one attention check)
    oob        out-of-bounds guard and canaries for Triton kernels in CPU mode
    race       SIMT race checker for Numba CUDA kernels in the simulator
    bench      measuring on a GPU: timing, peak memory, TFLOP/s, % of peak, SDPA baselines
    results    benchmark rows (Row): record with provenance, read back, one plot, one table
    quoted     the measured figures a chapter's prose pastes in with myst-nb's glue
    viz        figures that are not benchmark rows: roofline
    sources    the chapter sources (solutions/chN_*.py) and running their cells
    contract   Exercise, Variant, Chapter: what a chapter declares about itself
    shipping   a student's functions sent to a child process by value (cloudpickle), cell sources too
    aot        ahead-of-time compiles of Gluon kernels (no GPU needed) and their stored tables
    overhead, sweep, conformance, graded_variants
               GPU records: host time per call, the sweep of shapes, what each public
               function accepts, known-wrong variants graded through autograde
    gluon_kit  what the Gluon kernels share: TMA and barrier names across Triton versions,
               tile helpers, the dense-input checks
    kernels    the Triton building blocks Chapters 3 and 4 derive, solved, for later chapters
               (generated, as are gqa_kernels and lazy_kernels: see given)
Chapters and the pipeline:
    chapters   one package per chapter (chapters/chN/): its CHAPTER contract, wrappers, checks,
               figures, known-wrong variants and benchmark
    notebooks  release (student notebooks via nbgrader) and execution of chapter sources
    given      the package modules a release generates from the chapter cells tagged
               export:<module> (kernels.py, gqa_kernels.py, lazy_kernels.py)
    book       the HTML book build and its benchmark appendix (sphinxext: its HTML fixes)
    grade      the instructor CLI's grading back end (imports nothing of the book)
    cli        the ``flashbook`` command: release, book, bench, grading
    publish    the published addresses, badges and project URLs, from one repository address
    colab_install  the install step of every notebook's Colab setup cell (and of a chapter's
               extra packages, installed only when missing)
"""
import importlib

from .device import setup, current, Backend


def check_values(on: bool = True):
    """Context manager: the wrappers check their index tensors' values on a GPU too (one host
    sync per new tensor); see ``flashbook.cases.check_values``."""
    from .cases import check_values as on_request
    return on_request(on)

__version__ = "0.1.0"
__all__ = ["setup", "current", "Backend", "check_values", "__version__"]

# `fb.check`, `fb.bench`, ... are imported on first use (PEP 562): they import torch and
# matplotlib, which the grader's worker processes and the command line never need (about 3 s
# a process). None of them imports triton or numba, so `fb.setup()` may still come after.
_LAZY = ("check", "reference", "bench", "results", "viz")


def __getattr__(name: str):
    if name in _LAZY:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
