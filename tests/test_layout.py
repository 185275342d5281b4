"""The package's shape: no module over MAX_LINES lines, and no import cycle among its modules.

The cycle scan reads every module with ``ast`` (nothing is imported) and takes every import of a
flashbook module as an edge, including imports made inside a function: a deferred import that
closes a cycle is still a cycle in the design.
"""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "flashbook"
MAX_LINES = 500

def _modules():
    """Every module of the package, by dotted name -> (path, is_package)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = ("flashbook",) + path.relative_to(PACKAGE).with_suffix("").parts
        is_package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return found


def _edges(name, path, is_package, modules):
    """The flashbook modules that module `name` imports, anywhere in its body."""
    package = name if is_package else name.rpartition(".")[0]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):      # level 1 is ".", the module's package
            anchor = package.rsplit(".", node.level - 1)[0] if node.level else ""
            base = ".".join(part for part in (anchor, node.module) if part)
            for alias in node.names:                  # `from pkg import mod` imports pkg.mod
                submodule = f"{base}.{alias.name}"
                targets.add(submodule if submodule in modules else base)
    return {target for target in targets if target in modules and target != name}


def _cycles(graph):
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, components = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(components)


def test_no_module_is_over_the_line_limit():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        name, n = path.relative_to(PACKAGE).as_posix(), len(path.read_text().splitlines())
        if n > MAX_LINES:
            offenders.append(f"{name}: {n} lines")
    assert not offenders, f"modules over {MAX_LINES} lines:\n" + "\n".join(offenders)


def test_no_import_cycles():
    modules = _modules()
    graph = {name: _edges(name, path, is_pkg, modules) for name, (path, is_pkg) in modules.items()}
    cycles = list(_cycles(graph))
    assert not cycles, "import cycles among flashbook modules:\n" + "\n".join(
        " <-> ".join(component) for component in cycles)


# What chapters still take from each other (importer -> imported), and the chapter submodules a
# notebook still imports instead of the chapter's `__init__`. The design is neither (a chapter's
# public surface is its `__init__`; what two chapters share lives in the toolkit): both lists
# only shrink. A new edge fails; an edge that is gone must leave its list.
CROSS_CHAPTER = {
    # Chapter 6's Gluon launcher and its planner's configs, which Chapter 7's benchmark runs
    # with its tricks as hooks (chapters/ch7/gluon_tricks); the planner is still Chapter 6's
    ("ch7.benchmark", "ch6.gluon_fa3"),
}
NOTEBOOK_SUBMODULES = set()


def _chapter(module):
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "chapters" else None


def test_chapters_import_no_other_chapter_beyond_the_shrinking_list():
    modules = _modules()
    found = set()
    for name, (path, is_pkg) in modules.items():
        mine = _chapter(name)
        if mine is None:
            continue
        for target in _edges(name, path, is_pkg, modules):
            theirs = _chapter(target)
            if theirs is not None and theirs != mine:
                found.add((name.removeprefix("flashbook.chapters."),
                           target.removeprefix("flashbook.chapters.")))
    new, gone = sorted(found - CROSS_CHAPTER), sorted(CROSS_CHAPTER - found)
    assert not new, ("a chapter imports another (move what both need into the toolkit): "
                     + ", ".join(f"{a} -> {b}" for a, b in new))
    assert not gone, "no longer imported, remove from CROSS_CHAPTER: " + \
        ", ".join(f"{a} -> {b}" for a, b in gone)


def test_notebooks_import_chapters_through_their_init_beyond_the_shrinking_list():
    root = PACKAGE.parents[1]
    found = set()
    for path in sorted((root / "solutions").glob("ch*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            for module in names:
                parts = module.split(".")
                if module.startswith("flashbook.chapters.ch") and len(parts) > 3:
                    found.add((path.stem.split("_")[0], ".".join(parts[2:])))
    new, gone = sorted(found - NOTEBOOK_SUBMODULES), sorted(NOTEBOOK_SUBMODULES - found)
    assert not new, ("a notebook imports a chapter's submodule (re-export it from the chapter's "
                     "__init__): " + ", ".join(f"{a}: {b}" for a, b in new))
    assert not gone, "no longer imported, remove from NOTEBOOK_SUBMODULES: " + \
        ", ".join(f"{a}: {b}" for a, b in gone)
