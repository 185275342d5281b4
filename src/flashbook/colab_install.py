"""The install step of every notebook's Colab setup cell, and of a chapter's extra packages.

The cell runs before flashbook is installed, so ``flashbook.notebooks`` copies
``install_flashbook`` into it verbatim (the cell and this module cannot drift apart). A chapter
whose exercises need more (Chapter 6: JAX) calls ``install_missing`` from its own setup cell:
the same pip, with the same pins. Standard library only.
"""
import importlib.metadata
import re
import subprocess
import sys
import tempfile

KEPT = ("torch", "triton")   # Colab's own builds, matched to its CUDA: never replaced


def install_flashbook(version, repository, ref, requirements, run=subprocess.run,
                      installed_version=importlib.metadata.version):
    """Install the flashbook release ``version`` if it is published, else ``repository`` at ``ref``.

    flashbook goes in with ``--no-deps``; then its light requirements (never torch or triton),
    with a constraints file that pins the torch and triton already installed, so that pip can
    keep or add packages but never replace those two. Returns "release" or "repository".
    """
    pip = [sys.executable, "-m", "pip", "install", "-q"]
    light = [r for r in requirements if re.match(r"[\w.-]+", r).group(0).lower() not in KEPT]
    probe = run(pip + ["--no-deps", f"flashbook=={version}"], capture_output=True, text=True)
    if probe.returncode == 0:
        source = "release"
    else:   # no such release published (yet): the repository's code at ``ref``
        run(pip + ["--no-deps", f"flashbook @ git+{repository}@{ref}"], check=True)
        source = "repository"
    pins = []
    for name in KEPT:
        try:
            pins.append(f"{name}=={installed_version(name)}")
        except importlib.metadata.PackageNotFoundError:
            pass
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as constraints:
        constraints.write("\n".join(pins) + "\n")
    run(pip + light + ["-c", constraints.name], check=True)
    return source


def install_missing(requirements, run=subprocess.run, installed_version=importlib.metadata.version):
    """Install those of ``requirements`` whose package is not installed, as ``install_flashbook``
    installs the light ones: with a constraints file that pins ``KEPT`` and every package of
    ``requirements`` already installed at its installed version, so nothing installed is
    replaced. Returns the requirements it installed (none: pip did not run)."""
    def have(name):
        try:
            return installed_version(name)
        except importlib.metadata.PackageNotFoundError:
            return None
    missing, present = [], []
    for requirement in requirements:
        name = re.match(r"[\w.-]+", requirement).group(0)
        if have(name):
            present.append(name)
        else:
            missing.append(requirement)
    if not missing:
        return []
    pins = [f"{name}=={have(name)}" for name in (*KEPT, *present) if have(name)]
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as constraints:
        constraints.write("\n".join(pins) + "\n")
    run([sys.executable, "-m", "pip", "install", "-q", *missing, "-c", constraints.name],
        check=True)
    return missing
