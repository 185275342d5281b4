"""Grade real Chapter 1 submissions (correct / untouched / known-wrong) made from the released
notebook, through collect -> autograde -> export, in CPU mode."""
from __future__ import annotations

import copy
import csv
import os
import shutil
import sys
from pathlib import Path

import nbformat
import pytest

from flashbook import notebooks
from flashbook.chapters import ch1
from flashbook.grade import autograde as AG
from flashbook.grade import cellmeta
from flashbook.grade import collect as CO
from flashbook.grade import export as EX
from flashbook.grade.layout import Course

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_grade_chapter1_correct_untouched_wrong(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    root = tmp_path / "course"
    root.mkdir()
    shutil.copy(REPO / "autograder" / "nbgrader_config.py", root)
    (released,) = notebooks.release(out_dir=tmp_path / "notebooks", course=root, only=["ch1"])
    course = Course(root)
    rel = nbformat.read(released, as_version=4)
    name = released.stem
    src = {cellmeta.grade_id(c): c.source for c in course.source_notebook("ch1", name).cells
           if cellmeta.grade_id(c)}

    correct = copy.deepcopy(rel)
    for cell in correct.cells:
        if cellmeta.is_solution(cell):
            cell.source = src[cellmeta.grade_id(cell)]
    wrong = copy.deepcopy(correct)
    variant = next(v for v in ch1.VARIANTS if v.name == "attention_causal_aligned_top_left")
    next(c for c in wrong.cells
         if cellmeta.grade_id(c) == variant.cell).source = variant.apply(src[variant.cell])
    downloads = tmp_path / "downloads"
    downloads.mkdir()
    for sid, nb in (("correct", correct), ("untouched", rel), ("wrong", wrong)):
        nbformat.write(nb, downloads / f"{sid}_ch1_{name}.ipynb")
    assert len(CO.collect(downloads, "ch1", course)["collected"]) == 3

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
