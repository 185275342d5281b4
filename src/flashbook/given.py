"""Package modules generated from the chapter sources, d2l-style: a chapter's code that the
package runs (a later chapter's building blocks, a chapter's given kernel), copied out of the
chapter's code cells so that the chapter source stays the one copy.

A code cell tagged ``export:<module>`` (jupytext: ``# %% tags=["export:flashbook.kernels"]``,
after nbgrader's metadata on a solution cell) goes into that module, one of ``MODULES``: every
top-level function or class of the cell, without the solution markers, in the order of the
chapters and their cells, after a header that says the file is generated and from which cells.
An exported cell holds definitions only (anything else would be lost), and is neither a graded
test nor a demo. ``flashbook release`` (``notebooks.release`` into the repository's
``notebooks/``) rewrites each module; ``tests/test_given.py`` fails when a committed module
differs from what the sources give. The graded answers a generated module holds are listed with
the package's other given answers (``GIVEN`` in ``tests/test_publishing.py``, and the
instructor guide).
"""
from __future__ import annotations

import ast
import dataclasses
import inspect
from pathlib import Path

from .grade.cellmeta import grade_id, is_graded_test
from .sources import is_demo, read, repo_root, sources

MARKERS = ("### BEGIN SOLUTION", "### END SOLUTION")
TAG = "export:"           # a cell tag "export:flashbook.kernels": the cell goes into that module


@dataclasses.dataclass(frozen=True)
class Generated:
    module: str              # "flashbook.kernels": what the cells' tag names
    doc: str                 # the module's docstring
    imports: str             # the imports the definitions need (the chapter's setup cell
                             # imports more, and runs fb.setup())

    @property
    def path(self) -> str:   # in src/: "flashbook/kernels.py"
        return self.module.replace(".", "/") + ".py"


_TRITON = "import triton\nimport triton.language as tl\n"

MODULES = (
    Generated("flashbook.kernels", imports=_TRITON, doc=inspect.cleandoc("""
        Triton building blocks that Chapters 3 and 4 derive as exercises, solved, for the
        later chapters to build on (import this module after ``flashbook.setup()``: it imports
        Triton).

        * ``program_tile``: which query tile and which (sequence, head) pair a program takes,
          walking sections of pairs with their longest rows first (Chapter 4, Section 4).
        * ``attn_scores``, ``attn_update``, ``attn_step``: one K/V tile of the online softmax,
          with or without a mask (Chapter 3's loop body, Chapter 4's masked version);
          ``attn_two_tile_step``: the same for two query tiles, ordered so each softmax
          overlaps the other's matmul.
        * ``visible_pairs``, ``key_tiles``: the bottom-right causal / sliding-window mask of a
          tile, and the key tiles a program visits with the full ones among them (Chapter 4,
          Exercise 2a).""")),
    Generated("flashbook.gqa_kernels", doc=inspect.cleandoc("""
        Chapter 5's packed GQA forward in its two-tile form, the forward Chapter 9
        differentiates (``ch9.forward``): the answer to Chapter 5's optional Exercise 1b, the one
        answer of that chapter the package holds (Exercise 1's one-tile kernel stays out of it).
        Launch it with ``flashbook.gqa.launch_gqa(..., two_tiles=True)``. Import this module after
        ``flashbook.setup()``: it imports Triton."""),
              imports=_TRITON + "\nfrom flashbook.kernels import attn_two_tile_step, key_tiles, "
                                "program_tile, visible_pairs\n"),
    Generated("flashbook.lazy_kernels", imports=_TRITON, doc=inspect.cleandoc("""
        Chapter 7's kernel of Exercise 2 (lazy rescaling): Chapter 3's forward (one query tile a
        program, unmasked full key tiles, one masked tail tile, deferred normalisation) with its
        online-softmax step handed in as ``UPDATE`` (the student's ``lazy_update``) and its
        exponential as ``EXP2`` (``hw_exp2``, or Exercise 3's polynomial); it counts, per program,
        the steps that moved the reference max. ``ch7.launch_lazy`` launches it. Import this
        module after ``flashbook.setup()``: it imports Triton.""")),
)


@dataclasses.dataclass(frozen=True)
class Definition:
    name: str
    text: str                # the source, decorators included, solution markers left out
    source: str              # "solutions/ch4_masks_varlen.py"
    cell: str                # "solution cell ch4_masks" or "a given code cell"


def _targets(cell) -> list[str]:
    return [t[len(TAG):] for t in cell.get("metadata", {}).get("tags", []) if t.startswith(TAG)]


def drop_export_tags(cell) -> None:
    """Take the export tags off a cell of a notebook made from a chapter source."""
    if _targets(cell):
        cell.metadata["tags"] = [t for t in cell.metadata["tags"] if not t.startswith(TAG)]
        if not cell.metadata["tags"]:
            del cell.metadata["tags"]


def exported(root: Path | None = None) -> dict[str, list[Definition]]:
    """{module: its definitions, in the order of the chapters and their cells}, from every
    chapter source's cells tagged ``export:<module>``. A ValueError names a tag of no module
    in ``MODULES``, a graded test or demo cell tagged, a statement that is no definition, or a
    name defined twice in one module."""
    root = root or repo_root()
    known = {m.module for m in MODULES}
    out: dict[str, list[Definition]] = {m: [] for m in known}
    for src in sources(root):
        rel = src.path.relative_to(root).as_posix()
        for cell in read(src.path).cells:
            targets = _targets(cell)
            if not targets:
                continue
            where = f"{rel}, cell {grade_id(cell) or repr(cell.source[:60])}"
            if len(targets) > 1 or targets[0] not in known:
                raise ValueError(f"{where}: tagged {targets}; the modules: {sorted(known)}")
            if cell.cell_type != "code" or is_graded_test(cell) or is_demo(cell):
                raise ValueError(f"{where}: only a solution or given code cell is exported")
            lines = cell.source.splitlines()
            for node in ast.parse(cell.source).body:
                if not isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                    raise ValueError(f"{where}: an exported cell holds definitions only; line "
                                     f"{node.lineno} is a {type(node).__name__}")
                first = min([d.lineno for d in node.decorator_list] + [node.lineno])
                text = [x for x in lines[first - 1:node.end_lineno] if x.strip() not in MARKERS]
                if any(d.name == node.name for d in out[targets[0]]):
                    raise ValueError(f"{where}: {targets[0]} defines {node.name} twice")
                cell_name = (f"solution cell {grade_id(cell)}" if grade_id(cell)
                             else "a given code cell")
                out[targets[0]].append(Definition(node.name, "\n".join(text), rel, cell_name))
    return out


def render(module: Generated, definitions: list[Definition]) -> str:
    """The text of ``module`` holding ``definitions`` (its part of ``exported``)."""
    if not definitions:
        raise ValueError(f"{module.path}: no chapter cell is tagged {TAG}{module.module}")
    files = list(dict.fromkeys(d.source for d in definitions))
    whence = "".join(f"#   {d.name}: " + (f"{d.source}, " if len(files) > 1 else "")
                     + f"{d.cell}\n" for d in definitions)
    header = (f"# Generated from {' and '.join(files)} by `flashbook release` (make release): "
              f"do not edit.\n# Edit the cells tagged {TAG}{module.module} there and release "
              f"again\n# (tests/test_given.py fails while this file differs from them):\n"
              f"{whence}")
    body = "\n\n\n".join(d.text for d in definitions)
    return f'{header}"""{module.doc}\n"""\n{module.imports}\n\n{body}\n'


def rendered(root: Path | None = None) -> dict[str, str]:
    """{path in src/: the text the sources give now} of every generated module."""
    found = exported(root)
    return {m.path: render(m, found[m.module]) for m in MODULES}


def stale(root: Path | None = None) -> list[str]:
    """The generated modules whose file differs from what the sources give."""
    root = root or repo_root()
    return [p for p, text in rendered(root).items()
            if not (root / "src" / p).is_file() or (root / "src" / p).read_text() != text]


def write(root: Path | None = None) -> list[Path]:
    """Rewrite every generated module that differs from its sources; the paths written."""
    root = root or repo_root()
    written = []
    for p, text in rendered(root).items():
        path = root / "src" / p
        if not path.is_file() or path.read_text() != text:
            path.write_text(text)
            written.append(path)
    return written
