"""flashbook.conformance, the table of what each public function accepts (run in full on a GPU):
its quick grid in CPU mode, and that it tells a wrong answer from a right one."""
import json

import torch

from flashbook import conformance


def test_the_quick_grid_finds_chapter5s_functions_right(tmp_path):
    out = tmp_path / "c.json"
    assert conformance.main(["--quick", "--only", "ch5", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    names = {r["function"] for r in rows}
    assert names == {"ch5.attention_gqa", "ch5.attention_gqa_two_tiles", "ch5.decode"}, names
    assert all(r["status"] == "ok" and r["max_err"] <= r["tol"] for r in rows), rows


def test_a_wrong_output_is_recorded_as_wrong_and_a_crash_as_an_error():
    want = torch.zeros(3)

    def outcome(call, check=None):
        return conformance._as(conformance._outcome(call, check), torch.float32)
    assert outcome(lambda: want + 1, lambda o: (o - want).abs().max().item())["status"] == "wrong"
    assert outcome(lambda: want, lambda o: (o - want).abs().max().item())["status"] == "ok"
    assert outcome(lambda: 1 / 0)["status"] == "error"
    refused = outcome(lambda: int("x"))
    assert refused["status"] == "refused" and "invalid literal" in refused["note"]
