"""Shared fixtures. The whole suite runs in CPU mode: the Triton interpreter and the Numba CUDA
simulator, switched on here before anything imports triton or numba."""
import os

os.environ["FLASHBOOK_FORCE_CPU"] = "1"
os.environ["TRITON_INTERPRET"] = "1"
os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
os.environ.setdefault("MPLBACKEND", "Agg")

import shutil  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from flashbook import notebooks  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def root() -> Path:
    return ROOT


@pytest.fixture(scope="session")
def executed_dir() -> Path:
    """Executed chapter notebooks are cached here; the book build reuses them."""
    return ROOT / "_build" / "executed"


@pytest.fixture(scope="session")
def fresh_release(tmp_path_factory) -> Path:
    """A fresh `flashbook release` of every chapter into a scratch course; returns its output."""
    work = tmp_path_factory.mktemp("release")
    course = work / "course"
    course.mkdir()
    shutil.copy2(ROOT / "autograder" / "nbgrader_config.py", course / "nbgrader_config.py")
    out = work / "notebooks"
    notebooks.release(ROOT, out_dir=out, course=course)
    return out


@pytest.fixture(scope="session")
def built_book(executed_dir) -> Path:
    """Build the student edition of the book once per session; returns index.html."""
    from flashbook import book
    return book.build(ROOT)
