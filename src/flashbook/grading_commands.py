"""The grading commands of the ``flashbook`` command line (collect, autograde, merge, feedback,
export), with this checkout's course as their default: ``flashbook.cli`` adds them to its parser,
and the self-check and the graded variants (``selftest``, ``graded_variants``) run them through
``run``, as the command line runs them, without depending on the rest of it."""
from __future__ import annotations

import argparse

from . import sources

try:
    from .grade import cli as grade_cli
    NO_GRADING = None
except ImportError as e:    # no Jupyter (nbformat) on this machine: bench and selftest still work
    grade_cli, NO_GRADING = None, e


def add_subcommands(parser: argparse.ArgumentParser, sub) -> None:
    """Add the grading commands to ``sub`` (``parser``'s subparsers); where they are missing (no
    nbgrader), ``parser``'s epilog says so."""
    # the grading package knows no repository: this checkout's course is the CLI's default
    if grade_cli is not None:
        grade_cli.add_subcommands(sub, default_course=sources.repo_root() / "autograder")
    else:
        parser.epilog = f"The grading commands are missing: {NO_GRADING} (install nbgrader)."


def run(argv) -> int:
    """``flashbook <grading command> ...``: what ``flashbook.cli.main(argv)`` does for one of
    these commands; returns its exit status."""
    argv = list(argv)
    p = argparse.ArgumentParser(prog="flashbook")
    add_subcommands(p, p.add_subparsers(dest="command", required=True))
    args = p.parse_args(argv)
    args.argv = argv                      # as flashbook.cli.main sets it
    return args.func(args) or 0
