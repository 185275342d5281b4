"""Repair a submitted notebook against the release it came from.

Editors and students break nbgrader's cell metadata (nbgrader #424, #1083, #1398). We match
every cell of the submission to a cell of the release, strongest evidence first:

1. the marker line ``# flashbook: <grade_id>`` in its source (survives every editor),
2. its nbgrader ``grade_id`` metadata,
3. its nbformat cell id (kept by Jupyter, VS Code and Colab),
4. for locked cells: its source, equal to the release's.

Then: restore the release's metadata on matched cells, restore the release's source of locked
and test cells (edited test, older release), resolve duplicated grade ids (keep the student's
answer), and re-insert graded cells that were deleted. Every change is logged.
"""
from __future__ import annotations

import copy
import uuid

import nbformat

from . import cellmeta
from .markers import find_marker


def _norm(source: str) -> str:
    return "\n".join(line.rstrip() for line in (source or "").strip().splitlines())


def _kind(cell) -> str:
    if cellmeta.is_solution(cell):
        return "solution cell"
    if cellmeta.is_graded(cell):
        return "test cell"
    return "locked cell"


def repair(student, release) -> tuple[object, list[str]]:
    """Return (repaired copy of ``student``, log lines) — ``release`` is the released notebook."""
    nb = copy.deepcopy(student)
    log: list[str] = []
    rel_cells = [c for c in release.cells if cellmeta.grade_id(c)]
    rel = {cellmeta.grade_id(c): c for c in rel_cells}
    rel_order = [cellmeta.grade_id(c) for c in rel_cells]
    rel_by_cellid = {c.get("id"): cellmeta.grade_id(c) for c in rel_cells if c.get("id")}
    rel_by_source = {_norm(c.source): cellmeta.grade_id(c) for c in rel_cells
                     if cellmeta.is_locked(c) and _norm(c.source)}

    # 1. match every cell to a release grade id
    matched: list[str | None] = []
    for cell in nb.cells:
        gid = None
        marker, meta_id = find_marker(cell.get("source", "")), cellmeta.grade_id(cell)
        if marker in rel:
            gid = marker
        elif meta_id in rel:
            gid = meta_id
        elif cell.get("id") in rel_by_cellid and not cellmeta.nbgrader_meta(cell):
            gid = rel_by_cellid[cell.get("id")]
        elif _norm(cell.get("source", "")) in rel_by_source:
            gid = rel_by_source[_norm(cell.get("source", ""))]
        if meta_id and gid and meta_id != gid:
            log.append(f"cell metadata said {meta_id!r} but the cell is {gid!r}: fixed")
        elif meta_id and gid is None:
            log.append(f"cell with grade id {meta_id!r} is not in the release (older release?): "
                       "kept as an ordinary cell")
        matched.append(gid)

    # 2. duplicated grade ids: keep one graded copy per id
    keep = [True] * len(nb.cells)
    plain = [False] * len(nb.cells)       # keep the code, drop the grading metadata
    for gid in rel_order:
        idx = [i for i, g in enumerate(matched) if g == gid]
        if len(idx) < 2:
            continue
        if cellmeta.is_solution(rel[gid]):
            stub = _norm(rel[gid].source)
            answers = [i for i in idx if _norm(nb.cells[i].source) != stub]
            chosen = answers[-1] if answers else idx[0]
            for i in idx:
                if i == chosen:
                    continue
                if i in answers:
                    plain[i] = True       # runs before the chosen copy, as in the student's run
                else:
                    keep[i] = False       # an untouched stub would overwrite the answer
            log.append(f"grade id {gid!r} appeared {len(idx)} times: kept the student's answer "
                       f"(copy {idx.index(chosen) + 1}), removed the other copies' grading")
        else:
            for i in idx[1:]:
                keep[i] = False
            log.append(f"{_kind(rel[gid])} {gid!r} appeared {len(idx)} times: removed the copies")

    # 3. restore metadata (and locked sources) of matched cells
    cells, where = [], {}
    for i, cell in enumerate(nb.cells):
        if not keep[i]:
            continue
        gid = matched[i]
        if gid is None or plain[i]:
            cellmeta.drop_meta(cell)
            cells.append(cell)
            continue
        rcell = rel[gid]
        kind = _kind(rcell)
        if cellmeta.nbgrader_meta(cell) != cellmeta.nbgrader_meta(rcell):
            if not cellmeta.nbgrader_meta(cell):
                log.append(f"{kind} {gid!r} had lost its nbgrader metadata: restored")
            elif cellmeta.grade_id(cell) == gid:
                log.append(f"{kind} {gid!r} had changed nbgrader metadata: restored")
        cellmeta.set_meta(cell, cellmeta.nbgrader_meta(rcell))
        if cell.cell_type != rcell.cell_type:
            log.append(f"{kind} {gid!r} was turned into {cell.cell_type}: restored")
            cell = copy.deepcopy(rcell)
        if cellmeta.is_locked(rcell) and _norm(cell.source) != _norm(rcell.source):
            log.append(f"{kind} {gid!r} differed from the release (edited, or an older "
                       "release): restored")
            cell.source = rcell.source
        where[gid] = len(cells)
        cells.append(cell)

    # 4. re-insert deleted cells after the cell that precedes them in the release
    for k, gid in enumerate(rel_order):
        if gid in where:
            continue
        prev = [where[g] for g in rel_order[:k] if g in where]
        pos = max(prev) + 1 if prev else 0
        cells.insert(pos, copy.deepcopy(rel[gid]))
        where = {g: (p + 1 if p >= pos else p) for g, p in where.items()}
        where[gid] = pos
        log.append(f"{_kind(rel[gid])} {gid!r} was missing: re-inserted from the release")

    # 5. notebook-level fixes: unique cell ids, the release's kernel
    seen = set()
    for cell in cells:
        if "id" in cell and cell["id"] in seen:
            cell["id"] = uuid.uuid4().hex[:8]
        seen.add(cell.get("id"))
    nb.cells = cells
    if "kernelspec" in release.metadata:
        nb.metadata["kernelspec"] = copy.deepcopy(release.metadata["kernelspec"])
    nb.nbformat, nb.nbformat_minor = 4, max(nb.get("nbformat_minor", 5), 5)
    for cell in nb.cells:            # cell ids are required from nbformat 4.5 on
        cell.setdefault("id", uuid.uuid4().hex[:8])
    nbformat.validate(nb)
    return nb, log
