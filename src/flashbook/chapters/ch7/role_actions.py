"""The vocabulary of Chapter 7's five-role simulator (``roles``): the roles' names, the actions
a role program yields (TMA copies, MMA issues, commits, timed work of the softmax, correction
and epilogue roles) and the buffers with contents (shared and tensor memory) that the engine
(``role_engine``) checks every access against."""
from __future__ import annotations

import dataclasses

from flashbook.pipeline_types import Action, Barrier

__all__ = ["ROLE_NAMES", "TILES", "RoleAction", "TmaCopy", "MmaIssue", "Commit", "Work",
           "access_label", "content_text", "Access", "Buffer"]

ROLE_NAMES = ("load warp", "MMA warp", "softmax 0", "softmax 1", "correction", "epilogue warp")
TILES = (0, 1)


# ------------------------------------------------------------------------------------ actions

class RoleAction(Action):
    """An action of one of the five roles (a Chapter 6 action, so the engine's bookkeeping of
    made-but-never-yielded actions covers it)."""
    owner = ""


@dataclasses.dataclass(eq=False)
class TmaCopy(RoleAction):
    part: str              # "Q", "K" or "V"
    index: int             # the tile (Q) or the key step (K, V)
    bar: Barrier
    owner = "load warp"

    def __str__(self):
        return f"load_{self.part.lower()}({self.index}, {self.bar.name})"


@dataclasses.dataclass(eq=False)
class MmaIssue(RoleAction):
    kind: str              # "QK" or "PV"
    tile: int
    step: int
    owner = "MMA warp"

    def __str__(self):
        return f"{self.kind.lower()}({self.tile}, {self.step})"

    @property
    def label(self) -> str:
        return f"{self.kind}{self.tile}({self.step})"


@dataclasses.dataclass(eq=False)
class Commit(RoleAction):
    bar: Barrier
    owner = "MMA warp"

    def __str__(self):
        return f"commit({self.bar.name})"


@dataclasses.dataclass(eq=False)
class Work(RoleAction):
    kind: str              # rowmax, exp, rowsum, rescale, finish, store
    tile: int
    step: int | None = None

    def __str__(self):
        return f"{self.kind}({self.tile}" + ("" if self.step is None else f", {self.step}") + ")"

    @property
    def owner(self):
        if self.kind in ("rowmax", "exp", "rowsum"):
            return f"softmax {self.tile}"
        return "correction" if self.kind in ("rescale", "finish") else "epilogue warp"


# -------------------------------------------------------------------------- buffers, contents

def access_label(kind: str, tile: int, step: int | None = None) -> str:
    """An access's name, as the buffers' lists of awaited readers spell it."""
    if kind in ("QK", "PV"):
        return f"{kind}{tile}({step})"
    if kind in ("rowmax", "exp"):
        return f"softmax {tile}'s {kind}({tile}, {step})"
    if kind == "rowsum":
        return f"softmax {tile}'s rowsum({tile})"
    if kind == "rescale":
        return f"the correction's rescale({tile}, {step})"
    if kind == "finish":
        return f"the correction's finish({tile})"
    return f"the epilogue's store({tile})"


def content_text(c) -> str:
    if c is None:
        return "nothing yet"
    kind = c[0]
    return {"Q": lambda: f"Q tile {c[1]}",
            "K": lambda: f"K of step {c[1]}",
            "V": lambda: f"V of step {c[1]}",
            "S": lambda: f"the scores S of step {c[1]}",
            "P": lambda: f"P of step {c[1]}",
            "m": lambda: f"the row max of step {c[1]}",
            "l": lambda: "the row sum",
            "O": lambda: f"O accumulated through step {c[1]}",
            "O~": lambda: f"O rescaled for step {c[1]} (waiting for PV of step {c[1]})",
            "out": lambda: "the normalised O tile"}[kind]()


@dataclasses.dataclass
class Access:
    who: str               # "the MMA warp's PV1(3)", "softmax 0's rowmax(2)", ...
    agent: str             # the row it runs on: "tensor core", "TMA", "softmax 0", ...
    key: object            # its vector-clock component
    stamp: int             # its clock there
    mode: str              # "r", "w" or "rw"
    start: float
    end: float
    label: str = ""        # the reader's name in Buffer.need ("QK0(3)", "rowmax 0(3)", ...)
    vc: dict = dataclasses.field(default_factory=dict)   # what the accessor knows (its clock)


@dataclasses.dataclass
class Buffer:
    name: str
    memory: str            # "SMEM" or "TMEM"
    content: tuple | None = None
    write: Access | None = None           # the access that wrote ``content``
    reads: list = dataclasses.field(default_factory=list)    # reads of ``content``
    need: set = dataclasses.field(default_factory=set)       # readers ``content`` still awaits
    inflight: list = dataclasses.field(default_factory=list)  # accesses in progress


