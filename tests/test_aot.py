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


# ------------------------------------------------ the memo of ahead-of-time compiles (tests/)

def test_a_memo_holds_only_while_every_file_it_read_is_unchanged(tmp_path, monkeypatch):
    import aot_compile
    monkeypatch.setattr(aot_compile, "ROOT", tmp_path)
    monkeypatch.setattr(aot_compile, "MEMO_DIR", tmp_path / "memo")
    (tmp_path / "kernel.py").write_text("BLOCK = 64\n")
    memo = tmp_path / "memo" / "k.json.gz"
    aot_compile.write_memo(memo, ["kernel.py"], [{"shared": 1024}])
    assert aot_compile.read_memo(memo) == [{"shared": 1024}]
    (tmp_path / "kernel.py").write_text("BLOCK = 128\n")
    assert aot_compile.read_memo(memo) is None                 # an edited kernel compiles again
    aot_compile.write_memo(memo, ["kernel.py"], [{"shared": 2048}])
    (tmp_path / "kernel.py").unlink()
    assert aot_compile.read_memo(memo) is None                 # so does a removed one


def test_a_compile_records_what_it_read_and_is_not_run_again(tmp_path, monkeypatch):
    """The script reads a solution; its memo names that file and the flashbook modules it
    imported, not the virtual environment; the second call returns the memo without running
    the script (which would write ``ran``)."""
    import aot_compile
    monkeypatch.setattr(aot_compile, "MEMO_DIR", tmp_path / "memo")
    monkeypatch.setattr(aot_compile, "MEMO_MODE", "on")
    ran = tmp_path / "ran"
    body = (f"open({str(ran)!r}, 'a').write('x')\n"
            "print('RESULT' + json.dumps(len(open('solutions/ch1_naive_attention.py').read()) > 0))\n")
    assert aot_compile.compile_script(body, tmp_path) is True
    memo, = (tmp_path / "memo").glob("*.json.gz")
    reads = json.loads(__import__("gzip").decompress(memo.read_bytes()))["reads"]
    assert {"solutions/ch1_naive_attention.py", "src/flashbook/__init__.py",
            "src/flashbook/device.py"} <= set(reads)
    assert not [r for r in reads if "site-packages" in r or r.startswith(".venv")]
    assert aot_compile.compile_script(body, tmp_path) is True
    assert ran.read_text() == "x"
