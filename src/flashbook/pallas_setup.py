"""A chapter's setup step for JAX, whose exercises run in its Mosaic GPU interpret mode.

``ensure_jax(exercises=...)`` (the chapter's first code cell) installs ``JAX_REQUIREMENTS``
(``pallas_messages``: CPU wheels) when JAX is missing, through the Colab setup cell's pip
(``colab_install``), never replacing an installed JAX (Colab's has CUDA), nor while the
autograder runs the notebook (``NBGRADER_EXECUTION``). It prints which versions are proven and
never raises.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import os
import re
import subprocess

from . import colab_install
from .pallas_interpret import INSTALL, JAX_REQUIREMENTS, JAX_VERSIONS, jax_problem

__all__ = ["ensure_jax"]


def ensure_jax(run=subprocess.run, installed_version=importlib.metadata.version, environ=None,
               verbose: bool = True, *, exercises: str = "the interpret-mode checks") -> str:
    """Make JAX importable for the interpret-mode checks if it is missing; returns "present",
    "installed", "not installed while grading" or "install failed". ``exercises``: what the
    printed line says JAX is for ("Exercises 1 and 4")."""
    environ = os.environ if environ is None else environ
    missing = [r for r in JAX_REQUIREMENTS if not _has(r, installed_version)]
    if not missing:
        status, line = "present", _present(installed_version, exercises)
    elif environ.get("NBGRADER_EXECUTION"):
        status = "not installed while grading"
        line = (f"JAX for {exercises}: {', '.join(missing)} missing, not installed while "
                f"grading ({JAX_VERSIONS}).")
    else:
        try:
            installed = colab_install.install_missing(missing, run=run,
                                                      installed_version=installed_version)
        except (subprocess.CalledProcessError, OSError) as e:
            status = "install failed"
            line = (f"JAX for {exercises} is missing and could not be installed ({e}). "
                    f"Install it yourself, then restart: {INSTALL} (in a notebook: "
                    f"%pip install ...; {JAX_VERSIONS}).")
        else:
            importlib.invalidate_caches()
            status = "installed"
            line = (f"JAX for {exercises} was missing: installed {' '.join(installed)} "
                    f"(CPU wheels: the checks need no GPU); {JAX_VERSIONS}.")
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


def _present(installed_version, exercises: str) -> str:
    """The line for an installed JAX: its version, then the proven ones, or why it will not do."""
    jax, jaxlib = installed_version("jax"), installed_version("jaxlib")
    problem = jax_problem()
    if problem:
        return f"JAX {jax} (jaxlib {jaxlib}) for {exercises}: {problem}"
    return (f"JAX {jax} (jaxlib {jaxlib}) for {exercises}; "
            f"{JAX_VERSIONS}.")
