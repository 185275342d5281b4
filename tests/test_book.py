"""The book builds offline with warnings as errors; chapter pages show the student view with the
outputs of the solution; the instructor edition shows the solutions."""
import re

import pytest

from conftest import BOOK_MARKS
from flashbook import notebooks, results, sources

pytestmark = BOOK_MARKS


def _page(index, ch):
    return index.parent / "notebooks" / f"{ch.name}.html"


def test_every_chapter_is_in_the_table_of_contents(root):
    toc = (root / "_toc.yml").read_text()
    for ch in sources.sources():
        assert f"file: notebooks/{ch.name}" in toc, f"{ch.id} is missing from _toc.yml"


@pytest.mark.parametrize("ch", sources.sources(), ids=[c.id for c in sources.sources()])
def test_book_builds_and_pages_show_stubs_with_solution_outputs(built_book, ch):
    assert built_book.exists()
    html_root = built_book.parent
    html = _page(built_book, ch).read_text()
    assert "raise" in html and "NotImplementedError" in html, f"{ch.id}: no stubs shown"
    assert "BEGIN SOLUTION" not in html and "HIDDEN TESTS" not in html
    assert "PASSED" in html, f"{ch.id}: the passing checks' output is missing"
    assert re.search(r'<img [^>]*src="[^"]+\.png"', html), f"{ch.id}: no figure on the page"
    # the Colab launch button and badge open this chapter's student notebook
    assert notebooks.colab_url(ch, sources.repo_root()) in html
    assert (html_root / "mathjax" / "tex-chtml.js").exists(), "MathJax is not served by the book"
    assert "cdn.jsdelivr" not in html


def test_chapter_1_page_hides_the_solution_code(built_book):
    ch = sources.source("ch1")
    html = _page(built_book, ch).read_text()
    # a line that exists only inside the solution of Exercise 2
    assert "m_safe" not in html


def test_instructor_edition_shows_solutions(root, built_book):
    from flashbook import book
    index = book.build(root, instructor=True)
    html = _page(index, sources.source("ch1")).read_text()
    assert "m_safe" in html and "HIDDEN TESTS" in html


def test_benchmark_appendix_lists_every_recorded_measurement(built_book):
    html = (built_book.parent / "book" / "benchmarks.html").read_text()
    for chapter_dir in results.DATA_DIR.glob("ch*"):
        for csv_path in chapter_dir.glob("*.csv"):
            rows, meta = results.recorded(chapter_dir.name, csv_path.stem)
            assert f"{chapter_dir.name}: {meta['gpu']}" in html
            assert all(f"<code class=\"docutils literal notranslate\"><span class=\"pre\">{r.kernel}</span>"
                       in html for r in rows)


def test_file_names_are_not_turned_into_web_links(built_book):
    html_root = built_book.parent
    ch2 = _page(built_book, sources.source("ch2"))
    for page in (ch2, html_root / "book" / "preface.html"):
        html = page.read_text()
        assert "flash.cu" in html
        assert 'href="http://flash.cu"' not in html, f"{page.name}: flash.cu became a web link"
    # real links still are links
    assert 'href="https://nvidia.github.io/numba-cuda/"' in ch2.read_text()


def test_linkify_still_links_bare_urls_but_not_domain_like_names(root):
    """The book's MyST settings (from _config.yml): bare http(s) URLs are links, file names not."""
    import yaml
    from markdown_it.renderer import RendererHTML
    from myst_parser.config.main import MdParserConfig
    from myst_parser.parsers.mdit import create_md_parser
    sphinx_config = yaml.safe_load((root / "_config.yml").read_text())["sphinx"]["config"]
    config = MdParserConfig(enable_extensions={"linkify"},
                            linkify_fuzzy_links=sphinx_config["myst_linkify_fuzzy_links"])
    html = create_md_parser(config, RendererHTML).render(
        "See flash.cu and https://example.org/page and http://example.com.")
    assert 'href="http://flash.cu"' not in html
    assert 'href="https://example.org/page"' in html and 'href="http://example.com"' in html


def test_references_render_math_free_titles(built_book):
    html = (built_book.parent / "book" / "references.html").read_text()
    assert "$O(n^2)$" not in html and "O(n^2)" not in html
    assert "O(n²)" in html


@pytest.mark.parametrize("ch", sources.sources(), ids=[c.id for c in sources.sources()])
def test_chapter_page_shows_the_title_before_the_colab_cells(built_book, ch):
    html = _page(built_book, ch).read_text()
    body = html[html.index('<article class="bd-article"'):] if '<article class="bd-article"' in html else html
    h1 = body.index("<h1")
    badge = body.index("open-in-colab.svg")
    install = body.index("Setup: on Colab")
    assert h1 < badge and h1 < install, f"{ch.id}: the Colab cells come before the title"


@pytest.mark.parametrize("ch", sources.sources(), ids=[c.id for c in sources.sources()])
def test_student_notebook_still_starts_with_the_colab_cells(root, ch):
    import nbformat
    nb = nbformat.read(root / "notebooks" / f"{ch.name}.ipynb", as_version=4)
    assert "Open In Colab" in nb.cells[0].source
    assert "Setup: on Colab" in nb.cells[1].source
    assert nb.cells[2].source.startswith("# Chapter")
