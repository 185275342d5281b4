"""Chapter 6's setup step for JAX (Exercises 1 and 4 run in its Mosaic GPU interpret mode).

``ensure_jax()`` (the chapter's first code cell) installs ``interpret.JAX_REQUIREMENTS`` (CPU
wheels) when JAX is missing, through the Colab setup cell's pip (``colab_install``), never
replacing an installed JAX (Colab's has CUDA), nor while the autograder runs the notebook
(``NBGRADER_EXECUTION``). It prints which versions are proven and never raises.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import os
import re
import subprocess

from flashbook import colab_install

from . import interpret

__all__ = ["ensure_jax"]


def ensure_jax(run=subprocess.run, installed_version=importlib.metadata.version, environ=None,
               verbose: bool = True) -> str:
    """Make JAX importable for the interpret-mode checks if it is missing; returns "present",
    "installed", "not installed while grading" or "install failed"."""
    environ = os.environ if environ is None else environ
    missing = [r for r in interpret.JAX_REQUIREMENTS if not _has(r, installed_version)]
    if not missing:
        status, line = "present", _present(installed_version)
    elif environ.get("NBGRADER_EXECUTION"):
        status = "not installed while grading"
        line = (f"JAX for Exercises 1 and 4: {', '.join(missing)} missing, not installed while "
                f"grading ({interpret.JAX_VERSIONS}).")
    else:
        try:
            installed = colab_install.install_missing(missing, run=run,
                                                      installed_version=installed_version)
        except (subprocess.CalledProcessError, OSError) as e:
            status = "install failed"
            line = (f"JAX for Exercises 1 and 4 is missing and could not be installed ({e}). "
                    f"Install it yourself, then restart: {interpret.INSTALL} (in a notebook: "
                    f"%pip install ...; {interpret.JAX_VERSIONS}).")
        else:
            importlib.invalidate_caches()
            status = "installed"
            line = (f"JAX for Exercises 1 and 4 was missing: installed {' '.join(installed)} "
                    f"(CPU wheels: the checks need no GPU); {interpret.JAX_VERSIONS}.")
    if verbose:
        print(line)
    return status


def _has(requirement: str, installed_version) -> bool:
    name = re.match(r"[\w.-]+", requirement).group(0)
    try:
        installed_version(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def _present(installed_version) -> str:
    """The line for an installed JAX: its version, then the proven ones, or why it will not do."""
    jax, jaxlib = installed_version("jax"), installed_version("jaxlib")
    problem = interpret.jax_problem()
    if problem:
        return f"JAX {jax} (jaxlib {jaxlib}) for Exercises 1 and 4: {problem}"
    return (f"JAX {jax} (jaxlib {jaxlib}) for Exercises 1 and 4; "
            f"{interpret.JAX_VERSIONS}.")
