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


#: fp32 rows whose kernel does not run on the FMA units: their "% peak" is taken against the fp32
#: FMA peak, like every fp32 row, which is not their ceiling. kernel -> (from which compute
#: capability, what it runs on). The page marks their % peak and says why under the table.
FP32_ON_TENSOR_CORES = {
    "sdpa_efficient": ((8, 0), "PyTorch's memory-efficient backend (the CUTLASS kernels of xFormers) "
                               "computes fp32 matrix products on the tensor cores with 3xTF32 (three "
                               "TF32 products per fp32 product) on compute capability 8.0 and later"),
}


def _capability(meta: dict) -> tuple[int, ...] | None:
    try:
        return tuple(int(x) for x in str(meta["compute_capability"]).split("."))
    except (KeyError, ValueError):
        return None


CONFORMANCE_DIR = Path(__file__).resolve().parent / "data" / "conformance"
OVERHEAD_DIR = Path(__file__).resolve().parent / "data" / "overhead"


def benchmarks_page() -> str:
    """The appendix of measured results, generated from src/flashbook/data/bench (MyST markdown)."""
    lines = ["# Measured benchmarks", "",
             "Every GPU figure in this book comes from the files below, written by "
             "`flashbook bench <chapter>` on a real GPU. This page is generated from them at build "
             "time. TFLOP/s counts the two matmuls ($4 N_q N_k d$ per head); GB/s counts the "
             "compulsory traffic (read Q, K, V, write O); % of peak is against the GPU's datasheet "
             "peak (tensor cores for fp16, FMA units for fp32). An fp32 row marked † is of a kernel "
             "that runs fp32 on the tensor cores: its % of the FMA peak compares it with a ceiling "
             "it is not bound by (the note under its table says why).", ""]

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
            cc, marked = _capability(meta), {}
            for r in rows:
                note = r.note.replace("|", r"\|")    # e.g. "max|O-cuDNN|": a bare | ends the cell
                pct = f(r.pct_peak, '.1f')
                on_tc = FP32_ON_TENSOR_CORES.get(r.kernel)
                if on_tc and r.dtype == "float32" and r.pct_peak is not None and cc and cc >= on_tc[0]:
                    pct, marked[r.kernel] = f"{pct} †", on_tc[1]
                lines.append(f"| `{r.kernel}` | {r.role} | {r.B} | {r.H_q} | {r.N_q} | {r.d} | "
                             f"{r.dtype} | {f(r.ms, '.3f')} | {f(r.tflops, '.2f')} | "
                             f"{pct} | {note} |")
            lines.append("")
            for kernel, why in marked.items():
                lines += [f"† `{kernel}`: {why}, so its % of the fp32 FMA peak is not a fraction of "
                          "what the hardware it runs on can do; it only places it next to the FMA "
                          "kernels of the same table.", ""]
    return "\n".join(lines + conformance_section() + overhead_section() + sweep_section()
                           + graded_variants_section())


def conformance_section() -> list[str]:
    """What each public function accepts, from src/flashbook/data/conformance (MyST lines)."""
    import json
    from . import conformance
    lines = []
    for path in sorted(CONFORMANCE_DIR.glob("*.json")):
        record = json.loads(path.read_text())
        parts = record["provenance"]
        parts = parts if isinstance(parts, list) else [parts]
        first = parts[0]
        lines += ["## What the functions accept: " + first.get("gpu", path.stem), "",
                  "Each function the chapters show, called as a reader calls it over a grid of "
                  "head dimensions, dtypes, group sizes and modes, and compared with PyTorch's "
                  "SDPA in float32 (gradients too for Chapter 9): *ok* is a right answer, "
                  "*refused* a `ValueError` that says why, *wrong or failed* a bug. Measured with "
                  "`python -m flashbook.conformance --only <chapter>` at "
                  + ", ".join(sorted({f"`{p['commit']}`" for p in parts if p.get("commit")}))
                  + "; " + results.describe(first) + ".", "",
                  conformance.summary(record["rows"]), ""]
    return lines


def overhead_section() -> list[str]:
    """The host time each public function adds to its launches, from src/flashbook/data/overhead
    (MyST lines)."""
    import json
    from . import overhead
    lines = []
    for path in sorted(OVERHEAD_DIR.glob("*.json")):
        record = json.loads(path.read_text())
        meta = record["provenance"]
        over = [r["function"] for r in record["rows"]
                if r.get("added_us", 0) > meta.get("target_us", overhead.TARGET_US)]
        lines += ["## Host time per call: " + meta.get("gpu", path.stem), "",
                  "Each function the chapters show, called as a reader calls it (no config, every "
                  "check on) on a small problem, where the GPU finishes a kernel sooner than "
                  "Python issues the next, so a call's time is host time: the median of "
                  f"{record['rows'][0].get('reps', overhead.REPS)} calls; the same kernels "
                  "launched by hand: the outputs allocated with `torch.empty`, then "
                  "`kernel[grid](...)` with the same arguments (where Triton binds and "
                  "specializes each argument on every call), and for Chapter 9's differentiable "
                  "call one empty `torch.autograd.Function.apply`, which every custom autograd "
                  "op pays; what the wrapper adds to that (checks, tile choice: negative where "
                  "the plan it "
                  "remembers and its launch through the compiled kernel save more than they "
                  "cost, `flashbook.plans`); and the launches alone through the compiled "
                  "kernel, the floor. *Synchronises* is whether a call waits for the GPU (run "
                  "under `torch.cuda.set_sync_debug_mode(\"error\")`). Measured with "
                  f"`{meta.get('command', '?')}` at `{meta.get('commit')}`; "
                  + results.describe(meta) + ".", "",
                  overhead.summary(record["rows"]), ""]
        if over:
            lines += [f"Over the book's target of {meta.get('target_us', overhead.TARGET_US):g} "
                      "µs added per call: " + ", ".join(f"`{f}`" for f in over) + ".", ""]
        if record.get("speed"):
            lines += ["At the shapes of the chapters' benchmarks, the public call and the launch "
                      "under it (the config passed, or the checks skipped), both launched as a "
                      "user launches them (`triton.testing.do_bench` medians, not replayed from a "
                      "CUDA graph), in the same run:", "",
                      overhead.speed_summary(record["speed"]), ""]
    return lines


def sweep_section() -> list[str]:
    """The fastest kernels over a sweep of shapes, as ratios to cuDNN, from
    src/flashbook/data/sweep (MyST lines)."""
    import json
    from . import sweep
    lines = []
    for path in sorted(sweep.DATA_DIR.glob("*.csv")):
        meta = json.loads(path.with_suffix(".json").read_text())
        lines += ["## Over a sweep of shapes: " + meta.get("gpu", path.stem), "",
                  "The forwards of Chapters 3-6 and Chapter 8's decode as a reader calls them "
                  "(no config; the split count chosen by itself), and Chapter 9's backward, each "
                  "against SDPA's cuDNN and FA2 backends (and compiled FlexAttention, where the "
                  "run has it) on the same inputs, all launched (not "
                  "replayed from a CUDA graph). Each cell is the baseline's time divided by ours: "
                  "above 1, ours is faster. Forward and backward keep the tokens per batch "
                  f"constant ({sweep.TOKENS:,}: B = {sweep.TOKENS:,} / N), H = {sweep.HEADS}. "
                  + (f"The parts this record holds: {meta['parts'].replace(',', ', ')}. "
                     if meta.get("parts") else "")
                  + f"Measured with `{meta.get('command', '?')}` at `{meta.get('commit')}`; "
                  + results.describe(meta) + ".", "",
                  "Where each kernel stands, read from these rows:", "",
                  sweep.reading(results.read(path)), "",
                  sweep.ratio_tables(results.read(path)), ""]
    return lines


def graded_variants_section() -> list[str]:
    """Known-wrong variants graded on a GPU by the real pipeline, from
    src/flashbook/data/graded_variants (MyST lines)."""
    import json
    from . import graded_variants
    records = [json.loads(p.read_text()) for p in sorted(graded_variants.DATA_DIR.glob("*.json"))]
    if not records:
        return []
    first = records[0]["provenance"]
    return ["## Known-wrong solutions, graded on a GPU: " + first.get("gpu", "?"), "",
            "Each row is a submission that misses one idea of its exercise (the solution with "
            "one edit: a running max in float16, a producer that does not prefetch, a ring "
            "that all-gathers K and V, ...), handed in beside the solution and graded by "
            "`flashbook collect -> autograde --device gpu -> export`, as an instructor grades. "
            "*Verdict* says whether it lost points at its own exercise with a message that "
            "names its bug (the suite checks the same for every variant in CPU mode). Measured "
            "with `python -m flashbook.graded_variants --chapters <chapter> --names <variants>`; "
            + results.describe(first) + ".", "", graded_variants.summary(records), ""]


def title_first(nb):
    """Book pages open with the chapter title: move the header cells (Colab badge and install
    cell, tagged "header") to just after the first other markdown cell, the install cell's code
    folded ("hide-input"). The notebooks keep them first (Colab needs them there); only the staged
    book page is changed."""
    nb = nbformat.from_dict(nb)
    header = [c for c in nb.cells if "header" in c.metadata.get("tags", [])]
    for c in header:        # the install cell's code is for Colab: folded away on the page
        if c.cell_type == "code" and "hide-input" not in c.metadata.tags:
            c.metadata.tags.append("hide-input")
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
    _jupyter_book(root, src, out, "html", strict)
    return out / "_build" / "html" / "index.html"


def _jupyter_book(root: Path, src: Path, out: Path, builder: str, strict: bool) -> None:
    """``jupyter-book build`` of the staged sources with one Sphinx builder (warnings as errors
    when ``strict``)."""
    jb = Path(sys.executable).parent / "jupyter-book"   # the console script of this environment
    cmd = [str(jb), "build", str(src), "--path-output", str(out), "--builder", builder]
    if strict:
        cmd += ["--warningiserror", "--keep-going"]
    proc = subprocess.run(cmd, cwd=root)
    if proc.returncode != 0:
        raise RuntimeError(f"jupyter-book build --builder {builder} failed (exit {proc.returncode})")


# ------------------------------------------------------------------ the printable edition

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"   # Debian's (never a downloaded build)

# Print styles added to the single page before it is printed: no navigation chrome, each top-level
# page of the book (a chapter, an appendix) on a new sheet, figures and code kept readable.
PRINT_CSS = """
@page { size: A4; margin: 16mm 14mm 18mm 14mm; }
.bd-header, .bd-sidebar-primary, .bd-sidebar-secondary, .bd-header-article, .bd-footer,
.bd-footer-article, .bd-footer-content, .prev-next-area, .header-article-items, .bd-search,
.search-button-field, .skip-link, #pst-back-to-top, a.headerlink, .theme-switch-button { display: none !important; }
#jb-print-docs-body { display: none !important; }   /* the theme's print title and contents: ours replace it */
.bd-main, .bd-content, .bd-article-container, .bd-article, .bd-container, .bd-container__inner,
.bd-page-width { display: block !important; max-width: none !important; width: auto !important;
                 min-width: 0 !important; padding: 0 !important; margin: 0 !important; }
table { font-size: 0.8em; } table td, table th { word-break: break-word; }
div.toctree-wrapper > section, #flashbook-contents { break-before: page; }
.bd-main .bd-content .bd-article h1:first-of-type {   /* the theme hides the title in print */
  display: block !important; font-size: 2.6em; text-align: center; margin-top: 35vh; }
h1, h2, h3 { break-after: avoid; }
img, figure, .cell_output .output { break-inside: avoid; max-width: 100% !important; }
pre { white-space: pre-wrap !important; word-break: break-word; overflow: visible !important; }
#flashbook-contents ol { list-style: none; padding-left: 0; }
#flashbook-contents ol ol { padding-left: 1.5em; }
#flashbook-contents .part { font-weight: bold; margin-top: 0.8em; }
"""

# Adds the "Contents" section at the start of the book (after its title): every top-level page in
# the order of _toc.yml under its part caption, with the page's sections below it. Then waits for
# MathJax 3 (startup.promise resolves once the first typesetting pass is done), the fonts and every
# image; returns the images that did not load.
PREPARE_JS = """
async ({captions, css}) => {
  const style = document.createElement('style'); style.textContent = css;
  document.head.appendChild(style);
  const article = document.querySelector('article.bd-article') || document.body;
  const nav = document.createElement('nav'); nav.id = 'flashbook-contents';
  nav.innerHTML = '<h2>Contents</h2>';
  const top = document.createElement('ol'); nav.appendChild(top);
  const title = h => Array.from(h.childNodes).filter(n => !(n.classList && n.classList.contains('headerlink')))
                       .map(n => n.textContent).join('').trim();
  let part = null;
  for (const anchor of document.querySelectorAll('span[id^="document-"]')) {
    const section = anchor.nextElementSibling;
    if (!section || section.tagName !== 'SECTION') continue;
    const docname = anchor.id.slice('document-'.length);
    if (captions[docname] && captions[docname] !== part) {
      part = captions[docname];
      const li = document.createElement('li'); li.className = 'part'; li.textContent = part; top.appendChild(li);
    }
    const heading = section.querySelector('h1, h2');
    const li = document.createElement('li');
    li.innerHTML = `<a href="#${section.id}"></a>`; li.firstChild.textContent = title(heading);
    const subs = section.querySelectorAll(':scope > section');
    if (subs.length) {
      const ol = document.createElement('ol');
      for (const s of subs) {
        const h = s.querySelector('h1, h2, h3, h4'); if (!h) continue;
        const sub = document.createElement('li');
        sub.innerHTML = `<a href="#${s.id}"></a>`; sub.firstChild.textContent = title(h);
        ol.appendChild(sub);
      }
      li.appendChild(ol);
    }
    top.appendChild(li);
  }
  const h1 = article.querySelector('h1');
  h1.closest('section').insertBefore(nav, h1.nextSibling);
  for (const img of document.images) img.loading = 'eager';
  if (window.MathJax && MathJax.startup && MathJax.startup.promise) await MathJax.startup.promise;
  else throw new Error('MathJax did not start');
  await document.fonts.ready;
  await Promise.all(Array.from(document.images).map(img => img.complete ? null :
    new Promise(r => { img.addEventListener('load', r); img.addEventListener('error', r); })));
  return Array.from(document.images).filter(i => !(i.naturalWidth > 0)).map(i => i.src);
}
"""


def _toc_captions(root: Path) -> dict:
    """docname -> the caption of its part in _toc.yml (the preface, the root, has none)."""
    import yaml
    toc = yaml.safe_load((root / "_toc.yml").read_text())
    return {c["file"]: part.get("caption", "") for part in toc.get("parts", [])
            for c in part.get("chapters", [])}


def print_pdf(html: Path, pdf: Path, captions: dict | None = None) -> int:
    """Print one HTML page (served from its directory over a local HTTP server, so MathJax's
    fonts load as they do on the web) to ``pdf`` with Chromium; returns the number of images.
    Raises if an image did not load, MathJax did not finish or the page asked for the network."""
    import functools
    import http.server
    import threading

    from playwright.sync_api import sync_playwright
    if not Path(CHROMIUM).exists():
        raise FileNotFoundError(f"{CHROMIUM} not found: sudo apt-get install -y chromium")
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0),
                                             functools.partial(Quiet, directory=str(html.parent)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    site = f"http://127.0.0.1:{server.server_address[1]}"
    problems = []
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=[
                "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                "--disable-component-update", "--disable-sync", "--no-first-run"])
            try:
                page = browser.new_page()
                page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
                page.on("response", lambda r: problems.append(f"HTTP {r.status}: {r.url}")
                        if r.status >= 400 else None)
                # the book reads offline: nothing may leave this machine
                page.route("**/*", lambda route: route.continue_()
                           if route.request.url.startswith(site)
                           else (problems.append(f"external request: {route.request.url}"),
                                 route.abort()))
                # the theme loads the search index, which the singlehtml builder does not write
                # (a printed book has no search box)
                page.route(f"{site}/searchindex.js", lambda route: route.fulfill(
                    body="", content_type="text/javascript"))
                page.goto(f"{site}/{html.name}", wait_until="load", timeout=120_000)
                page.set_default_timeout(300_000)
                broken = page.evaluate(PREPARE_JS, {"captions": captions or {}, "css": PRINT_CSS})
                if broken:
                    raise RuntimeError(f"images that did not load: {broken}")
                if problems:
                    raise RuntimeError("printing the book:\n" + "\n".join(problems))
                n_images = page.evaluate("() => document.images.length")
                page.emulate_media(media="print")
                pdf.parent.mkdir(parents=True, exist_ok=True)
                page.pdf(path=str(pdf), format="A4", print_background=True, outline=True,
                         tagged=True, prefer_css_page_size=True, display_header_footer=True,
                         header_template="<span></span>",
                         footer_template='<div style="font-size:8px;width:100%;text-align:center">'
                                         '<span class="pageNumber"></span> / '
                                         '<span class="totalPages"></span></div>')
            finally:
                browser.close()
    finally:
        server.shutdown()
        server.server_close()
    return n_images


def build_pdf(root: Path | None = None, strict: bool = True) -> Path:
    """Build the printable edition: the student book as one HTML page (Sphinx's singlehtml
    builder, MathJax included), printed by Chromium to _build/pdf/flashbook.pdf; returns its path."""
    import yaml
    root = root or sources.repo_root()
    build_dir = root / "_build"
    src = stage(root, build_dir)
    out = build_dir / "pdf"
    _jupyter_book(root, src, out, "singlehtml", strict)
    site = out / "_build" / "singlehtml"
    # the singlehtml builder writes the whole book to <root doc>.html (book/preface.html) but makes
    # its links relative to the output's top directory: put the page there
    root_doc = yaml.safe_load((root / "_toc.yml").read_text())["root"]
    page = site / "flashbook.html"
    shutil.copy2(site / f"{root_doc}.html", page)
    pdf = out / "flashbook.pdf"
    print_pdf(page, pdf, _toc_captions(root))
    return pdf
