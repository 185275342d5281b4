"""The book builds offline with warnings as errors; chapter pages show the student view with the
outputs of the solution; the instructor edition shows the solutions."""
import re

import pytest

from flashbook import notebooks

pytestmark = pytest.mark.slow


def _page(index, ch):
    return index.parent / "notebooks" / f"{ch.name}.html"


def test_every_chapter_is_in_the_table_of_contents(root):
    toc = (root / "_toc.yml").read_text()
    for ch in notebooks.chapters():
        assert f"file: notebooks/{ch.name}" in toc, f"{ch.id} is missing from _toc.yml"


@pytest.mark.parametrize("ch", notebooks.chapters(), ids=[c.id for c in notebooks.chapters()])
def test_book_builds_and_pages_show_stubs_with_solution_outputs(built_book, ch):
    assert built_book.exists()
    html_root = built_book.parent
    html = _page(built_book, ch).read_text()
    assert "raise" in html and "NotImplementedError" in html, f"{ch.id}: no stubs shown"
    assert "BEGIN SOLUTION" not in html and "HIDDEN TESTS" not in html
    assert "PASSED" in html, f"{ch.id}: the passing checks' output is missing"
    assert re.search(r'<img [^>]*src="[^"]+\.png"', html), f"{ch.id}: no figure on the page"
    # the Colab launch button and badge open this chapter's student notebook
    assert notebooks.colab_url(ch, notebooks.repo_root()) in html
    assert (html_root / "mathjax" / "tex-chtml.js").exists(), "MathJax is not served by the book"
    assert "cdn.jsdelivr" not in html


def test_chapter_1_page_hides_the_solution_code(built_book):
    ch = notebooks.chapter("ch1")
    html = _page(built_book, ch).read_text()
    # a line that exists only inside the solution of Exercise 2
    assert "m_safe" not in html


def test_instructor_edition_shows_solutions(root, built_book):
    from flashbook import book
    index = book.build(root, instructor=True)
    html = _page(index, notebooks.chapter("ch1")).read_text()
    assert "m_safe" in html and "HIDDEN TESTS" in html


def test_benchmark_appendix_lists_every_recorded_measurement(built_book):
    from flashbook import benchmarks
    html = (built_book.parent / "book" / "benchmarks.html").read_text()
    for chapter_dir in benchmarks.DATA_DIR.glob("ch*"):
        for csv_path in chapter_dir.glob("*.csv"):
            rows, meta = benchmarks.recorded(chapter_dir.name, csv_path.stem)
            assert f"{chapter_dir.name}: {meta['gpu']}" in html
            assert all(f"<code class=\"docutils literal notranslate\"><span class=\"pre\">{r['kernel']}</span>"
                       in html for r in rows)
