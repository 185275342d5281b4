"""The notebook pipeline: one source per chapter (``solutions/chN_slug.py``, jupytext percent
format with nbgrader cell metadata) becomes

* the student notebook ``notebooks/chN_slug.ipynb`` (``flashbook release``, via nbgrader);
* the book page (``flashbook book``): executed in CPU mode, then shown with the student's
  source (stubs) but the outputs the solution produced;
* the kernels that ``flashbook bench`` times (``solution_namespace``).
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat

TAG_DEMO = "demo"     # plots, benchmarks, illustrations: skipped by known-wrong tests and bench


@dataclasses.dataclass(frozen=True)
class Chapter:
    id: str          # "ch1": also the nbgrader assignment name
    name: str        # "ch1_naive_attention": the notebook's file name without extension
    source: Path     # solutions/ch1_naive_attention.py


def repo_root() -> Path:
    """The checkout this package runs from (src layout: src/flashbook/ -> repo)."""
    env = os.environ.get("FLASHBOOK_ROOT")
    return Path(env) if env else Path(__file__).resolve().parents[2]


def chapters(root: Path | None = None) -> list[Chapter]:
    root = root or repo_root()
    out = []
    for path in sorted((root / "solutions").glob("ch*_*.py")):
        m = re.fullmatch(r"(ch\d+)_\w+", path.stem)
        if m:
            out.append(Chapter(m.group(1), path.stem, path))
    return sorted(out, key=lambda c: int(c.id[2:]))


def chapter(chapter_id: str, root: Path | None = None) -> Chapter:
    for c in chapters(root):
        if c.id == chapter_id:
            return c
    raise ValueError(f"no chapter {chapter_id!r} in solutions/")


def read_source(path: Path):
    """The solution notebook (nbformat v4) from its jupytext percent source."""
    import jupytext
    return jupytext.read(path, fmt="py:percent")


def grade_meta(cell) -> dict:
    return cell.get("metadata", {}).get("nbgrader", {})


def is_solution(cell) -> bool:
    return bool(grade_meta(cell).get("solution"))


def is_graded_test(cell) -> bool:
    m = grade_meta(cell)
    return bool(m.get("grade")) and not m.get("solution")


def is_demo(cell) -> bool:
    return TAG_DEMO in cell.get("metadata", {}).get("tags", [])


def fresh_module(name: str):
    """An empty module registered in sys.modules, to execute notebook cells in: tools such as
    dataclasses look their class's module up there."""
    import types
    module = types.ModuleType(name)
    sys.modules[name] = module
    return module


def exec_cell(source: str, name: str, ns: dict):
    """Execute one cell's source in ``ns``, registered in linecache so that tools reading the
    source back (inspect, and so @triton.jit) find it."""
    import linecache
    linecache.cache[name] = (len(source), None, source.splitlines(True), name)
    exec(compile(source, name, "exec"), ns)


def solution_namespace(chapter_id: str, root: Path | None = None,
                       replace: dict | None = None) -> dict:
    """Execute the chapter's code cells except graded tests and demo cells; return the globals.

    This is how ``flashbook bench`` gets the chapter's reference kernels without a second
    copy of the solution code. ``replace`` maps grade_ids to other cell sources (tests use it
    to run known-wrong answers).
    """
    nb = read_source(chapter(chapter_id, root).source)
    ns = fresh_module(f"flashbook_solution_{chapter_id}").__dict__
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code" and not is_graded_test(cell) and not is_demo(cell):
            source = (replace or {}).get(grade_meta(cell).get("grade_id"), cell.source)
            # the name changes with the source: Triton reads kernel sources back lazily
            exec_cell(source, f"<{chapter_id} cell {i} {hashlib.sha1(source.encode()).hexdigest()[:12]}>", ns)
    return ns


# ------------------------------------------------------------------------ header cells

def _config(root: Path) -> dict:
    import yaml
    return yaml.safe_load((root / "_config.yml").read_text())


def repository(root: Path) -> tuple[str, str]:
    """(url, branch) from _config.yml: the one place the repository's address lives."""
    repo = _config(root)["repository"]
    return repo["url"].rstrip("/"), repo.get("branch", "main")


def colab_url(ch: Chapter, root: Path) -> str:
    url, branch = repository(root)
    slug = url.split("github.com/", 1)[1]
    return f"https://colab.research.google.com/github/{slug}/blob/{branch}/notebooks/{ch.name}.ipynb"


COLAB_BADGE = "https://colab.research.google.com/assets/colab-badge.svg"
LOCAL_BADGE = "../book/figures/open-in-colab.svg"   # book pages: no image from the network


def header_cells(ch: Chapter, root: Path, badge_image: str = COLAB_BADGE) -> list:
    """The Colab badge and the install cell that start every student notebook and page.

    The install cell adds flashbook on Colab only, without touching Colab's torch/triton.
    """
    url, branch = repository(root)
    badge = nbformat.v4.new_markdown_cell(f"[![Open In Colab]({badge_image})]({colab_url(ch, root)})")
    install = nbformat.v4.new_code_cell(
        "# Setup: on Colab, install the flashbook helper package (keeps Colab's torch and triton).\n"
        "import sys, subprocess\n"
        "if \"google.colab\" in sys.modules:\n"
        "    subprocess.run([sys.executable, \"-m\", \"pip\", \"install\", \"-q\",\n"
        f"                    \"flashbook @ git+{url}@{branch}\"], check=True)")
    for cell, gid in ((badge, "colab_badge"), (install, "colab_install")):
        cell.metadata["nbgrader"] = {"grade": False, "solution": False, "locked": True,
                                     "grade_id": f"{ch.id}_{gid}", "schema_version": 3,
                                     "task": False}
        cell.metadata["tags"] = ["header"]
    return [badge, install]


def source_notebook(ch: Chapter, root: Path, badge_image: str = COLAB_BADGE):
    """The instructor notebook nbgrader starts from: header cells + the solution source."""
    nb = read_source(ch.source)
    nb.cells = header_cells(ch, root, badge_image) + nb.cells
    nb.metadata["kernelspec"] = {"display_name": "Python 3", "language": "python", "name": "python3"}
    nb.metadata.pop("jupytext", None)
    from .grade.markers import add_markers
    add_markers(nb)   # "# flashbook: <grade_id>": how collect re-identifies cells editors mangled
    for i, cell in enumerate(nb.cells):
        cell.pop("id", None)
        cell["id"] = f"{ch.id}-{i:03d}"   # stable ids keep regenerated notebooks identical
    return nb


# ---------------------------------------------------------------------------- release

def nbgrader(args: list[str], course: Path, **kw) -> subprocess.CompletedProcess:
    """Run an nbgrader command in the course directory (its nbgrader_config.py applies)."""
    env = dict(kw.pop("env", None) or os.environ)
    # nbgrader runs `alembic` for its database: put this environment's scripts on PATH.
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return subprocess.run([sys.executable, "-m", "nbgrader", *args], cwd=course,
                          capture_output=True, text=True, env=env, **kw)


def release(root: Path | None = None, out_dir: Path | None = None, course: Path | None = None,
            only: list[str] | None = None) -> list[Path]:
    """Regenerate student notebooks from solutions/ through nbgrader generate_assignment."""
    root = root or repo_root()
    course = course or root / "autograder"
    out_dir = out_dir or root / "notebooks"
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for ch in chapters(root):
        if only and ch.id not in only:
            continue
        src_dir = course / "source" / ch.id
        if src_dir.exists():
            shutil.rmtree(src_dir)
        src_dir.mkdir(parents=True)
        nbformat.write(source_notebook(ch, root), src_dir / f"{ch.name}.ipynb")
        proc = nbgrader(["generate_assignment", ch.id, "--force"], course)
        released = course / "release" / ch.id / f"{ch.name}.ipynb"
        if proc.returncode != 0 or not released.exists():
            raise RuntimeError(f"nbgrader generate_assignment {ch.id} failed:\n{proc.stdout}\n"
                               f"{proc.stderr}")
        nb = nbformat.read(released, as_version=4)
        target = out_dir / f"{ch.name}.ipynb"
        nbformat.write(nb, target)
        written.append(target)
    return written


# ------------------------------------------------------------------------ execution

def execute(nb, *, timeout: int = 600, allow_errors: bool = False, cwd: Path | None = None,
            env: dict | None = None):
    """Execute a notebook with nbclient in a fresh kernel; returns the executed notebook."""
    import tempfile

    from jupyter_client.manager import KernelManager
    from nbclient import NotebookClient
    old = dict(os.environ)
    try:
        if env:
            os.environ.update(env)   # the kernel inherits the parent's environment
        with tempfile.TemporaryDirectory(prefix="flashbook-kernel-") as sockets:
            # Unix sockets, not TCP ports: no port races when several notebooks run at once.
            km = KernelManager(kernel_name="python3", transport="ipc",
                               ip=os.path.join(sockets, "k"))
            client = NotebookClient(nb, km=km, timeout=timeout, allow_errors=allow_errors,
                                    resources={"metadata": {"path": str(cwd or repo_root())}})
            try:
                client.execute()
            finally:
                if km.has_kernel:          # a client given a km leaves its shutdown to us
                    km.shutdown_kernel(now=True)
    finally:
        os.environ.clear()
        os.environ.update(old)
    return nb


def _inputs_hash(ch: Chapter, root: Path) -> str:
    h = hashlib.sha256(ch.source.read_bytes())
    for p in sorted((root / "src" / "flashbook").rglob("*")):
        if p.is_file() and p.suffix in (".py", ".csv", ".json"):
            h.update(p.read_bytes())
    return h.hexdigest()


def executed_source(ch: Chapter, root: Path, cache_dir: Path, timeout: int = 900):
    """The source notebook executed top to bottom in CPU mode (cached by content hash)."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    key = _inputs_hash(ch, root)
    cached = cache_dir / f"{ch.name}.ipynb"
    if cached.exists():
        nb = nbformat.read(cached, as_version=4)
        if nb.metadata.get("flashbook_hash") == key:
            return nb
    nb = execute(source_notebook(ch, root, badge_image=LOCAL_BADGE), timeout=timeout,
                 env={"FLASHBOOK_FORCE_CPU": "1", "MPLBACKEND": "module://matplotlib_inline.backend_inline"})
    nb.metadata["flashbook_hash"] = key
    nbformat.write(nb, cached)
    return nb


def student_view(nb):
    """Replace solution regions by stubs and drop hidden tests, keeping outputs (book pages)."""
    from nbgrader.preprocessors import ClearHiddenTests, ClearSolutions
    nb = nbformat.from_dict(nb)
    resources = {"language": "python"}
    nb, _ = ClearSolutions(code_stub={"python": "# YOUR CODE HERE\nraise NotImplementedError()"},
                           enforce_metadata=True).preprocess(nb, resources)
    nb, _ = ClearHiddenTests(enforce_metadata=True).preprocess(nb, resources)
    return nb
