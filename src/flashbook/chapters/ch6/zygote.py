"""A warm parent for interpret-mode jobs: one process that has imported JAX once and forks a
fresh child per job (``interpret.run``), so a check pays JAX's start-up (about 1.5 s of the 3
to 7 s a job takes) once per notebook kernel instead of once per job.

Each job still runs in its own process, in its own session (process group): the parent kills
it on a time-out exactly as it kills a fresh process, and a job can neither hang nor poison the
next. The zygote never starts a JAX backend (only imports), so every child starts its own.

Protocol, one line each way: the parent writes a job directory; the zygote answers
``pid <pid>`` when the child is forked and ``exit <pid> <status>`` when it has been reaped.
If the zygote cannot start or dies, ``interpret.run`` falls back to a fresh process per job.
"""
from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

_HERE = Path(__file__).resolve()
_START_S = 60.0                 # the zygote's own start (imports JAX) may take this long


class Job:
    """A child forked by the zygote: ``wait``, ``poll`` and ``kill`` like a ``Popen``."""

    def __init__(self, zygote: "Zygote", pid: int):
        self.zygote, self.pid, self.returncode = zygote, pid, None

    def poll(self):
        if self.returncode is None:
            self.returncode = self.zygote.reaped(self.pid, 0.0)
        return self.returncode

    def wait(self, timeout: float | None = None):
        if self.returncode is None:
            self.returncode = self.zygote.reaped(self.pid, timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(f"interpret job {self.pid}", timeout)
        return self.returncode

    def kill(self):
        try:
            os.killpg(self.pid, signal.SIGKILL)        # the job's own session: only its tree
        except (ProcessLookupError, PermissionError):
            pass
        self.wait(timeout=30)


class Zygote:
    """The parent side: start the zygote process, hand it jobs, read what it says."""

    def __init__(self, env: dict):
        self.env = env
        # started as ``python interpret.py --zygote``: the child's own boot (bare packages)
        self.proc = subprocess.Popen([sys.executable, "-u", str(_HERE.parent / "interpret.py"),
                                      "--zygote"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env,
                                     start_new_session=True)
        self.buffer, self.exits = b"", {}
        self.lock = threading.Lock()
        if self._line(_START_S) != "ready":
            self.close()
            raise RuntimeError("the interpret-mode zygote did not start")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def start(self, job_dir: Path) -> Job:
        with self.lock:
            self.proc.stdin.write(f"{job_dir}\n".encode())
            self.proc.stdin.flush()
            while True:
                line = self._line(_START_S)
                if line is None:
                    raise RuntimeError("the interpret-mode zygote stopped answering")
                if line.startswith("pid "):
                    return Job(self, int(line.split()[1]))
                self._note(line)

    def reaped(self, pid: int, timeout: float | None):
        """The child's exit status once the zygote has reaped it; None if not within
        ``timeout`` seconds (None: wait as long as it takes)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.lock:
            while pid not in self.exits:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                line = self._line(left)
                if line is None:
                    if not self.alive():              # the zygote died: so did its children
                        return -signal.SIGKILL
                    continue
                self._note(line)
            return self.exits.pop(pid)

    def close(self):
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()

    def _note(self, line: str):
        if line.startswith("exit "):
            _, pid, status = line.split()
            self.exits[int(pid)] = int(status)

    def _line(self, timeout: float | None) -> str | None:
        """The next line from the zygote, or None after ``timeout`` seconds or at its end."""
        deadline = None if timeout is None else time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.buffer:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                return None
            chunk = os.read(fd, 4096)
            if not chunk:
                return None
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return line.decode()


# ----------------------------------------------------------------------- the zygote side

def serve():
    """The zygote's loop (in ``python interpret.py --zygote``, bare packages: no torch)."""
    from flashbook.chapters.ch6 import interpret_child, interpret_job
    interpret_child.die_with_parent()
    import jax
    jax.config.update("jax_platforms", "cpu")
    import jax.experimental.pallas.mosaic_gpu  # noqa: F401
    import importlib
    importlib.import_module("jax._src.pallas.mosaic_gpu.interpret.params")
    out = sys.stdout
    out.write("ready\n")
    out.flush()
    stdin = sys.stdin.fileno()
    buffer = b""
    while True:
        ready, _, _ = select.select([stdin], [], [], 0.05)
        if ready:
            chunk = os.read(stdin, 4096)
            if not chunk:
                break                                   # the parent closed the pipe
            buffer += chunk
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            pid = os.fork()
            if pid == 0:
                _child(Path(line.decode()), interpret_job, interpret_child)
            out.write(f"pid {pid}\n")
            out.flush()
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            out.write(f"exit {pid} {os.waitstatus_to_exitcode(status)}\n")
            out.flush()


def _child(job_dir: Path, interpret_job, interpret_child):
    """In the forked child: a session of its own, the job's files as stdio, then the job."""
    try:
        os.setsid()
        os.chdir(job_dir)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        for fd, name in ((1, interpret_job.STDOUT), (2, interpret_job.STDERR)):
            f = os.open(job_dir / name, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(f, fd)
        sys.stdout = open(1, "w", buffering=1, closefd=False)
        sys.stderr = open(2, "w", buffering=1, closefd=False)
        interpret_child.Child(job_dir).main()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(0)
