"""The grading subcommands of ``flashbook``: collect, autograde, merge, feedback, export.

    flashbook collect downloads/ --assignment ch1 [--roster roster.csv] [--force]
    flashbook autograde ch1 [--device cpu|gpu] [--timeout 600] [--workers 2] [--shard 0/4]
    flashbook merge ch1 shard0/ shard1/ ...
    flashbook feedback ch1
    flashbook export grades.csv [--nbgrader]

Every command works in a course directory: ``--course DIR``, else $FLASHBOOK_COURSE, else the
default the caller of ``add_subcommands`` gives (``flashbook``: ``autograder/`` of the checkout).
"""
from __future__ import annotations

import sys
from pathlib import Path

from . import sandbox
from .autograde import autograde, parse_shard
from .collect import collect
from .export import assignments_with_results, export
from .feedback import feedback
from .gradebook import export_gradebook
from .layout import COURSE_ENV, Course, course_root
from .merge import merge


def course_from_args(args) -> Course:
    """--course, else $FLASHBOOK_COURSE, else the default given to ``add_subcommands``."""
    return Course(course_root(args.course, default=args.default_course))


def _path(p):
    return Path(p) if p else None


def _collect(args):
    r = collect(Path(args.src), args.assignment, course_from_args(args), _path(args.roster),
                args.force)
    for s, log in r["collected"].items():
        print(f"collected {s}: " + "; ".join(log))
    for s, why in r["skipped"].items():
        print(f"SKIPPED {s}: {why}", file=sys.stderr)
    for u in r["unmatched"]:
        print(f"UNMATCHED (no student id; kept): {u}", file=sys.stderr)
    for f in r["ignored"]:
        print(f"ignored (not a notebook): {f}", file=sys.stderr)
    for s in r["not_in_roster"]:
        print(f"WARNING {s} is not in the roster", file=sys.stderr)
    print(f"{len(r['collected'])} collected, {len(r['skipped'])} skipped, "
          f"{len(r['unmatched'])} unmatched")
    return 1 if r["skipped"] or r["unmatched"] else 0


def _autograde(args):
    if sandbox.landlock_abi() < 1:
        print("WARNING: Landlock is not available on this kernel: student code will run with "
              "your user's file access. Grade untrusted classes in a container "
              "(see the instructor guide).", file=sys.stderr)
    r = autograde(args.assignment, course_from_args(args), device=args.device,
                  timeout=args.timeout, cell_timeout=args.cell_timeout, workers=args.workers,
                  shard=parse_shard(args.shard), force=args.force,
                  results_root=_path(args.results), memory_mb=args.memory_mb or None,
                  user=args.sandbox_user, students=args.student or None)
    for s, reasons in sorted(r["problems"].items()):
        print(f"{s}: " + "; ".join(reasons))
    for s, flags in sorted(r["flagged"].items()):
        print(f"{s}: FLAGGED for review: " + "; ".join(flags))
    print(f"graded {len(r['graded'])}, skipped {len(r['skipped'])} already graded "
          f"(--force regrades), {len(r['problems'])} with problems, {len(r['flagged'])} flagged "
          "for review (see above)")
    return 0


def _merge(args):
    r = merge(args.assignment, [Path(s) for s in args.shards], course_from_args(args),
              _path(args.results), args.force)
    print(f"merged {len(r['merged'])} students")
    for c in r["conflicts"]:
        print(f"CONFLICT {c}", file=sys.stderr)
    if r["missing"]:
        print(f"not graded yet: {', '.join(r['missing'])}", file=sys.stderr)
    return 1 if r["conflicts"] else 0


def _feedback(args):
    course = course_from_args(args)
    paths = feedback(args.assignment, course, _path(args.results), args.student or None)
    print(f"wrote {len(paths)} feedback pages under {course.root / 'feedback'}")


def _export(args):
    out = export(Path(args.out), course_from_args(args), args.assignment or None,
                 _path(args.results), summary=not args.no_summary)
    for kind, p in out.items():
        print(f"wrote {p}")
    if args.nbgrader:
        course = course_from_args(args)
        assignments = args.assignment or assignments_with_results(course, _path(args.results))
        r = export_gradebook(course, assignments, _path(args.results))
        print(f"wrote {r['grades']} grades of {len(r['students'])} students into "
              f"{course.root / 'gradebook.db'} (nbgrader; manual scores kept)")
        for u in r["unknown"]:
            print(f"WARNING {u} is not in the gradebook (released before this cell existed?)",
                  file=sys.stderr)


def add_subcommands(sub, default_course: Path | None = None) -> None:
    """Add the grading commands to ``sub`` (argparse subparsers). Without ``default_course``,
    a command needs --course or $FLASHBOOK_COURSE."""
    fallback = f", else {default_course}" if default_course else ""

    def common(p):
        p.add_argument("--course", help=f"course directory (default: ${COURSE_ENV}{fallback})")
        p.set_defaults(default_course=default_course)

    p = sub.add_parser("collect", help="place downloaded submissions in submitted/, repaired")
    p.add_argument("src", help="folder (or zip) of downloaded notebooks, zips, or nbgrader layout")
    p.add_argument("--assignment", required=True, help="assignment name, e.g. ch1")
    p.add_argument("--roster", help="CSV with a column id (optional: lms_id, first_name, "
                                    "last_name, email)")
    p.add_argument("--force", action="store_true", help="replace earlier submissions (kept)")
    common(p)
    p.set_defaults(func=_collect)

    p = sub.add_parser("autograde", help="grade every submission, each in its own process")
    p.add_argument("assignment")
    p.add_argument("--device", choices=["cpu", "gpu"], default="cpu")
    p.add_argument("--timeout", type=float, default=600,
                   help="wall-clock limit per submission in seconds (default 600)")
    p.add_argument("--cell-timeout", type=float, default=None,
                   help="interrupt a cell after this many seconds (default: --timeout)")
    p.add_argument("--workers", type=int, default=1,
                   help="submissions graded at once (gpu: default one per GPU)")
    p.add_argument("--shard", help="i/n: grade only shard i of n (0-based; e.g. "
                                   "$SLURM_ARRAY_TASK_ID/4)")
    p.add_argument("--force", action="store_true", help="regrade students already graded")
    p.add_argument("--results", help="results folder (default: <course>/results)")
    p.add_argument("--memory-mb", type=int, default=4096,
                   help="address-space limit of a student's kernel in CPU mode (0: none)")
    p.add_argument("--sandbox-user", help="run student kernels as this user (grader as root)")
    p.add_argument("--student", action="append", help="grade only this student (repeatable)")
    common(p)
    p.set_defaults(func=_autograde)

    p = sub.add_parser("merge", help="combine the results of several shards")
    p.add_argument("assignment")
    p.add_argument("shards", nargs="+", help="the shards' --results folders")
    p.add_argument("--results", help="merged results folder (default: <course>/results)")
    p.add_argument("--force", action="store_true")
    common(p)
    p.set_defaults(func=_merge)

    p = sub.add_parser("feedback", help="per-student feedback HTML")
    p.add_argument("assignment")
    p.add_argument("--results")
    p.add_argument("--student", action="append")
    common(p)
    p.set_defaults(func=_feedback)

    p = sub.add_parser("export", help="grades CSV and class summary (histograms)")
    p.add_argument("out", help="CSV file to write, e.g. grades.csv")
    p.add_argument("--assignment", action="append", help="(repeatable; default: all graded)")
    p.add_argument("--results")
    p.add_argument("--no-summary", action="store_true")
    p.add_argument("--nbgrader", action="store_true",
                   help="also write the grades and messages into nbgrader's gradebook.db "
                        "(for nbgrader export and formgrader; manual scores are kept)")
    common(p)
    p.set_defaults(func=_export)
