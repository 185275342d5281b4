"""``flashbook collect``: downloaded submissions -> ``submitted/<student>/<assignment>/``.

Accepts a folder (searched recursively) holding notebooks named as an LMS exports them
(``doe_jane_12345_ch03.ipynb``), zip files of those, or nbgrader's own layout
(``<student>/<assignment>/<nb>.ipynb``). Every notebook is repaired against the release
(``repair.py``); the original bytes, the repair log and where the file came from are kept in
``submitted/<student>/<assignment>/.flashbook/``. Nothing is ever dropped: a file whose student
cannot be told goes to ``unmatched/<assignment>/``; an earlier submission is only replaced with
``force``, and then kept in ``.flashbook/replaced-<time>/``.
"""
from __future__ import annotations

import csv
import dataclasses
import datetime
import hashlib
import re
import shutil
import zipfile
from pathlib import Path

import nbformat

from .layout import META_DIR, Course, write_json
from .repair import repair


@dataclasses.dataclass
class Item:
    """One submitted notebook file, from the folder or from inside a zip."""
    origin: str          # path relative to SRC, "archive.zip!member" for zip members
    data: bytes
    mtime: float

    @property
    def name(self) -> str:
        return self.origin.replace("!", "/").rsplit("/", 1)[-1]


def _tokens(text: str) -> list[str]:
    return [t for t in re.split(r"[^a-z0-9]+", text.lower()) if t]


def _safe_id(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("._") or "unknown"


class Roster:
    """roster.csv: a column ``id`` (the student id used in the gradebook) and optionally
    ``lms_id``, ``first_name``, ``last_name``, ``email`` — all used to recognize file names."""

    def __init__(self, path: Path | None):
        self.rows = []
        if path:
            with open(path, newline="") as f:
                self.rows = list(csv.DictReader(f))
            if self.rows and "id" not in self.rows[0]:
                raise ValueError(f"{path}: the roster needs a column 'id' "
                                 f"(columns found: {', '.join(self.rows[0])})")
        self.ids = {r["id"] for r in self.rows}

    def match(self, text: str) -> str | None:
        toks = set(_tokens(text))
        for r in self.rows:
            keys = [r.get("id"), r.get("lms_id"), (r.get("email") or "").split("@")[0]]
            if any(k and k.lower() in toks for k in keys):
                return r["id"]
        for r in self.rows:
            first, last = (r.get("first_name") or "").lower(), (r.get("last_name") or "").lower()
            if first and last and set(_tokens(first + " " + last)) <= toks:
                return r["id"]
        return None


def student_id(item: Item, assignment: str, names: list[str], roster: Roster) -> str | None:
    """Who handed this in: nbgrader layout, else the roster, else the LMS file name."""
    parts = item.origin.replace("!", "/").split("/")
    if len(parts) >= 3 and parts[-2] == assignment:
        return _safe_id(parts[-3])                  # <student>/<assignment>/<nb>.ipynb
    if roster.rows and roster.match(item.origin):
        return roster.match(item.origin)
    # LMS exports: lastname_firstname_<numeric id>_..., Moodle: "Jane Doe_12345_assignsub..."
    for part in reversed(parts):
        nums = [t for t in _tokens(Path(part).stem) if t.isdigit() and len(t) >= 3]
        if nums:
            return nums[0]
    stem = Path(item.name).stem
    for n in sorted(names, key=len, reverse=True):
        stem = stem.replace(n, "")
    stem = re.sub(rf"(^|[_\-\s]){re.escape(assignment)}($|[_\-\s])", "_", stem)
    return _safe_id(stem) if stem.strip("_- ") else None


def notebook_name(item: Item, names: list[str]) -> str | None:
    if len(names) == 1:
        return names[0]
    for n in sorted(names, key=len, reverse=True):
        if n in item.name:
            return n
    return None


def find_items(src: Path) -> tuple[list[Item], list[str]]:
    """Every notebook under ``src`` (zips opened); and the paths of files that are not."""
    items, ignored = [], []
    if src.is_file():
        files, base = [src], src.parent
    elif src.is_dir():
        files, base = sorted(p for p in src.rglob("*") if p.is_file()), src
    else:
        raise FileNotFoundError(f"{src}: no such file or folder")
    for p in files:
        rel = str(p.relative_to(base))
        if META_DIR in p.parts or p.name.startswith("._") or "__MACOSX" in p.parts:
            continue
        if p.suffix == ".ipynb":
            items.append(Item(rel, p.read_bytes(), p.stat().st_mtime))
        elif p.suffix == ".zip":
            try:
                with zipfile.ZipFile(p) as z:
                    for info in z.infolist():
                        name = info.filename
                        if name.endswith(".ipynb") and "__MACOSX" not in name \
                                and not Path(name).name.startswith("._"):
                            when = datetime.datetime(*info.date_time).timestamp()
                            items.append(Item(f"{rel}!{name}", z.read(info), when))
            except zipfile.BadZipFile:
                ignored.append(f"{rel} (not a readable zip file)")
        else:
            ignored.append(rel)
    return items, ignored


def place(course: Course, assignment: str, student: str, nb_name: str, chosen: Item,
          others: list[Item], force: bool) -> list[str]:
    """Write one student's repaired notebook, originals and logs. Returns the repair log."""
    dest = course.submission_dir(assignment, student)
    target = dest / f"{nb_name}.ipynb"
    meta = dest / META_DIR
    if target.exists():
        if not force:
            raise FileExistsError(f"{target} exists (collected earlier); --force replaces it")
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S-%f")
        keep = meta / f"replaced-{stamp}"
        keep.mkdir(parents=True)
        for p in dest.iterdir():
            if p.name != META_DIR:
                shutil.move(str(p), keep / p.name)
        for p in ("original", "repair.log", "collect.json"):
            if (meta / p).exists():
                shutil.move(str(meta / p), keep / p)
    (meta / "original").mkdir(parents=True, exist_ok=True)
    for k, item in enumerate([chosen, *others]):
        (meta / "original" / f"{k}_{_safe_id(item.name)}").write_bytes(item.data)
    log = []
    if others:
        log.append(f"{len(others) + 1} files for {nb_name}: graded the newest "
                   f"({chosen.origin}); the others are kept in {META_DIR}/original/")
    try:
        student_nb = nbformat.reads(chosen.data.decode("utf-8"), as_version=4)
        fixed, log_repair = repair(student_nb, course.release_notebook(assignment, nb_name))
        nbformat.write(fixed, target)
        log += log_repair or ["nothing to repair"]
    except Exception as e:
        # keep the bytes as they are: autograde then gives 0 with this reason
        target.write_bytes(chosen.data)
        log.append(f"the notebook could not be read or repaired ({type(e).__name__}: "
                   f"{str(e).splitlines()[0][:300] if str(e) else ''}); stored as submitted")
    (meta / "repair.log").write_text("\n".join(log) + "\n")
    write_json(meta / "collect.json", {
        "origin": chosen.origin, "others": [o.origin for o in others],
        "sha256": hashlib.sha256(chosen.data).hexdigest(),
        "collected_at": datetime.datetime.now().isoformat(timespec="seconds")})
    # nbgrader's timestamp file: when the file was last changed (LMS download / zip entry)
    (dest / "timestamp.txt").write_text(
        datetime.datetime.fromtimestamp(chosen.mtime).isoformat(sep=" "))
    return log


def collect(src: Path, assignment: str, course: Course | None = None,
            roster: Path | None = None, force: bool = False) -> dict:
    """Collect and repair; returns {"collected": {student: log}, "skipped": {...},
    "unmatched": [...], "ignored": [...]}."""
    course = course or Course()
    names = course.notebook_names(assignment)
    for n in names:
        course.release_notebook(assignment, n)
    rost = Roster(roster)
    items, ignored = find_items(Path(src))
    groups: dict[tuple[str, str], list[Item]] = {}
    unmatched = []
    for item in items:
        sid, nb_name = student_id(item, assignment, names, rost), notebook_name(item, names)
        if sid is None or nb_name is None:
            unmatched.append(item)
            continue
        groups.setdefault((sid, nb_name), []).append(item)
    report = {"collected": {}, "skipped": {}, "unmatched": [], "ignored": ignored,
              "not_in_roster": []}
    for (sid, nb_name), group in sorted(groups.items()):
        group.sort(key=lambda it: (it.mtime, it.origin))
        try:
            report["collected"][sid] = place(course, assignment, sid, nb_name, group[-1],
                                             group[:-1], force)
        except FileExistsError as e:
            report["skipped"][sid] = str(e)
        if rost.rows and sid not in rost.ids:
            report["not_in_roster"].append(sid)
    if unmatched:
        dest = course.root / "unmatched" / assignment
        dest.mkdir(parents=True, exist_ok=True)
        for item in unmatched:
            out = dest / _safe_id(item.origin.replace("!", "__").replace("/", "__"))
            out.write_bytes(item.data)
            report["unmatched"].append(f"{item.origin} -> {out}")
    return report
