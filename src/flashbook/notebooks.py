"""The notebook pipeline: one source per chapter (``solutions/chN_slug.py``, jupytext percent
format with nbgrader cell metadata) becomes

* the student notebook ``notebooks/chN_slug.ipynb`` (``flashbook release``, via nbgrader);
* the book page (``flashbook book``): executed in CPU mode, then shown with the student's
  source (stubs) but the outputs the solution produced;
* the package's generated modules (``given``: the chapter code the package runs, from the cells
  tagged ``export:<module>``, a tag the notebooks do not carry), rewritten by a release into the
  repository's ``notebooks/``;
"""
from __future__ import annotations

import hashlib
import inspect
import os
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat

from .grade.cellmeta import set_meta
from .grade.markers import add_markers
from . import colab_install, given, publish
from .sources import Source, read, repo_root, sources

# ------------------------------------------------------------------------ header cells

def repository(root: Path) -> tuple[str, str]:
    """(url, branch) from _config.yml: the one place the repository's address lives."""
    return publish.repository(root)


def colab_url(ch: Source, root: Path) -> str:
    url, branch = repository(root)
    owner, name = publish.slug(url)
    return f"https://colab.research.google.com/github/{owner}/{name}/blob/{branch}/notebooks/{ch.name}.ipynb"


COLAB_BADGE = "https://colab.research.google.com/assets/colab-badge.svg"
LOCAL_BADGE = "../book/figures/open-in-colab.svg"   # book pages: no image from the network


def install_cell_source(root: Path) -> str:
    """The Colab setup cell: ``colab_install.install_flashbook`` itself, then its call with this
    release's version, the repository address and branch, and the light requirements."""
    url, branch = repository(root)
    call = (f"install_flashbook({publish.package_version(root)!r}, {url!r}, {branch!r},\n"
            f"                      {publish.package_requirements(root)!r})")
    return ("# Setup: on Colab, install the flashbook helper package (keeps Colab's torch and triton).\n"
            "import importlib.metadata, re, subprocess, sys, tempfile\n"
            f"KEPT = {colab_install.KEPT!r}\n\n"
            + inspect.getsource(colab_install.install_flashbook) + "\n\n"
            "if \"google.colab\" in sys.modules:\n"
            f"    {call}")


def header_cells(ch: Source, root: Path, badge_image: str = COLAB_BADGE) -> list:
    """The Colab badge and the install cell that start every student notebook and page.

    The install cell adds flashbook on Colab only, without touching Colab's torch/triton.
    """
    badge = nbformat.v4.new_markdown_cell(f"[![Open In Colab]({badge_image})]({colab_url(ch, root)})")
    install = nbformat.v4.new_code_cell(install_cell_source(root))
    for cell, gid in ((badge, "colab_badge"), (install, "colab_install")):
        set_meta(cell, {"grade": False, "solution": False, "locked": True,
                        "grade_id": f"{ch.id}_{gid}", "schema_version": 3, "task": False})
        cell.metadata["tags"] = ["header"]
    return [badge, install]


def source_notebook(ch: Source, root: Path, badge_image: str = COLAB_BADGE):
    """The instructor notebook nbgrader starts from: header cells + the solution source."""
    nb = read(ch.path)
    nb.cells = header_cells(ch, root, badge_image) + nb.cells
    nb.metadata["kernelspec"] = {"display_name": "Python 3", "language": "python", "name": "python3"}
    nb.metadata.pop("jupytext", None)
    add_markers(nb)   # "# flashbook: <grade_id>": how collect re-identifies cells editors mangled
    for i, cell in enumerate(nb.cells):
        given.drop_export_tags(cell)      # the package's business, not the student's
        cell.pop("id", None)
        cell["id"] = f"{ch.id}-{i:03d}"   # stable ids keep regenerated notebooks identical
    return nb


# ---------------------------------------------------------------------------- release

def nbgrader(args: list[str], course: Path, **kw) -> subprocess.CompletedProcess:
    """Run an nbgrader command in the course directory (its nbgrader_config.py applies)."""
    return nbgrader_python(["-m", "nbgrader", *args], course, **kw)


# One interpreter for all of a release's assignments: importing nbgrader takes about 5 s, so
# `nbgrader generate_assignment` once per chapter spent most of a release importing it. The
# course's nbgrader_config.py is read as the command line reads it (NbGraderApp.initialize).
_GENERATE = """
import sys
from nbgrader.apps import NbGraderAPI, NbGraderApp
app = NbGraderApp()
app.initialize([])
api = NbGraderAPI(parent=app)
for assignment in sys.argv[1:]:
    result = api.generate_assignment(assignment, force=True)
    if not result["success"]:
        print(result.get("log", ""), result.get("error", ""), sep="\\n")
        sys.exit(f"nbgrader generate_assignment {assignment} failed")
"""


def generate_assignments(assignments: list[str], course: Path,
                         **kw) -> subprocess.CompletedProcess:
    """``nbgrader generate_assignment A --force`` for each of ``assignments``, in one process."""
    return nbgrader_python(["-c", _GENERATE, *assignments], course, **kw)


def nbgrader_python(args: list[str], course: Path, **kw) -> subprocess.CompletedProcess:
    """Run this Python with ``args`` in the course directory, as ``nbgrader`` runs there."""
    env = dict(kw.pop("env", None) or os.environ)
    # nbgrader runs `alembic` for its database: put this environment's scripts on PATH.
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return subprocess.run([sys.executable, *args], cwd=course, capture_output=True, text=True,
                          env=env, **kw)


def release(root: Path | None = None, out_dir: Path | None = None, course: Path | None = None,
            only: list[str] | None = None) -> list[Path]:
    """Regenerate student notebooks from solutions/ through nbgrader generate_assignment; a
    release into the repository's notebooks/ (no ``out_dir``) also rewrites the package's
    generated modules (``given.write``). Returns the paths written."""
    into_repository = out_dir is None
    root = root or repo_root()
    course = course or root / "autograder"
    out_dir = out_dir or root / "notebooks"
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    chosen = [ch for ch in sources(root) if not only or ch.id in only]
    for ch in chosen:
        src_dir = course / "source" / ch.id
        if src_dir.exists():
            shutil.rmtree(src_dir)
        src_dir.mkdir(parents=True)
        nbformat.write(source_notebook(ch, root), src_dir / f"{ch.name}.ipynb")
    proc = generate_assignments([ch.id for ch in chosen], course) if chosen else None
    for ch in chosen:
        released = course / "release" / ch.id / f"{ch.name}.ipynb"
        if proc.returncode != 0 or not released.exists():
            raise RuntimeError(f"nbgrader generate_assignment {ch.id} failed:\n{proc.stdout}\n"
                               f"{proc.stderr}")
        nb = nbformat.read(released, as_version=4)
        target = out_dir / f"{ch.name}.ipynb"
        nbformat.write(nb, target)
        written.append(target)
    if into_repository:
        written += given.write(root)
    return written


# ------------------------------------------------------------------------ execution

def execute(nb, *, timeout: int = 600, allow_errors: bool = False, cwd: Path | None = None,
            env: dict | None = None):
    """Execute a notebook with nbclient in a fresh kernel; returns the executed notebook.

    ``env`` is added to this process's environment for the kernel only: it goes to the kernel's
    launch and never into ``os.environ``, so callers (threads, tests) do not see each other's.
    """
    import tempfile

    from jupyter_client.manager import KernelManager
    from nbclient import NotebookClient
    kernel_env = {**os.environ, **(env or {})}
    with tempfile.TemporaryDirectory(prefix="flashbook-kernel-") as sockets:
        # Unix sockets, not TCP ports: no port races when several notebooks run at once.
        km = KernelManager(kernel_name="python3", transport="ipc",
                           ip=os.path.join(sockets, "k"))
        client = NotebookClient(nb, km=km, timeout=timeout, allow_errors=allow_errors,
                                resources={"metadata": {"path": str(cwd or repo_root())}})
        try:
            # nbclient passes execute()'s keyword arguments on to km.start_kernel(), whose `env`
            # is the kernel process's whole environment (hence os.environ plus ours).
            client.execute(env=kernel_env)
        finally:
            if km.has_kernel:          # a client given a km leaves its shutdown to us
                km.shutdown_kernel(now=True)
    return nb


# What a chapter's executed notebook depends on, besides its own source and package: the toolkit
# (the top-level modules), the grade modules that build a notebook's cells, and the recorded data
# the chapters quote. Not the grader, not other chapters' packages (a chapter's package imports
# none: tests/test_layout.py), not the self-check records (no chapter shows them).
NOTEBOOK_GRADE_MODULES = ("cellmeta.py", "markers.py")
UNQUOTED_DATA = ("selftest",)


def notebook_inputs(ch: Source, root: Path) -> list[Path]:
    """The files whose content keys ``ch``'s executed-notebook cache, sorted."""
    package = root / "src" / "flashbook"
    files = [ch.path, package / "chapters" / "__init__.py"]
    files += package.glob("*.py")
    files += (package / "grade" / name for name in NOTEBOOK_GRADE_MODULES)
    files += (p for p in (package / "chapters" / ch.id).rglob("*") if p.suffix == ".py")
    files += (p for p in (package / "data").rglob("*")
              if p.suffix in (".csv", ".json", ".txt")
              and p.relative_to(package / "data").parts[0] not in UNQUOTED_DATA)
    return sorted({p for p in files if p.is_file()})


def _inputs_hash(ch: Source, root: Path) -> str:
    h = hashlib.sha256()
    for p in notebook_inputs(ch, root):
        name, data = p.relative_to(root).as_posix().encode(), p.read_bytes()
        h.update(b"%d:%s %d:" % (len(name), name, len(data)) + data)
    return h.hexdigest()


def executed_source(ch: Source, root: Path, cache_dir: Path, timeout: int = 900):
    """The source notebook executed top to bottom in CPU mode (cached by content hash).

    Several processes may ask at once (the test suite's workers): one executes the chapter
    while the others wait on its lock file, then read what it wrote (whole, by a rename).
    """
    from filelock import FileLock   # installed with torch (pinned in constraints.txt)
    cache_dir.mkdir(parents=True, exist_ok=True)
    key = _inputs_hash(ch, root)
    cached = cache_dir / f"{ch.name}.ipynb"
    with FileLock(cache_dir / f"{ch.name}.lock"):
        if cached.exists():
            nb = nbformat.read(cached, as_version=4)
            if nb.metadata.get("flashbook_hash") == key:
                return nb
        nb = execute(source_notebook(ch, root, badge_image=LOCAL_BADGE), timeout=timeout,
                     env={"FLASHBOOK_FORCE_CPU": "1",
                          "MPLBACKEND": "module://matplotlib_inline.backend_inline"})
        nb.metadata["flashbook_hash"] = key
        partial = cached.with_name(cached.name + ".part")
        nbformat.write(nb, partial)
        os.replace(partial, cached)
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
