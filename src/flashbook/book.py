"""``flashbook book``: build the HTML book from the chapter sources, offline.

Pipeline (see book/how-the-book-is-built.md):
1. execute each chapter's source notebook in CPU mode (cached by content hash in
   _build/executed/);
2. turn it into the *student view*: solution regions become the stubs students get and hidden
   tests are removed, but the outputs the solution produced stay (instructor edition: skip this);
3. stage the pages under _build/src/ with the same relative paths as the repository, so
   ``notebooks/ch1_naive_attention.ipynb`` is the page whose Colab button opens the student
   notebook of that name;
4. copy MathJax from the django-static-mathjax wheel into the build (the book reads offline);
5. run ``jupyter-book build`` with warnings as errors.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import nbformat

from . import notebooks, results, sources


def mathjax_dir() -> Path:
    """MathJax 3's es5 bundle shipped inside the django-static-mathjax package."""
    import mathjax  # django-static-mathjax's top-level package
    path = Path(mathjax.__file__).parent / "static" / "mathjax" / "es5"
    if not (path / "tex-chtml.js").exists():
        raise FileNotFoundError(f"MathJax not found at {path}; install django-static-mathjax")
    return path


def benchmarks_page() -> str:
    """The appendix of measured results, generated from src/flashbook/data/bench (MyST markdown)."""
    lines = ["# Measured benchmarks", "",
             "Every GPU figure in this book comes from the files below, written by "
             "`flashbook bench <chapter>` on a real GPU. This page is generated from them at build "
             "time. TFLOP/s counts the two matmuls ($4 N_q N_k d$ per head); GB/s counts the "
             "compulsory traffic (read Q, K, V, write O); % of peak is against the GPU's datasheet "
             "peak (tensor cores for fp16, FMA units for fp32).", ""]

    def f(x, spec):
        return format(x, spec) if x is not None else "–"
    for chapter_dir in sorted(results.DATA_DIR.glob("ch*"), key=lambda p: int(p.name[2:])):
        for csv_path in sorted(chapter_dir.glob("*.csv")):
            rows, meta = results.recorded(chapter_dir.name, csv_path.stem)
            lines += [f"## {chapter_dir.name}: {meta.get('gpu', csv_path.stem)}", "",
                      f"Measured with `{meta.get('command', '?')}`; "
                      + results.describe(meta) + (f"; timer {meta['timer']}" if meta.get("timer") else "")
                      + ".", "",
                      "| kernel | role | B | H | N | d | dtype | ms | TFLOP/s | % peak | note |",
                      "|---|---|---|---|---|---|---|---|---|---|---|"]
            for r in rows:
                note = r.note.replace("|", r"\|")    # e.g. "max|O-cuDNN|": a bare | ends the cell
                lines.append(f"| `{r.kernel}` | {r.role} | {r.B} | {r.H_q} | {r.N_q} | {r.d} | "
                             f"{r.dtype} | {f(r.ms, '.3f')} | {f(r.tflops, '.2f')} | "
                             f"{f(r.pct_peak, '.1f')} | {note} |")
            lines.append("")
    return "\n".join(lines)


def title_first(nb):
    """Book pages open with the chapter title: move the header cells (Colab badge and install
    cell, tagged "header") to just after the first other markdown cell. The notebooks keep them
    first (Colab needs them there); only the staged book page is reordered."""
    nb = nbformat.from_dict(nb)
    header = [c for c in nb.cells if "header" in c.metadata.get("tags", [])]
    rest = [c for c in nb.cells if "header" not in c.metadata.get("tags", [])]
    i = next((k for k, c in enumerate(rest) if c.cell_type == "markdown"), -1)
    nb.cells = rest[:i + 1] + header + rest[i + 1:]
    return nb


def stage(root: Path, build: Path, instructor: bool = False) -> Path:
    """Assemble the Sphinx source tree under build/src and return it."""
    src = build / "src"
    if src.exists():
        shutil.rmtree(src)
    src.mkdir(parents=True)
    for name in ("_config.yml", "_toc.yml"):
        shutil.copy2(root / name, src / name)
    shutil.copytree(root / "book", src / "book")
    (src / "book" / "benchmarks.md").write_text(benchmarks_page())
    shutil.copytree(mathjax_dir(), src / "_extra" / "mathjax",
                    ignore=shutil.ignore_patterns("*.map", "sre", "a11y", "ui", "mml-*", "tex-mml*",
                                                  "tex-svg*", "output/svg*"))
    (src / "notebooks").mkdir()
    for ch in sources.sources(root):
        nb = notebooks.executed_source(ch, root, build / "executed")
        page = title_first(nb if instructor else notebooks.student_view(nb))
        nbformat.write(page, src / "notebooks" / f"{ch.name}.ipynb")
    return src


def build(root: Path | None = None, instructor: bool = False, strict: bool = True) -> Path:
    """Build the book; returns the path of index.html."""
    root = root or sources.repo_root()
    build_dir = root / "_build"
    src = stage(root, build_dir, instructor)
    # the student edition lands in _build/html; the instructor edition in _build/instructor/
    out = build_dir / "instructor" if instructor else root
    jb = Path(sys.executable).parent / "jupyter-book"   # the console script of this environment
    cmd = [str(jb), "build", str(src), "--path-output", str(out), "--builder", "html"]
    if strict:
        cmd += ["--warningiserror", "--keep-going"]
    proc = subprocess.run(cmd, cwd=root)
    if proc.returncode != 0:
        raise RuntimeError(f"jupyter-book build failed (exit {proc.returncode})")
    return out / "_build" / "html" / "index.html"
