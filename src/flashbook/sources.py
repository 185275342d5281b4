"""The chapter sources: ``solutions/chN_slug.py``, one per chapter, in jupytext percent format
with nbgrader cell metadata, and how to run their code outside a notebook.

``solution_namespace`` executes a chapter's definition cells (no tests, no demos) and returns
their globals: how benchmarks get the chapter's kernels and how tests get the solution, without
a second copy of the code.
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import linecache
import os
import re
import sys
import types
from pathlib import Path

from .grade.cellmeta import grade_id, is_graded_test

TAG_DEMO = "demo"     # plots, benchmarks, illustrations: skipped by known-wrong tests and bench


@dataclasses.dataclass(frozen=True)
class Source:
    id: str          # "ch1": also the nbgrader assignment name
    name: str        # "ch1_naive_attention": the notebook's file name without extension
    path: Path       # solutions/ch1_naive_attention.py


def repo_root() -> Path:
    """The checkout this package runs from (src layout: src/flashbook/ -> repo)."""
    env = os.environ.get("FLASHBOOK_ROOT")
    return Path(env) if env else Path(__file__).resolve().parents[2]


def sources(root: Path | None = None) -> list[Source]:
    root = root or repo_root()
    out = []
    for path in sorted((root / "solutions").glob("ch*_*.py")):
        m = re.fullmatch(r"(ch\d+)_\w+", path.stem)
        if m:
            out.append(Source(m.group(1), path.stem, path))
    return sorted(out, key=lambda c: int(c.id[2:]))


def source(chapter_id: str, root: Path | None = None) -> Source:
    for c in sources(root):
        if c.id == chapter_id:
            return c
    raise ValueError(f"no chapter {chapter_id!r} in solutions/")


def course_module(relative: str, root: Path | None = None) -> types.ModuleType:
    """A Python file of the course that is not in the package because it quotes solutions
    (``solutions/variants/ch3.py``, ``solutions/extras/ch9_one_kernel.py``), imported from the
    checkout (once per process). A ValueError names the file where the checkout lacks it."""
    root = root or repo_root()
    path = root / "solutions" / relative
    if not path.is_file():
        raise ValueError(f"{path} is not there: it is course material (it quotes solutions), in "
                         "the repository's solutions/ folder, not in the package")
    name = "flashbook_course." + relative.removesuffix(".py").replace("/", ".")
    module = sys.modules.get(name)
    if module is None or getattr(module, "__file__", None) != str(path):
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module          # before running it: dataclasses look it up
        spec.loader.exec_module(module)
    return module


def variants(chapter_id: str, root: Path | None = None) -> tuple:
    """The chapter's known-wrong variants (``contract.Variant``): ``VARIANTS`` of
    ``solutions/variants/<chapter_id>.py`` in the course's checkout (they quote the solution,
    so they are not in the package)."""
    return tuple(course_module(f"variants/{chapter_id}.py", root).VARIANTS)


def read(path: Path):
    """The solution notebook (nbformat v4) from its jupytext percent source."""
    import jupytext
    return jupytext.read(path, fmt="py:percent")


def is_demo(cell) -> bool:
    return TAG_DEMO in cell.get("metadata", {}).get("tags", [])


def cells_by_id(nb) -> dict[str, str]:
    """{grade_id: source} of every cell that has a grade_id."""
    return {grade_id(c): c.source for c in nb.cells if grade_id(c)}


def fresh_module(name: str) -> types.ModuleType:
    """An empty module registered in sys.modules, to execute notebook cells in: tools such as
    dataclasses look their class's module up there."""
    module = types.ModuleType(name)
    sys.modules[name] = module
    return module


def exec_cell(source: str, name: str, ns: dict):
    """Execute one cell's source in ``ns``, registered in linecache so that tools reading the
    source back (inspect, and so @triton.jit) find it. Give every distinct source its own
    ``name``: Triton reads a kernel's source back lazily."""
    linecache.cache[name] = (len(source), None, source.splitlines(True), name)
    exec(compile(source, name, "exec"), ns)


def cell_name(chapter_id: str, index: int, source: str) -> str:
    return f"<{chapter_id} cell {index} {hashlib.sha1(source.encode()).hexdigest()[:12]}>"


def solution_namespace(chapter_id: str, root: Path | None = None,
                       replace: dict | None = None) -> dict:
    """Execute the chapter's code cells except graded tests and demo cells; return the globals.

    ``replace`` maps grade_ids to other cell sources (stubs, known-wrong answers).
    """
    nb = read(source(chapter_id, root).path)
    ns = fresh_module(f"flashbook_solution_{chapter_id}").__dict__
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code" and not is_graded_test(cell) and not is_demo(cell):
            src = (replace or {}).get(grade_id(cell), cell.source)
            exec_cell(src, cell_name(chapter_id, i, src), ns)
    return ns
