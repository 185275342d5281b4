"""The result of grading one submission: what the worker produces, autograde completes and
stores as ``results/<assignment>/<student>/result.json``, and feedback, export and merge read.

On disk the record also carries what is derived from its notebooks (``cells``, ``reasons``,
``score``, ``max_score``), so that the JSON alone answers "how did this student do".
"""
from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Literal

Status = Literal["passed", "partial", "failed", "not run", "manual"]
PASSED: Status = "passed"
PARTIAL: Status = "partial"
FAILED: Status = "failed"
NOT_RUN: Status = "not run"
MANUAL: Status = "manual"

_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def strip_ansi(text: str) -> str:
    """``text`` without the terminal colours IPython puts in tracebacks."""
    return _ANSI.sub("", text or "")


@dataclasses.dataclass(frozen=True)
class CellResult:
    """One graded cell (its grade id is its key in ``NotebookResult.cells``)."""
    score: float | None          # None: graded by hand (markdown answers)
    max_score: float
    status: Status
    message: str = ""            # why it lost points (plain text: ``strip_ansi``)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> CellResult:
        return cls(data["score"], data["max_score"], data["status"], data.get("message") or "")


def zeroed(max_scores: dict[str, float], reason: str) -> dict[str, CellResult]:
    """0 points for every graded cell, because of ``reason``."""
    return {gid: CellResult(0.0, pts, NOT_RUN, reason) for gid, pts in max_scores.items()}


@dataclasses.dataclass(frozen=True)
class Flag:
    """Something in the student's own code that an honest answer has no use for (``scan``):
    graded as usual, listed for the instructor to review."""
    cell: str                    # the cell's grade id, or "cell N" (1-based) for other cells
    line: int                    # 1-based line in that cell's source (0: unknown)
    what: str

    def __str__(self) -> str:
        return f"{self.cell}:{self.line} {self.what}"

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> Flag:
        return cls(data["cell"], int(data.get("line") or 0), data["what"])


@dataclasses.dataclass(frozen=True)
class NotebookResult:
    name: str                                   # the notebook's file name without .ipynb
    cells: dict[str, CellResult]                # by grade id, in notebook order
    repairs: tuple[str, ...] = ()               # what repair changed before grading
    notes: tuple[str, ...] = ()                 # what went wrong while grading it
    flags: tuple[Flag, ...] = ()                # possible tampering found in its code (scan)

    @property
    def score(self) -> float:
        return sum(c.score or 0 for c in self.cells.values())

    @property
    def max_score(self) -> float:
        return sum(c.max_score for c in self.cells.values())

    def to_json(self) -> dict:
        return {"name": self.name, "cells": {g: c.to_json() for g, c in self.cells.items()},
                "repairs": list(self.repairs), "notes": list(self.notes),
                "flags": [f.to_json() for f in self.flags]}

    @classmethod
    def from_json(cls, data: dict) -> NotebookResult:
        return cls(data["name"], {g: CellResult.from_json(c) for g, c in data["cells"].items()},
                   tuple(data.get("repairs", ())), tuple(data.get("notes", ())),
                   tuple(Flag.from_json(f) for f in data.get("flags", ())))


@dataclasses.dataclass(frozen=True)
class SubmissionResult:
    student: str
    assignment: str
    notebooks: tuple[NotebookResult, ...]
    seconds: float | None = None                # the worker's grading time
    worker_log: str | None = None               # the worker's last words, when it failed
    # added by autograde when it stores the result
    device: str | None = None                   # "cpu" or "gpu"
    graded_at: str | None = None                # ISO time
    submitted_sha256: dict[str, str] = dataclasses.field(default_factory=dict)  # per notebook

    @property
    def cells(self) -> dict[str, CellResult]:
        """Every graded cell of the submission, by grade id."""
        return {g: c for nb in self.notebooks for g, c in nb.cells.items()}

    @property
    def reasons(self) -> list[str]:
        """Everything that went wrong while grading (a reason noted per notebook, once)."""
        return list(dict.fromkeys(n for nb in self.notebooks for n in nb.notes))

    @property
    def flags(self) -> list[str]:
        """Every flag of the submission, as "notebook: cell:line what"."""
        many = len(self.notebooks) > 1
        return [f"{nb.name}: {f}" if many else str(f) for nb in self.notebooks for f in nb.flags]

    @property
    def score(self) -> float:
        return sum(nb.score for nb in self.notebooks)

    @property
    def max_score(self) -> float:
        return sum(nb.max_score for nb in self.notebooks)

    def timeless(self) -> SubmissionResult:
        """The record without when and how long: equal for two gradings of the same files."""
        return dataclasses.replace(self, seconds=None, graded_at=None)

    def to_json(self) -> dict:
        return {"student": self.student, "assignment": self.assignment,
                "notebooks": [nb.to_json() for nb in self.notebooks],
                "seconds": self.seconds, "worker_log": self.worker_log, "device": self.device,
                "graded_at": self.graded_at, "submitted_sha256": dict(self.submitted_sha256),
                "cells": {g: c.to_json() for g, c in self.cells.items()},
                "reasons": self.reasons, "flags": self.flags, "score": self.score,
                "max_score": self.max_score}

    @classmethod
    def from_json(cls, data: dict) -> SubmissionResult:
        notebooks = [NotebookResult.from_json(nb) for nb in data["notebooks"]]
        # Written before this record existed, a failed grading listed its zeroed cells only
        # at the top level: keep them, so that the maximum score stays right.
        listed = {g for nb in notebooks for g in nb.cells}
        orphans = {g: CellResult.from_json(c) for g, c in data.get("cells", {}).items()
                   if g not in listed}
        if orphans and notebooks:
            notebooks[0] = dataclasses.replace(notebooks[0],
                                               cells={**notebooks[0].cells, **orphans})
        return cls(data["student"], data["assignment"], tuple(notebooks),
                   seconds=data.get("seconds"), worker_log=data.get("worker_log"),
                   device=data.get("device"), graded_at=data.get("graded_at"),
                   submitted_sha256=dict(data.get("submitted_sha256", {})))


def load(path: Path) -> SubmissionResult:
    return SubmissionResult.from_json(json.loads(Path(path).read_text()))
