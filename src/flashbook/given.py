"""Package modules generated from the chapter sources: a chapter's solved code that a later
chapter runs on, copied out of its solution cells, so that the solution stays the one source.

``flashbook release`` (``notebooks.release`` into the repository's ``notebooks/``) rewrites
each module of ``MODULES`` from ``solutions/``; ``tests/test_given.py`` fails when a committed
module differs from what the sources give. A generated module holds the named top-level
definitions of the chapter's code cells, in the order named, without the solution markers,
after a header that says where they come from. The graded answers a generated module holds
are listed with the package's other given answers (``GIVEN`` in ``tests/test_publishing.py``,
and the instructor guide).
"""
from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from .grade.cellmeta import grade_id, is_graded_test
from .sources import is_demo, read, repo_root, source

MARKERS = ("### BEGIN SOLUTION", "### END SOLUTION")


@dataclasses.dataclass(frozen=True)
class Generated:
    path: str                # in the package: "flashbook/gqa_kernels.py"
    chapter: str             # the chapter whose solution cells it copies: "ch5"
    names: tuple[str, ...]   # the top-level definitions it copies, in this order
    doc: str                 # the module's docstring
    imports: str             # the imports the definitions need (the chapter's setup cell
                             # imports more, and runs fb.setup())


MODULES = (
    Generated(
        path="flashbook/gqa_kernels.py",
        chapter="ch5",
        names=("store_folded_rows", "attn_gqa_two_tiles"),
        doc="Chapter 5's packed GQA forward in its two-tile form, the forward Chapter 9\n"
            "differentiates (``ch9.forward``): the answer to Chapter 5's optional Exercise 1b, "
            "the one\nanswer of that chapter the package holds (Exercise 1's one-tile kernel "
            "stays out of it).\nLaunch it with ``flashbook.gqa.launch_gqa(..., two_tiles=True)``. "
            "Import this module after\n``flashbook.setup()``: it imports Triton.",
        imports="import triton\nimport triton.language as tl\n\n"
                "from flashbook.kernels import attn_two_tile_step, key_tiles, program_tile, "
                "visible_pairs\n"),
)


def _definitions(chapter_id: str, root: Path | None) -> dict[str, tuple[str, str]]:
    """{name: (source text, the cell's grade id or None)} of every top-level function or class
    defined in the chapter's code cells (graded tests and demo cells excluded)."""
    out = {}
    for cell in read(source(chapter_id, root).path).cells:
        if cell.cell_type != "code" or is_graded_test(cell) or is_demo(cell):
            continue
        lines = cell.source.splitlines()
        for node in ast.parse(cell.source).body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                first = min([d.lineno for d in node.decorator_list] + [node.lineno])
                text = [x for x in lines[first - 1:node.end_lineno] if x.strip() not in MARKERS]
                out[node.name] = ("\n".join(text), grade_id(cell))
    return out


def render(module: Generated, root: Path | None = None) -> str:
    """The text of ``module`` as the chapter's solution source gives it now."""
    root = root or repo_root()
    found = _definitions(module.chapter, root)
    missing = [n for n in module.names if n not in found]
    if missing:
        raise ValueError(f"{module.path}: {module.chapter}'s solution defines no {missing}")
    src = source(module.chapter, root).path.relative_to(root).as_posix()
    whence = "".join(f"#   {n}: " + (f"solution cell {found[n][1]}\n" if found[n][1] else
                                      "an ungraded code cell\n") for n in module.names)
    header = (f"# Generated from {src} by `flashbook release` (make release): do not edit.\n"
              f"# Edit the solution and release again (tests/test_given.py checks this file).\n"
              f"{whence}")
    body = "\n\n\n".join(found[n][0] for n in module.names)
    return f'{header}"""{module.doc}\n"""\n{module.imports}\n\n{body}\n'


def stale(root: Path | None = None) -> list[str]:
    """The generated modules whose file differs from what the sources give."""
    root = root or repo_root()
    out = []
    for m in MODULES:
        path = root / "src" / m.path
        if not path.is_file() or path.read_text() != render(m, root):
            out.append(m.path)
    return out


def write(root: Path | None = None) -> list[Path]:
    """Rewrite every generated module that differs from its sources; the paths written."""
    root = root or repo_root()
    written = []
    for m in MODULES:
        path, text = root / "src" / m.path, render(m, root)
        if not path.is_file() or path.read_text() != text:
            path.write_text(text)
            written.append(path)
    return written
