"""A message-passing simulator for reductions over the processing elements (PEs) of one group
laid out on a 2-D mesh (Chapter 8, Exercise 3), and the mesh kernel's chain reduce.

PE ``p`` of a group of ``n`` sits at row ``p // cols``, column ``p % cols`` (row-major; the last
row may be partial). Each PE runs a *program*, a Python generator: ``x = yield recv(src)``
blocks until PE ``src`` has sent to it, ``yield send(dst, x)`` hands ``x`` to PE ``dst``
(buffered: the sender goes on). The program ``return``s its final value (the root's is the
reduction). Time: a message sent at time t arrives at t + 1 (one sequential step of latency,
the cost that dominates small messages), a PE's clock jumps to the arrival when it receives, and
merging costs nothing; the root's clock at the end is the reduction's critical path. Hops: the
mesh distance between sender and receiver (|drow| + |dcol|), summed over messages.

When every unfinished PE waits on a message that can never come (a PE outside the group, one
that finished, or a cycle of waits), the simulator stops and reports a deadlock: who waits on whom.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

__all__ = ["send", "recv", "Deadlock", "SimResult", "simulate", "seed_chain_reduce",
           "mesh_shape", "position"]


@dataclasses.dataclass(frozen=True)
class _Send:
    dst: int
    value: object


@dataclasses.dataclass(frozen=True)
class _Recv:
    src: int


def _as_op(op):
    """``op`` as this module's ``_Send`` or ``_Recv``, else None. The grader loads the checks
    afresh, so a program may yield the ops of the notebook's own import of this module: the
    same classes by name and fields, which are copied into this module's (nothing else is
    taken from them)."""
    if type(op) in (_Send, _Recv):
        return op
    kind = type(op)
    if kind.__module__ != __name__ or not dataclasses.is_dataclass(op):
        return None
    if kind.__qualname__ == "_Send":
        return _Send(int(op.dst), op.value)
    if kind.__qualname__ == "_Recv":
        return _Recv(int(op.src))
    return None


def send(dst: int, value) -> _Send:
    """``yield send(dst, value)``: hand ``value`` to PE ``dst`` (one message)."""
    return _Send(int(dst), value)


def recv(src: int) -> _Recv:
    """``value = yield recv(src)``: wait for PE ``src``'s next message."""
    return _Recv(int(src))


class Deadlock(Exception):
    """Every unfinished PE waits on a message that never comes; ``waits`` maps PE -> the PE it
    waits on."""

    def __init__(self, waits: dict, n: int, cols: int):
        self.waits = waits
        parts = []
        for pe, src in sorted(waits.items())[:6]:
            why = ("not in the group" if not 0 <= src < n else
                   "itself blocked" if src in waits else "which never sends to it")
            parts.append(f"PE {pe} (row {pe // cols}, col {pe % cols}) waits on PE {src}, {why}")
        super().__init__(f"deadlock (group of {n} PEs, {cols} columns): " + "; ".join(parts))


@dataclasses.dataclass
class SimResult:
    result: object           # what the root (PE 0) returned
    returned: dict           # PE -> what its program returned
    messages: int            # sends, in all
    steps: int               # the root's clock at the end: the critical path in messages
    hops: int                # mesh hops summed over messages
    received: dict           # PE -> number of messages it received
    unreceived: list         # (src, dst) of messages sent but never received


def mesh_shape(n: int, cols: int) -> tuple[int, int]:
    """(rows, cols) of a group of n PEs laid out row-major with at most ``cols`` columns."""
    cols = max(1, min(cols, n))
    return -(-n // cols), cols


def position(pe: int, cols: int) -> tuple[int, int]:
    return pe // cols, pe % cols


def simulate(program: Callable, states: list, cols: int, *, max_ops: int = 100000,
             **kwargs) -> SimResult:
    """Run ``program(pe, n, cols, state, **kwargs)`` on every PE of a group of n = len(states)
    and return what happened; raises Deadlock, or TypeError when a program is not a generator
    or yields something other than ``send``/``recv``."""
    n = len(states)
    gens = {pe: program(pe, n, cols, states[pe], **kwargs) for pe in range(n)}
    for pe, g in gens.items():
        if not hasattr(g, "send"):
            raise TypeError(f"the program must be a generator (use `yield send(...)` and `x = "
                            f"yield recv(...)`), got {type(g).__name__} for PE {pe}")
    clock = {pe: 0 for pe in range(n)}
    inbox: dict = {}                        # (src, dst) -> [(arrival, value), ...]
    pending: dict = {}                      # pe -> the recv it is blocked in
    value: dict = {pe: None for pe in range(n)}
    returned, received = {}, {pe: 0 for pe in range(n)}
    messages = hops = ops = 0
    progressed = True
    while progressed:
        progressed = False
        for pe in range(n):
            if pe in returned:
                continue
            while True:
                if pe in pending:                               # blocked in a recv
                    queue = inbox.get((pending[pe].src, pe))
                    if not queue:
                        break
                    arrival, value[pe] = queue.pop(0)
                    clock[pe] = max(clock[pe], arrival)
                    received[pe] += 1
                    del pending[pe]
                    progressed = True
                ops += 1
                if ops > max_ops:
                    raise RuntimeError(f"more than {max_ops} operations: a program that never "
                                       "ends?")
                try:
                    op = gens[pe].send(value[pe])
                except StopIteration as stop:
                    returned[pe] = stop.value
                    progressed = True
                    break
                value[pe] = None
                progressed = True
                op = _as_op(op) or op
                if isinstance(op, _Send):
                    if not 0 <= op.dst < n:
                        raise Deadlock({pe: op.dst}, n, cols)
                    (r0, c0), (r1, c1) = position(pe, cols), position(op.dst, cols)
                    messages += 1
                    hops += abs(r0 - r1) + abs(c0 - c1)
                    inbox.setdefault((pe, op.dst), []).append((clock[pe] + 1, op.value))
                elif isinstance(op, _Recv):
                    pending[pe] = op
                else:
                    raise TypeError(f"PE {pe} yielded {op!r}: yield send(dst, x) or recv(src)")
    if pending:
        raise Deadlock({pe: op.src for pe, op in pending.items()}, n, cols)
    left = [(src, dst) for (src, dst), queue in inbox.items() for _ in queue]
    return SimResult(returned.get(0), returned, messages, clock[0], hops, received, left)


def seed_chain_reduce(pe, n, cols, state, merge):
    """The mesh kernel's reduction, as a program: a row chain flowing west (each PE but the last of its
    row receives from its east neighbour, merges, and all but column 0 send west), then a
    column chain flowing north along column 0, with ``cols = min(4, n)`` columns. It assumes
    every row is full: with n = 6 and 4 columns, PE 5 (row 1, column 1) waits on an east
    neighbour, PE 6, that is not in the group."""
    cols = min(cols, n)
    rows = -(-n // cols)
    row, col = pe // cols, pe % cols
    if cols > 1:
        if col < cols - 1:
            state = merge(state, (yield recv(pe + 1)))
        if col > 0:
            yield send(pe - 1, state)
    if col == 0 and rows > 1:
        if row < rows - 1:
            state = merge(state, (yield recv(pe + cols)))
        if row > 0:
            yield send(pe - cols, state)
    return state if pe == 0 else None
