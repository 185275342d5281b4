"""flashbook.aot: the stored compile table round-trips, with its provenance and one row a
config, in the order compiled; ``sass_loops`` finds the innermost MMA loops of a listing."""
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


SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   SHFL.IDX PT, R2, R3, R4, 0x1f ;
        /*0020*/                   QGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR8], RZ, !UPT ;
        /*0030*/                   SHFL.IDX PT, R2, R3, R4, 0x1f ;
        /*0040*/                   PRMT R5, R6, 0x5410, R7 ;
        /*0050*/               @P0 BRA 0x20 ;
        /*0060*/                   SHFL.BFLY PT, R2, R3, 0x1, 0x1f ;
        /*0070*/               @P1 BRA 0x60 ;
        /*0080*/              @!P2 BRA 0x10 ;
        /*0090*/                   EXIT ;
"""


def test_sass_loops_counts_the_innermost_loops_with_an_mma():
    """0x20-0x50 is an MMA loop; 0x60-0x70 has no MMA; 0x10-0x80 holds other loops."""
    assert aot.sass_loops(SASS, ("SHFL.IDX", "PRMT", "SHFL")) == [
        dict(start="0x20", end="0x50", n=4, mma=1, **{"SHFL.IDX": 1, "PRMT": 1, "SHFL": 1})]


MASKED = """
        /*0000*/                   QGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR8], RZ, !UPT ;
        /*0010*/              @!P0 BRA 0x40 ;
        /*0020*/                   FSEL R26, R26, -INF , !P1 ;
        /*0030*/                   FSEL R27, R27, -INF , !P1 ;
        /*0040*/                   MUFU.EX2 R3, R4 ;
        /*0050*/              @!P3 BRA 0x1000 ;
        /*0060*/               @P2 BRA 0x0 ;
        /*0070*/                   EXIT ;
"""


def test_sass_loops_taken_leaves_out_the_blocks_a_forward_branch_skips():
    """The branch at 0x10 skips the mask block (0x20-0x30) inside the loop; the one at 0x50
    lands outside it (a retry path) and skips nothing."""
    static, = aot.sass_loops(MASKED, ("FSEL", "MUFU"))
    assert (static["n"], static["FSEL"]) == (7, 2) and "skipped" not in static
    taken, = aot.sass_loops(MASKED, ("FSEL", "MUFU"), taken=True)
    assert (taken["n"], taken["FSEL"], taken["MUFU"], taken["skipped"]) == (5, 0, 1, 2)
