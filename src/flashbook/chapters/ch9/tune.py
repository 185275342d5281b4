"""Chapter 9 on a GPU in one run: the kernels checked at full size against SDPA, a small sweep
of backward tile configs, then ``flashbook bench ch9`` recorded under ``--out``.

    python -m flashbook.chapters.ch9.tune --out OUT_DIR [--no-bench] [--no-sweep]

Prints one summary at the end: errors against SDPA, the best config of each kernel with its
time, and the backward's TFLOP/s against cuDNN's and the FlashAttention-2 backend's.
"""
from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

import flashbook as fb

SWEEP = {   # (BLOCK_M, BLOCK_N, num_warps, num_stages), besides bwd_config's choice
    "dkdv": ((64, 128, 8, 2), (32, 128, 4, 3), (128, 128, 8, 1), (64, 64, 4, 3)),
    "dq": ((128, 64, 8, 2), (128, 32, 4, 3), (64, 64, 4, 3), (128, 128, 8, 1)),
}


def _grads_err(got, want):
    """max |got - want| / max |want| over dQ, dK, dV."""
    return max(((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
               for a, b in zip(got, want))


def correctness(ns, ch9, torch, lines):
    """Full-size and GQA / packed cases against SDPA (cuDNN, else the default backend)."""
    from flashbook.chapters.ch9.benchmark import ours_fns, sdpa_grads_fn
    ok = True
    for B, Hq, Hkv, N, d, dtype, causal in ((1, 16, 16, 16384, 128, torch.float16, False),
                                           (1, 16, 16, 16384, 128, torch.float16, True),
                                           (1, 16, 16, 16384, 64, torch.bfloat16, True),
                                           (2, 32, 8, 4096, 128, torch.float16, True)):
        g = torch.Generator(device="cuda").manual_seed(1)
        q = torch.randn(B, Hq, N, d, device="cuda", dtype=dtype, generator=g)
        k, v = (torch.randn(B, Hkv, N, d, device="cuda", dtype=dtype, generator=g)
                for _ in range(2))
        do = torch.randn_like(q)
        if Hq == Hkv:
            want = sdpa_grads_fn("sdpa_cudnn", q, k, v, do, causal, "bwd")[1]
            flash = sdpa_grads_fn("sdpa_flash", q, k, v, do, causal, "bwd")[1]
            base = f", sdpa_flash vs cudnn {_grads_err(flash, want):.2e}"
        else:
            qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
            o = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, is_causal=causal,
                                                                 enable_gqa=True)
            want, base = torch.autograd.grad(o, (qq, kk, vv), do), " (SDPA enable_gqa)"
        got = ours_fns(ns, q, k, v, do, causal)[2]
        err = _grads_err(got, want)
        bad = err > 2e-2
        ok &= not bad
        lines.append(f"{'WRONG ' if bad else ''}grads B={B} Hq={Hq} Hkv={Hkv} N={N} d={d} "
                     f"{str(dtype)[6:]} causal={causal}: rel err vs cudnn {err:.2e}{base}")
        del q, k, v, do, got, want
        torch.cuda.empty_cache()
    # packed: three sequences against SDPA per sequence
    lens = (3000, 1, 5000)
    Hq, Hkv, d = 8, 2, 128
    tot = sum(lens)
    q = torch.randn(tot, Hq, d, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(tot, Hkv, d, device="cuda", dtype=torch.float16) for _ in range(2))
    do = torch.randn_like(q)
    cu = torch.tensor([0, lens[0], lens[0] + lens[1], tot], device="cuda", dtype=torch.int32)
    qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
    o, _ = ns["FlashAttentionFn"].apply(qq, kk, vv, cu, cu, max(lens), max(lens), True, None)
    got = torch.autograd.grad(o, (qq, kk, vv), do)
    # the references of every sequence, gathered into packed tensors and compared once: a
    # sequence of one key has dQ = dK = 0 exactly, so an error relative to it alone is noise
    want = [torch.zeros_like(t) for t in got]
    for a, b in zip(cu.tolist(), cu.tolist()[1:]):
        xs = [t[a:b].transpose(0, 1)[None].detach().requires_grad_() for t in (q, k, v)]
        ob = torch.nn.functional.scaled_dot_product_attention(*xs, is_causal=True,
                                                              enable_gqa=True)
        ref = torch.autograd.grad(ob, xs, do[a:b].transpose(0, 1)[None])
        for w, r in zip(want, ref):
            w[a:b] = r[0].transpose(0, 1)
    worst = _grads_err(got, want)
    ok &= worst <= 2e-2
    lines.append(f"{'WRONG ' if worst > 2e-2 else ''}grads packed {lens} GQA 8/2 causal through "
                 f"FlashAttentionFn: rel err vs SDPA per sequence {worst:.2e}")
    return ok


def sweep(ns, ch9, torch, lines, causal=False, only=None):
    """Time each candidate config of each kernel at (1, 16, 16384, 128) fp16 (``only``: a dict
    kernel -> configs to time instead of the default and SWEEP's)."""
    import triton.testing
    B, H, N, d = 1, 16, 16384, 128
    q, k, v, do = (torch.randn(B * N, H, d, device="cuda", dtype=torch.float16)
                   for _ in range(4))
    cu = torch.tensor([0, N], device="cuda", dtype=torch.int32)
    o, lse = ch9.forward(q, k, v, cu, cu, N, N, causal=causal)
    delta = ch9.launch_preprocess(ns["bwd_preprocess_kernel"], o, do)
    best = {}
    for which, launch, kern, n in (("dkdv", ch9.launch_dkdv, "bwd_dkdv_kernel", N),
                                   ("dq", ch9.launch_dq, "bwd_dq_kernel", N)):
        default = ch9.bwd_config(which, d, torch.float16, torch.cuda.get_device_capability())
        configs = only[which] if only else (default, *(ch9.BwdConfig(*c) for c in SWEEP[which]))
        for cfg in dict.fromkeys(configs):
            fn = lambda: launch(ns[kern], q, k, v, do, lse, delta, cu, cu, n, causal=causal,
                                config=cfg)
            try:
                fn()
                ms = triton.testing.do_bench(fn, warmup=5, rep=40)
            except Exception as e:  # noqa: BLE001 - a config that does not compile or fit
                lines.append(f"  sweep {which} {cfg}: failed ({type(e).__name__}: "
                             f"{str(e).splitlines()[0][:80] if str(e) else ''})")
                continue
            tag = " (default)" if cfg == default else ""
            lines.append(f"  sweep {which} causal={causal} {cfg}: {ms:.3f} ms{tag}")
            if which not in best or ms < best[which][1]:
                best[which] = (cfg, ms)
    for which, (cfg, ms) in best.items():
        lines.append(f"BEST {which} d=128 fp16 causal={causal}: {cfg} {ms:.3f} ms")
    return best


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True)
    p.add_argument("--no-bench", action="store_true")
    p.add_argument("--no-sweep", action="store_true")
    args = p.parse_args(argv)
    backend = fb.setup()
    import torch
    from flashbook import results, sources
    from flashbook.chapters import ch9
    if not backend.gpu:
        sys.exit("needs a CUDA GPU")
    ns = sources.solution_namespace("ch9")
    lines, t0 = [], time.time()
    ok = correctness(ns, ch9, torch, lines)
    lines.append(f"[correctness done at {time.time() - t0:.0f} s]")
    if not args.no_sweep:
        best = sweep(ns, ch9, torch, lines, False)
        defaults = {w: ch9.bwd_config(w, 128, torch.float16, torch.cuda.get_device_capability())
                    for w in ("dkdv", "dq")}
        sweep(ns, ch9, torch, lines, True,
              only={w: (defaults[w], *([best[w][0]] if w in best else [])) for w in defaults})
        lines.append(f"[sweep done at {time.time() - t0:.0f} s]")
    if not args.no_bench:
        command = "python -m flashbook.chapters.ch9.tune " + " ".join(
            map(shlex.quote, sys.argv[1:]))
        path = results.record(ch9.BENCHMARKED, Path(args.out) / "bench", command)
        rows = results.read(path)
        print(results.table(rows))
        by = {(r.kernel, r.causal, r.d): r for r in rows}
        for causal, d in ((False, 128), (True, 128)):
            mine = by.get(("ch9_bwd", causal, d))
            for base in ("sdpa_cudnn_bwd", "sdpa_flash_bwd"):
                other = by.get((base, causal, d))
                if mine and other and mine.tflops and other.tflops:
                    lines.append(f"bwd causal={causal}: ch9 {mine.tflops:.0f} TFLOP/s vs {base} "
                                 f"{other.tflops:.0f} -> {mine.tflops / other.tflops:.2f}x")
        for r in rows:
            if r.d == 64:
                lines.append(f"CS336 config (1,16,16384,64 bf16 causal fwd+bwd): {r.kernel} "
                             f"{r.ms if r.ms is None else round(r.ms, 3)} ms {r.note}")
        lines.append(f"[bench done at {time.time() - t0:.0f} s] wrote {path}")
    print("\n==== ch9 summary ====")
    print("\n".join(lines))
    print("ALL GRADIENTS OK" if ok else "SOME GRADIENTS WRONG")


if __name__ == "__main__":
    main()
