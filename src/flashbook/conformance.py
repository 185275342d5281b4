"""What each chapter's public function accepts, checked against PyTorch's SDPA on this machine.

``python -m flashbook.conformance --out conformance.json`` calls the functions the chapters show
(from the checkout's solutions, as a reader calls them) over a grid of head dimensions, dtypes,
group sizes and modes (causal, sliding window, packed, paged, both layouts), and records for each
call whether it was taken and right (max |O - SDPA| within the dtype's tolerance; gradients too
for Chapter 9), refused with a ``ValueError`` (its message), or failed otherwise (a bug). The
reference is SDPA in float32 on the same (rounded) inputs, with an explicit boolean mask for the
book's bottom-right causal masks and windows and ``enable_gqa`` for grouped heads; rows that see
no key are 0 in the book's convention (SDPA gives NaN there: they are compared with 0).

``--quick`` runs a few cells of the grid (the CPU test runs it in the interpreter).
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

from . import reference, results, sources
from .device import current

TOL = {torch.float32: 2e-3, torch.float16: 1e-2, torch.bfloat16: 4e-2}   # max |O - SDPA|
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


# ------------------------------------------------------------------ the reference

def _sdpa(q, k, v, mask, scale=None):
    """SDPA in float32 of (B, H_q, N_q, d) q and (B, H_kv, N_k, d) k, v with a boolean (N_q,
    N_k) mask; rows without a visible key give 0."""
    o = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask,
                                       scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return torch.nan_to_num(o, nan=0.0) * mask.any(-1)[..., None]


def _packed_sdpa(q, k, v, lens_q, lens_k, causal, window):
    """Packed (total, H, d) tensors: one SDPA over all tokens with a block-diagonal mask."""
    mask = torch.zeros(sum(lens_q), sum(lens_k), dtype=torch.bool, device=q.device)
    i = j = 0
    for a, b in zip(lens_q, lens_k):
        mask[i:i + a, j:j + b] = reference.visible_mask(a, b, causal=causal, window=window,
                                                        device=q.device)
        i, j = i + a, j + b
    o = _sdpa(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], mask)
    return o[0].transpose(0, 1)


# ------------------------------------------------------------------ one call

def _outcome(call, check):
    """('ok' | 'wrong' | 'refused' | 'error', max error, note) of ``call()`` checked by
    ``check(result) -> max error``."""
    try:
        out = call()
    except ValueError as e:
        return "refused", None, str(e).splitlines()[0][:300]
    except Exception as e:  # noqa: BLE001 - recorded: anything but a ValueError is a bug
        return "error", None, f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
    err = check(out)
    return ("ok" if err is not None and math.isfinite(err) else "wrong"), err, ""


def _err(got, want) -> float:
    return (got.float() - want.float()).abs().max().item() if got.numel() else 0.0


def _rand(*shape, dtype, seed):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device=current().device, dtype=dtype)


# ------------------------------------------------------------------ the functions

def _dense_rows(ns, name, fn_name, grid, kind):
    rows = []
    for d, dt, (N_q, N_k), causal in grid:
        dtype = DTYPES[dt]
        q = _rand(2, 4, N_q, d, dtype=dtype, seed=d + N_q)
        k, v = (_rand(2, 4, N_k, d, dtype=dtype, seed=d + N_k + i) for i in (1, 2))
        mask = reference.visible_mask(N_q, N_k, causal=causal, device=q.device)
        want = _sdpa(q, k, v, mask)
        fn = ns[fn_name]
        if kind == "fa3":
            call = lambda: fn(q, k, v, causal=causal)                          # noqa: E731
        else:
            call = lambda: fn(q, k, v)                                          # noqa: E731
        rows.append(dict(function=name, d=d, dtype=dt, mode="causal" if causal else "none",
                         shape=f"B=2, H=4, N_q={N_q}, N_k={N_k}",
                         **_as(_outcome(call, lambda out: _err(out[0], want)), dtype)))
    return rows


def _packed_rows(ns, name, fn_name, grid, small=False):
    rows = []
    for d, dt, G, mode in grid:
        dtype = DTYPES[dt]
        lens_q, lens_k = ((5, 1, 20), (30, 17, 20)) if small else \
            ((31, 1, 200, 129), (263, 135, 200, 64))
        h_kv = 2 if G < 8 else 1
        h_q = G * h_kv
        q = _rand(sum(lens_q), h_q, d, dtype=dtype, seed=d + G)
        k, v = (_rand(sum(lens_k), h_kv, d, dtype=dtype, seed=d + G + i) for i in (1, 2))
        causal, window = mode == "causal", (64, 0) if mode == "window (64, 0)" else None
        cu_q, cu_k = (torch.tensor([0, *itertools.accumulate(x)], dtype=torch.int32,
                                   device=q.device) for x in (lens_q, lens_k))
        want = _packed_sdpa(q, k, v, lens_q, lens_k, causal, window)
        call = lambda: ns[fn_name](q, k, v, cu_q, cu_k, max(lens_q), max(lens_k),  # noqa: E731
                                   causal=causal, window_size=window or (-1, -1))
        rows.append(dict(function=name, d=d, dtype=dt, mode=mode, G=G,
                         shape=f"seqlens_q={list(lens_q)}, seqlens_k={list(lens_k)}, "
                               f"h_q={h_q}, h_kv={h_kv}",
                         **_as(_outcome(call, lambda out: _err(out[0], want)), dtype)))
    return rows


def _decode_rows(ns, name, grid, split: bool, small=False):
    from flashbook.chapters import ch5
    rows = []
    for d, dt, G, n_new, paged in grid:
        dtype = DTYPES[dt]
        B, max_len, h_kv = 3, 128 if small else 1024, 2
        lengths = (100, 65, max(n_new, 5)) if small else (1000, 257, max(n_new, 5))
        q = _rand(B, n_new, G * h_kv, d, dtype=dtype, seed=d + G)
        kc, vc = (_rand(B, max_len, h_kv, d, dtype=dtype, seed=d + i) for i in (1, 2))
        seqlens = torch.tensor(lengths, dtype=torch.int32, device=q.device)
        want = torch.stack([_sdpa(q[b:b + 1].transpose(1, 2), kc[b:b + 1, :n].transpose(1, 2),
                                  vc[b:b + 1, :n].transpose(1, 2),
                                  reference.visible_mask(n_new, n, causal=True, device=q.device)
                                  )[0].transpose(0, 1) for b, n in enumerate(lengths)])
        if split:
            call = lambda: ns["decode_split_kv"](q, kc, vc, seqlens)           # noqa: E731
        elif paged:
            kp, vp, table = ch5.paged_cache(kc, vc, 64)
            call = lambda: ns["decode"](q, kp, vp, seqlens, table.to(q.device))  # noqa: E731
        else:
            call = lambda: ns["decode"](q, kc, vc, seqlens)                     # noqa: E731
        rows.append(dict(function=name, d=d, dtype=dt, G=G,
                         mode=("paged (64)" if paged else "contiguous") + f", {n_new} new",
                         shape=f"B={B}, lengths={list(lengths)}, h_q={G * h_kv}, h_kv={h_kv}",
                         **_as(_outcome(call, lambda out: _err(out[0], want)), dtype)))
    return rows


def _trainable_rows(ns, grid, small=False):
    """Chapter 9's flash_attention: O and dQ, dK, dV against SDPA's (float32 autograd)."""
    rows = []
    for d, dt, layout, causal in grid:
        dtype = DTYPES[dt]
        N_q, N_k = (24, 40) if small else (300, 517)
        B, h_q, h_kv = 2, 6, 2
        shape = lambda n, h: (B, h, n, d) if layout == "bhnd" else (B, n, h, d)  # noqa: E731
        q = _rand(*shape(N_q, h_q), dtype=dtype, seed=d).requires_grad_()
        k, v = (_rand(*shape(N_k, h_kv), dtype=dtype, seed=d + i).requires_grad_()
                for i in (1, 2))
        do = _rand(*shape(N_q, h_q), dtype=dtype, seed=d + 3)
        dense = (lambda t: t) if layout == "bhnd" else (lambda t: t.transpose(1, 2))
        ref = [t.detach().float().requires_grad_() for t in (q, k, v)]
        o_ref = _sdpa(*(dense(t) for t in ref),
                      reference.visible_mask(N_q, N_k, causal=causal, device=q.device))
        grads_ref = torch.autograd.grad(o_ref, ref, dense(do).float())

        def call():
            o, lse = ns["flash_attention"](q, k, v, causal, None, layout=layout,
                                           return_lse=True)
            return o, lse, torch.autograd.grad(o, (q, k, v), do)

        def check(out):
            o, lse, grads = out
            scale = max(1.0, max(g.abs().max().item() for g in grads_ref))
            return max([_err(dense(o), o_ref)] + [_err(g, w) / scale
                                                 for g, w in zip(grads, grads_ref)])
        rows.append(dict(function="ch9.flash_attention (forward + backward)", d=d, dtype=dt,
                         mode=f"{'causal' if causal else 'none'}, layout={layout}",
                         G=h_q // h_kv, shape=f"B={B}, h_q={h_q}, h_kv={h_kv}, N_q={N_q}, "
                                              f"N_k={N_k}",
                         **_as(_outcome(call, check), dtype)))
    return rows


def _as(outcome, dtype) -> dict:
    status, err, note = outcome
    if status == "ok" and err > TOL[dtype]:
        status = "wrong"
    return dict(status=status, max_err=err, tol=TOL[dtype], note=note)


# ------------------------------------------------------------------ the grid

def run(quick: bool = False, only: str | None = None, done=None) -> list[dict]:
    """The rows of every job (of chapter ``only``); ``done(rows)`` after each job."""
    gpu = current().gpu
    chapter = only.split(".")[0] if only else None
    dims = (16,) if quick else (32, 64, 128, 96, 256)
    dts = ("fp32",) if quick else ("fp16", "bf16", "fp32")
    dense_n = [(40, 70)] if quick else [(1000, 1000), (37, 1500), (1500, 257)]
    G_s = (3,) if quick else (1, 3, 7, 8)
    modes = ("causal",) if quick else ("none", "causal", "window (64, 0)")
    ns = {c: sources.solution_namespace(c) for c in ("ch3", "ch4", "ch5", "ch7", "ch8", "ch9")
          if not only or chapter == c}
    jobs = {   # "chapter.function": the calls; --only ch5 runs every ch5 job
        "ch3.attention": lambda: _dense_rows(
            ns["ch3"], "ch3.attention", "attention",
            itertools.product(dims, dts, dense_n, (False,)), "dense"),
        "ch3.attention_two_tiles": lambda: _dense_rows(
            ns["ch3"], "ch3.attention_two_tiles", "attention_two_tiles",
            itertools.product(dims, dts, dense_n, (False,)), "dense"),
        "ch4.attention_varlen": lambda: _packed_rows(
            ns["ch4"], "ch4.attention_varlen", "attention_varlen",
            itertools.product(dims, dts, (1,), modes), quick),
        "ch5.attention_gqa": lambda: _packed_rows(
            ns["ch5"], "ch5.attention_gqa", "attention_gqa",
            itertools.product(dims, dts, G_s, modes), quick),
        "ch5.attention_gqa_two_tiles": lambda: _packed_rows(
            ns["ch5"], "ch5.attention_gqa_two_tiles", "attention_gqa_two_tiles",
            itertools.product(dims, dts, G_s, modes), quick),
        "ch5.decode": lambda: _decode_rows(
            ns["ch5"], "ch5.decode",
            itertools.product(dims, dts, G_s, (1, 4) if not quick else (2,), (False, True)),
            split=False, small=quick),
        "ch7.attention_lazy": lambda: _dense_rows(
            ns["ch7"], "ch7.attention_lazy", "attention_lazy",
            itertools.product(dims, dts, dense_n, (False,)), "dense"),
        "ch8.decode_split_kv": lambda: _decode_rows(
            ns["ch8"], "ch8.decode_split_kv", itertools.product(dims, dts, G_s, (1,), (False,)),
            split=True, small=quick),
        "ch9.flash_attention": lambda: _trainable_rows(ns["ch9"], itertools.product(
            dims, dts, ("bhnd", "bnhd"), (True,) if quick else (False, True)), quick),
    }
    if gpu and not quick and (not only or chapter == "ch6"):
        from flashbook import fa3_launch as gluon_fa3
        jobs["ch6.gluon_fa3.attention_fa3"] = lambda: _dense_rows(
            {"f": gluon_fa3.attention_fa3}, "ch6.gluon_fa3.attention_fa3", "f",
            itertools.product(dims, dts, dense_n, (False, True)), "fa3")
    rows = []
    for name, job in jobs.items():
        if only and only not in (name, name.split(".")[0]):
            continue
        start = time.monotonic()
        try:
            got = job()
        except Exception:  # noqa: BLE001 - one function's crash must not lose the others
            got = [dict(function=name, status="error", note=traceback.format_exc()[-600:])]
        rows += got
        print(f"{name}: {len(got)} calls, {time.monotonic() - start:.0f} s, "
              f"{sum(r['status'] == 'ok' for r in got)} ok, "
              f"{sum(r['status'] == 'refused' for r in got)} refused, "
              f"{sum(r['status'] in ('wrong', 'error') for r in got)} wrong or failed",
              flush=True)
        if done is not None:
            done(rows)
    return rows


def summary(rows: list[dict]) -> str:
    """A markdown table: per function, the head dims, dtypes and modes it took (and was right
    on), how many calls were refused, and how many were wrong or failed."""
    out = ["| function | taken and right: d | dtypes | modes | G | ok | refused | wrong or failed |",
           "|---|---|---|---|---|---|---|---|"]
    for fn in dict.fromkeys(r["function"] for r in rows):
        mine = [r for r in rows if r["function"] == fn]
        ok = [r for r in mine if r["status"] == "ok"]

        def values(key, among=ok):
            return "; ".join(str(v) for v in sorted({r[key] for r in among if key in r},
                                                    key=lambda v: (str(type(v)), v))) or "-"
        out.append(f"| {fn} | {values('d')} | {values('dtype')} | {values('mode')} | "
                   f"{values('G')} | {len(ok)} | "
                   f"{sum(r['status'] == 'refused' for r in mine)} | "
                   f"{sum(r['status'] in ('wrong', 'error') for r in mine)} |")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path)
    p.add_argument("--summary", type=Path, metavar="RECORD",
                   help="print the markdown table of a record (no calls are made)")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--only", help="one chapter (ch5) or one function (ch5.decode)")
    p.add_argument("--commit", help="the commit of the sources, recorded in the provenance")
    args = p.parse_args(argv)
    if args.summary:
        print(summary(json.loads(args.summary.read_text())["rows"]))
        return 0
    if args.out is None:
        p.error("--out is required")
    from flashbook import setup
    setup()
    command = ("python -m flashbook.conformance" + (" --quick" if args.quick else "")
               + (f" --only {args.only}" if args.only else ""))

    def write(rows):   # after each function, so a time limit keeps the finished ones
        record = dict(provenance=dict(results.provenance(command), commit=args.commit),
                      rows=rows)
        args.out.write_text(json.dumps(record, indent=1) + "\n")
    rows = run(args.quick, args.only, done=write)
    write(rows)
    return 1 if any(r["status"] in ("wrong", "error") for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
