"""The ``flashbook`` command line: release, book, bench, selftest, and the grading commands."""
from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

# ``results`` (torch, matplotlib: about 1.5 s of imports) is imported by the one command that
# needs it, so that the grading commands start in a tenth of that.
from . import chapters, grading_commands, publish, selftest, sources
from .grading_commands import NO_GRADING, grade_cli  # noqa: F401  (importable from here too)


def _release(args):
    from . import notebooks
    for path in notebooks.release(only=args.chapters or None):
        print(f"wrote {path}")


def _book(args):
    from . import book
    index = book.build(instructor=args.instructor, strict=not args.no_strict)
    print(f"Book built: {index}")


def _pdf(args):
    from . import book
    pdf = book.build_pdf(strict=not args.no_strict)
    print(f"PDF built: {pdf}")


def _bench(args):
    from . import results
    out = Path(args.out) if args.out else results.DATA_DIR
    command = "flashbook " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    path = results.record(chapters.contract(args.chapter), out, command)
    print(f"wrote {path} and {path.with_suffix('.json').name}")


def _readme(args):
    root = sources.repo_root()
    stale = [what for what, update in (("address and badges", publish.update_readme),
                                       ("chapter table", publish.update_chapter_table))
             if update(root, check=args.check)]
    if args.check and stale:
        print(f"README.md is stale ({', '.join(stale)}): run `flashbook readme`", file=sys.stderr)
        return 1
    print("README.md " + (f"updated ({', '.join(stale)})" if stale else "is up to date")
          + " from _config.yml and src/flashbook/data/selftest")
    return 0


def _selftest(args):
    root = Path(args.root).resolve() if args.root else sources.repo_root()
    if not args.root and not (root / "solutions").is_dir() and Path("solutions").is_dir():
        root = Path.cwd()          # an installed flashbook, run from inside a checkout
    ids = [c.strip() for c in args.chapters.split(",") if c.strip()] if args.chapters else None
    try:
        path, _, ok = selftest.selftest(
            root, ids, Path(args.out) if args.out else None, grade=not args.no_grade,
            runner=args.runner, timeout=args.timeout, commit=args.commit,
            command="flashbook " + shlex.join(args.argv), echo=lambda s: print(s, flush=True))
    except ValueError as e:
        print(f"flashbook selftest: {e}", file=sys.stderr)
        return 2
    print(f"wrote {path}" + ("" if ok else " (some chapters FAILED: see above)"))
    return 0 if ok else 1


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

    s = sub.add_parser("selftest", help="run (and grade) each solved chapter from the installed "
                                        "package on this GPU; record it in data/selftest")
    s.add_argument("--chapters", help="comma-separated chapter ids, e.g. ch1,ch4 (default: all)")
    s.add_argument("--no-grade", action="store_true", help="only run the solved notebooks")
    s.add_argument("--root", help="the checkout (default: $FLASHBOOK_ROOT, the checkout an "
                                  "editable install runs from, else the current directory)")
    s.add_argument("--out", help="the record (default: src/flashbook/data/selftest/<gpu>.json)")
    s.add_argument("--commit", help="the commit to record (default: the root's git HEAD); name it "
                   "where the root has no .git, or a .git older than its files")
    s.add_argument("--runner", choices=["auto", "nbclient", "script"], default="auto",
                   help="auto: nbclient when nbclient and ipykernel are installed, else script")
    s.add_argument("--timeout", type=float, default=1200,
                   help="seconds per chapter, for its run and for its grading (default 1200)")
    s.set_defaults(func=_selftest)

    m = sub.add_parser("readme", help="write README's book address, badges and chapter table "
                                      "(from _config.yml and the self-check records)")
    m.add_argument("--check", action="store_true", help="only say whether they are up to date")
    m.set_defaults(func=_readme)

    grading_commands.add_subcommands(p, sub)     # collect, autograde, merge, feedback, export
    return p


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.argv = argv                      # the command line, for the records' provenance
    return args.func(args) or 0


if __name__ == "__main__":
    sys.exit(main())
