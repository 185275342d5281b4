"""Buffers with contents, for the pipeline model's configurations whose ops read and write named
buffers (``Spec.accesses``): every access says what it expects to find, and ``Buffers`` checks
it when it starts against the accesses in progress, the contents, and the barrier order (vector
clocks) after the last write and the reads since. A hazard names the time, the accessors and
the buffer: *read before ready* (old contents, or a write no barrier orders before the read),
*overwrite* (contents still awaited by a reader, or reads no barrier orders before the write),
*race* (two accesses overlap in time and one writes). The words are the configuration's (its
pipeline's ``describe``, ``content_text``, ``hint``, ``race_note`` and ``newer``)."""
from __future__ import annotations

import dataclasses

from .pipeline_types import Hazard

__all__ = ["Access", "Buffer", "Buffers"]


@dataclasses.dataclass
class Access:
    who: str               # "the MMA warp's PV1(3)", "softmax 0's rowmax(0, 2)", ...
    agent: str             # the row it runs on: "tensor core", "TMA", "softmax 0", ...
    key: object            # its vector-clock component
    stamp: int             # its clock there
    mode: str              # "r", "w" or "rw"
    start: float
    end: float
    label: str = ""        # the reader's name in Buffer.need
    vc: dict = dataclasses.field(default_factory=dict)   # what the accessor knows (its clock)


@dataclasses.dataclass
class Buffer:
    name: str
    memory: str            # where it lives ("SMEM", "TMEM", ...)
    content: tuple | None = None
    write: Access | None = None           # the access that wrote ``content``
    reads: list = dataclasses.field(default_factory=list)    # reads of ``content``
    need: set = dataclasses.field(default_factory=set)       # readers ``content`` still awaits
    inflight: list = dataclasses.field(default_factory=list)  # accesses in progress


def _cap(text: str) -> str:
    return text[:1].upper() + text[1:]


class Buffers:
    """The buffers of one run (``pipe.buffers()``: {name: Buffer}, two names may share one)."""

    def __init__(self, pipe, engine):
        self.pipe, self.engine = pipe, engine
        self.bufs = pipe.buffers() if hasattr(pipe, "buffers") else {}

    def __getitem__(self, name: str) -> Buffer:
        return self.bufs[name]

    def access(self, buf: Buffer, acc: Access, expect=None):
        """Check an access when it starts: overlap with accesses in progress, the contents it
        expects, and the barrier order against the last write and the reads since."""
        now = self.engine.now
        for other in buf.inflight:
            if other.key != acc.key and ("w" in acc.mode or "w" in other.mode):
                raise Hazard("race", now, self.race_text(buf, acc, other))
        vc = acc.vc
        if "r" in acc.mode:
            if buf.content != expect:
                kind = "overwrite" if self.pipe.newer(buf.content, expect) else \
                    "read before ready"
                raise Hazard(kind, now, self.content_text(buf, acc, expect))
            w = buf.write
            if w is not None and vc.get(w.key, 0) < w.stamp:
                raise Hazard("read before ready", now, self.unordered_text(buf, acc, w, "read"))
        if "w" in acc.mode:
            if buf.need - {acc.label}:
                raise Hazard("overwrite", now, self.unread_text(buf, acc))
            for prior in ([buf.write] if buf.write else []) + buf.reads:
                if prior.key != acc.key and vc.get(prior.key, 0) < prior.stamp:
                    raise Hazard("overwrite", now, self.unordered_text(buf, acc, prior, "write"))
        if "r" in acc.mode:
            buf.reads.append(acc)
            buf.need.discard(acc.label)
        buf.inflight.append(acc)

    @staticmethod
    def complete(buf: Buffer, acc: Access, new=None, need=()):
        buf.inflight.remove(acc)
        if "w" in acc.mode:
            buf.content, buf.write, buf.reads, buf.need = new, acc, [], set(need)

    # ---------------------------------------------------------------- messages
    def content_text(self, buf: Buffer, acc: Access, expect) -> str:
        pipe, have, w = self.pipe, buf.content, buf.write
        by = f" (written by {w.who} at t={w.end:g})" if w else ""
        return (f"{_cap(acc.who)} reads {pipe.describe(buf)} expecting "
                f"{pipe.content_text(expect)}, but it holds {pipe.content_text(have)}{by}."
                + pipe.hint(buf, acc, expect, have))

    def unordered_text(self, buf: Buffer, acc: Access, prior: Access, what: str) -> str:
        kind = "wrote" if "w" in prior.mode else "read"
        verb = "reads" if what == "read" else "writes"
        noun = "write" if kind == "wrote" else "read"
        return (f"{_cap(acc.who)} {verb} {self.pipe.describe(buf)}, which {prior.who} {kind} at "
                f"t={prior.start:g}, but no barrier orders that {noun} before this {what}: the "
                f"timing of this run hid it, another run's would not."
                + self.pipe.hint(buf, acc, buf.content, buf.content))

    def unread_text(self, buf: Buffer, acc: Access) -> str:
        missing = ", ".join(sorted(buf.need - {acc.label}))
        return (f"{_cap(acc.who)} overwrites {self.pipe.describe(buf)}, which holds "
                f"{self.pipe.content_text(buf.content)}, before {missing} read it."
                + self.pipe.hint(buf, acc, None, buf.content))

    def race_text(self, buf: Buffer, acc: Access, other: Access) -> str:
        a_verb = {"r": "reads", "w": "writes", "rw": "updates"}[acc.mode]
        o_verb = {"r": "reading", "w": "writing", "rw": "updating"}[other.mode]
        return (f"{_cap(acc.who)} {a_verb} {self.pipe.describe(buf)} at t={self.engine.now:g} "
                f"while {other.who} is still {o_verb} it (t={other.start:g}..{other.end:g})."
                + self.pipe.race_note(buf, acc, other)
                + self.pipe.hint(buf, acc, buf.content, buf.content))
