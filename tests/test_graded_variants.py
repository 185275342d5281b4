"""flashbook.graded_variants: known-wrong variants graded through collect -> autograde -> export."""
import os

import pytest

from flashbook import graded_variants, sources
from flashbook.contract import Variant

pytestmark = pytest.mark.slow


def test_the_grader_takes_a_variants_points_and_notices_one_that_keeps_them(monkeypatch):
    monkeypatch.delenv("FLASHBOOK_QUICK_BENCH", raising=False)
    real = {v.name: v for v in sources.variants("ch1")}
    harmless = Variant("comment_reworded", "ch1_softmax",
                       (("# every exponent <= 0", "# every exponent is at most 0"),),
                       expect="anything")
    monkeypatch.setattr(sources, "variants", lambda cid, root=None: (
        real["softmax_without_max_subtraction"], harmless))
    out = graded_variants.grade_chapter("ch1", sources.repo_root(), device="cpu", workers=2,
                                        echo=lambda s: None)
    assert out["solution"]["earned"] == out["solution"]["possible"] == 10
    wrong, same = out["variants"]["softmax_without_max_subtraction"], out["variants"][
        "comment_reworded"]
    assert graded_variants.ok(wrong) and "ch1_softmax_test" in wrong["lost_at"], wrong
    assert wrong["earned"] < 10
    assert same["lost_at"] == [] and same["earned"] == 10 and not graded_variants.ok(same)
    assert graded_variants.verdict(same) == "KEPT EVERY POINT"
    assert "FLASHBOOK_QUICK_BENCH" not in os.environ        # the grader's quick mode, undone


def test_the_summary_keeps_each_variants_newest_run():
    def record(date, commit, earned, lost):
        v = dict(cell="c", earned=earned, lost_at=lost, at_own_exercise=bool(lost),
                 names_its_bug=bool(lost), message="")
        return {"provenance": {"date": date, "commit": commit},
                "chapters": {"ch4": {"solution": {"earned": 11, "possible": 11},
                                     "variants": {"x": v}}}}
    text = graded_variants.summary([record("2026-12-02T18", "bbbbbbbb", 8, ["ch4_t"]),
                                    record("2026-12-01T10", "aaaaaaaa", 11, [])])
    (row,) = [line for line in text.splitlines() if "`x`" in line]
    assert "`bbbbbbb`" in row and "| 8 |" in row and "lost its exercise's points" in row
    assert "KEPT" not in text
