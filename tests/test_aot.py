"""flashbook.aot: the stored compile table round-trips, with its provenance and one row a
config, in the order compiled."""
import json

from flashbook import aot


def test_write_compiled_table_round_trips(tmp_path, capsys):
    out = tmp_path / "table.json"
    aot.write_compiled_table(out, "flashbook.chapters.chX.planner", ["--out", str(out)],
                             [(64, 2), (128, 3)],
                             lambda d, s: {"d": d, "stages": s, "shared": d * s},
                             lambda command: {"command": command, "triton": "x"})
    table = json.loads(out.read_text())
    assert table["provenance"] == {
        "command": f"python -m flashbook.chapters.chX.planner --out {out}", "triton": "x"}
    assert table["configs"] == [{"d": 64, "stages": 2, "shared": 128},
                                {"d": 128, "stages": 3, "shared": 384}]
    lines = out.read_text().splitlines()                   # one config a line
    assert '  {"d": 64, "stages": 2, "shared": 128},' in lines
    assert "wrote" in capsys.readouterr().out
