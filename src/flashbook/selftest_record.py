"""The self-check's record, ``src/flashbook/data/selftest/<gpu>.json``: what it says about a
chapter's sources (``source_hash``), reading, merging and writing it, and the text README's chapter
table shows for each chapter from the records (``check_cell``). ``flashbook selftest`` writes the
records; ``publish.update_chapter_table`` reads them. ``flashbook.selftest`` re-exports these names.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from pathlib import Path

from . import sources as chapter_sources

SCHEMA = 1
RECORDS = Path("src") / "flashbook" / "data" / "selftest"    # under the checkout's root


# ------------------------------------------------------------------ what a chapter is made of

def source_files(chapter_id: str, root: Path) -> list[Path]:
    """The chapter's source and every file of its package (no bytecode), sorted by path."""
    files = [chapter_sources.source(chapter_id, root).path]
    package = root / "src" / "flashbook" / "chapters" / chapter_id
    files += [p for p in package.rglob("*") if p.is_file()
              and "__pycache__" not in p.parts and p.suffix != ".pyc"]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def source_hash(chapter_id: str, root: Path) -> str:
    """sha256 over the chapter's files, each as its path (relative to root) and content."""
    h = hashlib.sha256()
    for p in source_files(chapter_id, root):
        name, data = p.relative_to(root).as_posix().encode(), p.read_bytes()
        h.update(b"%d:%s %d:" % (len(name), name, len(data)) + data)
    return h.hexdigest()


# ------------------------------------------------------------------ the record

def load(path: Path) -> dict:
    """The record at ``path`` ({"schema", "gpu", "updated", "chapters"}), empty if absent."""
    if not path.exists():
        return {"schema": SCHEMA, "chapters": {}}
    record = json.loads(path.read_text())
    if record.get("schema") != SCHEMA:
        raise ValueError(f"{path}: schema {record.get('schema')!r}, this flashbook writes {SCHEMA}")
    return record


def merge(record: dict, entries: dict) -> dict:
    """``record`` with ``entries`` (chapter id -> entry) replacing those chapters; a failed
    entry keeps the ``last_pass`` of the one it replaces; other chapters are kept."""
    chapters = dict(record.get("chapters", {}))
    for cid, entry in entries.items():
        p = entry["provenance"]
        graded = (entry.get("grading") or {}).get("status") != "skipped"
        last = ({"sha256": entry["sha256"], "commit": p["commit"], "date": p["date"],
                 "gpu": p["gpu"], "graded": graded} if entry["passed"]
                else chapters.get(cid, {}).get("last_pass"))
        chapters[cid] = {**entry, "last_pass": last}
    latest = max((c["provenance"] for c in chapters.values()), key=lambda p: p["date"],
                 default={})
    return {"schema": SCHEMA, "gpu": latest.get("gpu"), "updated": latest.get("date"),
            "chapters": dict(sorted(chapters.items(), key=lambda kv: int(kv[0][2:])))}


def save(path: Path, record: dict) -> None:
    """Write atomically: a crash never leaves half a record."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(record, indent=2) + "\n")
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)



# ------------------------------------------------------------------ README's chapter table

def records(directory: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(Path(directory).glob("*.json"))]


def _gpu(name: str | None) -> str:
    return re.sub(r"^(NVIDIA|Tesla)\s+", "", (name or "unknown GPU").strip())


def _commit(commit: str | None) -> str:
    return f"`{commit[:7]}`" if commit else "an unknown commit"


def check_cell(chapter_id: str, current: str, found: list[dict]) -> str:
    """The table's text for one chapter: the GPUs whose last pass ran these sources ("notebook
    only" where that pass ran the solved notebook without the grader, ``--no-grade``), else
    "stale (...)" or "not yet"; a latest run of these sources that failed is added."""
    passes, failures = [], []
    for record in found:
        entry = record.get("chapters", {}).get(chapter_id)
        if not entry:
            continue
        if entry.get("last_pass"):
            passes.append(entry["last_pass"])
        if not entry["passed"] and entry["sha256"] == current:
            p = entry["provenance"]
            failures.append(f"failed on {_gpu(p['gpu'])} at {_commit(p['commit'])}")
    fresh = sorted((p for p in passes if p["sha256"] == current), key=lambda p: _gpu(p["gpu"]))
    if fresh:
        text = ", ".join(f"{_gpu(p['gpu'])} at {_commit(p['commit'])}"
                         + (" (notebook only)" if p.get("graded") is False else "")
                         for p in fresh)
    elif passes:
        latest = max(passes, key=lambda p: p["date"])
        text = f"stale (sources changed since {_commit(latest['commit'])})"
    else:
        text = "not yet"
    return text + (f" ({'; '.join(failures)})" if failures else "")
