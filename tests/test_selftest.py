"""`flashbook selftest`: the record (round trip, merge), the chapters' source hashes, README's
generated chapter column, the failure phrases, the two ways of running a solved notebook outside
the checkout, quick benchmark timing, and real runs of the first chapter in CPU mode (run, and
run then grade through collect -> autograde -> export)."""
from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from flashbook import bench, cli, publish, results, selftest, sources
from flashbook.device import Backend, GPU_SIZES

PROVENANCE_KEYS = ("gpu", "compute_capability", "driver", "cuda", "torch", "triton", "jax",
                   "numba", "numba_cuda", "python", "date", "command", "commit", "package")


# ------------------------------------------------------------------ a fake checkout

FAKE = '''# ---
# jupyter:
#   jupytext:
#     formats: py:percent
# ---

# %% [markdown]
# # Chapter {n}: a fake chapter

# %%
import importlib.util, os
print("FLASHBOOK_ROOT", os.environ.get("FLASHBOOK_ROOT"))
print("PYTHONPATH", os.environ.get("PYTHONPATH"))
print("QUICK", os.environ.get("FLASHBOOK_QUICK_BENCH"))
print("CWD", os.getcwd())
print("PACKAGE", importlib.util.find_spec("flashbook").origin)

# %% nbgrader={{"grade": true, "grade_id": "ch{n}_fake_test", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}}
assert True
### BEGIN HIDDEN TESTS
{hidden}
### END HIDDEN TESTS

# %% tags=["demo"]
{demo}
'''


def fake_root(tmp_path: Path, n: int = 1, hidden: str = "hidden_value_of_the_test = 41 + 1",
              demo: str = "print('done')") -> Path:
    """A checkout with one chapter (its source and a package file) and a README table."""
    root = tmp_path / "checkout"
    (root / "solutions").mkdir(parents=True, exist_ok=True)
    (root / "solutions" / f"ch{n}_fake.py").write_text(FAKE.format(n=n, hidden=hidden, demo=demo))
    package = root / "src" / "flashbook" / "chapters" / f"ch{n}"
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text("CHAPTER = None\n")
    return root


def entry(passed=True, sha="a" * 64, commit="1234567890abcdef", date="2026-01-02T03:04:05+00:00",
          gpu="NVIDIA H200", graded=True) -> dict:
    grading = ({"status": "graded", "device": "gpu", "earned": 1.0, "possible": 1.0}
               if graded else {"status": "skipped", "reason": "--no-grade"})
    return {"passed": passed, "ran": passed, "how": "script", "seconds": 1.0, "sha256": sha,
            "error": None if passed else "exit code 1", "failed_cell": None,
            "grading": grading,
            "provenance": {"gpu": gpu, "commit": commit, "date": date}}


# ------------------------------------------------------------------ the record

def test_record_round_trip_and_merge(tmp_path):
    path = tmp_path / "selftest" / "h200.json"
    first = selftest.merge(selftest.load(path), {"ch1": entry(), "ch4": entry(sha="b" * 64)})
    selftest.save(path, first)
    assert selftest.load(path) == first
    assert [p.name for p in path.parent.iterdir()] == ["h200.json"]      # no temporary left
    assert path.stat().st_mode & 0o777 == 0o644
    assert first["chapters"]["ch1"]["last_pass"] == {
        "sha256": "a" * 64, "commit": "1234567890abcdef", "date": "2026-01-02T03:04:05+00:00",
        "gpu": "NVIDIA H200", "graded": True}
    # a run of a subset updates those chapters and keeps the others; a failure keeps the pass
    later = entry(passed=False, sha="c" * 64, commit="fedcba", date="2026-02-01T00:00:00+00:00")
    second = selftest.merge(selftest.load(path), {"ch4": later, "ch10": entry()})
    selftest.save(path, second)
    again = selftest.load(path)
    assert list(again["chapters"]) == ["ch1", "ch4", "ch10"]
    assert again["chapters"]["ch1"] == first["chapters"]["ch1"]
    assert again["chapters"]["ch4"]["passed"] is False
    assert again["chapters"]["ch4"]["last_pass"] == first["chapters"]["ch4"]["last_pass"]
    assert again["updated"] == "2026-02-01T00:00:00+00:00" and again["gpu"] == "NVIDIA H200"
    path.write_text(json.dumps({**again, "schema": 99}))
    with pytest.raises(ValueError, match="schema 99"):
        selftest.load(path)


def test_source_hash_changes_when_a_chapter_file_changes(tmp_path):
    root = fake_root(tmp_path)
    fake_root(tmp_path, n=2)
    package = root / "src" / "flashbook" / "chapters" / "ch1"
    before = selftest.source_hash("ch1", root)
    assert [p.relative_to(root).as_posix() for p in selftest.source_files("ch1", root)] == [
        "solutions/ch1_fake.py", "src/flashbook/chapters/ch1/__init__.py"]
    (package / "__pycache__").mkdir()
    (package / "__pycache__" / "x.cpython-311.pyc").write_bytes(b"bytecode")
    (root / "solutions" / "ch2_fake.py").write_text("# another chapter\n")
    assert selftest.source_hash("ch1", root) == before          # bytecode, other chapters: no
    (package / "__init__.py").write_text("CHAPTER = 1\n")
    assert selftest.source_hash("ch1", root) != before
    (package / "__init__.py").write_text("CHAPTER = None\n")
    assert selftest.source_hash("ch1", root) == before
    (package / "checks.py").write_text("")                      # a new, even empty, file
    assert selftest.source_hash("ch1", root) != before
    (package / "checks.py").unlink()
    text = (root / "solutions" / "ch1_fake.py").read_text()
    (root / "solutions" / "ch1_fake.py").write_text(text + "\n")
    assert selftest.source_hash("ch1", root) != before


def test_the_first_chapters_hash_covers_its_source_and_package(root):
    names = [p.relative_to(root).as_posix() for p in selftest.source_files("ch1", root)]
    assert names[0] == sources.source("ch1", root).path.relative_to(root).as_posix()
    assert "src/flashbook/chapters/ch1/__init__.py" in names
    assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc")]


# ------------------------------------------------------------------ README's chapter table

def test_readme_cells_from_fake_records():
    now, old = "a" * 64, "b" * 64
    passing = selftest.merge({}, {"ch1": entry(sha=now), "ch2": entry(sha=old, commit="0ld0ld0ld"),
                                  "ch4": entry(sha=now, commit="abcdef012")})
    t4 = selftest.merge({}, {"ch4": entry(sha=now, gpu="Tesla T4", commit="7777777aa"),
                             "ch5": entry(passed=False, sha=now, gpu="Tesla T4", commit="999999")})
    found = [passing, t4]
    assert selftest.check_cell("ch1", now, found) == "H200 at `1234567`"
    assert selftest.check_cell("ch2", now, found) == "stale (sources changed since `0ld0ld0`)"
    assert selftest.check_cell("ch3", now, found) == "not yet"
    assert selftest.check_cell("ch4", now, found) == "H200 at `abcdef0`, T4 at `7777777`"
    assert selftest.check_cell("ch5", now, found) == "not yet (failed on T4 at `999999`)"
    assert selftest.check_cell("ch1", now, []) == "not yet"
    notebook_only = [selftest.merge({}, {"ch1": entry(sha=now, graded=False)})]
    assert selftest.check_cell("ch1", now, notebook_only) == "H200 at `1234567` (notebook only)"


def test_readme_table_is_rewritten_from_the_records(root, tmp_path):
    text = (root / "README.md").read_text()
    cells = {"ch1": "H200 at `1234567`", "ch2": "stale (sources changed since `0ld0ld0`)"}
    new = publish.chapter_table(text, cells)
    assert "| 1. Naive attention, and why it is slow | ready | H200 at `1234567` |" in new
    assert "| 2. From flash.cu to Numba-CUDA | ready | stale (sources changed since `0ld0ld0`) |" \
        in new
    assert re.search(r"^\| 3\. Online softmax and the Triton FlashAttention forward "
                     r"\| \w+ \| — \|$", new, re.M)        # a chapter without a cell
    assert "| chapter | status | last GPU self-check |\n|---|---|---|\n" in new
    assert publish.chapter_table(new, cells) == new
    outside = text.split(publish.TABLE_BEGIN)[0], text.split(publish.TABLE_END)[1]
    assert new.startswith(outside[0]) and new.endswith(outside[1])
    with pytest.raises(ValueError, match="chapter table once"):
        publish.chapter_table(text.replace(publish.TABLE_END, ""), cells)


def test_readme_follows_the_records_and_the_sources(root, tmp_path):
    fake = fake_root(tmp_path)
    shutil.copy(root / "README.md", fake / "README.md")
    record = fake / selftest.RECORDS / "h200.json"
    selftest.save(record, selftest.merge({}, {"ch1": entry(sha=selftest.source_hash("ch1", fake))}))
    assert publish.update_chapter_table(fake)
    row = "| 1. Naive attention, and why it is slow | ready |"
    assert f"{row} H200 at `1234567` |" in (fake / "README.md").read_text()
    assert not publish.update_chapter_table(fake, check=True)
    (fake / "solutions" / "ch1_fake.py").write_text("# %%\nprint('changed')\n")
    assert publish.update_chapter_table(fake, check=True)          # the sources moved on
    publish.update_chapter_table(fake)
    assert f"{row} stale (sources changed since `1234567`) |" in (fake / "README.md").read_text()
    record.unlink()
    publish.update_chapter_table(fake)
    assert f"{row} not yet |" in (fake / "README.md").read_text()


def test_readme_chapter_table_is_up_to_date(root):
    assert not publish.update_chapter_table(root, check=True), \
        "README.md's chapter table disagrees with src/flashbook/data/selftest (a record, or a " \
        "chapter's sources changed): run `flashbook readme`"


# ------------------------------------------------------------------ failure phrases

# What solutions/ prints in except clauses that is expected output of a solved notebook.
EXPECTED_PRINTS = ("IndexError:", "ValueError:", "   (the launch failed: ", "group of ")


def _printed_text(call: ast.Call) -> str:
    """The literal text of a print call's arguments (f-strings: their constant parts)."""
    return " ".join(n.value for n in ast.walk(call)
                    if isinstance(n, ast.Constant) and isinstance(n.value, str))


def test_every_print_in_an_except_clause_is_classified(root):
    """Each is a failure phrase, expected output, or said after a failure phrase (the same
    except clause explaining the failure further)."""
    unclassified, printed = [], []
    for ch in sources.sources(root):
        for node in ast.walk(ast.parse(ch.path.read_text())):
            if isinstance(node, ast.ExceptHandler):
                calls = [c for c in ast.walk(node)
                         if isinstance(c, ast.Call) and getattr(c.func, "id", None) == "print"]
                texts = [_printed_text(c) for c in calls]
                printed += texts
                if any(selftest.failure_phrase(t) for t in texts):
                    continue
                unclassified += [f"{ch.path.name}:{c.lineno} {t!r}" for c, t in zip(calls, texts)
                                 if t and not t.startswith(EXPECTED_PRINTS)]
    assert len(printed) > 20
    assert not unclassified, ("a new print in an except clause: add its phrase to "
                              f"selftest.FAILURE_PHRASES or to EXPECTED_PRINTS: {unclassified}")
    said = [p.read_text() for p in [*(root / "solutions").glob("ch*.py"),
                                    *(root / "src" / "flashbook" / "chapters").rglob("*.py")]]
    for phrase in selftest.FAILURE_PHRASES:
        assert any(phrase in t for t in said), f"{phrase!r} is printed nowhere any more"


def test_failure_phrase_detection():
    assert selftest.failure_phrase("ok\nCould not benchmark your kernel (is Exercise 2 done?): "
                                   "RuntimeError\nmore") == \
        "Could not benchmark your kernel (is Exercise 2 done?): RuntimeError"
    assert selftest.failure_phrase("PASSED softmax: 3/3 cases\n") is None
    assert selftest.failure_phrase("   (the launch failed: CudaAPIError; flash.cu never looks)") \
        is None
    assert selftest.failure_phrase("Skipped until Exercises 1-3 is solved (a stub ...)")


# ------------------------------------------------------------------ running outside the checkout

def test_read_percent_reads_the_chapters_as_jupytext_does(root):
    for ch in sources.sources(root):
        assert selftest.read_percent(ch.path.read_text()) == selftest.solved_cells(ch.path), ch.id


def test_script_runner_runs_outside_the_checkout(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHBOOK_ROOT", str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "elsewhere"))
    root = fake_root(tmp_path)
    r = selftest.run_chapter("ch1", root, "script", timeout=60)
    assert r["ran"] and r["error"] is None and r["how"] == "script", r


def _run_report(runner, tmp_path, **fake):
    root = fake_root(tmp_path, **fake)
    cells = selftest.solved_cells(sources.source("ch1", root).path)
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    run = selftest.run_nbclient if runner == "nbclient" else selftest.run_script
    return run(cells, work, selftest.child_env(), 20), work


@pytest.mark.parametrize("runner", ["script", pytest.param("nbclient", marks=pytest.mark.slow)])
def test_runner_environment_raises_and_phrases(runner, tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHBOOK_ROOT", str(tmp_path))
    r, work = _run_report(runner, tmp_path)
    assert r["error"] is None, r["error"]
    seen = dict(line.split(" ", 1) for line in r["output"].splitlines() if " " in line)
    assert seen["FLASHBOOK_ROOT"] == "None" and seen["QUICK"] == "1"
    assert seen["PYTHONPATH"] == str(selftest.package_dir())
    assert Path(seen["CWD"]).resolve() == work.resolve()
    assert Path(seen["PACKAGE"]).resolve() == Path(selftest.__file__).parent / "__init__.py"

    hidden = "assert the_hidden_value_nobody_defines == 42"
    root = fake_root(tmp_path, hidden=hidden)
    failed = selftest.run_chapter("ch1", root, runner, timeout=60)
    assert not failed["ran"] and failed["failed_cell"] == "cell 2 (ch1_fake_test)", failed
    assert "NameError" in failed["error"] and hidden in failed["error"]   # the line, as it ran

    root = fake_root(tmp_path, demo="print('Could not benchmark your kernel: RuntimeError')")
    phrase = selftest.run_chapter("ch1", root, runner, timeout=60)
    assert not phrase["ran"] and phrase["error"].startswith(
        "the output says it failed: Could not benchmark your kernel: RuntimeError"), phrase


@pytest.mark.timeout(300)   # a runner that waited for the hour-long chapter fails here
def test_script_runner_stops_a_chapter_past_its_timeout(tmp_path):
    root = fake_root(tmp_path, demo="import time\ntime.sleep(3600)")
    r = selftest.run_chapter("ch1", root, "script", timeout=3)
    assert not r["ran"] and r["error"].startswith("did not finish within 3 s"), r
    assert r["seconds"] >= 3                   # it did wait for the chapter that long


def test_without_jupyter_it_runs_scripts_and_skips_grading(tmp_path, monkeypatch):
    monkeypatch.setattr(selftest, "missing", lambda modules: list(modules))
    root = fake_root(tmp_path)
    fake_root(tmp_path, n=2)
    out = tmp_path / "record.json"
    path, record, ok = selftest.selftest(root, ["ch1"], out, commit="feedbeef",
                                         command="flashbook selftest", echo=lambda *_: None)
    assert ok and path == out
    ch1 = record["chapters"]["ch1"]
    assert ch1["how"] == "script" and ch1["passed"]
    assert ch1["grading"]["status"] == "skipped"
    assert ch1["grading"]["reason"].startswith("grading skipped: nbgrader/nbclient not installed")
    assert ch1["provenance"]["commit"] == "feedbeef"           # no .git: the --commit given
    assert ch1["uncommitted_changes"] is None
    assert ch1["sha256"] == selftest.source_hash("ch1", root)
    _, record, _ = selftest.selftest(root, ["ch2"], out, grade=False, echo=lambda *_: None)
    assert list(selftest.load(out)["chapters"]) == ["ch1", "ch2"]
    assert record["chapters"]["ch1"] == ch1
    with pytest.raises(ValueError, match="no chapter ch7"):
        selftest.selftest(root, ["ch7"], out)
    with pytest.raises(ValueError, match="give --out"):        # CPU mode: no default record
        selftest.selftest(root, ["ch1"], None)


def test_a_broken_grading_pipeline_is_recorded_not_raised(tmp_path, monkeypatch):
    monkeypatch.setattr(selftest, "missing", lambda modules: [])
    root = fake_root(tmp_path)                          # no autograder/nbgrader_config.py
    g = selftest.grade_chapter("ch1", root, "cpu", timeout=60)
    assert g["status"] == "error" and "nbgrader_config.py" in g["reason"], g
    assert not selftest.full_marks(g)
    assert not selftest.full_marks({"status": "graded", "earned": 8.0, "possible": 10.0})
    assert selftest.full_marks({"status": "skipped", "reason": "--no-grade"})


# ------------------------------------------------------------------ quick benchmark timing

def test_quick_bench_times_with_few_repetitions(monkeypatch):
    assert bench.gpu_timer() == results.GPU_TIMER and bench.gpu_timer(True) == results.GRAPH_TIMER
    seen = []

    class Timer:
        def __init__(self, **kw):
            pass

        def blocked_autorange(self, min_run_time):
            seen.append(min_run_time)
            return type("M", (), {"median": 1e-3})()

    monkeypatch.setattr("torch.utils.benchmark.Timer", Timer)
    bench.time_ms(lambda: None)
    monkeypatch.setenv(bench.QUICK_ENV, "1")
    assert bench.gpu_timer()["rep"] < results.GPU_TIMER["rep"] / 10
    assert bench.gpu_timer(True)["rep"] < results.GRAPH_TIMER["rep"] / 10
    bench.time_ms(lambda: None)
    assert seen == [0.2, 0.01]
    from flashbook import chapters
    monkeypatch.setattr(results, "current", lambda: Backend(True, "NVIDIA H200", (9, 0), GPU_SIZES))
    with pytest.raises(RuntimeError, match="FLASHBOOK_QUICK_BENCH=1 is set"):
        results.record(chapters.contract("ch1"), Path("/nonexistent"), "flashbook bench")


# ------------------------------------------------------------------ real runs (CPU mode)

def _check_record(path: Path, how: str) -> dict:
    record = selftest.load(path)
    assert record["gpu"] == "CPU" and list(record["chapters"]) == ["ch1"]
    first = record["chapters"]["ch1"]
    assert first["passed"] and first["ran"] and first["how"] == how, first
    assert first["sha256"] == selftest.source_hash("ch1", sources.repo_root())
    missing = [k for k in PROVENANCE_KEYS if k not in first["provenance"]]
    assert not missing, missing
    assert first["provenance"]["package"] in ("checkout", "installed")
    assert first["provenance"]["command"].startswith("flashbook selftest --chapters ch1")
    return first


@pytest.mark.slow
def test_selftest_runs_the_first_chapter_as_a_script(tmp_path):
    out = tmp_path / "cpu.json"
    assert cli.main(["selftest", "--chapters", "ch1", "--no-grade", "--runner", "script",
                     "--out", str(out)]) == 0
    first = _check_record(out, "script")
    assert first["grading"] == {"status": "skipped", "reason": "--no-grade"}


@pytest.mark.slow
def test_selftest_runs_and_grades_the_first_chapter(tmp_path):
    out = tmp_path / "cpu.json"
    assert cli.main(["selftest", "--chapters", "ch1", "--out", str(out)]) == 0
    grading = _check_record(out, "nbclient")["grading"]
    assert grading["status"] == "graded" and grading["device"] == "cpu", grading
    assert grading["earned"] == grading["possible"] == 10 and grading["lost"] == [], grading


@pytest.mark.slow
def test_selftest_runs_where_jupyter_is_not_installed(tmp_path):
    """The GPU machines have no Jupyter: nbformat, jupytext, nbclient and nbgrader unimportable."""
    root = fake_root(tmp_path)
    out = tmp_path / "record.json"
    block = ("import importlib.abc, importlib.util, sys\n"
             "GONE = {'nbformat', 'jupytext', 'nbclient', 'ipykernel', 'nbgrader', "
             "'jupyter_client', 'yaml'}\n"
             "class Gone(importlib.abc.MetaPathFinder):\n"
             "    def find_spec(self, name, path, target=None):\n"
             "        if name.split('.')[0] in GONE: raise ImportError(name)\n"
             "sys.meta_path.insert(0, Gone())\n"
             "find = importlib.util.find_spec\n"
             "importlib.util.find_spec = lambda n, p=None: None if n in GONE else find(n, p)\n"
             "from flashbook import cli\n"
             f"sys.exit(cli.main(['selftest', '--root', {str(root)!r}, '--out', {str(out)!r}]))\n")
    proc = subprocess.run([sys.executable, "-c", block], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "FLASHBOOK_FORCE_CPU": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    first = selftest.load(out)["chapters"]["ch1"]
    assert first["passed"] and first["how"] == "script", first
    assert first["grading"]["reason"].startswith("grading skipped: nbgrader/nbclient not installed")


def test_the_commit_given_wins_over_an_older_git_in_the_root(tmp_path):
    """A copy of a checkout whose .git is at an older commit (the files are newer): the record
    names the commit given, and cannot tell whether the files are committed."""
    root = fake_root(tmp_path)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(root)]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "old"], check=True)
    old = selftest.git_commit(root)
    (root / "solutions" / "ch1_fake.py").write_text(
        (root / "solutions" / "ch1_fake.py").read_text() + "\n# newer\n")
    files = selftest.source_files("ch1", root)
    assert selftest.uncommitted(files, root) is True                # judged against its git
    assert selftest.uncommitted(files, root, old) is True
    assert selftest.uncommitted(files, root, "f" * 40) is None      # another commit: unknown
    assert selftest.recorded_commit(root, "f" * 40) == "f" * 40
    assert selftest.recorded_commit(root, None) == old
