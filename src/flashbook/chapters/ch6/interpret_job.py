"""What the two sides of a Chapter 6 interpret-mode job share: ``interpret`` (the parent) and
``interpret_child`` and ``zygote`` (the child's side). The job directory's files, the names a
kernel's source may use without importing them, the child's watchdog limits, and the records of
a job's calls (``Call``) and of what came back (``Run``). Standard library only: the child imports
it through bare packages (no torch). ``interpret`` re-exports these names.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

__all__ = ["DEADLOCK_S", "GRACE_S", "DEFAULT_IMPORTS", "EVENTS", "STDOUT", "STDERR", "Call", "Run"]

DEADLOCK_S = 2.0               # no CPU used while warpgroups wait on barriers: a deadlock
GRACE_S = 1.0                  # after a barrier error: the rest of the kernel hangs, soon
# Names a kernel's source may use without importing them (the child provides them).
DEFAULT_IMPORTS = {"jax": "import jax", "jnp": "import jax.numpy as jnp", "lax": "from jax import lax",
             "pl": "import jax.experimental.pallas as pl",
             "plgpu": "import jax.experimental.pallas.mosaic_gpu as plgpu",
             "np": "import numpy as np", "math": "import math", "functools": "import functools"}
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
    shipped: list
