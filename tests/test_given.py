"""The package's generated modules (``flashbook.given``): each equals what its chapter's solution
cells give now (a solution edited without `make release` fails here), holds the named
definitions and nothing of the solution markers, and a release rewrites a stale one."""
import ast
import shutil

from flashbook import given, notebooks, sources


def test_generated_modules_match_their_solutions(root):
    assert given.MODULES
    assert not given.stale(root), \
        f"{given.stale(root)} differ from the solutions they are generated from: run `make release`"


def test_generated_modules_hold_the_named_definitions_only(root):
    for m in given.MODULES:
        text = (root / "src" / m.path).read_text()
        tree = ast.parse(text)
        defined = [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
        assert defined == list(m.names), m.path
        assert ast.get_docstring(tree) and text.startswith("# Generated from solutions/")
        assert not any(x in text for x in given.MARKERS), m.path


def _scratch(root, tmp_path, module):
    """A scratch root with the module's chapter source and the committed module."""
    chapter = sources.source(module.chapter, root).path
    (tmp_path / "solutions").mkdir()
    shutil.copy2(chapter, tmp_path / "solutions" / chapter.name)
    target = tmp_path / "src" / module.path
    target.parent.mkdir(parents=True)
    shutil.copy2(root / "src" / module.path, target)
    return tmp_path / "solutions" / chapter.name, target


def test_an_edited_solution_makes_its_module_stale_and_a_release_rewrites_it(root, tmp_path):
    m = given.MODULES[0]
    chapter, target = _scratch(root, tmp_path, m)
    text = chapter.read_text()
    first = f"def {m.names[0]}("
    assert text.count(first) == 1
    chapter.write_text(text.replace(first, f"def {m.names[0]}(  ", 1))
    assert given.stale(tmp_path) == [m.path]
    # a release into the repository's notebooks/ (here: of no chapter) rewrites it
    written = notebooks.release(tmp_path, course=tmp_path / "course", only=["none"])
    assert written == [target] and not given.stale(tmp_path)
    assert f"def {m.names[0]}(  " in target.read_text()
    assert notebooks.release(tmp_path, course=tmp_path / "course", only=["none"]) == []
