"""Which versions of the toolchain the book needs, and what this runtime has.

``MINIMUM`` holds pyproject.toml's lower bounds (``tests/test_versions.py`` keeps the two equal),
and each is a version the book is proven on (README, *Versions*): CI pins torch 2.13, triton
3.9, numba 0.68.1 and numba-cuda 0.30.4 (``constraints.txt``); the H200 image that the recorded
benchmarks ran on has torch 2.11, triton 3.6, numba 0.68.0 and numba-cuda 0.30.4. Nothing older
is tested, so nothing older is claimed. ``flashbook.setup(needs=...)`` prints what a chapter
needs next to what is installed. Standard library only: ``setup()`` runs before triton and
numba may be imported, so versions are read from the installed packages' metadata.
"""
from __future__ import annotations

import importlib.metadata
import re

MINIMUM = {"torch": "2.11", "triton": "3.6", "numba": "0.68", "numba-cuda": "0.30.4"}
WHY = {"triton": "Gluon's warp_specialize signature changed in 3.5 and 3.6"}
DEFAULT_NEEDS = ("torch", "triton")        # what every Triton chapter needs


def installed(name: str) -> str | None:
    """The installed version of the distribution ``name``, or None."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def as_tuple(version: str) -> tuple[int, ...]:
    """'2.11.0+cu130' -> (2, 11, 0): the release numbers, a local or pre-release tag dropped."""
    return tuple(int(x) for x in re.match(r"\d+(?:\.\d+)*", version).group(0).split("."))


def at_least(have: str, need: str) -> bool:
    h, n = as_tuple(have), as_tuple(need)
    width = max(len(h), len(n))
    return h + (0,) * (width - len(h)) >= n + (0,) * (width - len(n))


def needs_text(needs=DEFAULT_NEEDS) -> str:
    """'torch >= 2.11, triton >= 3.6': the wording of a chapter's needs."""
    return ", ".join(f"{name} >= {MINIMUM[name]}" for name in needs)


def report(needs=DEFAULT_NEEDS, version=installed) -> tuple[str, list[str]]:
    """(the line ``setup()`` prints: what is installed and what the chapter needs, the warnings:
    a needed package missing or older than its minimum)."""
    unknown = [n for n in needs if n not in MINIMUM]
    if unknown:
        raise ValueError(f"no minimum version known for {unknown}; known: {sorted(MINIMUM)}")
    have = {name: version(name) for name in needs}
    listed = ", ".join(f"{name} {v or 'missing'}" for name, v in have.items())
    line = f"flashbook | {listed} | this chapter needs {needs_text(needs)}"
    warnings = []
    for name, v in have.items():
        want = MINIMUM[name]
        why = f": {WHY[name]}" if name in WHY else ""
        upgrade = f'pip install -U "torch>={MINIMUM["torch"]}" (it brings its own triton)' \
            if name == "triton" else f'pip install -U "{name}>={want}"'
        if v is None:
            warnings.append(f"WARNING: {name} is not installed; this chapter needs {name} >= "
                            f"{want}{why}. Install it: {upgrade}.")
        elif not at_least(v, want):
            warnings.append(f"WARNING: {name} {v} is older than this chapter needs ({name} >= "
                            f"{want}{why}); nothing older is tested. Upgrade: {upgrade}.")
    return line, warnings
