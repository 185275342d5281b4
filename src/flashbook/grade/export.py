"""``flashbook export``: the grades CSV (one row per student, one column per graded cell, plus
per assignment ``total``, ``max``, ``notes``, ``lost`` (each graded cell that lost points, with
the first line of its reason) and ``flags``: what the tampering scan found, as ``cell:line what``) and the class summary: per-exercise score histograms (PNG) and a short
Markdown report."""
from __future__ import annotations

import csv
import statistics
from pathlib import Path

from . import cellmeta
from .layout import Course, read_results
from .record import SubmissionResult


def _columns(course: Course, a: str, results: dict[str, SubmissionResult]) -> list[str]:
    """Graded cells in notebook order (from the source), else as found in the results."""
    try:
        return [gid for n in course.notebook_names(a)
                for gid in cellmeta.graded_points(course.source_notebook(a, n))]
    except FileNotFoundError:
        return sorted({g for r in results.values() for g in r.cells})


def lost_points(cells: dict, order: list[str]) -> list[str]:
    """"cell: reason" for each graded cell that scored less than its points (reason: the first
    line of its message, at most 200 characters)."""
    out = []
    for g in order:
        c = cells.get(g)
        if c is not None and c.score is not None and c.score < c.max_score:
            why = (c.message or "").strip().splitlines()
            out.append(f"{g}: {why[0][:200] if why else c.status}")
    return out


def assignments_with_results(course: Course, results_root: Path | None) -> list[str]:
    root = results_root or course.root / "results"
    return sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []


def export(out: Path, course: Course | None = None, assignments: list[str] | None = None,
           results_root: Path | None = None, summary: bool = True) -> dict:
    """Write ``out`` (CSV) and, with ``summary``, ``<stem>_summary.png`` and ``.md``."""
    course = course or Course()
    assignments = assignments or assignments_with_results(course, results_root)
    if not assignments:
        raise FileNotFoundError(f"no results under {results_root or course.root / 'results'} — "
                                "run `flashbook autograde` first")
    data = {a: read_results(course.results_dir(a, results_root)) for a in assignments}
    cols = {a: _columns(course, a, data[a]) for a in assignments}
    students = sorted({s for a in assignments for s in data[a]})
    header = ["student_id"]
    for a in assignments:
        header += [f"{a}/{g}" for g in cols[a]] + [f"{a}/total", f"{a}/max", f"{a}/notes",
                                                   f"{a}/lost", f"{a}/flags"]
    header.append("total")
    rows = []
    for s in students:
        row, total = {"student_id": s}, 0.0
        for a in assignments:
            r = data[a].get(s)
            if r is None:
                row[f"{a}/notes"] = "no submission graded"
                continue
            cells = r.cells
            for g in cols[a]:
                c = cells.get(g)
                row[f"{a}/{g}"] = "" if c is None or c.score is None else f"{c.score:g}"
            row[f"{a}/total"], row[f"{a}/max"] = f"{r.score:g}", f"{r.max_score:g}"
            row[f"{a}/notes"] = "; ".join(r.reasons)
            row[f"{a}/lost"] = "; ".join(lost_points(cells, cols[a]))
            row[f"{a}/flags"] = "; ".join(r.flags)        # possible tampering: review these
            total += r.score
        row["total"] = f"{total:g}"
        rows.append(row)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", newline="") as f:
        w = csv.DictWriter(f, header, restval="")
        w.writeheader()
        w.writerows(rows)
    written = {"csv": out}
    if summary and students:
        written.update(class_summary(out, assignments, cols, data))
    return written


def class_summary(out: Path, assignments, cols, data) -> dict:
    """Per-exercise score histograms and a Markdown table of means and problems."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(a, g) for a in assignments for g in cols[a]]
    ncol = min(4, len(panels))
    nrow = -(-len(panels) // ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(3.2 * ncol, 2.6 * nrow), squeeze=False)
    lines = ["# Class summary", "", "| exercise | max | graded | mean | median | full marks |",
             "|---|---|---|---|---|---|"]
    for ax, (a, g) in zip(axes.flat, panels):
        cells = [r.cells[g] for r in data[a].values() if g in r.cells]
        scores = [c.score for c in cells if c.score is not None]
        top = max((c.max_score for c in cells), default=1) or 1
        ax.hist(scores, bins=min(10, max(2, int(top) + 1)), range=(0, top), color="#4c72b0")
        ax.set_title(f"{a}/{g}", fontsize=8)
        ax.set_xlabel("points")
        ax.set_ylabel("students")
        if scores:
            full = sum(s >= top for s in scores)
            lines.append(f"| {a}/{g} | {top:g} | {len(scores)} | {statistics.mean(scores):.2f} | "
                         f"{statistics.median(scores):g} | {full} |")
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.tight_layout()
    png = out.with_name(out.stem + "_summary.png")
    fig.savefig(png, dpi=100)
    plt.close(fig)
    lines += ["", f"![per-exercise score histograms]({png.name})", "",
              "## Submissions graded with problems", ""]
    for a in assignments:
        for s, r in sorted(data[a].items()):
            if r.reasons:
                lines.append(f"- {a} / {s}: {'; '.join(r.reasons)}")
    lines += ["", "## Submissions flagged for review (possible tampering; graded as usual)", ""]
    for a in assignments:
        for s, r in sorted(data[a].items()):
            if r.flags:
                lines.append(f"- {a} / {s}: {'; '.join(r.flags)}")
    md = out.with_name(out.stem + "_summary.md")
    md.write_text("\n".join(lines) + "\n")
    return {"png": png, "md": md}
