"""Shared fixtures. The whole suite runs in CPU mode: the Triton interpreter and the Numba CUDA
simulator, switched on here before anything imports triton or numba."""
import os

os.environ["FLASHBOOK_FORCE_CPU"] = "1"
os.environ["TRITON_INTERPRET"] = "1"
os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
os.environ.setdefault("MPLBACKEND", "Agg")

import collections  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from flashbook import book, notebooks  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


# Parallel runs (pytest-xdist; `make test` passes -n, pyproject.toml --dist loadgroup): each
# worker is its own pytest session, so each would set up the session fixtures below on its own.
# What every worker may share is made once per run by the first worker that asks (`shared_once`:
# a lock file beside it): the distributions, the fresh release. The executed chapter notebooks in
# _build/executed/ are shared the same way (`notebooks.executed_source` locks each chapter), so
# each chapter executes once per run, on whichever worker first needs it. But `built_book` is a
# jupyter-book build into _build/: every test that uses it is put in the xdist group "book", so
# that one worker runs all of them, one after the other, and builds the book once.
SHARED_BUILD_FIXTURES = {"built_book"}


def _uses_build(item) -> bool:
    return not SHARED_BUILD_FIXTURES.isdisjoint(item.fixturenames)   # fixturenames: the closure


def _groups(item) -> set:
    return {m.args[0] if m.args else m.kwargs.get("name", "default")
            for m in item.iter_markers("xdist_group")}


@pytest.hookimpl(tryfirst=True)   # before xdist reads the marks (to route tests to a worker)
def pytest_collection_modifyitems(config, items):
    for item in items:
        if _uses_build(item) and not _groups(item):
            item.add_marker(pytest.mark.xdist_group("book"))


@pytest.hookimpl(tryfirst=True)   # before any fixture is set up
def pytest_runtest_setup(item):
    """Refuse to run a test where it could race another worker over _build/ (an error raised at
    collection would be lost inside an xdist worker; a failed setup is reported)."""
    if _uses_build(item) and _groups(item) != {"book"}:   # xdist would make "book_x" of two
        pytest.fail(f"this test builds into _build/ (built_book): it must be in xdist "
                    f"group 'book' only, not {sorted(_groups(item))}", pytrace=False)
    # xdist tells the controller a test's group by appending "@group" to its node id. With
    # pytest 9.2.0 that silently stopped working (pytest-xdist issue #1386; hence pytest 9.1.1 in
    # constraints.txt), and two workers could then build into _build/ at once.
    if getattr(item.config.option, "loadgroup", False) and _groups(item) \
            and item.nodeid.rfind("@") <= item.nodeid.rfind("]"):   # loadgroup: set in workers only
        pytest.fail("pytest-xdist's --dist loadgroup is not grouping tests with this pytest: "
                    "install the versions in constraints.txt, or run without -n", pytrace=False)


def build_distributions(out: Path) -> Path:
    """`python -m build --no-isolation` of the tracked (and new, not ignored) files, copied out of
    the checkout first (a build in place would leave build/ and egg-info there); returns ``out``."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           cwd=ROOT, capture_output=True, text=True, check=True).stdout
    tree = out.parent / f"{out.name}-tree"
    for rel in filter(None, files.split("\0")):
        if (ROOT / rel).is_file():
            (tree / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, tree / rel)
    proc = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "-o", str(out),
                           str(tree)],
                          capture_output=True, text=True, timeout=300)
    shutil.rmtree(tree)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


@pytest.fixture(scope="session")
def root() -> Path:
    return ROOT


def shared_once(tmp_path_factory, worker_id: str, name: str, make) -> Path:
    """``make(path)`` once per test run, by the first worker that asks; the others wait on its
    lock and reuse the directory (pytest-xdist's workers share their base temp dir's parent)."""
    from filelock import FileLock
    base = tmp_path_factory.getbasetemp()
    base = base.parent if worker_id != "master" else base
    out, done = base / name, base / f"{name}.done"
    with FileLock(str(base / f"{name}.lock")):
        if not done.exists():
            shutil.rmtree(out, ignore_errors=True)
            make(out)
            done.touch()
    return out


@pytest.fixture(scope="session")
def executed_dir() -> Path:
    """Executed chapter notebooks are cached here; the book build reuses them. Shared by all
    workers of a parallel run (``notebooks.executed_source`` locks each chapter)."""
    return ROOT / "_build" / "executed"


def graded_cells(nb) -> dict:
    """{grade id: (score, status, message, points)} of an executed notebook's graded test cells,
    by the grader's own rule (``grade.worker.cell_score``: an error earns 0, a number partial
    credit)."""
    from flashbook.grade import cellmeta, worker
    return {cellmeta.grade_id(c): (*worker.cell_score(c, cellmeta.points(c)), cellmeta.points(c))
            for c in nb.cells if cellmeta.is_graded_test(c)}


@pytest.fixture(scope="session")
def distributions(tmp_path_factory, worker_id) -> dict[str, Path]:
    """The wheel and the sdist of the tracked (and new, not ignored) files, built once per run."""
    out = shared_once(tmp_path_factory, worker_id, "dist", build_distributions)
    return {"wheel": next(out.glob("*.whl")), "sdist": next(out.glob("*.tar.gz"))}


@pytest.fixture(scope="session")
def fresh_release(tmp_path_factory, worker_id) -> Path:
    """A fresh `flashbook release` of every chapter into a scratch course, made once per run;
    returns its output (read only: copy the course beside it before grading in it)."""
    def release(work: Path):
        course = work / "course"
        course.mkdir(parents=True)
        shutil.copy2(ROOT / "autograder" / "nbgrader_config.py", course / "nbgrader_config.py")
        notebooks.release(ROOT, out_dir=work / "notebooks", course=course)
    return shared_once(tmp_path_factory, worker_id, "release", release) / "notebooks"


@pytest.fixture(scope="session")
def built_book(executed_dir) -> Path:
    """Build the student edition of the book once per session; returns index.html."""
    return book.build(ROOT)


# --------------------------------------------------------------- the per-chapter budget

_CHAPTER_IN_NODEID = re.compile(r"(?<![a-z0-9])(ch\d+)(?![0-9])")
_seconds_by_chapter: dict = collections.defaultdict(float)


_CHAPTER_FILE = re.compile(r"tests/test_(ch\d+)(?![0-9])")


def pytest_runtest_logreport(report):
    """Add each test's time to the chapter its id names (``test_ch3.py``, ``[ch3-...]``,
    ``[ch3_attn_test]``). Setup phases count to the chapter of their test file (its own
    fixtures: a compile, its solution's namespace); elsewhere they build what every chapter
    shares (the book, a release), and the grading pipeline's end-to-end tests are the
    pipeline's: both count as shared."""
    m = _CHAPTER_IN_NODEID.search(report.nodeid)
    if report.when == "setup":
        m = _CHAPTER_FILE.search(report.nodeid)
    shared = "tests/test_grading" in report.nodeid or m is None
    _seconds_by_chapter["shared" if shared else m.group(1)] += report.duration


def pytest_terminal_summary(terminalreporter):
    """Print the suite's cost per chapter (the budget in CONTRIBUTING.md is per chapter)."""
    if not _seconds_by_chapter:
        return
    terminalreporter.section("test time by chapter (summed over workers)")
    for name in sorted(_seconds_by_chapter, key=lambda n: (n == "shared", n)):
        terminalreporter.write_line(f"{name:>8}: {_seconds_by_chapter[name]:7.1f} s")


# ------------------------------------------------------- marks of the tests on the built book

# Tests that read the book built into _build/ (the first to ask may build it: the whole book,
# every chapter executed) run on one worker, in the "book" group, with a limit that grows with
# the chapters; the browser and PDF tests also need Debian's chromium.
BOOK_MARKS = [pytest.mark.slow, pytest.mark.xdist_group("book"),
              pytest.mark.timeout(900 * (len(notebooks.sources(ROOT)) + 1))]
CHROMIUM = book.CHROMIUM
NEEDS_CHROMIUM = pytest.mark.skipif(not os.access(CHROMIUM, os.X_OK),
                                    reason="chromium is not installed: sudo apt-get install -y chromium")
