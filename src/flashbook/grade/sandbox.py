"""Isolation for the student's code: a scrubbed environment, resource limits, and the
kernel launcher that applies them.

What this gives (and what it cannot):
* the kernel starts in the submission's scratch work directory, with HOME and TMPDIR there and
  an environment that holds nothing of the instructor's (no tokens, no FLASHBOOK_* paths);
* its address space (CPU mode), core dumps and file sizes are limited (``setrlimit``);
* it dies with the grading worker (``PR_SET_PDEATHSIG``), so no orphan keeps looping;
* Landlock (Linux >= 5.13, unprivileged): the kernel may read only the system, Python and
  flashbook's own code, and write only its work directory — so it cannot read the course
  directory (solutions, gradebook, other students' files) nor write anything else; with
  Landlock ABI >= 4 it also cannot open TCP connections except on its own ports; for a chapter
  whose graded code starts processes that talk over loopback (``Chapter.local_ports``: Chapter
  8's ring over gloo) also on the ephemeral range (Landlock cannot tell loopback from remote
  hosts, so those ports are then open to both; well-known ports such as 22, 80 and 443 stay
  closed);
* optionally (``--sandbox-user``, when grading runs as root) it drops to an unprivileged user.
Without Landlock (older kernels, some container runtimes) the kernel has the grader's rights:
``autograde`` warns, and the instructor guide says how to add a container.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import pwd
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path

KERNEL_NAME = "flashbook-sandbox"
# What the student's kernel may see of the environment (values, where set, are ours).
# FLASHBOOK_QUICK_BENCH: `flashbook selftest` grades with the benchmark cells' quick timing.
_KEEP = ("LANG", "LC_ALL", "TZ", "FLASHBOOK_QUICK_BENCH")


def scrubbed_env(home: Path, device: str, gpu: str | None = None,
                 extra: dict | None = None) -> dict:
    """A minimal environment for the grading worker and its kernel."""
    env = {k: os.environ[k] for k in _KEEP if k in os.environ}
    bindir = str(Path(sys.executable).parent)
    env.update(PATH=f"{bindir}:/usr/local/bin:/usr/bin:/bin", HOME=str(home),
               PYTHONNOUSERSITE="1", PYTHONDONTWRITEBYTECODE="1", MPLBACKEND="Agg",
               OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", JUPYTER_PLATFORM_DIRS="1",
               NBGRADER_EXECUTION="autograde")
    if device == "cpu":
        env.update(FLASHBOOK_FORCE_CPU="1", CUDA_VISIBLE_DEVICES="")
    elif gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpu
    env.update(extra or {})
    return env


def sandbox_user(requested: str | None) -> str | None:
    """Check that the kernel can run as ``requested`` (None: as the grader's own user)."""
    if not requested:
        return None
    if os.geteuid() != 0:
        raise ValueError("--sandbox-user needs the grader to run as root (e.g. in a container)")
    pw = pwd.getpwnam(requested)          # KeyError: no such user
    probe = subprocess.run([sys.executable, "-c", "import ipykernel, flashbook"],
                           user=pw.pw_uid, group=pw.pw_gid, extra_groups=[],
                           capture_output=True, text=True, cwd="/")
    if probe.returncode != 0:
        raise ValueError(f"user {requested!r} cannot run {sys.executable} with ipykernel and "
                         f"flashbook (install Python outside a private home directory):\n"
                         f"{probe.stderr.strip()[-500:]}")
    return requested


# ------------------------------------------------------------------------------ Landlock
# Linux uapi (include/uapi/linux/landlock.h); syscall numbers are the same on all arches.
_SYS_CREATE, _SYS_ADD_RULE, _SYS_RESTRICT = 444, 445, 446
_FS_EXECUTE, _FS_WRITE, _FS_READ_FILE, _FS_READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
_FS_ALL_V1 = (1 << 13) - 1                    # execute .. make_sym
_NET_BIND_TCP, _NET_CONNECT_TCP = 1 << 0, 1 << 1


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64)]


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


class _NetPort(ctypes.Structure):
    _fields_ = [("allowed_access", ctypes.c_uint64), ("port", ctypes.c_uint64)]


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def landlock_abi() -> int:
    """The kernel's Landlock ABI version; 0 when Landlock is not available."""
    try:
        return max(0, _libc().syscall(_SYS_CREATE, None, ctypes.c_size_t(0), ctypes.c_uint32(1)))
    except (OSError, AttributeError):
        return 0


def ephemeral_ports() -> tuple[int, int]:
    """The local (ephemeral) port range, Linux's ``ip_local_port_range``."""
    try:
        lo, hi = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def read_only_paths() -> list[str]:
    """What the kernel needs to read: the system, Python, site-packages, flashbook's code."""
    paths = ["/usr", "/lib", "/lib64", "/lib32", "/bin", "/sbin", "/etc", "/opt", "/proc",
             "/sys", sys.prefix, sys.base_prefix, os.path.realpath(sys.base_prefix),
             str(Path(os.path.realpath(sys.executable)).parent),
             str(Path(__file__).resolve().parents[2])]          # .../src (flashbook package)
    paths += [p for p in sys.path if p and os.path.isdir(p)]
    return sorted({p for p in paths if os.path.isdir(p)})


def landlock(rw: list[str], ro: list[str], tcp_bind_ports: list[int],
             local_ports: bool = False) -> int:
    """Restrict this process and its children for good; returns the ABI used (0: none).
    ``local_ports``: also allow bind to port 0 and bind/connect on the ephemeral ports."""
    abi = landlock_abi()
    if abi < 1:
        return 0
    libc = _libc()
    fs_all = _FS_ALL_V1 | (1 << 13 if abi >= 2 else 0) | (1 << 14 if abi >= 3 else 0) \
        | (1 << 15 if abi >= 5 else 0)
    attr = _RulesetAttr(fs_all, (_NET_BIND_TCP | _NET_CONNECT_TCP) if abi >= 4 else 0)
    size = ctypes.sizeof(_RulesetAttr) if abi >= 4 else 8
    fd = libc.syscall(_SYS_CREATE, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
    if fd < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset")
    rox = _FS_EXECUTE | _FS_READ_FILE | _FS_READ_DIR
    for paths, access in ((ro, rox), (rw, fs_all)):
        for path in paths:
            pfd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            rule = _PathBeneath(access, pfd)
            rc = libc.syscall(_SYS_ADD_RULE, fd, 1, ctypes.byref(rule), ctypes.c_uint32(0))
            os.close(pfd)
            if rc:
                raise OSError(ctypes.get_errno(), f"landlock_add_rule {path}")
    if abi >= 4:
        # the kernel's own ports; with local_ports, bind to port 0 (the system picks one) and
        # bind/connect within the ephemeral range: processes the student's code starts talk to
        # each other that way (torch.distributed over gloo). Well-known ports stay closed.
        rules = [(port, _NET_BIND_TCP) for port in tcp_bind_ports]
        if local_ports:
            lo, hi = ephemeral_ports()
            rules += [(0, _NET_BIND_TCP)] + \
                [(port, _NET_BIND_TCP | _NET_CONNECT_TCP) for port in range(lo, hi + 1)]
        for port, access in rules:
            rule = _NetPort(access, port)
            if libc.syscall(_SYS_ADD_RULE, fd, 2, ctypes.byref(rule), ctypes.c_uint32(0)):
                raise OSError(ctypes.get_errno(), f"landlock_add_rule port {port}")
    if libc.prctl(38, 1, 0, 0, 0):                      # PR_SET_NO_NEW_PRIVS
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    if libc.syscall(_SYS_RESTRICT, fd, ctypes.c_uint32(0)):
        raise OSError(ctypes.get_errno(), "landlock_restrict_self")
    os.close(fd)
    return abi


def write_kernelspec(jupyter_dir: Path, workdir: Path, memory_mb: int | None,
                     user: str | None, local_ports: bool = False) -> str:
    """A kernelspec that starts ipykernel through this module's launcher."""
    argv = [sys.executable, "-m", "flashbook.grade.sandbox", "--workdir", str(workdir)]
    if local_ports:
        argv += ["--local-ports"]
    if memory_mb:
        argv += ["--memory-mb", str(memory_mb)]
    if user:
        argv += ["--user", user]
    spec = {"argv": argv + ["-f", "{connection_file}"], "display_name": "flashbook sandbox",
            "language": "python", "interrupt_mode": "signal"}
    d = jupyter_dir / "kernels" / KERNEL_NAME
    d.mkdir(parents=True, exist_ok=True)
    (d / "kernel.json").write_text(json.dumps(spec))
    return KERNEL_NAME


def _limit(which: int, value: int) -> None:
    soft, hard = resource.getrlimit(which)
    if hard != resource.RLIM_INFINITY:
        value = min(value, hard)
    resource.setrlimit(which, (value, value if hard == resource.RLIM_INFINITY else hard))


def _die_with_parent() -> None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)          # PR_SET_PDEATHSIG
    except OSError:
        pass


def _drop_privileges(user: str, workdir: Path) -> None:
    pw = pwd.getpwnam(user)
    for p in [workdir, *workdir.rglob("*")]:
        os.chown(p, pw.pw_uid, pw.pw_gid)
    os.setgroups([])
    os.setgid(pw.pw_gid)
    os.setuid(pw.pw_uid)


def main(argv=None) -> None:
    """Kernel launcher: limits, scratch cwd, unprivileged user, then exec ipykernel."""
    p = argparse.ArgumentParser(prog="flashbook.grade.sandbox")
    p.add_argument("--workdir", required=True)
    p.add_argument("--memory-mb", type=int)
    p.add_argument("--user")
    p.add_argument("--no-landlock", action="store_true")
    p.add_argument("--local-ports", action="store_true",
                   help="allow loopback TCP between processes the kernel starts (gloo)")
    p.add_argument("-f", dest="connection_file", required=True)
    a = p.parse_args(argv)
    workdir = Path(a.workdir)
    if a.memory_mb:
        _limit(resource.RLIMIT_AS, a.memory_mb * 2**20)
    _limit(resource.RLIMIT_CORE, 0)
    _limit(resource.RLIMIT_FSIZE, 2**30)     # no file over 1 GiB
    # the connection file lies outside what the kernel may read: it gets its own copy
    conn = str(workdir / ".kernel.json")
    shutil.copy(a.connection_file, conn)
    if a.user:
        _drop_privileges(a.user, workdir)
    _die_with_parent()                        # after setuid, which clears it
    info = json.loads(Path(conn).read_text())
    ports = [int(info[k]) for k in ("shell_port", "iopub_port", "stdin_port", "control_port",
                                    "hb_port")]
    if not a.no_landlock:
        tmp = workdir / "tmp"
        tmp.mkdir(exist_ok=True)
        try:
            # /proc/<own pid>: e.g. resetting peak memory (clear_refs) for measurements
            landlock(rw=[str(workdir), "/dev", f"/proc/{os.getpid()}"], ro=read_only_paths(),
                     tcp_bind_ports=ports, local_ports=a.local_ports)
        except OSError as e:
            print(f"flashbook sandbox: Landlock not applied: {e}", file=sys.stderr)
        os.environ["TMPDIR"] = str(tmp)
    os.environ["HOME"] = str(workdir)
    os.chdir(workdir)
    os.execv(sys.executable, [sys.executable, "-m", "ipykernel_launcher", "-f", conn,
                              "--HistoryManager.hist_file=:memory:"])


if __name__ == "__main__":
    main()
