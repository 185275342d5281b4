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


# What chapters take from each other (importer -> imported), and the chapter submodules a
# notebook imports instead of the chapter's `__init__`: none. A chapter's public surface is its
# `__init__`, and what two chapters share lives in the toolkit (Chapter 6's FA3 launch, kernel and
# planner, which Chapter 7's benchmark runs, are `fa3_launch`, `fa3_kernel`, `fa3_planner`).
# A new edge fails.
CROSS_CHAPTER = set()
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


# A chapter's problems are the toolkit's case types (``cases.AttnCase``, ``case_sweeps.DecodeCase``,
# ``sharding.ShardedCase``, and a ring's geometry ``pipeline_types.Ring``): no module of a
# chapter defines a class whose name ends in "Case".
CHAPTER_CASE_TYPES = set()


def chapter_case_types(modules) -> set[str]:
    """Every class named *Case that a chapter module defines, as chN.module.Class."""
    found = set()
    for name, (path, _) in modules.items():
        if _chapter(name) is None:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef) and node.name.endswith("Case"):
                found.add(f"{name.removeprefix('flashbook.chapters.')}.{node.name}")
    return found


def test_chapters_define_no_case_type_beyond_the_shrinking_list():
    found = chapter_case_types(_modules())
    new, gone = sorted(found - CHAPTER_CASE_TYPES), sorted(CHAPTER_CASE_TYPES - found)
    assert not new, ("a chapter defines its own case type (use or extend the toolkit's: "
                     "cases.AttnCase, case_sweeps.DecodeCase, sharding.ShardedCase): " + ", ".join(new))
    assert not gone, "no longer defined, remove from CHAPTER_CASE_TYPES: " + ", ".join(gone)


def test_a_case_type_in_a_chapter_is_found(tmp_path):
    module = tmp_path / "probe.py"
    module.write_text("import dataclasses\n\n@dataclasses.dataclass\nclass ProbeCase:\n    n: int\n")
    assert chapter_case_types({"flashbook.chapters.ch99.probe": (module, False)}) == \
        {"ch99.probe.ProbeCase"}


# The layers, bottom up (CONTRIBUTING): ``grade`` (nbgrader, not attention) imports nothing of
# flashbook outside itself; the toolkit imports no chapter and, of ``grade``, only the leaf
# ``grade.cellmeta`` (the nbgrader metadata of the chapter sources: ``sources``, ``given``);
# the chapters import the toolkit, never a command; the commands tie them together.
COMMANDS = {"book", "cli", "conformance", "graded_variants", "grading_commands", "notebooks",
            "overhead", "selftest", "sweep", "fp8_bench"}
LEAF = "flashbook.grade.cellmeta"


def _layer(module) -> int:
    parts = module.split(".")
    if parts[1:2] == ["grade"]:
        return 0
    if parts[1:2] == ["chapters"]:
        return 2
    return 3 if parts[-1] in COMMANDS and len(parts) == 2 else 1


def layer_violations(graph) -> list[str]:
    """Imports that run up a layer, or into ``grade`` past its leaf from below the commands."""
    return sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets
                  if _layer(b) > _layer(a) or
                  (_layer(b) == 0 and b != LEAF and 0 < _layer(a) < 3))


def test_no_import_runs_up_the_layers():
    modules = _modules()
    graph = {name: _edges(name, path, is_pkg, modules) for name, (path, is_pkg) in modules.items()}
    bad = layer_violations(graph)
    assert not bad, "imports against the layers (CONTRIBUTING):\n" + "\n".join(bad)
    assert layer_violations({"flashbook.sources": {"flashbook.grade.layout"},
                             "flashbook.cases": {"flashbook.chapters.ch1"},
                             "flashbook.chapters.ch1.checks": {"flashbook.selftest"},
                             "flashbook.grade.scan": {"flashbook.sources"}}) == [
        "flashbook.cases -> flashbook.chapters.ch1",
        "flashbook.chapters.ch1.checks -> flashbook.selftest",
        "flashbook.grade.scan -> flashbook.sources", "flashbook.sources -> flashbook.grade.layout"]
