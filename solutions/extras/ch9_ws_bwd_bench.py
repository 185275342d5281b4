"""Check and time the warp-specialized Gluon backward (``ch9_gluon_ws_bwd.py``, beside this
file) on an H100/H200 against fp32 autograd, cuDNN's SDPA backward and the one-kernel Gluon
backward (``ch9_gluon_bwd.py``). Course material, like the kernels; run from a checkout:

    python solutions/extras/ch9_ws_bwd_bench.py                      # every case, default configs
    python solutions/extras/ch9_ws_bwd_bench.py --configs 64,2 64,3  # also sweep BLOCK_M,STAGES
    python solutions/extras/ch9_ws_bwd_bench.py --quick              # small shapes (odd, GQA)
    python solutions/extras/ch9_ws_bwd_bench.py --ablation           # each switch off in turn
    python solutions/extras/ch9_ws_bwd_bench.py --cs336 [--record F] # forward + backward, d = 64
    python solutions/extras/ch9_ws_bwd_bench.py --record OUT.json --commit SHA  # with provenance
The ablation measured on an H100 at f879615 (head-major launch order the default) is
``src/flashbook/data/ws_bwd/h100.json``, this script's record, unedited.
Each case runs in a child process with a time limit, so a hang or a crash spoils one case only;
a child prints its row as "ROW " + JSON, which the parent collects.
"""
import argparse
import dataclasses
import hashlib
import importlib.util
import json
import math
import shlex
import subprocess
import sys
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from flashbook import results
from flashbook.bench import time_ms

ROOT = Path(__file__).resolve().parent


def load(rel):
    path = ROOT / rel
    spec = importlib.util.spec_from_file_location("course_" + path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


WS = load("ch9_gluon_ws_bwd.py")
try:
    OLD = load("ch9_gluon_bwd.py")
except Exception as e:                                   # noqa: BLE001
    print("could not load ch9_gluon_bwd.py:", e)
    OLD = None

# (B, H_q, H_kv, N, d)
SHAPES = [(1, 16, 16, 16384, 128), (4, 16, 16, 4096, 64), (1, 32, 8, 8192, 128)]
QUICK = [(1, 4, 4, 1000, 128), (2, 4, 4, 777, 64), (1, 8, 2, 1024, 128)]


def forward(q, k, v, causal, scale):
    """O and the natural-log LSE (B, H, N) from PyTorch's flash forward (k, v expanded for GQA)."""
    g = q.shape[1] // k.shape[1]
    ke, ve = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    out = torch.ops.aten._scaled_dot_product_flash_attention(q, ke, ve, 0.0, causal, False,
                                                            scale=scale)
    return out[0].contiguous(), out[1].float().contiguous()


def reference(q, k, v, do, causal, scale, heads_kv=1):
    """fp32 autograd of SDPA's math on batch 0, the first ``heads_kv`` kv heads (their group)."""
    g = q.shape[1] // k.shape[1]
    qs = q[:1, :heads_kv * g].float().requires_grad_()
    ks = k[:1, :heads_kv].float().requires_grad_()
    vs = v[:1, :heads_kv].float().requires_grad_()
    with sdpa_kernel(SDPBackend.MATH):
        o = F.scaled_dot_product_attention(qs, ks.repeat_interleave(g, 1),
                                           vs.repeat_interleave(g, 1), is_causal=causal,
                                           scale=scale)
    return torch.autograd.grad(o, (qs, ks, vs), do[:1, :heads_kv * g].float())


def errors(got, want, g, heads_kv=1):
    dq, dk, dv = got
    parts = (dq[:1, :heads_kv * g], dk[:1, :heads_kv], dv[:1, :heads_kv])
    out = []
    for name, a, b in zip(("dQ", "dK", "dV"), parts, want):
        err = (a.float() - b).abs().max().item()
        rel = err / max(b.abs().max().item(), 1e-6)
        out.append((name, err, rel, bool(torch.isfinite(a).all())))
    return out


def bench(fn):
    return time_ms(fn)          # the book's GPU timer, the one provenance() names


def cudnn_bwd_ms(q, k, v, do, causal, scale):
    g = q.shape[1] // k.shape[1]
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        try:
            o = F.scaled_dot_product_attention(*leaves, is_causal=causal, scale=scale,
                                               enable_gqa=g > 1)
            note = ""
        except Exception:                                # noqa: BLE001  cuDNN without GQA
            leaves = [leaves[0]] + [t.detach().repeat_interleave(g, 1).requires_grad_()
                                    for t in leaves[1:]]
            o = F.scaled_dot_product_attention(*leaves, is_causal=causal, scale=scale)
            note = " (k, v expanded)"
        return bench(lambda: torch.autograd.grad(o, leaves, do, retain_graph=True)), note


def tflops(B, H, N, d, causal, ms):
    flop = 2.5 * 4 * B * H * N * N * d / (2 if causal else 1)
    return flop / ms / 1e9


def run_case(shape, dtype, causal, configs):
    B, H, Hkv, N, d = shape
    g = H // Hkv
    tag = f"{shape} {str(dtype)[6:]} causal={causal}"
    print(f"\n=== {tag}", flush=True)
    row = dict(shape=list(shape), dtype=str(dtype)[6:], causal=causal, tflops={}, ms={},
               max_rel_err={})
    scale = 1 / math.sqrt(d)
    q, k, v, do = inputs(shape, dtype)
    o, lse = forward(q, k, v, causal, scale)
    want = reference(q, k, v, do, causal, scale, heads_kv=1 if g > 1 else 2)
    heads_kv = 1 if g > 1 else 2
    results = {}
    for cfg in [None] + configs:
        name = f"ws {cfg.BLOCK_M},{cfg.STAGES}" if cfg else "ws default"
        try:
            got = WS.ws_backward(q, k, v, o, lse, do, causal, scale, config=cfg)
            torch.cuda.synchronize()
            errs = errors(got, want, g, heads_kv)
            print(f"  {name}: " + "  ".join(
                f"{n} max|err| {e:.3e} (rel {r:.1e}{'' if ok else ' NaN/inf!'})"
                for n, e, r, ok in errs), flush=True)
            ms = bench(lambda: WS.ws_backward(q, k, v, o, lse, do, causal, scale, config=cfg))
            results[name] = ms
            row["max_rel_err"][name] = max(r if ok else math.inf for _, _, r, ok in errs)
            print(f"  {name}: {ms:.3f} ms  {tflops(B, H, N, d, causal, ms):.0f} TFLOP/s",
                  flush=True)
        except Exception as e:                           # noqa: BLE001
            print(f"  {name}: FAILED {type(e).__name__}: {str(e)[:3000]}", flush=True)
            traceback.print_exc(limit=3)
    try:
        ms, note = cudnn_bwd_ms(q, k, v, do, causal, scale)
        results["cudnn"] = ms
        print(f"  cudnn bwd{note}: {ms:.3f} ms  {tflops(B, H, N, d, causal, ms):.0f} TFLOP/s",
              flush=True)
    except Exception as e:                               # noqa: BLE001
        print(f"  cudnn: FAILED {type(e).__name__}: {str(e)[:500]}", flush=True)
    if OLD is not None:
        try:
            ke, ve = (t.repeat_interleave(g, 1).contiguous() for t in (k, v))
            got = OLD.gluon_backward(q, ke, ve, o, lse, do, causal, scale)
            ms = bench(lambda: OLD.gluon_backward(q, ke, ve, o, lse, do, causal, scale))
            results["gluon_bwd"] = ms
            print(f"  gluon_backward (one kernel{', k/v expanded' if g > 1 else ''}): {ms:.3f} ms"
                  f"  {tflops(B, H, N, d, causal, ms):.0f} TFLOP/s", flush=True)
        except Exception as e:                           # noqa: BLE001
            print(f"  gluon_backward: FAILED {type(e).__name__}: {str(e)[:500]}", flush=True)
    if "cudnn" in results:
        best = min((ms, n) for n, ms in results.items() if n.startswith("ws")) if any(
            n.startswith("ws") for n in results) else None
        if best:
            print(f"  best ws ({best[1]}) / cudnn speed: {results['cudnn'] / best[0]:.2f}x",
                  flush=True)
    row["ms"] = results
    row["tflops"] = {n: tflops(B, H, N, d, causal, ms) for n, ms in results.items()}
    print("ROW " + json.dumps(row), flush=True)
    del q, k, v, do, o, lse
    torch.cuda.empty_cache()


def inputs(shape, dtype):
    """q, k, v, dO: torch.randn, seed 0."""
    B, H, Hkv, N, d = shape
    torch.manual_seed(0)
    return (torch.randn(B, h, N, d, device="cuda", dtype=dtype) for h in (H, Hkv, Hkv, H))


ABLATION_SHAPE = (1, 16, 16, 16384, 128)
SWITCHES = ("longest_first", "dq_wait_late", "setmaxnreg")


def run_ablation(causal):
    """Every switch of WsBwdConfig flipped in turn against the default, at ABLATION_SHAPE fp16; each
    variant's gradients checked against the fp32 reference before it is timed."""
    B, H, Hkv, N, d = shape = ABLATION_SHAPE
    print(f"\n=== ablation {shape} float16 causal={causal}", flush=True)
    q, k, v, do = inputs(shape, torch.float16)
    scale = 1 / math.sqrt(d)
    o, lse = forward(q, k, v, causal, scale)
    want = reference(q, k, v, do, causal, scale, heads_kv=2)
    base = WS.ws_bwd_config(d, causal)
    row = dict(shape=list(shape), dtype="float16", causal=causal, ms={}, tflops={},
               max_rel_err={})
    for switch in ("",) + SWITCHES:            # the default, then each switch flipped
        flipped = not getattr(base, switch) if switch else None
        cfg = dataclasses.replace(base, **{switch: flipped}) if switch else base
        name = f"{switch} {'on' if flipped else 'off'}" if switch else "default"
        try:
            got = WS.ws_backward(q, k, v, o, lse, do, causal, scale, config=cfg)
            rel = max(r if ok else math.inf for _, _, r, ok in errors(got, want, 1, 2))
            del got
            ms = bench(lambda: WS.ws_backward(q, k, v, o, lse, do, causal, scale, config=cfg))
        except Exception as e:                           # noqa: BLE001
            print(f"  {name}: FAILED {type(e).__name__}: {str(e)[:2000]}", flush=True)
            continue
        row["ms"][name], row["max_rel_err"][name] = ms, rel
        row["tflops"][name] = tflops(B, H, N, d, causal, ms)
        print(f"  {name}: {ms:.3f} ms  {row['tflops'][name]:.0f} TFLOP/s  max rel err "
              f"{rel:.1e}", flush=True)
    baselines = [("cudnn", lambda: cudnn_bwd_ms(q, k, v, do, causal, scale)[0])]
    if OLD is not None:           # the same five GEMMs, every warp doing every job: no roles
        baselines.append(("one kernel, no warp specialization", lambda: bench(
            lambda: OLD.gluon_backward(q, k, v, o, lse, do, causal, scale))))
    for name, timed in baselines:
        try:
            ms = timed()
        except Exception as e:                           # noqa: BLE001
            print(f"  {name}: FAILED {type(e).__name__}: {str(e)[:2000]}", flush=True)
            continue
        row["ms"][name], row["tflops"][name] = ms, tflops(B, H, N, d, causal, ms)
        print(f"  {name}: {ms:.3f} ms  {row['tflops'][name]:.0f} TFLOP/s", flush=True)
    print("ROW " + json.dumps(row), flush=True)


CS336_SHAPE = (1, 16, 16, 16384, 64)        # CS336's leaderboard: bf16, causal, d_model 1024


def run_cs336():
    """Forward + backward at CS336_SHAPE bf16 causal: Chapter 6's Gluon forward (as a user calls
    it, ``attention_fa3``) then this backward, against cuDNN's forward and backward through
    autograd; the gradients checked against fp32 autograd first."""
    from flashbook.fa3_launch import attention_fa3
    B, H, Hkv, N, d = shape = CS336_SHAPE
    print(f"\n=== forward + backward {shape} bfloat16 causal=True", flush=True)
    q, k, v, do = inputs(shape, torch.bfloat16)
    scale = 1 / math.sqrt(d)
    want = reference(q, k, v, do, True, scale, heads_kv=2)

    def ours():
        o, lse = attention_fa3(q, k, v, causal=True)
        return WS.ws_backward(q, k, v, o, lse, do, True, scale)

    rel = max(r if ok else math.inf for _, _, r, ok in errors(ours(), want, 1, 2))
    row = dict(shape=list(shape), dtype="bfloat16", causal=True, fwd_bwd=True,
               max_rel_err={"ours": rel}, ms={}, tflops={})
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            o = F.scaled_dot_product_attention(*leaves, is_causal=True, scale=scale)
        return torch.autograd.grad(o, leaves, do)

    timings = dict(ours=ours, cudnn=cudnn,
                   ours_forward=lambda: attention_fa3(q, k, v, causal=True))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        timings["cudnn_forward"] = lambda: F.scaled_dot_product_attention(q, k, v,
                                                                          is_causal=True)
        for name, fn in timings.items():
            ms = bench(fn)
            # tflops counts the backward's 2.5 x 4 B H N^2 d; the forward is 1.0x, both 3.5x
            flop = tflops(B, H, N, d, True, ms) * (1 if "forward" in name else 3.5) / 2.5
            row["ms"][name], row["tflops"][name] = ms, flop
            print(f"  {name}: {ms:.3f} ms  {flop:.0f} TFLOP/s", flush=True)
    print(f"  ours / cudnn speed (fwd + bwd): {row['ms']['cudnn'] / row['ms']['ours']:.2f}x  "
          f"max rel err {rel:.1e}", flush=True)
    print("ROW " + json.dumps(row), flush=True)
    return row


def print_ablation(rows):
    names = ["default"] + [f"{s} {o}" for s in SWITCHES for o in ("on", "off")] + [
        "one kernel, no warp specialization", "cudnn"]
    print("\n| variant | " + " | ".join(f"causal={r['causal']} TFLOP/s (x default)"
                                       for r in rows) + " |")
    print("|---|" + "---|" * len(rows))
    for n in names:
        cells = [f"{r['tflops'][n]:.0f} ({r['tflops'][n] / r['tflops']['default']:.2f}x)"
                 if n in r["tflops"] and "default" in r["tflops"] else "-" for r in rows]
        print(f"| {n} | " + " | ".join(cells) + " |")


def print_table(rows):
    print("\n| shape (B,Hq,Hkv,N,d) | dtype | causal | ws | cuDNN | gluon_backward | ws/cuDNN |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        t = r["tflops"]
        ratio = f"{t['ws default'] / t['cudnn']:.2f}x" if "ws default" in t and "cudnn" in t \
            else "-"
        cells = [f"{t[n]:.0f}" if n in t else "-" for n in ("ws default", "cudnn", "gluon_bwd")]
        print(f"| {tuple(r['shape'])} | {r['dtype']} | {r['causal']} | " + " | ".join(cells)
              + f" | {ratio} |")


COMMIT = None                # --commit: the checkout's commit, where the copy has no .git


def provenance():
    """Where the numbers come from (``results.provenance``: the GPU, its driver, the versions,
    the date, the timer, the command), with the commit, the kernel's hash and the FLOP count."""
    kernel = ROOT / "ch9_gluon_ws_bwd.py"
    git = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    return results.provenance("python " + shlex.join(sys.argv)) | dict(
        git_commit=COMMIT or git.stdout.strip() or None,
        kernel_sha256=hashlib.sha256(kernel.read_bytes()).hexdigest(),
        flops="2.5 x 4 B H N^2 d (halved when causal)", inputs="torch.randn, seed 0")


def cases(args):
    dtypes = [dict(fp16=torch.float16, bf16=torch.bfloat16)[x] for x in args.dtypes.split(",")]
    shapes = QUICK + ([] if args.quick else SHAPES)
    return [(shape, dtype, causal) for shape in shapes for dtype in dtypes
            for causal in (False, True)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", nargs="*", default=[], help="BLOCK_M,STAGES pairs to sweep")
    ap.add_argument("--quick", action="store_true", help="the small shapes (odd lengths) only")
    ap.add_argument("--dtypes", default="fp16,bf16")
    ap.add_argument("--timeout", type=int, default=240, help="seconds a case may take (a hang)")
    ap.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--ablation", action="store_true",
                    help="only the ablation of WsBwdConfig's switches at (1,16,16384,128) fp16")
    ap.add_argument("--record", metavar="OUT.json", help="write the rows and their provenance")
    ap.add_argument("--commit", help="the commit of the sources, recorded in the provenance")
    ap.add_argument("--cs336", action="store_true",
                    help="forward + backward at (1,16,16384,64) bf16 causal against cuDNN")
    ap.add_argument("--abl", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    global COMMIT
    COMMIT = args.commit
    configs = [WS.WsBwdConfig(*map(int, c.split(","))) for c in args.configs]
    todo = cases(args)
    if args.one is not None:                 # a child: one case
        run_case(*todo[args.one], configs)
        return
    if args.abl is not None:
        run_ablation(bool(args.abl))
        return
    if args.cs336:
        rows = [run_cs336()]
        if args.record:
            Path(args.record).write_text(json.dumps(dict(provenance=provenance(), rows=rows),
                                                    indent=1) + "\n")
            print("recorded", args.record)
        return
    print("torch", torch.__version__, "triton", triton.__version__,
          torch.cuda.get_device_name(), flush=True)
    children = [(f"ablation causal={c}", ["--abl", str(int(c))]) for c in (False, True)] \
        if args.ablation else \
        [(str(case), ["--one", str(i), "--dtypes", args.dtypes, "--configs", *args.configs]
          + (["--quick"] if args.quick else [])) for i, case in enumerate(todo)]
    rows = []
    for name, flags in children:             # each case in its own process: a hang is killed
        try:
            out = subprocess.run([sys.executable, __file__, *flags], timeout=args.timeout,
                                 check=False, capture_output=True, text=True)
        except subprocess.TimeoutExpired as e:
            print((e.stdout or b"").decode() if isinstance(e.stdout, bytes) else e.stdout or "")
            print(f"\n=== {name}: TIMED OUT after {args.timeout} s (a deadlock?)", flush=True)
            continue
        print(out.stdout.replace("\nROW ", "\n(row) ")[:20000], out.stderr[-3000:], flush=True)
        rows += [json.loads(line[4:]) for line in out.stdout.splitlines()
                 if line.startswith("ROW ")]
    (print_ablation if args.ablation else print_table)(rows)
    if args.record:
        Path(args.record).write_text(json.dumps(dict(provenance=provenance(), rows=rows),
                                                indent=1) + "\n")
        print("recorded", args.record)


if __name__ == "__main__":
    main()
