"""The pinned toolchain is stated consistently, and the repository carries no build output."""
import re
import subprocess
import tomllib

import yaml


def _pins(lines):
    return dict(re.match(r"\s*([A-Za-z0-9_.\-]+)==(\S+)", x).groups() for x in lines
                if re.match(r"\s*[A-Za-z0-9_.\-]+==", x))


def test_environment_yml_matches_pyproject_pins(root):
    dev = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]["dev"]
    env = yaml.safe_load((root / "environment.yml").read_text())
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict) and "pip" in d)
    assert _pins(dev) == _pins(pip)


def test_constraints_agree_with_pyproject_pins(root):
    dev = _pins(tomllib.loads((root / "pyproject.toml").read_text())["project"]
                ["optional-dependencies"]["dev"])
    constraints = _pins((root / "constraints.txt").read_text().splitlines())
    norm = {k.lower().replace("_", "-"): v for k, v in constraints.items()}
    for name, version in dev.items():
        if name == "torch":   # pinned in the Makefile (the CPU wheel), not in constraints
            continue
        assert norm.get(name.lower()) == version, f"{name}: pyproject {version}, constraints {norm.get(name.lower())}"


def test_no_build_output_or_outputs_in_sources_are_tracked(root):
    files = subprocess.run(["git", "ls-files"], cwd=root, capture_output=True, text=True).stdout.split()
    assert not [f for f in files if f.startswith(("_build/", ".venv/", "autograder/source/",
                                                  "autograder/release/", "autograder/submitted/"))]
    assert not [f for f in files if f.endswith(".pyc") or "__pycache__" in f]


def test_student_notebooks_carry_no_outputs(root):
    import nbformat
    for path in (root / "notebooks").glob("*.ipynb"):
        nb = nbformat.read(path, as_version=4)
        assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), path.name
