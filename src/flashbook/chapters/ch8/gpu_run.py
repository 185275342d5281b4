"""Chapter 8 on GPUs, in one command: check the split-KV kernels at full size, record the
one-GPU benchmark, and run the ring benchmark on every visible GPU (``torchrun``, NCCL)::

    python -m flashbook.chapters.ch8.gpu_run --out DIR      (from the repository's root)

1. Checks (each prints a line, and a failure stops the run): split-KV decode (the solution's
   kernels) against fp32 torch attention and cuDNN at (B, h_q, h_kv, context, d) = (1, 32, 8,
   131072, 128) fp16, at a context that is not a multiple of the key tile, at batch 4, and
   against Chapter 5's decode; the chosen split count.
2. ``python -m flashbook.chapters.ch8.benchmark --out DIR/bench`` (``DIR/bench/ch8/<gpu>.csv``).
3. With two GPUs or more: ``NCCL_NVLS_ENABLE=0 python -m torch.distributed.run
   --nproc-per-node=<GPUs> -m flashbook.chapters.ch8.ring_bench --out DIR/ring``
   (``DIR/ring/<gpu>x<GPUs>.csv``, ``.json``, ``ring_trace_rank0.json``).
"""
from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import torch


def _reference(q, k, v, lens):
    """fp32 attention of one new token per sequence: q (B, 1, h_q, d), cache (B, L, h_kv, d)."""
    B, _, h_q, d = q.shape
    G = h_q // k.shape[2]
    o = torch.empty(B, 1, h_q, d, dtype=torch.float32, device=q.device)
    q = q.float()
    lse = torch.empty(B, h_q, 1, dtype=torch.float32, device=q.device)
    for b, n in enumerate(lens.tolist()):
        kk = k[b, :n].float().repeat_interleave(G, dim=1).transpose(0, 1)   # (h_q, n, d)
        vv = v[b, :n].float().repeat_interleave(G, dim=1).transpose(0, 1)
        s = torch.einsum("hd,hnd->hn", q[b, 0], kk) / math.sqrt(d)
        lse[b, :, 0] = torch.logsumexp(s, -1)
        o[b, 0] = torch.einsum("hn,hnd->hd", torch.softmax(s, -1), vv)
    return o, lse


CHECKS = ((1, 131072, 131072), (1, 131072, 131000), (4, 32768, 20000))   # (B, context, valid)


def checks(cases=CHECKS, h_q: int = 32, h_kv: int = 8, d: int = 128, device: str = "cuda",
           dtype=torch.float16, tol: float = 4e-3) -> None:
    """Split-KV decode against fp32 torch attention and Chapter 5's decode; raises SystemExit
    when one is off by more than ``tol``."""
    from flashbook import sources
    from flashbook.chapters import ch8
    from flashbook.chapters.ch8.launch import split_config
    from flashbook.device import current
    ns = sources.solution_namespace("ch8")
    ns5 = sources.solution_namespace("ch5")
    for B, context, valid in cases:
        q = torch.randn(B, 1, h_q, d, device=device, dtype=dtype)
        k, v = (torch.randn(B, context, h_kv, d, device=device, dtype=dtype) for _ in range(2))
        lens = torch.full((B,), valid, dtype=torch.int32, device=device)
        o, lse = ns["decode_split_kv"](q, k, v, lens)
        want_o, want_lse = _reference(q, k, v, lens)
        err_o = (o.float() - want_o).abs().max().item()
        err_lse = (lse - want_lse).abs().max().item()
        o5, _ = ns5["decode"](q, k, v, lens)
        err5 = (o.float() - o5.float()).abs().max().item()
        s = ch8.choose_num_splits(B, h_kv, context, ch8.sm_count(),
                                  split_config(current().capability)[0])
        print(f"check split-KV B={B} context={context} valid={valid}: {s} splits, "
              f"max|O-fp32|={err_o:.1e}, max|LSE-fp32|={err_lse:.1e}, max|O-ch5|={err5:.1e}",
              flush=True)
        if not (err_o < tol and err_lse < tol and err5 < tol):
            raise SystemExit("split-KV decode is wrong at full size")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--skip-bench", action="store_true")
    p.add_argument("--skip-ring", action="store_true")
    p.add_argument("--ring-timeout", type=float, default=300.0)
    args = p.parse_args(argv)
    out = Path(args.out)
    if "FLASHBOOK_ROOT" not in os.environ and (Path.cwd() / "solutions").is_dir():
        os.environ["FLASHBOOK_ROOT"] = str(Path.cwd())    # an installed copy finds the sources
    import flashbook
    flashbook.setup()
    t0 = time.monotonic()
    checks()
    print(f"[{time.monotonic() - t0:.0f} s] checks passed", flush=True)
    if not args.skip_bench:
        from flashbook.chapters.ch8 import benchmark
        benchmark.main(["--out", str(out / "bench")])
        print(f"[{time.monotonic() - t0:.0f} s] one-GPU benchmark recorded", flush=True)
    n = torch.cuda.device_count()
    if n >= 2 and not args.skip_ring:
        env = dict(os.environ, NCCL_NVLS_ENABLE="0")
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={n}", "-m",
               "flashbook.chapters.ch8.ring_bench", "--out", str(out / "ring")]
        print(" ".join(cmd), flush=True)
        proc = subprocess.Popen(cmd, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=args.ring_timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)                 # torchrun and its workers: their own group
            proc.wait()
            rc = "killed after its time limit"
        print(f"[{time.monotonic() - t0:.0f} s] ring benchmark on {n} GPUs: exit {rc}", flush=True)
        if rc:
            return rc
    elif n < 2:
        print("one GPU: the ring benchmark needs two or more (device kind nvidia-h200-x2)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
