"""Grade real Chapter 1 submissions (correct / untouched / known-wrong, and four that tamper with
the grading) made from the released notebook, through collect -> autograde -> export, in CPU
mode."""
from __future__ import annotations

import copy
import csv
import os
import shutil
import sys
from pathlib import Path

import nbformat
import pytest

from flashbook import sources
from flashbook.grade import autograde as AG
from flashbook.grade import cellmeta
from flashbook.grade import collect as CO
from flashbook.grade import export as EX
from flashbook.grade.layout import Course

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "fixtures" / "grading"))
import course as C  # noqa: E402  (the grading fixtures' shared attacks)

# Tampering, each in an answer cell (the exploit first). Each must earn exactly what its
# real answers earn, and be flagged. Without the guard each of them scored more (10, 10, 8, 10).
REBIND = """
ch1.check_softmax = ch1.check_attention = ch1.check_traffic = lambda *a, **k: None
"""
SYS_MODULES = """
import sys
checks = sys.modules["flashbook.chapters.ch1"]
for name in ("check_softmax", "check_attention", "check_traffic"):
    getattr(checks, name).__code__ = (lambda fn, *args, **kwargs: None).__code__
sys.modules["flashbook.check"].assert_close = lambda *a, **k: None
"""
TORCH = """
import numpy
torch.Tensor.any = lambda self, *a, **k: torch.tensor(False)
torch.allclose = lambda *a, **k: True
torch.testing.assert_close = lambda *a, **k: None
numpy.testing.assert_allclose = lambda *a, **k: None
def naive_attention(q, k, v, scale=None, causal=False):
    return torch.zeros_like(q), torch.zeros(q.shape[:-1])
"""
DISPLAY = C.SILENCE_ERRORS
# student -> (total, {test cell: points} for the cells checked, flag that must be among theirs)
TAMPERING = {
    "rebind": (0, {}, "ch1_softmax:"),
    "sysmodules": (0, {}, "touches sys.modules"),
    "torchpatch": (3, {"ch1_softmax_test": "3", "ch1_attention_test": "0",
                       "ch1_attention_causal_test": "0"}, "torch.Tensor.any"),
    "display": (2, {"ch1_traffic_test": "2", "ch1_softmax_test": "0"}, "calls get_ipython()"),
}


@pytest.mark.slow
def test_grade_chapter1_correct_untouched_wrong(tmp_path, monkeypatch, fresh_release):
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    # a copy of the run's fresh release (every chapter, released once per run by nbgrader)
    course = Course(shutil.copytree(fresh_release.parent / "course", tmp_path / "course"))
    (name,) = course.notebook_names("ch1")
    rel = course.release_notebook("ch1", name)
    src = {cellmeta.grade_id(c): c.source for c in course.source_notebook("ch1", name).cells
           if cellmeta.grade_id(c)}

    correct = copy.deepcopy(rel)
    for cell in correct.cells:
        if cellmeta.is_solution(cell):
            cell.source = src[cellmeta.grade_id(cell)]
    wrong = copy.deepcopy(correct)
    variant = next(v for v in sources.variants("ch1") if v.name == "attention_causal_aligned_top_left")
    next(c for c in wrong.cells
         if cellmeta.grade_id(c) == variant.cell).source = variant.apply(src[variant.cell])
    def answered(nb, **cells):
        nb = copy.deepcopy(nb)
        for cell in nb.cells:
            gid = cellmeta.grade_id(cell)
            if gid in cells:
                cell.source = cells[gid](cell.source)
        return nb
    solution = {g: (lambda _, g=g: src[g]) for g in src}
    classroom = {
        "correct": correct, "untouched": rel, "wrong": wrong,
        "rebind": answered(rel, ch1_softmax=lambda s: s + REBIND),
        "sysmodules": answered(rel, ch1_softmax=lambda s: s + SYS_MODULES),
        "torchpatch": answered(rel, ch1_softmax=solution["ch1_softmax"],
                               ch1_attention=lambda s: s + TORCH),
        "display": answered(rel, ch1_softmax=lambda s: s + DISPLAY,
                            ch1_traffic=solution["ch1_traffic"]),
    }
    downloads = tmp_path / "downloads"
    downloads.mkdir()
    for sid, nb in classroom.items():
        nbformat.write(nb, downloads / f"{sid}_ch1_{name}.ipynb")
    assert len(CO.collect(downloads, "ch1", course)["collected"]) == len(classroom)

    AG.autograde("ch1", course, timeout=400, workers=2, progress=False)
    with open(EX.export(tmp_path / "grades.csv", course, summary=False)["csv"]) as f:
        rows = {r["student_id"]: r for r in csv.DictReader(f)}
    full = float(rows["correct"]["ch1/max"])
    assert full == 10
    assert float(rows["correct"]["ch1/total"]) == full, rows["correct"]
    assert float(rows["untouched"]["ch1/total"]) == 0, rows["untouched"]
    w = rows["wrong"]
    assert w["ch1/ch1_attention_causal_test"] == "0" and w["ch1/ch1_softmax_test"] == "3", w
    assert 0 < float(w["ch1/total"]) < full
    for sid in ("correct", "untouched", "wrong"):           # honest: no flag
        assert rows[sid]["ch1/flags"] == "", (sid, rows[sid]["ch1/flags"])
    for sid, (total, cells, flag) in TAMPERING.items():
        row = rows[sid]
        assert float(row["ch1/total"]) == total, (sid, row)
        assert all(row[f"ch1/{g}"] == p for g, p in cells.items()), (sid, row)
        assert flag in row["ch1/flags"], (sid, row["ch1/flags"])
