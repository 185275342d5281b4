"""Publishing, offline: the GitHub workflows (validated against check-jsonschema's vendored
schema), the addresses derived from _config.yml (README, pyproject, Colab), the Colab setup
cell's install logic, and the wheel and sdist (built with --no-isolation, opened and checked)."""
from __future__ import annotations

import ast
import importlib.metadata
import inspect
import os
import re
import subprocess
import sys
import tarfile
import types
import zipfile
from pathlib import Path

import pytest
import tomllib
import yaml

from flashbook import colab_install, notebooks, publish, sources
from flashbook.grade import cellmeta


WORKFLOWS = Path(".github") / "workflows"


def _workflow(root, name) -> dict:
    data = yaml.safe_load((root / WORKFLOWS / name).read_text())
    data["on"] = data.pop(True, data.get("on"))        # YAML 1.1 reads the key `on` as True
    return data


def _validate(*paths) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "check_jsonschema", "--builtin-schema",
                           "vendor.github-workflows", *map(str, paths)],
                          capture_output=True, text=True, timeout=120)


# ------------------------------------------------------------------------------ workflows

def test_workflows_and_a_broken_one_against_the_vendored_schema(root, tmp_path):
    names = sorted(p.name for p in (root / WORKFLOWS).glob("*.yml"))
    assert names == sorted(publish.WORKFLOWS.values())
    good = _validate(*(root / WORKFLOWS / n for n in names))
    assert good.returncode == 0, good.stdout + good.stderr
    # a step that both runs a command and uses an action, and a job without runs-on
    broken = (root / WORKFLOWS / "book.yml").read_text().replace(
        "      - name: Build the book (make book)\n        run: make book",
        "      - name: Build the book (make book)\n        uses: actions/checkout@v4\n"
        "        run: make book").replace("    runs-on: ubuntu-24.04\n    permissions:", "    permissions:")
    assert broken != (root / WORKFLOWS / "book.yml").read_text()
    (tmp_path / "book.yml").write_text(broken)
    bad = _validate(tmp_path / "book.yml")
    assert bad.returncode != 0 and "book.yml::$.jobs" in bad.stdout, bad.stdout + bad.stderr


def _steps(job) -> list[dict]:
    return job.get("steps", [])


def _uses(job) -> list[str]:
    return [s["uses"].split("@")[0] for s in _steps(job) if "uses" in s]


def test_every_needs_names_a_job(root):
    for name in publish.WORKFLOWS.values():
        jobs = _workflow(root, name)["jobs"]
        for job_id, job in jobs.items():
            needs = job.get("needs", [])
            for need in [needs] if isinstance(needs, str) else needs:
                assert need in jobs, f"{name}: job {job_id} needs {need!r}, which does not exist"


def test_ci_workflow_runs_ci_run(root):
    wf = _workflow(root, "ci.yml")
    assert {"push", "pull_request"} <= set(wf["on"])
    assert [s.get("run") for s in _steps(wf["jobs"]["test"])][-1] == "bash .ci/run"


def test_book_workflow_builds_like_make_book_and_deploys_main_only(root):
    wf = _workflow(root, "book.yml")
    assert wf["on"]["push"]["branches"] == ["main"] and "pull_request" in wf["on"]
    assert wf["permissions"] == {"contents": "read"}
    assert "concurrency" in wf
    build, deploy = wf["jobs"]["build"], wf["jobs"]["deploy"]
    assert "make book" in [s.get("run") for s in _steps(build)]       # exactly as `make book`
    upload = next(s for s in _steps(build) if s.get("uses", "").startswith(
        "actions/upload-pages-artifact@"))
    assert upload["with"]["path"] == "_build/html" and "pull_request" in upload["if"]
    assert deploy["needs"] == "build" and "pull_request" in deploy["if"]
    assert "refs/heads/main" in deploy["if"]
    assert deploy["permissions"] == {"pages": "write", "id-token": "write"}
    assert deploy["environment"]["name"] == "github-pages"
    assert _uses(deploy) == ["actions/deploy-pages"]


def test_release_workflow_checks_the_tag_then_publishes_with_trusted_publishing(root):
    wf = _workflow(root, "release.yml")
    assert wf["on"] == {"push": {"tags": ["v*"]}}
    build, publish_job = wf["jobs"]["build"], wf["jobs"]["publish"]
    runs = [s.get("run", "") for s in _steps(build)]
    check = next(i for i, r in enumerate(runs) if "does not match the package version" in r)
    assert check < next(i for i, r in enumerate(runs) if "python -m build" in r)
    assert publish_job["permissions"] == {"id-token": "write"}
    assert publish_job["environment"]["name"] == "pypi" and publish_job["needs"] == "build"
    assert _uses(publish_job)[-1] == "pypa/gh-action-pypi-publish"
    assert "password" not in str(publish_job)                          # no token: trusted


@pytest.mark.parametrize("tag_matches", [True, False])
def test_release_tag_check_runs_as_written(root, tag_matches):
    """The workflow's own check step, run by bash: the package's version passes, another fails."""
    step = next(s for s in _steps(_workflow(root, "release.yml")["jobs"]["build"])
                if "does not match" in s.get("run", ""))
    version = publish.package_version(root)
    tag = f"v{version}" if tag_matches else f"v{version}.post99"
    env = {**os.environ, "TAG": tag, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    proc = subprocess.run(["bash", "-e", "-c", step["run"]], cwd=root, env=env,
                          capture_output=True, text=True, timeout=60)
    assert (proc.returncode == 0) == tag_matches, proc.stdout + proc.stderr
    assert (f"releasing flashbook {version}" if tag_matches else "does not match") in proc.stdout


# ----------------------------------------------------------------- the one repository address

def test_addresses_derive_from_the_repository_url():
    url = "https://github.com/Some-Org/attn-book"
    assert publish.slug(url + ".git") == ("Some-Org", "attn-book")
    assert publish.pages_url(url) == "https://some-org.github.io/attn-book/"
    assert publish.pages_url("https://github.com/me/me.github.io") == "https://me.github.io/"
    with pytest.raises(ValueError, match="not a GitHub repository"):
        publish.slug("https://example.org/x/y")


def test_readme_published_block_is_up_to_date(root):
    assert not publish.update_readme(root, check=True), "README.md is stale: run `flashbook readme`"
    url, _ = publish.repository(root)
    text = (root / "README.md").read_text()
    assert publish.pages_url(url) in text and f"{url}/actions/workflows/ci.yml/badge.svg" in text


def test_readme_block_follows_a_new_address(root, tmp_path):
    for name in ("README.md", "_config.yml", "pyproject.toml"):
        (tmp_path / name).write_text((root / name).read_text())
    config = (tmp_path / "_config.yml").read_text()
    old, _ = publish.repository(root)
    (tmp_path / "_config.yml").write_text(config.replace(old, "https://github.com/acme/fb"))
    assert publish.update_readme(tmp_path)
    text = (tmp_path / "README.md").read_text()
    assert "https://acme.github.io/fb/" in text and old not in text.split(publish.BEGIN)[1]
    assert not publish.update_readme(tmp_path, check=True)          # now up to date


def test_package_version_is_stated_once(root):
    import flashbook
    assert flashbook.__version__ == publish.package_version(root)


def test_pyproject_urls_derive_from_the_repository_url(root):
    urls = tomllib.loads((root / "pyproject.toml").read_text())["project"]["urls"]
    assert urls == publish.project_urls(publish.repository(root)[0])


def test_colab_links_derive_from_the_repository_url(root):
    url, branch = publish.repository(root)
    owner, name = publish.slug(url)
    ch = sources.sources(root)[0]
    assert notebooks.colab_url(ch, root) == (f"https://colab.research.google.com/github/{owner}/"
                                             f"{name}/blob/{branch}/notebooks/{ch.name}.ipynb")


# ------------------------------------------------------------------- the Colab setup cell

class FakePip:
    """A pip that knows which flashbook releases exist and records every command."""

    def __init__(self, released: set[str]):
        self.released, self.calls = released, []

    def __call__(self, cmd, check=False, **kw):
        self.calls.append(cmd)
        if "-c" in cmd:
            self.constraints = Path(cmd[cmd.index("-c") + 1]).read_text()
        spec = next((a for a in cmd if a.startswith("flashbook")), None)
        ok = spec is None or "git+" in spec or spec.split("==")[1] in self.released
        if check and not ok:
            raise subprocess.CalledProcessError(1, cmd)
        return types.SimpleNamespace(returncode=0 if ok else 1)


COLAB = {"torch": "2.8.0+cu126", "triton": "3.4.0"}
REQS = ["numpy>=1.24", "torch>=2.4", "triton>=3.2", "numba-cuda>=0.10"]


@pytest.mark.parametrize("released", [{"0.1.0"}, set()])
def test_colab_install_takes_the_release_else_the_repository(released):
    pip = FakePip(released)
    source = colab_install.install_flashbook("0.1.0", "https://github.com/o/r", "main", REQS,
                                             run=pip, installed_version=COLAB.__getitem__)
    flashbook_installs = [c for c in pip.calls if any(a.startswith("flashbook") for a in c)]
    if released:
        assert source == "release" and len(flashbook_installs) == 1
        assert flashbook_installs[0][-1] == "flashbook==0.1.0"
    else:
        assert source == "repository" and len(flashbook_installs) == 2
        assert flashbook_installs[-1][-1] == "flashbook @ git+https://github.com/o/r@main"
    assert all("--no-deps" in c for c in flashbook_installs)
    light = pip.calls[-1]
    assert light[light.index("-q") + 1:light.index("-c")] == ["numpy>=1.24", "numba-cuda>=0.10"]
    assert not [a for c in pip.calls for a in c if a.startswith(("torch", "triton"))]
    assert pip.constraints.split() == ["torch==2.8.0+cu126", "triton==3.4.0"]


def test_install_missing_installs_only_what_is_absent_and_pins_the_rest():
    have = {**COLAB, "absl-py": "1.4.0"}

    def version(name):
        if name not in have:
            raise importlib.metadata.PackageNotFoundError(name)
        return have[name]
    pip = FakePip(set())
    assert colab_install.install_missing(["jax==0.10.2", "absl-py>=2.5.1"], run=pip,
                                         installed_version=version) == ["jax==0.10.2"]
    (cmd,) = pip.calls
    assert cmd[cmd.index("-q") + 1:cmd.index("-c")] == ["jax==0.10.2"]
    assert pip.constraints.split() == ["torch==2.8.0+cu126", "triton==3.4.0", "absl-py==1.4.0"]
    pip = FakePip(set())
    assert colab_install.install_missing(["absl-py"], run=pip, installed_version=version) == []
    assert pip.calls == []                                  # nothing missing: pip never runs


def test_setup_cell_is_the_tested_function_and_does_nothing_off_colab(root, monkeypatch):
    cell = notebooks.install_cell_source(root)
    assert inspect.getsource(colab_install.install_flashbook) in cell
    version = publish.package_version(root)
    url, branch = publish.repository(root)
    assert f"install_flashbook({version!r}, {url!r}, {branch!r}," in cell
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("pip ran off Colab"))
    namespace = {}
    exec(compile(cell, "setup-cell", "exec"), namespace)          # not on Colab: nothing runs
    assert callable(namespace["install_flashbook"])


# -------------------------------------------------------------------- the wheel and the sdist

@pytest.fixture(scope="module")
def dists(distributions) -> dict[str, Path]:
    """The wheel and the sdist of the tracked (and new, not ignored) files (one build per run,
    shared with tests/test_student_path.py)."""
    return distributions


def _contents(path: Path) -> dict[str, bytes]:
    if path.suffix == ".whl":
        with zipfile.ZipFile(path) as z:
            return {n: z.read(n) for n in z.namelist()}
    with tarfile.open(path) as t:
        top = t.getnames()[0].split("/")[0]
        return {m.name.removeprefix(top + "/"): t.extractfile(m).read() for m in t if m.isfile()}


@pytest.mark.parametrize("kind", ["wheel", "sdist"])
def test_distribution_has_the_package_and_its_data_and_no_course_material(root, dists, kind):
    files = _contents(dists[kind])
    prefix = "" if kind == "wheel" else "src/"
    data = sorted(p.relative_to(root / "src").as_posix()
                  for p in (root / "src" / "flashbook" / "data").rglob("*") if p.is_file())
    assert data and not [d for d in data if prefix + d not in files], "data files missing"
    modules = [p.relative_to(root / "src").as_posix()
               for p in (root / "src" / "flashbook").rglob("*.py")]
    assert not [m for m in modules if prefix + m not in files], "modules missing"
    course = ("solutions/", "notebooks/", "autograder/", "tests/", "book/", "_build/")
    assert not [n for n in files if n.startswith(course) or n.endswith(".ipynb")]


# Solved exercises the package ships on purpose, each for a later chapter to build on or given
# to the student anyway; no other file of the wheel may hold an answer (module -> grade ids).
# The instructor guide lists the same (test_instructor_guide_lists_the_given_answers).
GIVEN = {
    "flashbook/kernels.py": ("ch4_masks",),          # Chapter 4's masks, for Chapters 5-9
    "flashbook/gqa_kernels.py": ("ch5_two_tiles", "ch4_two_tiles"),  # the
    # optional two-tile kernels: Chapter 5's (generated), which Chapter 9 runs, and Chapter 4's,
    # the same kernel with one query head a group, which shares most of its lines
    "flashbook/lazy_kernels.py": ("ch3_attn_kernel",),   # Chapter 3's kernel, made lazy (in
    # Chapter 7's notebook too, generated from it)
    "flashbook/chapters/ch8/mesh.py": ("ch8_chain",),  # the mesh kernel's buggy reduction the
}                                                      # exercise fixes (in the notebook too)


def _answers(root) -> dict[str, list[str]]:
    """grade id -> the substantive lines (code, 25 characters or more) of its solution region,
    for the regions of 3 or more such lines."""
    out = {}
    for ch in sources.sources(root):
        for cell in sources.read(ch.path).cells:
            if cellmeta.is_solution(cell) and "### BEGIN SOLUTION" in cell.source:
                region = cell.source.split("### BEGIN SOLUTION", 1)[1].split("### END SOLUTION")[0]
                lines = [x.strip() for x in region.splitlines()]
                lines = [x for x in lines if len(x) >= 25 and not x.startswith("#")]
                if len(lines) >= 3:
                    out[cellmeta.grade_id(cell)] = lines
    return out


def test_wheel_holds_no_answer_but_the_building_blocks_it_lists(root, dists):
    """An answer is held when half of its region's lines (3 at least) stand in one file. The
    known-wrong variants quote answers too: they live in solutions/variants/, not here."""
    answers = _answers(root)
    assert len(answers) > 40
    held = {}
    for name, blob in _contents(dists["wheel"]).items():
        if name.endswith(".py"):
            text = blob.decode()
            for gid, lines in answers.items():
                if sum(x in text for x in lines) >= max(3, len(lines) / 2):
                    held.setdefault(name, []).append(gid)
    extra = {n: [g for g in gids if g not in GIVEN.get(n, ())] for n, gids in held.items()}
    leaked = {n: g for n, g in extra.items() if g}
    assert not leaked, f"answers in the wheel (module: grade ids): {leaked}"
    assert set(held) == set(GIVEN), f"GIVEN lists modules that hold no answer: {held}"
    assert not [n for n in _contents(dists["wheel"]) if "/variants" in n]


def test_the_wheel_alone_runs_chapter_9s_autograd_function(root, dists, tmp_path):
    """Chapter 9's Exercise 3 (its Function runs Chapter 5's forward kernel) from the unpacked
    wheel, in a folder with no checkout, FLASHBOOK_ROOT pointing nowhere: the solution's code
    cells up to Exercise 3's visible check (other graded cells and demos left out) pass it, and
    nothing executed a chapter source (issue 27: "no chapter 'ch5' in solutions/")."""
    with zipfile.ZipFile(dists["wheel"]) as z:
        z.extractall(tmp_path / "site")
    cells = []
    for cell in sources.read(sources.source("ch9", root).path).cells:
        gid = cellmeta.grade_id(cell)
        if cell.cell_type != "code" or sources.is_demo(cell) or \
                (cellmeta.is_graded_test(cell) and gid != "ch9_autograd_test"):
            continue
        cells.append(cell.source.split("### BEGIN HIDDEN TESTS")[0])
        if gid == "ch9_autograd_test":
            break
    script = tmp_path / "work" / "ch9_cells.py"        # a file: Triton reads kernels' source
    script.parent.mkdir()
    script.write_text("\n\n".join(cells) + "\n\nimport sys\nprint(fb.__file__)\n"
                      "print(sorted(m for m in sys.modules if m.startswith("
                      "('flashbook_solution', 'flashbook_course'))))\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site"), "FLASHBOOK_FORCE_CPU": "1",
           "FLASHBOOK_ROOT": str(tmp_path / "no-checkout")}
    proc = subprocess.run([sys.executable, str(script)], cwd=script.parent, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    *out, where, executed = proc.stdout.splitlines()
    assert where.startswith(str(tmp_path / "site")) and executed == "[]"
    assert "PASSED FlashAttentionFn" in "\n".join(out)


def test_instructor_guide_lists_the_given_answers(root):
    """The guide's table of the answers the package holds names exactly GIVEN's modules and
    grade ids (a row: `module` | `grade id` (...) | why)."""
    text = (root / "book" / "instructor-guide.md").read_text()
    table = text.split("compares this table with GIVEN -->", 1)[1].split("\n\n", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("|")][2:]   # past the head
    listed = {}
    for row in rows:
        module, answers = (cell.strip() for cell in row.strip("|").split("|")[:2])
        listed[module.strip("`")] = tuple(re.findall(r"`(ch\d+_\w+)`", answers))
    assert listed == GIVEN


def test_wheel_metadata_is_complete(root, dists):
    files = _contents(dists["wheel"])
    meta = next(v for k, v in files.items() if k.endswith(".dist-info/METADATA")).decode()
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    assert f"Version: {project['version']}" in meta and "License-Expression: Apache-2.0" in meta
    assert "Requires-Python: >=3.11" in meta and "Classifier: Topic :: Education" in meta
    for label, url in publish.project_urls(publish.repository(root)[0]).items():
        assert f"Project-URL: {label}, {url}" in meta
    assert any(k.endswith(".dist-info/licenses/LICENSE") for k in files)
    assert b"flashbook = flashbook.cli:main" in next(
        v for k, v in files.items() if k.endswith("entry_points.txt"))


def test_book_pages_fold_the_setup_cell_and_notebooks_keep_it_open(root):
    from flashbook import book
    ch = sources.sources(root)[0]
    nb = notebooks.source_notebook(ch, root)
    page = book.title_first(nb)
    install = next(c for c in page.cells if "Setup: on Colab" in c.source)
    assert "hide-input" in install.metadata.tags
    assert "hide-input" not in nb.cells[1].metadata.tags and nb.cells[1] is not install


def test_the_wheel_alone_imports_every_chapter_and_finds_its_data(root, dists, tmp_path):
    """Unpacked on its own (no checkout on the path), the package imports every chapter and
    finds its recorded data: nothing in it reads the repository."""
    with zipfile.ZipFile(dists["wheel"]) as z:
        z.extractall(tmp_path / "site")
    code = ("import importlib, flashbook\n"
            "from flashbook import chapters, results\n"
            "for c in chapters.IDS: importlib.import_module('flashbook.chapters.' + c)\n"
            "print(flashbook.__file__)\n"
            "print(sorted(p.name for p in results.DATA_DIR.iterdir() if p.is_dir()))\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site"), "FLASHBOOK_FORCE_CPU": "1"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    where, recorded = proc.stdout.splitlines()[-2:]
    assert where.startswith(str(tmp_path / "site"))
    assert ast.literal_eval(recorded) == sorted(p.name for p in (root / "src/flashbook/data/bench").iterdir()
                                    if p.is_dir())
