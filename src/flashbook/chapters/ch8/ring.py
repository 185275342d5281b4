"""Exercises 4b and 5's harness: a student's ``ring_attention`` (or ``ulysses_attention``) run
by P CPU processes over gloo (``torch.distributed``), started as ``torchrun`` starts them (one
fresh Python per rank), every one torn down whatever the student's code does.

The parent sends the student's function by value (``flashbook.shipping``: a notebook's
function cannot be imported by another process) to P spawned workers. Each worker
joins a gloo process group (a file store in a scratch directory, so no port can clash), rebuilds
the function, and runs every case of the job in one go (a process start costs seconds: one per
world size per check). For each case every worker builds the same seeded full problem, takes its
shard (zig-zag or contiguous positions), calls ``ring_attention(q, k, v, q_pos, k_pos, causal)``
(or the case's own entry: Ulysses, the traffic demo) and saves its (O, LSE) and the traffic it
sent: point-to-point (``batch_isend_irecv``) and the bytes each collective sent to other ranks.
A case the check expects to raise (a world size the method cannot use) saves the exception
instead. The parent compares each rank's shard with single-process float64 attention.

Teardown: a worker that raises writes its traceback and exits at once; the parent then kills the
others (blocked in a send or receive that will never complete). A job that runs past its time
limit (a deadlock) is killed the same way and reported as one; the gloo group's own timeout and
each worker's parent-death signal are the second and third nets. A worker never outlives the check.
"""
from __future__ import annotations

import dataclasses
import datetime
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from flashbook.sharding import ShardedCase, causal_work, contiguous_positions, zigzag_positions

__all__ = ["zigzag_positions", "contiguous_positions", "ShardedCase", "RingRun", "run_ring",
           "causal_work"]

TIMEOUT_S = 60.0             # one job (every case of one world size), process start included


@dataclasses.dataclass
class RingRun:
    status: str                  # ok | raised | timeout | died
    outputs: dict                # (case index, rank) -> dict(o, lse, sent_bytes, sent_msgs,
                                 #   collectives: the names of those it called, collective_bytes
                                 #   and collective_calls: per name; raised: an expected error)
    error: str = ""              # the traceback of the first worker that raised
    rank: int | None = None      # which worker raised
    wall_s: float = 0.0


# ------------------------------------------------------------------------- the parent

def run_ring(functions: dict, cases: list, world_size: int, timeout: float = TIMEOUT_S,
             entry: str | list = "ring_attention", may_raise=()) -> RingRun:
    """Run ``functions[entry]`` on every case in ``world_size`` fresh processes (this file run
    as a script, one process per rank, as ``torchrun`` starts them), then tear them down.
    ``entry`` may be a list, one name per case; a case whose index is in ``may_raise`` saves
    the exception its call raises (``outputs[i, r]["raised"]``) and the job goes on."""
    entries = [entry] * len(cases) if isinstance(entry, str) else list(entry)
    import json
    import subprocess
    from flashbook import shipping
    job = Path(tempfile.mkdtemp(prefix="flashbook-ring-"))
    (job / "functions.pkl").write_bytes(shipping.dumps(functions))
    (job / "job.json").write_text(json.dumps(dict(
        entries=entries, may_raise=list(may_raise), cases=[dataclasses.asdict(c) for c in cases],
        timeout=timeout, world_size=world_size)))
    src = str(Path(__file__).resolve().parents[3])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [src] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]),
        OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    start = time.monotonic()
    procs = []
    try:
        for rank in range(world_size):
            with open(job / f"log_rank{rank}.txt", "wb") as log:
                procs.append(subprocess.Popen(
                    [sys.executable, str(Path(__file__).resolve()), str(job), str(rank)],
                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                    cwd=job, start_new_session=True))
        status = "ok"
        while True:
            if any(job.glob("error_rank*.txt")):
                status = "raised"
                break
            codes = [p.poll() for p in procs]
            if all(c is not None for c in codes):
                if any(codes):
                    time.sleep(0.2)                      # its error file may be on the way
                    status = "raised" if any(job.glob("error_rank*.txt")) else "died"
                break
            if time.monotonic() - start > timeout:
                status = "timeout"
                break
            time.sleep(0.05)
        _kill_all(procs)
        outputs = {}
        for f in job.glob("out_case*_rank*.pt"):
            i, r = f.stem[len("out_case"):].split("_rank")
            outputs[int(i), int(r)] = torch.load(f, weights_only=True)
        run = RingRun(status, outputs, wall_s=time.monotonic() - start)
        errors = sorted(job.glob("error_rank*.txt"), key=_first_cause)
        if errors:
            run.error = errors[0].read_text()
            run.rank = int(errors[0].stem[len("error_rank"):])
        elif status == "died":
            logs = "".join((job / f"log_rank{r}.txt").read_text(errors="replace")[-1500:]
                           for r in range(world_size))
            run.error = f"exit codes {[p.returncode for p in procs]}\n{logs}"
        return run
    finally:
        _kill_all(procs)
        shutil.rmtree(job, ignore_errors=True)


def _first_cause(path: Path):
    """Sort key of the workers' error files: the student's own exception before the
    connection errors it caused in the other ranks, then the earliest."""
    text = path.read_text(errors="replace")
    return ("Connection closed by peer" in text or "DistBackendError" in text,
            path.stat().st_mtime_ns)


def _kill_all(procs):
    """SIGKILL each worker's process group (each started its own session: only its tree)."""
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                p.kill()
    for p in procs:
        try:
            p.wait(timeout=10)
        except Exception:  # noqa: BLE001 - never let teardown raise
            pass


# ------------------------------------------------------------------------- the worker

def _die_with_parent():
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


COLLECTIVES = ("all_gather", "all_gather_into_tensor", "all_gather_single", "all_gather_object",
               "all_to_all", "all_to_all_single", "broadcast", "all_reduce", "reduce",
               "reduce_scatter", "reduce_scatter_tensor", "gather", "scatter")


def _bytes_to_others(dist, name: str, args, kwargs) -> int:
    """The bytes a collective call sends from this rank to the others, as if sent directly
    (an all-gather of t: t to each of the P - 1 others; an all-to-all: every part but this
    rank's own). Collectives no chapter exercise uses count 0: their names are recorded."""
    P, rank = dist.get_world_size(), dist.get_rank()
    a = list(args) + [None] * 4

    def nbytes(t):
        return t.numel() * t.element_size()
    if name in ("all_gather", "all_gather_into_tensor", "all_gather_single"):
        return (P - 1) * nbytes(kwargs.get("tensor", kwargs.get("input_tensor", a[1])))
    if name == "all_to_all":
        parts = kwargs.get("input_tensor_list", a[1])
        return sum(nbytes(t) for j, t in enumerate(parts) if j != rank)
    if name == "all_to_all_single":
        x = kwargs.get("input", a[1])
        splits = kwargs.get("input_split_sizes", a[3])
        rows = list(splits) if splits else [x.shape[0] // P] * P
        return (sum(rows) - rows[rank]) * nbytes(x) // max(x.shape[0], 1)
    return 0


def _count_traffic(dist, counter: dict):
    """Wrap ``dist.batch_isend_irecv`` to count the messages and bytes this rank sends, and the
    collectives to record their use, their calls and the bytes they send to other ranks (a ring
    passes K/V with point-to-point messages only; Ulysses with all-to-alls).
    Returns the function that puts the originals back."""
    from torch.distributed import distributed_c10d as c10d
    originals = {name: getattr(dist, name) for name in ("batch_isend_irecv", *COLLECTIVES)
                 if hasattr(dist, name)}

    def counted(p2p_op_list):
        for op in p2p_op_list:
            if op.op is c10d.isend:
                counter["msgs"] += 1
                counter["bytes"] += op.tensor.numel() * op.tensor.element_size()
        return originals["batch_isend_irecv"](p2p_op_list)

    def recorded(name):
        def collective(*args, **kwargs):
            counter["collectives"].add(name)
            counter["calls"][name] = counter["calls"].get(name, 0) + 1
            counter["coll_bytes"][name] = (counter["coll_bytes"].get(name, 0)
                                           + _bytes_to_others(dist, name, args, kwargs))
            return originals[name](*args, **kwargs)
        return collective
    dist.batch_isend_irecv = counted
    for name in COLLECTIVES:
        if name in originals:
            setattr(dist, name, recorded(name))

    def restore():
        for name, f in originals.items():
            setattr(dist, name, f)
    return restore


def _worker(job_dir: Path, rank: int):
    import json
    from flashbook import shipping
    _die_with_parent()
    torch.set_num_threads(1)
    import torch.distributed as dist
    spec = json.loads((job_dir / "job.json").read_text())
    world_size, timeout, cases = spec["world_size"], spec["timeout"], spec["cases"]
    entries, may_raise = spec["entries"], set(spec["may_raise"])
    try:
        dist.init_process_group("gloo", init_method=f"file://{job_dir / 'store'}", rank=rank,
                                world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout))
        functions = shipping.loads((job_dir / "functions.pkl").read_bytes())
        for i, (c, entry) in enumerate(zip(cases, entries)):
            case = ShardedCase(**c)
            q, k, v = case.inputs()
            pos = case.positions(world_size, rank)
            counter = {"msgs": 0, "bytes": 0, "collectives": set(), "calls": {},
                       "coll_bytes": {}}
            restore = _count_traffic(dist, counter)
            try:
                out = functions[entry](q[:, :, pos].contiguous(), k[:, :, pos].contiguous(),
                                       v[:, :, pos].contiguous(), pos.clone(), pos.clone(),
                                       case.causal)
            except Exception as e:  # noqa: BLE001 - an error this case expects is its result
                if i not in may_raise:
                    raise
                out = f"{type(e).__name__}: {e}"
            finally:
                restore()
            traffic = {"sent_msgs": counter["msgs"], "sent_bytes": counter["bytes"],
                       "collectives": sorted(counter["collectives"]),
                       "collective_calls": counter["calls"],
                       "collective_bytes": counter["coll_bytes"]}
            if isinstance(out, str):
                torch.save(dict(traffic, raised=out), job_dir / f"out_case{i}_rank{rank}.pt")
                dist.barrier()
                continue
            if not (isinstance(out, tuple) and len(out) == 2
                    and all(isinstance(t, torch.Tensor) for t in out)):
                raise TypeError(f"{entry} must return a tuple (O, LSE) of tensors, got "
                                f"{type(out).__name__}")
            torch.save(dict(traffic, o=out[0].detach().clone(), lse=out[1].detach().clone()),
                       job_dir / f"out_case{i}_rank{rank}.pt")
            dist.barrier()
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - reported to the parent, then this process ends
        text = "".join(traceback.format_exception(e))
        tmp = job_dir / f".error_rank{rank}.tmp"
        tmp.write_text(text[-6000:])
        tmp.rename(job_dir / f"error_rank{rank}.txt")            # atomic: the parent reads whole
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


if __name__ == "__main__":
    sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).parent]
    try:
        _worker(Path(sys.argv[1]), int(sys.argv[2]))
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
