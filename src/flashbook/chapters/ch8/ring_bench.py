"""Chapter 8's multi-GPU benchmark: ring attention over NCCL on any number of GPUs, beside
Ulysses and all-gather context parallelism (``cp_methods``) and one GPU running the whole problem,
all with the same kernel.

Run with ``torchrun`` (one process per GPU; keep NVLink multicast off)::

    NCCL_NVLS_ENABLE=0 python -m torch.distributed.run --nproc-per-node=2 \\
        -m flashbook.chapters.ch8.ring_bench --out DIR

Problem: one sequence of N tokens (``SIZES``: 32768, 131072, 262144), H = h_kv = 16 heads,
d = 128, fp16, causal and not. Each rank holds N / P tokens of Q, K, V: zig-zag chunks
(r and 2P - 1 - r of 2P) when causal, contiguous slices when not. The kernel is Chapter 5's
fastest forward, ``attention_gqa_two_tiles`` (the two-tile M-fold kernel, G = 1 here), on the
packed ``(tokens, H, d)`` layout; it returns O and LSE.

One ring forward, per rank: K and V sit in one buffer ``(2, N/P, H, d)``; at step t the buffer
from rank r - t is posted onward (``batch_isend_irecv``: send to r + 1, receive from r - 1) before
the step's attention, and waited for after it. Causal zig-zag steps: step 0 is the rank's own
shard, causal; a block from an earlier rank is seen by all local queries through its first chunk
(non-causal, N/P x N/(2P)); a block from a later rank is seen by the local second chunk only
(non-causal, N/(2P) x N/P): every step after the first is the same work on every rank. Each
partial (O, LSE) is merged into fp32 accumulators by ``merge_into_kernel`` (reads 10 bytes and
writes 8 per element updated).

Measured (CUDA events, after a warm-up, median of ``REPS`` runs, the slowest rank): the ring's
time; the same kernel on one GPU over the whole problem (``ch5_two_tiles`` rows); per step, the
time in attention and merge and the time the stream then waited for the K/V transfer (the
exposed communication: the timeline); and the transfer alone, without compute. Exactness: each
rank's O and LSE against the one-GPU result at the same positions; the same for Ulysses (on
contiguous shards) and all-gather (on the ring's shards), timed alike. Rank 0 writes
``DIR/<gpu>x<P>.csv`` (``results.Row``s: ``ch8_ring`` reference, ``ch8_ulysses`` and
``ch8_allgather`` variants, ``ch5_two_tiles`` variant,
and last, once those are written, ``context_parallel`` baselines: PyTorch's prototype around SDPA
where it runs, a noted row where it fails)
and ``<gpu>x<P>.json`` (provenance, world size, NCCL version, per-step timeline), and a
``torch.profiler`` trace of one causal ring forward at N = 131072
(``DIR/ring_trace_rank0.json``, Chrome trace format).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from flashbook.chapters.ch8 import cp_methods

SIZES = (32768, 131072, 262144)
H, D = 16, 128
DTYPE = torch.float16
REPS = 5
TOLERANCE = 1e-2          # max |O_ring - O_one_gpu| in fp16 (different summation order)


def zigzag_ranges(n: int, P: int, rank: int):
    """Token ranges (start, stop) of rank's two zig-zag chunks."""
    c = n // (2 * P)
    a, b = rank, 2 * P - 1 - rank
    return (a * c, (a + 1) * c), (b * c, (b + 1) * c)


def shard(x: torch.Tensor, n: int, P: int, rank: int, causal: bool) -> torch.Tensor:
    """This rank's rows of a (N, H, d) tensor: zig-zag chunks (causal) or a contiguous slice."""
    if causal:
        (a0, a1), (b0, b1) = zigzag_ranges(n, P, rank)
        return torch.cat([x[a0:a1], x[b0:b1]]).contiguous()
    c = n // P
    return x[rank * c:(rank + 1) * c].contiguous()


def shard_lse(lse: torch.Tensor, n: int, P: int, rank: int, causal: bool) -> torch.Tensor:
    return shard(lse.transpose(0, 1), n, P, rank, causal).transpose(0, 1).contiguous()


def _merge_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def merge_into_kernel(O_ACC, LSE_ACC, O_NEW, LSE_NEW, n_new, row0, n_acc,
                          H: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr):
        """Rows row0 .. row0 + n_new of the fp32 accumulators (O (n_acc, H, d), LSE (H, n_acc))
        merged with a partial (O (n_new, H, d), LSE (H, n_new)); program (row block, head)."""
        r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        h = tl.program_id(1)
        d = tl.arange(0, HEAD_DIM)
        ok = r < n_new
        la = tl.load(LSE_ACC + h * n_acc + row0 + r, mask=ok, other=float("-inf"))
        lb = tl.load(LSE_NEW + h * n_new + r, mask=ok, other=float("-inf"))
        m = tl.maximum(la, lb)
        m = tl.where(m == float("-inf"), 0.0, m)
        wa = tl.exp(la - m)
        wb = tl.exp(lb - m)
        tot = wa + wb
        inv = tl.where(tot > 0.0, 1.0 / tot, 0.0)
        pa = O_ACC + ((row0 + r)[:, None] * H + h) * HEAD_DIM + d[None, :]
        pb = O_NEW + (r[:, None] * H + h) * HEAD_DIM + d[None, :]
        oa = tl.load(pa, mask=ok[:, None], other=0.0)
        ob = tl.load(pb, mask=ok[:, None], other=0.0).to(tl.float32)
        tl.store(pa, oa * (wa * inv)[:, None] + ob * (wb * inv)[:, None], mask=ok[:, None])
        tl.store(LSE_ACC + h * n_acc + row0 + r, m + tl.log(tot), mask=ok)
    return merge_into_kernel


class _NoEvent:
    """Stands in for torch.cuda.Event on CPU (the gloo check of this module's ring logic)."""

    def record(self):
        pass

    def elapsed_time(self, other):
        return 0.0


def _event():
    return torch.cuda.Event(enable_timing=True) if torch.cuda.is_available() else _NoEvent()


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


class Ring:
    """One rank's ring attention forward with a given attention function."""

    def __init__(self, attention, n: int, causal: bool):
        self.attention, self.n, self.causal = attention, n, causal
        self.rank, self.P = dist.get_rank(), dist.get_world_size()
        self.merge_kernel = _merge_kernel()
        self.cu = {}
        self.bufs = None

    def _attn(self, q, k, v, causal):
        dev = q.device
        key = (q.shape[0], k.shape[0])
        if key not in self.cu:
            self.cu[key] = (torch.tensor([0, q.shape[0]], dtype=torch.int32, device=dev),
                            torch.tensor([0, k.shape[0]], dtype=torch.int32, device=dev))
        cu_q, cu_k = self.cu[key]
        return self.attention(q, k, v, cu_q, cu_k, q.shape[0], k.shape[0], causal=causal)

    def _merge(self, o_acc, lse_acc, o, lse, row0):
        import triton
        n_new = o.shape[0]
        self.merge_kernel[(triton.cdiv(n_new, 64), H)](o_acc, lse_acc, o, lse, n_new, row0,
                                                      o_acc.shape[0], H=H, HEAD_DIM=D,
                                                      BLOCK_R=64, num_warps=4)

    def step_work(self, q, kv, src):
        """(O, LSE, first row) of this step's partial for the local queries."""
        k, v = kv[0], kv[1]
        if not self.causal:
            o, lse = self._attn(q, k, v, False)
            return o, lse, 0
        half = q.shape[0] // 2
        if src < self.rank:                       # the block's first chunk, all local queries
            o, lse = self._attn(q, k[:half], v[:half], False)
            return o, lse, 0
        o, lse = self._attn(q[half:], k, v, False)   # a later rank: the local second chunk
        return o, lse, half

    def forward(self, q, kv, timeline: list | None = None):
        """Ring attention over the local q (n, H, d) and K/V buffer kv (2, n, H, d)."""
        P, rank = self.P, self.rank
        nxt_rank, prv_rank = (rank + 1) % P, (rank - 1) % P
        if getattr(self, "bufs", None) is None or self.bufs[0].shape != kv.shape:
            self.bufs = (torch.empty_like(kv), torch.empty_like(kv))   # kv itself is never
        cur = kv                                                      # received into
        o_acc, lse_acc = None, None
        events = []
        for step in range(P):
            e0 = _event()
            e0.record()
            reqs = []
            if step < P - 1:
                incoming = self.bufs[step % 2]
                reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, cur, nxt_rank),
                                               dist.P2POp(dist.irecv, incoming, prv_rank)])
            if step == 0:                                        # the own shard
                o, lse = self._attn(q, kv[0], kv[1], self.causal)
                o_acc, lse_acc = o.float(), lse
            else:
                src = (rank - step) % P
                o, lse, row0 = self.step_work(q, cur, src)
                self._merge(o_acc, lse_acc, o, lse, row0)
            e1 = _event()
            e1.record()
            for r in reqs:
                r.wait()
            e2 = _event()
            e2.record()
            events.append((e0, e1, e2))
            if step < P - 1:
                cur = incoming
        if timeline is not None:
            timeline.append(events)
        return o_acc.to(q.dtype), lse_acc


def _time(fn, reps: int) -> tuple[float, list]:
    """Median ms of fn() over reps runs (after one warm-up), the slowest rank's (CUDA events;
    on CPU, for the gloo check of this code, every time is 0)."""
    fn()
    _sync()
    times = []
    for _ in range(reps):
        dist.barrier()
        _sync()
        a, b = _event(), _event()
        a.record()
        fn()
        b.record()
        _sync()
        t = torch.tensor([a.elapsed_time(b)], device=_device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times.append(t.item())
    return statistics.median(times), times


def run_case(attention, n: int, causal: bool, reps: int, profile_dir: Path | None = None):
    """Measure one (N, causal): the ring, one GPU, the per-step timeline and exactness."""
    from flashbook.reference import attention_flops
    rank, P = dist.get_rank(), dist.get_world_size()
    dev, dtype = _device(), DTYPE if torch.cuda.is_available() else torch.float32
    g = torch.Generator(device=dev).manual_seed(1234)
    q, k, v = (torch.randn(n, H, D, device=dev, dtype=dtype, generator=g) for _ in range(3))
    cu = torch.tensor([0, n], dtype=torch.int32, device=dev)
    one = lambda: attention(q, k, v, cu, cu, n, n, causal=causal)  # noqa: E731
    t1, _ = _time(one, max(2, reps // 2))
    o_full, lse_full = one()
    ring = Ring(attention, n, causal)
    q_loc = shard(q, n, P, rank, causal)
    kv = torch.stack([shard(k, n, P, rank, causal), shard(v, n, P, rank, causal)]).contiguous()
    o_ring, lse_ring = ring.forward(q_loc, kv)
    err_o = (o_ring.float() - shard(o_full, n, P, rank, causal).float()).abs().max()
    err_lse = (lse_ring - shard_lse(lse_full, n, P, rank, causal)).abs().max()
    # Ulysses on contiguous shards (it needs no zig-zag), all-gather on the ring's shards
    contiguous = [(rank * (n // P), (rank + 1) * (n // P))]
    qc, kc, vc = (shard(t, n, P, rank, False) for t in (q, k, v))
    others = {"ulysses": (lambda: cp_methods.ulysses(attention, qc, kc, vc, causal), False),
              "allgather": (lambda: cp_methods.allgather(
                  attention, q_loc, kv[0], kv[1], causal,
                  zigzag_ranges(n, P, rank) if causal else contiguous), causal)}
    errs = [err_o, err_lse]
    for fn, zigzag in others.values():
        o, lse = fn()
        errs += [(o.float() - shard(o_full, n, P, rank, zigzag).float()).abs().max(),
                 (lse - shard_lse(lse_full, n, P, rank, zigzag)).abs().max()]
    errs = torch.stack(errs)
    dist.all_reduce(errs, op=dist.ReduceOp.MAX)
    o_full = lse_full = q = k = v = one = o = lse = None  # free the one-GPU problem
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    tp, times = _time(lambda: ring.forward(q_loc, kv), reps)
    timeline = []
    ring.forward(q_loc, kv, timeline)
    _sync()
    steps = [dict(step=i, compute_ms=e0.elapsed_time(e1), wait_ms=e1.elapsed_time(e2))
             for i, (e0, e1, e2) in enumerate(timeline[0])]
    spare = torch.empty_like(kv)

    def hop():
        reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, kv, (rank + 1) % P),
                                       dist.P2POp(dist.irecv, spare, (rank - 1) % P)])
        for r in reqs:
            r.wait()
    t_hop, _ = _time(hop, reps) if P > 1 else (0.0, [])
    if profile_dir is not None and rank == 0:
        from torch.profiler import ProfilerActivity, profile
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA]
                                               if torch.cuda.is_available() else [])
        with profile(activities=activities) as prof:
            ring.forward(q_loc, kv)
            _sync()
        prof.export_chrome_trace(str(profile_dir / "ring_trace_rank0.json"))
    elif profile_dir is not None:
        ring.forward(q_loc, kv)
        _sync()
    flops = attention_flops(1, H, n, n, D, causal)
    methods = {f"{name}_ms": _time(fn, reps)[0] for name, (fn, _) in others.items()}
    methods.update(max_err_ulysses=errs[2:4].max().item(), max_err_allgather=errs[4:6].max().item())
    return dict(N=n, causal=causal, world_size=P, ring_ms=tp, ring_runs_ms=times, one_gpu_ms=t1,
                **methods,
                efficiency=t1 / (P * tp) if tp else float("nan"), max_err_o=errs[0].item(),
                max_err_lse=errs[1].item(),
                hop_ms=t_hop, hop_bytes=kv.numel() * kv.element_size(), steps_rank0=steps,
                flops=flops)


def rows_of(cases: list, peak_tflops: float | None):
    from flashbook.results import Row
    out = []
    for c in cases:
        P = c["world_size"]
        base = dict(B=1, H_q=H, H_kv=H, N_q=c["N"], N_k=c["N"], d=D, dtype="float16",
                    causal=c["causal"], gbps=None)
        exposed = sum(s["wait_ms"] for s in c["steps_rank0"])
        others = tuple(
            (f"ch8_{name}", "variant", c[f"{name}_ms"], P,
             f"world_size={P}; {what}; max|O-1gpu| and |LSE-1gpu| {c[f'max_err_{name}']:.1e}"
             + ("; WRONG" if not c[f"max_err_{name}"] < TOLERANCE else ""))
            for name, what in (("ulysses", "contiguous shards, all-to-all of Q, K, V and O"),
                               ("allgather", "all-gather of K and V, "
                                + ("zig-zag" if c["causal"] else "contiguous") + " shards"))
            if f"{name}_ms" in c)
        for kernel, role, ms, gpus, note in others + (
                ("ch8_ring", "reference", c["ring_ms"], P,
                 f"world_size={P}; {'zig-zag' if c['causal'] else 'contiguous'} shards; scaling "
                 f"efficiency {100 * c['efficiency']:.1f} % (1-GPU {c['one_gpu_ms']:.2f} ms); "
                 f"exposed comm {exposed:.2f} ms (rank 0); one hop alone {c['hop_ms']:.2f} ms "
                 f"for {c['hop_bytes'] / 2**20:.0f} MiB; max|O-1gpu|={c['max_err_o']:.1e}, "
                 f"max|LSE-1gpu|={c['max_err_lse']:.1e}"
                 + ("; WRONG" if not c["max_err_o"] < TOLERANCE else "")),
                ("ch5_two_tiles", "variant", c["one_gpu_ms"], 1,
                 "one GPU, the whole problem (the ring's kernel)")):
            tflops = c["flops"] / (ms * 1e-3) / 1e12
            pct = 100 * tflops / (peak_tflops * gpus) if peak_tflops else None
            out.append(Row(kernel=kernel, role=role, ms=ms, tflops=tflops, pct_peak=pct,
                           note=note, **base))
    return out


def reference_attention(q, k, v, cu_q, cu_k, max_q, max_k, causal=False):
    """The kernel's interface, (O (n, H, d), LSE (H, n)), in plain torch: for the CPU check."""
    from flashbook.reference import attention_varlen
    return attention_varlen(q, k, v, cu_q, cu_k, causal=causal)


def cpu_check(n: int = 64, profile_dir: Path | None = None) -> float:
    """This module's ring (zig-zag steps, merges, hops) over gloo with reference attention,
    against one process: the largest error over both masks (all ranks)."""
    rank, P = dist.get_rank(), dist.get_world_size()
    worst = 0.0
    for causal in (True, False):
        g = torch.Generator().manual_seed(7)
        q, k, v = (torch.randn(n, H, D, generator=g) for _ in range(3))
        cu = torch.tensor([0, n], dtype=torch.int32)
        o_full, lse_full = reference_attention(q, k, v, cu, cu, n, n, causal)
        ring = Ring(reference_attention, n, causal)
        kv = torch.stack([shard(k, n, P, rank, causal), shard(v, n, P, rank, causal)])
        o, lse = ring.forward(shard(q, n, P, rank, causal), kv.contiguous())
        err = max((o - shard(o_full, n, P, rank, causal)).abs().max().item(),
                  (lse - shard_lse(lse_full, n, P, rank, causal)).abs().max().item())
        worst = max(worst, err)
    t = torch.tensor([worst])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    for causal in (True, False):                 # the measuring code, end to end (times are 0)
        c = run_case(reference_attention, n, causal, reps=1, profile_dir=profile_dir)
        worst = max(worst, c["max_err_o"], c["max_err_lse"], c["max_err_ulysses"],
                    c["max_err_allgather"])
        if rank == 0:
            rows_of([dict(c, ring_ms=1.0, one_gpu_ms=1.0, ulysses_ms=1.0, allgather_ms=1.0)],
                    None)
    return max(t.item(), worst)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="ring attention over NCCL (run with torchrun)")
    p.add_argument("--out", required=False)
    p.add_argument("--cpu-check", action="store_true",
                   help="gloo on CPU, reference attention: check the ring logic, no timing")
    p.add_argument("--sizes", type=int, nargs="*", default=list(SIZES))
    p.add_argument("--no-context-parallel", dest="context_parallel", action="store_false",
                   help="skip PyTorch's prototype context_parallel rows")
    p.add_argument("--reps", type=int, default=REPS)
    args = p.parse_args(argv)
    import flashbook
    flashbook.setup(verbose=False)
    if args.cpu_check:
        dist.init_process_group("gloo")
        err = cpu_check(profile_dir=Path(args.out) if args.out else None)
        if dist.get_rank() == 0:
            print(f"CPU CHECK max error {err:.2e}", flush=True)
        dist.destroy_process_group()
        return 0 if err < 1e-4 else 1
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    import datetime
    dist.init_process_group("nccl", device_id=torch.device("cuda", local),
                            timeout=datetime.timedelta(seconds=300))   # a hung collective aborts
    rank, P = dist.get_rank(), dist.get_world_size()
    from flashbook import results, sources
    from flashbook.bench import gpu_peak
    from flashbook.bench_setups import quiet
    ns = quiet(sources.solution_namespace("ch5"))
    attention = ns["attention_gqa_two_tiles"]
    out = Path(args.out)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    cases = []
    for n in args.sizes:
        for causal in (True, False):
            if n % (2 * P):
                continue
            prof = out if (causal and n == 131072) else None
            c = run_case(attention, n, causal, args.reps, prof)
            cases.append(c)
            if rank == 0:
                print(f"N={n:7d} {'causal    ' if causal else 'non-causal'} P={P}: ring "
                      f"{c['ring_ms']:8.2f} ms, 1 GPU {c['one_gpu_ms']:8.2f} ms, efficiency "
                      f"{100 * c['efficiency']:5.1f} %, exposed comm "
                      f"{sum(s['wait_ms'] for s in c['steps_rank0']):.2f} ms, hop "
                      f"{c['hop_ms']:.2f} ms, max|O-1gpu| {c['max_err_o']:.1e}"
                      + ("  WRONG" if not c["max_err_o"] < TOLERANCE else ""), flush=True)
            torch.cuda.empty_cache()
    if rank == 0:
        peak = gpu_peak()
        slug = f"{results.gpu_slug(torch.cuda.get_device_name(0))}x{P}"
        prov = results.provenance("NCCL_NVLS_ENABLE=" + os.environ.get("NCCL_NVLS_ENABLE", "") +
                                  " python -m torch.distributed.run --nproc-per-node=" + str(P) +
                                  " -m flashbook.chapters.ch8.ring_bench " + " ".join(
                                      argv if argv is not None else sys.argv[1:]))
        prov.update(world_size=P, nccl=".".join(map(str, torch.cuda.nccl.version())),
                    timer=f"CUDA events, median of {args.reps} runs, slowest rank",
                    nccl_nvls_enable=os.environ.get("NCCL_NVLS_ENABLE"),
                    timeline={f"N={c['N']},causal={c['causal']}": c["steps_rank0"]
                              for c in cases})
        rows = rows_of(cases, peak.tensor_tflops if peak else None)
        path = results.write(rows, out, slug, prov)
        print(f"wrote {path}")
    if args.context_parallel:                     # after the rows are safe on disk
        from flashbook.chapters.ch8.cp_baseline import context_parallel_ms, cp_row
        cp_rows = []
        for n in args.sizes:
            for causal in (True, False):
                ms, note = context_parallel_ms(n, causal, args.reps, H, D, DTYPE, _time)
                if rank == 0:
                    cp_rows.append(cp_row(n, causal, P, ms, note, H, D,
                                          peak.tensor_tflops if peak else None))
                    print(f"N={n:7d} {'causal    ' if causal else 'non-causal'} P={P}: "
                          f"context_parallel " + (f"{ms:8.2f} ms" if ms else note), flush=True)
        if rank == 0:
            results.write(rows + cp_rows, out, slug, prov)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
