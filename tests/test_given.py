"""The package's generated modules (``flashbook.given``): each equals what the chapter cells
tagged ``export:<module>`` give now (a tagged cell edited without `make release` fails here),
holds those cells' definitions and nothing of the solution markers, and a release rewrites a
stale one; a tag that names no module, or a tagged cell that would lose a line, is an error."""
import ast
import shutil

import pytest

from flashbook import given, notebooks, sources


def test_generated_modules_match_their_solutions(root):
    assert given.MODULES
    assert not given.stale(root), \
        f"{given.stale(root)} differ from the solutions they are generated from: run `make release`"


def test_generated_modules_hold_the_tagged_definitions_only(root):
    found = given.exported(root)
    for m in given.MODULES:
        text = (root / "src" / m.path).read_text()
        tree = ast.parse(text)
        defined = [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
        assert defined and defined == [d.name for d in found[m.module]], m.path
        assert ast.get_docstring(tree) and text.startswith("# Generated from solutions/")
        assert f"tagged export:{m.module}" in text.split('"""')[0], m.path
        assert not any(x in text for x in given.MARKERS), m.path


def test_the_kernels_later_chapters_import_are_generated(root):
    """What Chapters 5-9 import from ``kernels`` and Chapter 7 from ``lazy_kernels``."""
    names = {m: [d.name for d in defs] for m, defs in given.exported(root).items()}
    assert {"program_tile", "attn_step", "attn_two_tile_step", "visible_pairs",
            "key_tiles"} <= set(names["flashbook.kernels"])
    assert names["flashbook.lazy_kernels"] == ["hw_exp2", "attn_fwd_lazy"]


def _scratch(root, tmp_path):
    """A scratch root with every chapter source and the committed generated modules."""
    (tmp_path / "solutions").mkdir()
    for ch in sources.sources(root):
        shutil.copy2(ch.path, tmp_path / "solutions" / ch.path.name)
    for m in given.MODULES:
        target = tmp_path / "src" / m.path
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / "src" / m.path, target)
    return tmp_path


@pytest.mark.parametrize("module", [m.module for m in given.MODULES])
def test_an_edited_cell_makes_its_module_stale_and_a_release_rewrites_it(root, tmp_path,
                                                                          module):
    m = next(x for x in given.MODULES if x.module == module)
    first = given.exported(root)[module][0]
    scratch = _scratch(root, tmp_path)
    chapter = scratch / first.source
    text = chapter.read_text()
    header = f"def {first.name}("
    assert text.count(header) == 1
    chapter.write_text(text.replace(header, f"def {first.name}(  ", 1))
    assert given.stale(scratch) == [m.path]
    # a release into the repository's notebooks/ (here: of no chapter) rewrites it
    written = notebooks.release(scratch, course=scratch / "course", only=["none"])
    assert written == [scratch / "src" / m.path] and not given.stale(scratch)
    assert f"def {first.name}(  " in (scratch / "src" / m.path).read_text()
    assert notebooks.release(scratch, course=scratch / "course", only=["none"]) == []


CELL = '# %% tags=["export:flashbook.kernels"]\n@triton.jit\ndef f(x):\n    return x\n'


@pytest.mark.parametrize("cell, error", [
    (CELL.replace("flashbook.kernels", "flashbook.kernel"), "the modules:"),
    (CELL + "SCALE = 2.0\n", "definitions only; line 4 is a Assign"),
    (CELL.replace('tags=["export', 'tags=["demo", "export'), "only a solution or given"),
    (CELL + "\n" + CELL, "defines f twice"),
])
def test_a_wrong_export_tag_is_an_error(tmp_path, cell, error):
    (tmp_path / "solutions").mkdir()
    (tmp_path / "solutions" / "ch1_x.py").write_text(f"# %%\nimport triton\n\n{cell}")
    with pytest.raises(ValueError, match=error):
        given.exported(tmp_path)


def test_a_module_with_no_tagged_cell_is_an_error(tmp_path):
    (tmp_path / "solutions").mkdir()
    (tmp_path / "solutions" / "ch1_x.py").write_text(CELL)
    with pytest.raises(ValueError, match="no chapter cell is tagged export:flashbook.gqa_kernels"):
        given.stale(tmp_path)


def test_notebooks_made_from_the_sources_carry_no_export_tag(root):
    """The tags are the package's business: neither the student nor the book sees them."""
    tagged = {d.source for defs in given.exported(root).values() for d in defs}
    for ch in sources.sources(root):
        if ch.path.relative_to(root).as_posix() in tagged:
            nb = notebooks.source_notebook(ch, root)
            assert not [t for c in nb.cells for t in c.metadata.get("tags", [])
                        if t.startswith(given.TAG)], ch.id
