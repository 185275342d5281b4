"""The printable edition (`make pdf`): one PDF of the whole book, printed by Debian's chromium."""
import re
import unicodedata

import pytest

from conftest import BOOK_MARKS, NEEDS_CHROMIUM
from flashbook import book, sources

pytestmark = BOOK_MARKS + [NEEDS_CHROMIUM]

# what a page shows when MathJax did not typeset it
RAW_TEX = ["$$", "$O(", "\\frac", "\\(", "\\)", "\\[", "\\]", "\\begin{", "\\sum", "\\sqrt",
           "\\mathrm", "\\exp", "\\le", "\\cdot"]


@pytest.fixture(scope="module")
def pdf(executed_dir, root):
    return book.build_pdf(root)


@pytest.fixture(scope="module")
def reader(pdf):
    import pypdf
    return pypdf.PdfReader(pdf)


@pytest.fixture(scope="module")
def page_texts(reader):
    # NFKC: the PDF's text keeps typographic ligatures ("ﬂash" for "flash")
    return [unicodedata.normalize("NFKC", p.extract_text() or "") for p in reader.pages]


def _chapter_titles(root):
    """The title (first "# " heading) of every page in _toc.yml: chapter sources and book pages."""
    import yaml
    toc = yaml.safe_load((root / "_toc.yml").read_text())
    docs = [toc["root"]] + [c["file"] for part in toc["parts"] for c in part["chapters"]]
    by_name = {f"notebooks/{ch.name}": ch for ch in sources.sources(root)}
    titles = []
    for doc in docs:
        if doc in by_name:
            text = "\n".join(c.source for c in sources.read(by_name[doc].path).cells
                             if c.cell_type == "markdown")
        elif (root / f"{doc}.md").exists():
            text = (root / f"{doc}.md").read_text()
        else:   # generated at build time (book/benchmarks.md)
            continue
        m = re.search(r"^# +(.+)$", text, re.M)
        assert m, f"{doc} has no title"
        titles.append(" ".join(m.group(1).replace("`", "").split()))
    assert len(titles) >= len(by_name)
    return titles


def test_pdf_has_pages_and_contents(pdf, page_texts):
    assert pdf == sources.repo_root() / "_build" / "pdf" / "flashbook.pdf"
    assert len(page_texts) >= max(20, 2 * len(sources.sources())), len(page_texts)
    # the table of contents comes first: the title page, then "Contents"
    assert any(t.lstrip().startswith("Contents") for t in page_texts[:3])


def test_pdf_contains_every_chapter_title(page_texts, root):
    text = " ".join(" ".join(t.split()) for t in page_texts)
    for title in _chapter_titles(root):
        assert title in text, f"chapter missing from the PDF: {title!r}"
    # the contents: from its first page to the page before the one the first document starts on
    # (it grows with the book: nine chapters and the guides take more than two pages)
    pages = [" ".join(t.split()) for t in page_texts]
    first = next(i for i, t in enumerate(pages) if t.startswith("Contents"))
    body = next((i for i in range(first + 1, len(pages))
                 if pages[i].startswith(_chapter_titles(root)[1])), None)
    assert body is not None, "no page starts with the first document's title"
    contents = " ".join(pages[first:body])
    for title in _chapter_titles(root)[1:]:   # [0]: the book's title, above the contents
        assert title in contents, f"chapter missing from the contents: {title!r}"


def test_no_page_shows_raw_tex(page_texts):
    bad = [(i + 1, tex) for i, t in enumerate(page_texts) for tex in RAW_TEX if tex in t]
    assert not bad, f"raw TeX on (page, text): {bad[:20]}"


def image_xobjects(resources, seen=None) -> int:
    """How many image XObjects a page's (or form's) resources draw, forms followed once each.
    Chromium puts every raster image in an XObject, never inline; pypdf's ``page.images`` would
    count the same ones but parses every content stream looking for inline images (8 s)."""
    seen = set() if seen is None else seen
    xobjects = (resources or {}).get("/XObject")
    count = 0
    for name, ref in (xobjects.get_object().items() if xobjects is not None else ()):
        obj = ref.get_object()
        if obj.get("/Subtype") == "/Image":
            count += 1
        elif obj.get("/Subtype") == "/Form" and id(obj) not in seen:
            seen.add(id(obj))
            count += image_xobjects(obj.get("/Resources"), seen)
    return count


def test_every_figure_is_in_the_pdf(reader, pdf):
    # build_pdf raised if any <img> had not loaded (naturalWidth 0); here: every raster figure
    # of the single page is an image in the PDF
    html = (pdf.parent / "_build" / "singlehtml" / "flashbook.html").read_text()
    figures = re.findall(r"<img [^>]*src=\"[^\"]+\.(?:png|jpe?g|gif)\"", html)
    assert figures
    assert sum(image_xobjects(p.get("/Resources")) for p in reader.pages) >= len(figures)


def test_a_missing_image_stops_the_print(tmp_path):
    (tmp_path / "mathjax").symlink_to(book.mathjax_dir(), target_is_directory=True)
    page = tmp_path / "page.html"
    page.write_text('<html><head><script src="mathjax/tex-chtml.js"></script></head><body>'
                    '<section><h1>t</h1><p>\\(x^2\\)</p><img src="missing.png"></section>'
                    '</body></html>')
    with pytest.raises(RuntimeError, match="missing.png"):
        book.print_pdf(page, tmp_path / "out.pdf")
