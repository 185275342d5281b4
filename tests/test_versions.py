"""The versions the book claims are the versions it is proven on: README's *Versions* against
constraints.txt (CI) and the H200 runs' provenance, pyproject's lower bounds against both, and
each chapter's *What you need* and setup cell against ``flashbook.versions``."""
import ast
import json
import re
from pathlib import Path

import pytest
import tomllib

from flashbook import pallas_interpret as interpret
from flashbook import sources, versions

ROOT = Path(__file__).resolve().parents[1]
TOOLCHAIN = ("torch", "triton", "numba", "numba-cuda", "jax", "jaxlib", "absl-py")
PAIR = re.compile(r"\b([a-z][\w-]*) (\d+\.\d+\.\d+)\b")


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _pins() -> dict[str, str]:
    """CI's pins: constraints.txt, and torch's in pyproject's dev extra (the Makefile's)."""
    pins = dict(re.findall(r"^([\w.-]+)==(\S+)$", (ROOT / "constraints.txt").read_text(), re.M))
    dev = dict(r.split("==") for r in _pyproject()["project"]["optional-dependencies"]["dev"])
    return {name.lower(): pins.get(name, dev.get(name)) for name in {*pins, *dev}}


def _readme_versions() -> tuple[dict, dict]:
    """(CI's versions, the GPU's) as README's *Versions* states them."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## Versions\n", 1)[1].split("\n## ", 1)[0].replace("\n", " ")
    ci, gpu = section.split("On a GPU", 1)
    gpu = gpu.split("self-check", 1)[0]
    return dict(PAIR.findall(ci)), dict(PAIR.findall(gpu))


def _lower_bounds() -> dict[str, str]:
    project = _pyproject()["project"]
    reqs = project["dependencies"] + project["optional-dependencies"]["hopper"]
    return {m[1]: m[2] for m in (re.fullmatch(r"([\w-]+)(?:>=|==)([\d.]+)", r) for r in reqs)
            if m}


def test_readme_ci_versions_are_the_pins_ci_installs():
    ci, _ = _readme_versions()
    assert set(ci) == set(TOOLCHAIN)
    pins = _pins()
    assert {name: pins[name] for name in ci} == ci


def test_readme_gpu_versions_are_the_h200_runs_provenance():
    _, gpu = _readme_versions()
    runs = [json.loads(p.read_text()) for p in sorted((ROOT / "src/flashbook/data/bench")
                                                       .glob("*/h200.json"))]
    for name, key in (("torch", "torch"), ("triton", "triton"), ("numba", "numba"),
                      ("numba-cuda", "numba_cuda"), ("jax", "jax")):
        seen = {r[key].split("+")[0] for r in runs if r.get(key)}
        assert seen == {gpu[name]}, (name, seen)
    assert interpret.JAX_GPU_VERSION == gpu["jax"]


def test_pyproject_lower_bounds_are_proven_versions():
    ci, gpu = _readme_versions()
    bounds = _lower_bounds()
    assert set(TOOLCHAIN) <= set(bounds), "a toolchain package without a lower bound"
    for name in TOOLCHAIN:
        proven = sorted((v for v in (ci.get(name), gpu.get(name)) if v), key=versions.as_tuple)
        width = len(versions.as_tuple(bounds[name]))
        assert versions.as_tuple(proven[0])[:width] == versions.as_tuple(bounds[name]), \
            f"{name}>={bounds[name]}: the oldest proven is {proven[0]}"
    assert {n: bounds[n] for n in versions.MINIMUM} == versions.MINIMUM
    assert interpret.JAX_VERSION == bounds["jax"] == bounds["jaxlib"] == _pins()["jax"]
    assert f"jax=={interpret.JAX_VERSION}" in interpret.JAX_REQUIREMENTS


def test_jax_is_pinned_to_the_version_the_interpret_instruments_wrap():
    """Chapter 6's checks wrap JAX's private interpret-mode modules (``pallas_child``,
    ``pallas_instruments``): every install pins the JAX they are written for, and it is this one."""
    import importlib.metadata
    hopper = _pyproject()["project"]["optional-dependencies"]["hopper"]
    for name in ("jax", "jaxlib"):
        assert f"{name}=={interpret.JAX_VERSION}" in hopper
        assert _pins()[name] == interpret.JAX_VERSION
    if interpret.jax_problem() is None:
        assert importlib.metadata.version("jax") == interpret.JAX_VERSION


def _setup_needs(source: str) -> tuple:
    call = re.search(r"^backend = fb\.setup\((.*)\)\s*(?:#.*)?$", source, re.M)
    assert call, "no `backend = fb.setup(...)` line"
    if not call.group(1):
        return versions.DEFAULT_NEEDS
    return ast.literal_eval(call.group(1).removeprefix("needs="))


# Chapter 9's source belongs to another engineer's work in progress: its setup cell prints the
# default needs (torch, triton), but its *What you need* does not state versions yet.
NOT_YET = {"ch9"}


@pytest.mark.parametrize("chapter", [c.id for c in sources.sources(ROOT) if c.id not in NOT_YET])
def test_what_you_need_states_the_versions_the_setup_cell_checks(chapter):
    source = sources.source(chapter, ROOT).path.read_text()
    needs = _setup_needs(source)
    paragraph = source.split("# **What you need**", 1)[1].split("\n#\n", 1)[0]
    paragraph = " ".join(line.removeprefix("#").strip() for line in paragraph.splitlines())
    stated = dict(re.findall(r"\b([a-z][\w-]*) >= (\d+(?:\.\d+)*)", paragraph))
    assert stated == {name: versions.MINIMUM[name] for name in needs}, paragraph
