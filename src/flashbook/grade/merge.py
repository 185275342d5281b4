"""``flashbook merge``: combine the results of shards graded on several machines.

Each shard (``flashbook autograde NAME --shard i/n --results DIR``) writes
``DIR/<assignment>/<student>/``; merge copies those folders into the course's results store.
A student found in two shards with different results is a conflict (an error unless ``force``).
"""
from __future__ import annotations

import shutil
from pathlib import Path

from .layout import RESULT_FILE, Course
from .record import load


def _student_dirs(shard: Path, a: str) -> list[Path]:
    base = shard / a if (shard / a).is_dir() else shard
    return sorted(p.parent for p in base.glob(f"*/{RESULT_FILE}"))


def _same(x: Path, y: Path) -> bool:
    """The same grades, whenever and however fast they were graded."""
    return load(x / RESULT_FILE).timeless() == load(y / RESULT_FILE).timeless()


def merge(a: str, shards: list[Path], course: Course | None = None,
          results_root: Path | None = None, force: bool = False) -> dict:
    """Copy every shard's results for ``a`` into the results store; returns a report."""
    course = course or Course()
    dest_root = course.results_dir(a, results_root)
    report = {"merged": [], "conflicts": [], "missing": []}
    seen: dict[str, Path] = {}
    for shard in shards:
        shard = Path(shard)
        if not shard.is_dir():
            raise FileNotFoundError(f"{shard}: no such results folder")
        for d in _student_dirs(shard, a):
            s = d.name
            if s in seen and not _same(seen[s], d):
                report["conflicts"].append(f"{s}: {seen[s]} and {d} differ")
                if not force:
                    continue
            seen[s] = d
    if report["conflicts"] and not force:
        raise ValueError("shards disagree (use --force to take the later shard):\n  "
                         + "\n  ".join(report["conflicts"]))
    for s, d in sorted(seen.items()):
        target = dest_root / s
        if target.resolve() == d.resolve():
            continue
        if target.exists():
            if not force and not _same(target, d):
                report["conflicts"].append(f"{s}: already in {dest_root} with another result")
                continue
            shutil.rmtree(target)
        shutil.copytree(d, target)
        report["merged"].append(s)
    report["missing"] = [s for s in course.students(a)
                         if not (dest_root / s / RESULT_FILE).exists()]
    return report

