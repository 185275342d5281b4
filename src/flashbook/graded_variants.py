"""Known-wrong variants graded by the real pipeline: does each lose its exercise's points when
an instructor grades it, on this machine's device?

``python -m flashbook.graded_variants --chapters ch4,ch6 [--names a,b] --out v.json`` releases
each chapter into a scratch course (as ``flashbook selftest`` does), hands in one submission per
known-wrong variant (the released notebook answered with the solution's cells, the variant's
edit applied to its cell) beside the solution itself, and runs ``collect -> autograde ->
export`` through the ``flashbook`` command line (``--device gpu`` on a GPU). For each variant
it records the cells that lost points and whether the variant lost them where the suite says it
must: at a graded cell of its own exercise, with its ``expect`` in the message. The suite checks
the same in-process (``tests/test_chapters.py``); this is the grader's verdict.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import csv
import io
import json
import os
import tempfile
import time
from pathlib import Path

from . import chapters, results, sources
from .grade.cellmeta import grade_id
from .selftest import answered_release

SOLVED = "solution"          # the student id of the solution's own submission
DATA_DIR = Path(__file__).resolve().parent / "data" / "graded_variants"


def _student(variant_name: str) -> str:
    return "v_" + variant_name


def grade_chapter(chapter_id: str, root: Path, names=None, device: str = "cpu",
                  timeout: float = 900, workers: int = 1, echo=print) -> dict:
    """{"solution": {earned, possible}, "variants": {name: verdict}} for one chapter."""
    import nbformat
    from . import grading_commands
    from .bench import QUICK_ENV
    from .grade.layout import Course, read_results
    known = {v.name: v for v in sources.variants(chapter_id, root)}
    unknown = sorted(set(names or ()) - set(known))
    if unknown:
        raise ValueError(f"{chapter_id} has no known-wrong variant {', '.join(unknown)}")
    chosen = [known[n] for n in names] if names else list(known.values())
    graders = {ex.grade_id: ex for ex in chapters.contract(chapter_id).exercises}
    with tempfile.TemporaryDirectory(prefix=f"flashbook-variants-{chapter_id}-") as w, \
            contextlib.redirect_stdout(io.StringIO()) as log:
        work = Path(w)
        course, released, solved = answered_release(chapter_id, root, work)
        handed = {SOLVED: solved}
        for v in chosen:
            nb = copy.deepcopy(solved)
            (cell,) = [c for c in nb.cells if grade_id(c) == v.cell]
            cell.source = v.apply(cell.source)
            handed[_student(v.name)] = nb
        for student, nb in handed.items():
            folder = work / "downloads" / student / chapter_id
            folder.mkdir(parents=True)
            nbformat.write(nb, folder / released.name)
        where = ["--course", str(course)]
        start = time.monotonic()
        before = os.environ.get(QUICK_ENV)
        os.environ[QUICK_ENV] = "1"        # the grader's kernels time in quick mode (kept)
        try:
            for argv in (["collect", str(work / "downloads"), "--assignment", chapter_id, *where],
                         ["autograde", chapter_id, "--device", device, "--timeout", str(timeout),
                          "--workers", str(workers), *where],
                         ["export", str(work / "grades.csv"), "--assignment", chapter_id,
                          "--no-summary", *where]):
                if grading_commands.run(argv):
                    raise RuntimeError(f"flashbook {argv[0]} failed:\n{log.getvalue()[-2000:]}")
        finally:
            if before is None:
                os.environ.pop(QUICK_ENV, None)
            else:
                os.environ[QUICK_ENV] = before
        with open(work / "grades.csv", newline="") as f:
            totals = {r["student_id"]: (float(r[f"{chapter_id}/total"]),
                                        float(r[f"{chapter_id}/max"])) for r in csv.DictReader(f)}
        graded = read_results(Course(course).results_dir(chapter_id))
    out = {"solution": dict(zip(("earned", "possible"), totals[SOLVED])), "variants": {},
           "seconds": round(time.monotonic() - start, 1), "device": device}
    for v in chosen:
        cells = graded[_student(v.name)].cells
        lost = {g: c for g, c in cells.items() if c.score is None or c.score < c.max_score}
        own = [g for g in lost if g in graders and v.cell in graders[g].cells]
        out["variants"][v.name] = {
            "cell": v.cell, "earned": totals[_student(v.name)][0],
            "lost_at": sorted(lost), "at_own_exercise": bool(own),
            "names_its_bug": any(v.expect in lost[g].message for g in own),
            "message": (lost[own[0]].message if own else
                        next(iter(lost.values())).message if lost else "")[-600:]}
        echo(f"{chapter_id} {v.name}: " + verdict(out["variants"][v.name]))
    return out


def verdict(entry: dict) -> str:
    if not entry["lost_at"]:
        return "KEPT EVERY POINT"
    if not entry["at_own_exercise"]:
        return f"lost points elsewhere ({', '.join(entry['lost_at'])})"
    return "lost its exercise's points" + ("" if entry["names_its_bug"] else
                                           ", but the message does not name its bug")


def ok(entry: dict) -> bool:
    return entry["at_own_exercise"] and entry["names_its_bug"]


def summary(records) -> str:
    """Markdown: one row per variant of the ``records`` (as ``main`` writes them), newest run of
    each (chapter, variant) kept, with the solution's score in the same run."""
    latest = {}
    for record in sorted(records, key=lambda r: r["provenance"].get("date", "")):
        commit = (record["provenance"].get("commit") or "?")[:7]
        for cid, entry in record["chapters"].items():
            for name, v in entry["variants"].items():
                latest[(cid, name)] = (commit, entry["solution"], v)
    lines = ["| chapter | known-wrong variant | at | earned | solution | lost at | verdict |",
             "|---|---|---|---|---|---|---|"]
    for (cid, name), (commit, solution, v) in sorted(latest.items()):
        lines.append(f"| {cid} | `{name}` | `{commit}` | {v['earned']:g} | "
                     f"{solution['earned']:g}/{solution['possible']:g} | "
                     f"{', '.join(f'`{g}`' for g in v['lost_at']) or '-'} | {verdict(v)} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--chapters", required=True, help="comma-separated chapter ids")
    p.add_argument("--names", help="comma-separated variant names (default: every variant)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--root", type=Path, default=None, help="the checkout (default: found)")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--commit")
    args = p.parse_args(argv)
    from flashbook import setup
    from .device import current
    setup()
    root = (args.root or sources.repo_root()).resolve()
    names = set(args.names.split(",")) if args.names else None
    record = {"provenance": dict(results.provenance("python -m flashbook.graded_variants "
                                                    f"--chapters {args.chapters}"),
                                 commit=args.commit), "chapters": {}}
    good = True
    for cid in args.chapters.split(","):
        mine = None if names is None else \
            sorted(n for n in names if n in {v.name for v in sources.variants(cid, root)})
        if mine == []:
            continue
        entry = grade_chapter(cid, root, mine, "gpu" if current().gpu else "cpu",
                              args.timeout, args.workers)
        record["chapters"][cid] = entry
        good &= entry["solution"]["earned"] == entry["solution"]["possible"] and \
            all(ok(e) for e in entry["variants"].values())
        args.out.write_text(json.dumps(record, indent=1) + "\n")
    return 0 if good else 1


if __name__ == "__main__":
    raise SystemExit(main())
