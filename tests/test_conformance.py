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


def test_every_public_function_refuses_another_head_dim_saying_why_and_the_way_out():
    """d = 24 (a multiple of 8, not a power of two): a ValueError that gives the reason and the
    zero-padding way out, not a shape complaint about k and v."""
    from flashbook import sources
    ns = {c: sources.solution_namespace(c) for c in ("ch3", "ch4", "ch5", "ch7", "ch8", "ch9")}
    dense = [(24, "fp32", (8, 8), False)]
    rows = (conformance._dense_rows(ns["ch3"], "ch3.attention", "attention", dense, "dense")
            + conformance._dense_rows(ns["ch7"], "ch7.attention_lazy", "attention_lazy", dense,
                                      "dense")
            + conformance._packed_rows(ns["ch4"], "ch4", "attention_varlen",
                                       [(24, "fp32", 1, "causal")], small=True)
            + conformance._packed_rows(ns["ch5"], "ch5", "attention_gqa",
                                       [(24, "fp32", 3, "none")], small=True)
            + conformance._decode_rows(ns["ch5"], "ch5.decode", [(24, "fp32", 2, 1, False)],
                                       split=False, small=True)
            + conformance._decode_rows(ns["ch8"], "ch8", [(24, "fp32", 2, 1, False)],
                                       split=True, small=True)
            + conformance._trainable_rows(ns["ch9"], [(24, "fp32", "bnhd", True)], small=True))
    for r in rows:
        assert r["status"] == "refused", r
        assert "head dimension" in r["note"] and "zero-pad" in r["note"], r


def test_the_summary_lists_what_each_function_took_and_counts_the_rest(tmp_path, capsys):
    rows = [dict(function="f", d=64, dtype="fp16", mode="causal", G=1, status="ok"),
            dict(function="f", d=128, dtype="fp32", mode="none", G=3, status="ok"),
            dict(function="f", d=96, dtype="fp16", mode="none", G=1, status="refused"),
            dict(function="g", d=32, dtype="bf16", mode="none", status="wrong"),
            dict(function="g", d=32, dtype="fp16", mode="none", status="error")]
    record = tmp_path / "r.json"
    record.write_text(json.dumps(dict(provenance={}, rows=rows)))
    assert conformance.main(["--summary", str(record)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[2] == "| f | 64; 128 | fp16; fp32 | causal; none | 1; 3 | 2 | 1 | 0 |"
    assert lines[3] == "| g | - | - | - | - | 0 | 0 | 2 |"


def test_the_benchmarks_page_shows_the_recorded_table_with_its_provenance():
    from flashbook import book
    page = book.benchmarks_page()
    record = json.loads((book.CONFORMANCE_DIR / "h200.json").read_text())
    assert "## What the functions accept: NVIDIA H200" in page
    for p in record["provenance"]:
        assert p["commit"] and f"`{p['commit']}`" in page
    for fn in {r["function"] for r in record["rows"]}:
        assert f"\n| {fn} | " in page, fn
