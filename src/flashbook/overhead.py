"""How much host time each chapter's public function adds to its kernel launches, and whether
it waits for the device.

``python -m flashbook.overhead --out overhead.json`` calls the functions the chapters show (from
the checkout's solutions, as a reader calls them: no config, every check on) on small problems,
where the GPU finishes a kernel faster than Python can issue the next one, so a call's wall time
is host time. It records the launches one call makes (``plans.recorded_launches``: every
launcher of the book launches through ``plans.Launch``) and, over ``REPS`` rounds after a
warm-up (the compile), the medians of:

* ``host_us``: one public call (nothing waits for the GPU in the loop);
* ``launch_us``: what the call would cost with no wrapper at all: its output tensors allocated
  the ordinary way (``torch.empty`` of each tensor it returns, ``alloc_us``), then the same
  launches made the ordinary way, ``kernel[grid](...)`` with the same arguments
  (``plans.triton_launch``: Triton binds and specializes every argument); for a
  differentiable function (a call with ``inputs``: Chapter 9's, on inputs that require grad,
  as its training step calls it) also one empty ``torch.autograd.Function.apply`` on its
  tensors (``autograd_us``), which every custom autograd op, flash-attn's ``flash_attn_func``
  included, pays before its kernel; Chapter 9's call on inputs that require no grad records
  nothing, so its floor has no autograd op;
* ``added_us = host_us - launch_us``: what the wrapper adds to that launch (checks, tile choice,
  output buffers); the book's target is at most ``TARGET_US``. Negative when the wrapper's
  remembered plan and direct launch (``plans.Launch``) save more than its own work costs;
* ``direct_us``: the launches alone through the compiled kernels' own launcher (``plans.
  direct_launch``), and ``wrapper_us = host_us - direct_us``, everything else the call does
  (its Python, its output buffers);
* ``profile`` (``--profile``): the costliest Python functions of a call (``profile``);
* ``syncs``: whether one call synchronises with the device (run under
  ``torch.cuda.set_sync_debug_mode("error")``, which raises at any synchronising CUDA call).

On a CPU it runs the same loop in the Triton interpreter (``--quick``: the tests' check that the
tool works); those figures measure the interpreter, not a launch.
"""
from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
import traceback
from pathlib import Path

import torch

from . import plans, results, sources
from .device import current

REPS = 200
TARGET_US = 10.0
PROFILE_TOP = 15


def syncs(call) -> bool | None:
    """Whether ``call()`` synchronises with the device (None on a CPU: nothing to ask)."""
    if not current().gpu:
        return None
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        call()
    except RuntimeError as e:
        if "synchroniz" in str(e):
            return True
        raise
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    return False


class _Nothing(torch.autograd.Function):
    """An autograd op that does nothing: what ``Function.apply`` itself costs."""

    @staticmethod
    def forward(ctx, *tensors):
        return tensors[0]

    @staticmethod
    def backward(ctx, grad):
        return grad


def _tensors(value) -> list:
    """The tensors in a call's result (a tensor, or nested tuples and lists of them)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []


def measure(name: str, call, reps: int = REPS, inputs: tuple = ()) -> dict:
    """One function's row: host, launch, direct and added microseconds per call (medians over
    ``reps`` rounds that time the call and its floor replayed both ways, in turn), launches
    per call, and whether it synchronises. ``inputs``: the tensors of a differentiable
    function, given to the empty autograd op of its floor (none: not differentiable)."""
    for _ in range(3):                      # compile, fill the caches
        call()
    sync = syncs(call)
    with plans.recorded_launches() as made:
        result = call()
    shapes = [(t.shape, t.dtype, t.device) for t in _tensors(result)]

    def alloc():
        for shape, dtype, device in shapes:
            torch.empty(shape, dtype=dtype, device=device)

    def autograd():
        if inputs:
            _Nothing.apply(*inputs)

    def ordinary():
        alloc()
        autograd()
        for launch, tensors in made:
            plans.triton_launch(launch, tensors)

    def direct():
        for launch, tensors in made:
            plans.direct_launch(launch, tensors)
    for _ in range(3):
        ordinary()
    times = {"host": [], "launch": [], "direct": [], "alloc": [], "autograd": []}
    for _ in range(reps):
        for label, f in (("host", call), ("launch", ordinary), ("direct", direct),
                         ("alloc", alloc), ("autograd", autograd)):
            start = time.perf_counter()
            f()
            times[label].append(time.perf_counter() - start)
    if current().gpu:
        torch.cuda.synchronize()
    us = {label: round(statistics.median(xs) * 1e6, 2) for label, xs in times.items()}
    return dict(function=name, host_us=us["host"], launch_us=us["launch"],
                added_us=round(us["host"] - us["launch"], 2), direct_us=us["direct"],
                wrapper_us=round(us["host"] - us["direct"], 2), alloc_us=us["alloc"],
                autograd_us=us["autograd"] if inputs else None, launches=len(made),
                syncs=sync, reps=reps)


def profile(call, reps: int = REPS, top: int = PROFILE_TOP) -> list[dict]:
    """Where one call's host time goes: ``cProfile`` over ``reps`` calls (after the warm-up),
    the ``top`` functions by their own time, in µs per call (``own_us``: in the function
    itself; ``total_us``: with what it calls). The profiler slows every Python call, so the
    figures rank the costs; ``measure``'s are the unprofiled times."""
    import cProfile
    import pstats
    for _ in range(3):
        call()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(reps):
        call()
    prof.disable()
    stats = pstats.Stats(prof).stats
    rows = []
    for (path, line, fn), (_, calls, own, total, _) in stats.items():
        where = f"{Path(path).name}:{line}({fn})" if line else fn
        rows.append(dict(function=where, calls=round(calls / reps, 2),
                         own_us=round(own / reps * 1e6, 2), total_us=round(total / reps * 1e6, 2)))
    return sorted(rows, key=lambda r: -r["own_us"])[:top]


# ------------------------------------------------------------------ the calls

def _rand(*shape, dtype):
    return torch.randn(*shape, device=current().device).to(dtype)


def calls(quick: bool = False) -> dict:
    """{function name: a zero-argument call of it, as the chapter shows it}, on small inputs."""
    gpu = current().gpu
    dt = torch.float16 if gpu else torch.float32
    d, N = (64, 256) if not quick else (16, 32)
    ns = {c: sources.solution_namespace(c) for c in ("ch3", "ch4", "ch5", "ch7", "ch8", "ch9")}
    q, k, v = (_rand(1, 4, N, d, dtype=dt) for _ in range(3))
    lens = (N // 2, N // 4, N // 4)
    cu = torch.tensor([0, N // 2, 3 * N // 4, N], dtype=torch.int32, device=q.device)
    qp, kp, vp = (_rand(N, 8, d, dtype=dt), _rand(N, 2, d, dtype=dt), _rand(N, 2, d, dtype=dt))
    qh = qp[:, :2]              # two query heads, as many as K/V has (a view made once)
    B, max_len = 4, 4 * N
    qd = _rand(B, 1, 8, d, dtype=dt)
    kc, vc = (_rand(B, max_len, 2, d, dtype=dt) for _ in range(2))
    seqlens = torch.tensor([max_len, max_len // 2, 7, max_len - 3], dtype=torch.int32,
                           device=q.device)
    # Chapter 9's call as its training step makes it (``ch9.train``): (B, H, N, d) contiguous
    # with B = 2, inputs that require grad (autograd records it); and with inputs that do not
    dense = tuple(_rand(2, 4, N, d, dtype=dt) for _ in range(3))
    leaves = tuple(t.detach().requires_grad_() for t in dense)
    from flashbook.chapters import ch5
    kpage, vpage, table = ch5.paged_cache(kc, vc, 64)
    table = table.to(q.device)
    out = {
        "ch3.attention": lambda: ns["ch3"]["attention"](q, k, v),
        "ch3.attention_two_tiles": lambda: ns["ch3"]["attention_two_tiles"](q, k, v),
        "ch4.attention_varlen": lambda: ns["ch4"]["attention_varlen"](
            qh, kp, vp, cu, cu, max(lens), max(lens), causal=True),
        "ch5.attention_gqa": lambda: ns["ch5"]["attention_gqa"](
            qp, kp, vp, cu, cu, max(lens), max(lens), causal=True),
        "ch5.attention_gqa_two_tiles": lambda: ns["ch5"]["attention_gqa_two_tiles"](
            qp, kp, vp, cu, cu, max(lens), max(lens), causal=True),
        "ch5.decode (contiguous)": lambda: ns["ch5"]["decode"](qd, kc, vc, seqlens),
        "ch5.decode (paged)": lambda: ns["ch5"]["decode"](qd, kpage, vpage, seqlens, table),
        "ch7.attention_lazy": lambda: ns["ch7"]["attention_lazy"](q, k, v),
        "ch8.decode_split_kv": lambda: ns["ch8"]["decode_split_kv"](qd, kc, vc, seqlens),
        "ch9.flash_attention (forward)": lambda: ns["ch9"]["flash_attention"](
            *leaves, causal=True),
        "ch9.flash_attention (forward, no grad)": lambda: ns["ch9"]["flash_attention"](
            *dense, causal=True),
    }
    out["ch9.flash_attention (forward)"].inputs = leaves        # differentiable: see measure
    if gpu and torch.cuda.get_device_capability() == (9, 0):
        from flashbook import fa3_launch as gluon_fa3
        out["ch6.gluon_fa3.attention_fa3"] = lambda: gluon_fa3.attention_fa3(q, k, v, causal=True)
        # Chapter 6's FP8 forward in Gluon on e4m3 inputs (V transposed), its scales in blocks of
        # 64 query rows and 256 keys, where its default config is its fastest (64 x 256 tiles)
        from flashbook.fa3_fp8_launch import E4M3, attention_fp8_gluon
        q8, k8 = q.to(E4M3), k.to(E4M3)
        vt8 = v.to(E4M3).transpose(-1, -2).contiguous()
        qs, ks, vs = (torch.ones(1, 4, n, device=q.device) for n in (N // 64, N // 256, N // 256))
        out["ch6.attention_fp8_gluon"] = lambda: attention_fp8_gluon(
            q8, qs, k8, ks, vt8, vs, causal=True, block_m=64, block_n=256)
    return out


# The shapes where a user's call was once much slower than the launch under it (flashbook
# issue 30's table): (function, shape, causal).
SPEED_CASES = (
    ("ch6.gluon_fa3.attention_fa3", (1, 16, 16384, 128), True),
    ("ch6.gluon_fa3.attention_fa3", (4, 16, 4096, 128), True),
    ("ch6.gluon_fa3.attention_fa3", (4, 16, 4096, 64), False),
    ("ch6.gluon_fa3.attention_fa3", (4, 16, 4096, 64), True),
    ("ch6.gluon_fa3.attention_fa3", (1, 16, 2048, 128), False),
    ("ch5.decode", (32, 32, 8, 8192, 128), True),         # (B, h_q, h_kv, context, d)
    ("ch5.decode", (8, 32, 8, 32768, 128), True),
    ("ch8.decode_split_kv", (1, 32, 8, 131072, 128), True),
    ("ch8.decode_split_kv", (8, 32, 8, 32768, 128), True),
)


@functools.lru_cache(maxsize=None)
def _namespace(chapter_id: str) -> dict:
    """The chapter's solution, executed once per process (each speed case reuses it)."""
    return sources.solution_namespace(chapter_id)


def _speed_pair(name, shape, causal):
    """(the public call as the chapter shows it, the launch under it) for one SPEED_CASES row."""
    dt = torch.float16
    if name.startswith("ch6"):
        from flashbook import fa3_launch as gluon_fa3
        q, k, v = (_rand(*shape, dtype=dt) for _ in range(3))
        B, H, N, d = shape
        config = gluon_fa3.pick_config(d, dt, causal, B, H, N, N)
        return (lambda: gluon_fa3.attention_fa3(q, k, v, causal=causal),
                lambda: gluon_fa3.attention_fa3(q, k, v, causal=causal, config=config))
    B, h_q, h_kv, context, d = shape
    q = _rand(B, 1, h_q, d, dtype=dt)
    kc, vc = (_rand(B, context, h_kv, d, dtype=dt) for _ in range(2))
    lens = torch.full((B,), context, dtype=torch.int32, device=q.device)
    if name == "ch5.decode":
        from flashbook.bench_setups import quiet
        ns = _namespace("ch5")
        unchecked = quiet(ns)["decode"]
        return (lambda: ns["decode"](q, kc, vc, lens), lambda: unchecked(q, kc, vc, lens))
    from flashbook.chapters.ch8.launch import launch_split_kv
    ns = _namespace("ch8")
    return (lambda: ns["decode_split_kv"](q, kc, vc, lens),
            lambda: launch_split_kv(ns["split_kv_kernel"], ns["combine_kernel"], q, kc, vc, lens))


SPEED_ROUNDS = 3


def speed(cases=SPEED_CASES, rounds: int = SPEED_ROUNDS) -> list[dict]:
    """For each case, ``triton.testing.do_bench`` medians (launched, not replayed from a graph:
    as a user calls it) of the public call and of the launch under it, and their ratio. The two
    are timed in turn, ``rounds`` times, and each keeps the median of its rounds: timed once
    each, one after the other, two calls of the same kernel and config differed by up to 8 %."""
    from triton.testing import do_bench
    rows = []
    for name, shape, causal in cases:
        try:
            public, launch = _speed_pair(name, shape, causal)
            timed = [(do_bench(public, **results.GPU_TIMER), do_bench(launch, **results.GPU_TIMER))
                     for _ in range(rounds)]
            ms_public, ms_launch = (statistics.median(t) for t in zip(*timed))
            rows.append(dict(function=name, shape=list(shape), causal=causal, ms_public=ms_public,
                             ms_launch=ms_launch, ratio=ms_launch / ms_public))
        except Exception:  # noqa: BLE001 - one case's failure must not lose the others
            rows.append(dict(function=name, shape=list(shape), causal=causal,
                             error=traceback.format_exc()[-600:]))
        print(rows[-1], flush=True)
    return rows


def run(quick: bool = False, only: str | None = None, reps: int = REPS,
        profiled: bool = False) -> list[dict]:
    rows = []
    for name, call in calls(quick).items():
        if only and not name.startswith(only):
            continue
        try:
            rows.append(measure(name, call, reps, getattr(call, "inputs", ())))
            if profiled:
                rows[-1]["profile"] = profile(call, reps)
        except Exception:  # noqa: BLE001 - one function's failure must not lose the others
            rows.append(dict(function=name, error=traceback.format_exc()[-600:]))
        print(rows[-1], flush=True)
    return rows


def summary(rows: list[dict]) -> str:
    """A markdown table of a record's rows."""
    lines = ["| function | host µs per call | its launches as `kernel[grid]` | added by the "
             "wrapper | launches through the compiled kernel | launches | synchronises |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['function']} | failed | | | | | |")
            continue
        direct = f"{r['direct_us']:.1f}" if "direct_us" in r else "-"
        lines.append(f"| {r['function']} | {r['host_us']:.1f} | {r['launch_us']:.1f} | "
                     f"{r['added_us']:.1f} | {direct} | {r['launches']:g} | "
                     f"{'-' if r['syncs'] is None else ('yes' if r['syncs'] else 'no')} |")
    return "\n".join(lines)


def speed_summary(rows: list[dict]) -> str:
    """A markdown table of ``speed`` rows."""
    lines = ["| function | shape | causal | public call (ms) | launch (ms) | launch / public |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        shape = "x".join(map(str, r["shape"]))
        if "error" in r:
            lines.append(f"| {r['function']} | {shape} | {r['causal']} | failed | | |")
            continue
        lines.append(f"| {r['function']} | {shape} | {r['causal']} | {r['ms_public']:.4f} | "
                     f"{r['ms_launch']:.4f} | {r['ratio']:.3f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--only", help="functions whose name starts with this (ch5.decode)")
    p.add_argument("--reps", type=int, default=REPS)
    p.add_argument("--commit", help="the commit of the sources, recorded in the provenance")
    p.add_argument("--profile", action="store_true",
                   help="also record each function's costliest Python functions (cProfile)")
    p.add_argument("--speed", action="store_true",
                   help="also time the public calls beside their launches at SPEED_CASES (GPU)")
    args = p.parse_args(argv)
    from flashbook import setup
    setup()
    command = "python -m flashbook.overhead" + (" --quick" if args.quick else "") + \
        (f" --only {args.only}" if args.only else "") + (" --speed" if args.speed else "") + \
        (" --profile" if args.profile else "")
    rows = run(args.quick, args.only, args.reps, args.profile)
    record = dict(provenance=dict(results.provenance(command), commit=args.commit,
                                  target_us=TARGET_US), rows=rows)
    if args.speed:
        record["speed"] = speed()
        print(speed_summary(record["speed"]))
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(summary(rows))
    return 1 if any("error" in r or r.get("syncs") for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
