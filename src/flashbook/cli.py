"""The ``flashbook`` command line: release, book, bench, and the grading commands."""
from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from . import book, chapters, notebooks, publish, results, sources
from .grade import cli as grade_cli


def _release(args):
    for path in notebooks.release(only=args.chapters or None):
        print(f"wrote {path}")


def _book(args):
    index = book.build(instructor=args.instructor, strict=not args.no_strict)
    print(f"Book built: {index}")


def _pdf(args):
    pdf = book.build_pdf(strict=not args.no_strict)
    print(f"PDF built: {pdf}")


def _bench(args):
    out = Path(args.out) if args.out else results.DATA_DIR
    command = "flashbook " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    path = results.record(chapters.contract(args.chapter), out, command)
    print(f"wrote {path} and {path.with_suffix('.json').name}")


def _readme(args):
    root = sources.repo_root()
    changed = publish.update_readme(root, check=args.check)
    if args.check and changed:
        print("README.md's address and badges are stale: run `flashbook readme`", file=sys.stderr)
        return 1
    print("README.md " + ("updated" if changed else "is up to date") + " from _config.yml")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="flashbook", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser("release", help="regenerate notebooks/ from solutions/ (nbgrader)")
    r.add_argument("chapters", nargs="*", help="chapter ids (default: all)")
    r.set_defaults(func=_release)

    b = sub.add_parser("book", help="execute chapters in CPU mode and build the HTML book")
    b.add_argument("--instructor", action="store_true", help="show solutions (instructor edition)")
    b.add_argument("--no-strict", action="store_true", help="do not treat warnings as errors")
    b.set_defaults(func=_book)

    d = sub.add_parser("pdf", help="build the book as one printable PDF (needs chromium)")
    d.add_argument("--no-strict", action="store_true", help="do not treat warnings as errors")
    d.set_defaults(func=_pdf)

    c = sub.add_parser("bench", help="benchmark a chapter's kernels on this GPU, record the data")
    c.add_argument("chapter")
    c.add_argument("--out", help="output root (default: src/flashbook/data/bench)")
    c.set_defaults(func=_bench)

    m = sub.add_parser("readme", help="write README's book address and badges from _config.yml")
    m.add_argument("--check", action="store_true", help="only say whether they are up to date")
    m.set_defaults(func=_readme)

    # the grading package knows no repository: this checkout's course is the CLI's default
    grade_cli.add_subcommands(sub, default_course=sources.repo_root() / "autograder")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args) or 0


if __name__ == "__main__":
    sys.exit(main())
