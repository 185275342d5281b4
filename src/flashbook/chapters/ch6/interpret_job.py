"""What the two sides of a Chapter 6 interpret-mode job share: ``interpret`` (the parent) and
``interpret_child`` (the job's process). The job directory's files, and the records of a job's
calls (``Call``), of the student's functions as the messages quote them (``Source``) and of what
came back (``Run``). ``interpret`` re-exports these names.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

__all__ = ["EVENTS", "STDOUT", "STDERR", "Call", "Source", "Run"]

EVENTS, STDOUT, STDERR = "events.jsonl", "stdout.txt", "stderr.txt"


@dataclasses.dataclass
class Call:
    """One kernel run of a job: ``target(**functions, **arrays, **params)``."""
    label: str
    arrays: dict
    params: dict
    thread_names: dict | None = None      # warpgroup id -> "the producer warpgroup"
    barrier_names: Sequence[str] = ()     # in allocation order: "full[0]", ...
    smem_names: Sequence[str] = ()        # SMEM scratch buffers in allocation order


@dataclasses.dataclass(frozen=True)
class Source:
    """A student's function as the messages quote it: its source and where it came from."""
    name: str            # the name the check knows it by
    defines: str         # the name its ``def`` binds
    source: str
    filename: str
    firstlineno: int

    def line(self, lineno: int) -> str | None:
        i = lineno - self.firstlineno
        lines = self.source.splitlines()
        return lines[i].strip() if 0 <= i < len(lines) else None


@dataclasses.dataclass
class Run:
    """What came back from a job."""
    status: str   # ok | failed | stalled | timeout | killed | died | no-jax | source-error
    calls: list              # per call: dict(outputs=..., races=[...], elapsed=..., done=bool,
                             # order=the order log, ``interpret_child.ORDER_DOC``, or None)
    problems: list           # barrier misuse the interpreter raised (dicts)
    pending: list            # barrier waits pending when the kernel stopped making progress
    error: dict | None       # an exception that ended a call (type, message, frames, text)
    failed_call: int | None  # the call that was running when things went wrong
    wall_s: float
    limit_s: float           # the time limit it ran under
    log: str                 # the tail of the child's stdout and stderr
    shipped: list            # the student's functions, ``Source``s
