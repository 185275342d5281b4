"""Where things live in the course directory.

nbgrader's layout, plus flashbook's results store::

    <course>/                 (the CLI's default: autograder/ of the checkout)
      nbgrader_config.py
      source/<assignment>/<nb>.ipynb          instructor notebooks (solutions, hidden tests)
      release/<assignment>/<nb>.ipynb         what students get
      submitted/<student>/<assignment>/<nb>.ipynb      repaired submission (collect)
      submitted/<student>/<assignment>/.flashbook/     original files + repair.log
      results/<assignment>/<student>/result.json       scores, reasons (autograde)
      results/<assignment>/<student>/<nb>.ipynb        the graded notebook (has hidden tests)
      feedback/<student>/<assignment>/<nb>.html        what the student gets back
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import nbformat

from .record import SubmissionResult, load

META_DIR = ".flashbook"       # per-submission: originals and repair log (never graded)
RESULT_FILE = "result.json"   # results/<assignment>/<student>/RESULT_FILE
COURSE_ENV = "FLASHBOOK_COURSE"


class CourseNotGiven(ValueError):
    """No course directory was named: grading has no idea where to work."""


def course_root(path: str | Path | None = None, default: str | Path | None = None) -> Path:
    """The course directory: ``path``, else $FLASHBOOK_COURSE, else ``default`` (the CLI's:
    ``autograder/`` of the checkout). The grading package itself assumes no repository."""
    chosen = path or os.environ.get(COURSE_ENV) or default
    if not chosen:
        raise CourseNotGiven(f"no course directory given: pass --course DIR or set {COURSE_ENV}")
    return Path(chosen).resolve()


class Course:
    """The course directory ``root`` (else $FLASHBOOK_COURSE) and the paths inside it."""

    def __init__(self, root: str | Path | None = None):
        self.root = course_root(root)

    def source_dir(self, a: str) -> Path:
        return self.root / "source" / a

    def release_dir(self, a: str) -> Path:
        return self.root / "release" / a

    def submission_dir(self, a: str, student: str) -> Path:
        return self.root / "submitted" / student / a

    def results_dir(self, a: str, results_root: Path | None = None) -> Path:
        return (results_root or self.root / "results") / a

    def feedback_dir(self, a: str, student: str) -> Path:
        return self.root / "feedback" / student / a

    def notebook_names(self, a: str) -> list[str]:
        """The assignment's notebooks (names without .ipynb), from source/ (or release/)."""
        for d in (self.source_dir(a), self.release_dir(a)):
            names = sorted(p.stem for p in d.glob("*.ipynb"))
            if names:
                return names
        raise FileNotFoundError(
            f"assignment {a!r} has no notebooks in {self.source_dir(a)} — run `flashbook release "
            f"{a}` first (course directory: {self.root})")

    def source_notebook(self, a: str, name: str):
        return nbformat.read(self.source_dir(a) / f"{name}.ipynb", as_version=4)

    def release_notebook(self, a: str, name: str):
        path = self.release_dir(a) / f"{name}.ipynb"
        if not path.exists():
            raise FileNotFoundError(f"{path} missing — run `flashbook release {a}` first")
        return nbformat.read(path, as_version=4)

    def students(self, a: str) -> list[str]:
        """Students with a submission folder for assignment ``a``."""
        sub = self.root / "submitted"
        if not sub.is_dir():
            return []
        return sorted(p.name for p in sub.iterdir() if (p / a).is_dir())


def write_json(path: Path, data) -> None:
    """Write atomically (a crash never leaves half a result behind)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    os.replace(tmp, path)


def read_results(results_dir: Path) -> dict[str, SubmissionResult]:
    """{student: result} from results/<assignment>/<student>/result.json."""
    out = {}
    if results_dir.is_dir():
        for p in sorted(results_dir.glob(f"*/{RESULT_FILE}")):
            out[p.parent.name] = load(p)
    return out
