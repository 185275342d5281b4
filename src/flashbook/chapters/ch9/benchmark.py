"""Chapter 9 benchmark: the backward alone and forward + backward against SDPA's cuDNN and
FlashAttention-2 backends (``flashbook bench ch9`` on a GPU).

Cases (``CASES``): (B, H, N, d) = (1, 16, 16384, 128) fp16, causal and not, and the public
CS336 (2025) leaderboard's configuration, (1, 16, 16384, 64) bf16 causal, forward + backward.
Inputs ``torch.randn`` (seeded), dO too. Rows per case:

* ``ch9_bwd`` (reference): the solution's ``attention_backward`` (preprocess, dK/dV, dQ) on
  the packed ``(B*N, H, d)`` tensors, from O and LSE of Chapter 5's forward (``ch9.forward``).
* ``ch9_fwdbwd`` (reference): ``ch9.forward`` without its host-side argument checks, then
  ``attention_backward``: what ``FlashAttentionFn`` runs, without autograd's bookkeeping.
* ``ch9_bwd_atomic``, ``ch9_bwd_fused`` (variants, backward cases): the one-kernel backward of
  the course's ``solutions/extras/ch9_one_kernel.py`` (not in the package: it holds Exercise
  1's answer), K/V-stationary, adding dQ into fp32 by scalar atomics (``dq_tma=False``) or by
  TMA reduces (FlashAttention-3's way); each note says whether two runs gave the same bits.
  Timed only with the chapter's own solution (``flashbook bench ch9``, ``tune``): a notebook's
  benchmark cell (``run(ns=globals())``) reads nothing of the checkout and leaves them out.
* ``ch9_bwd_gluon`` (variant, backward cases): the course's ``solutions/extras/ch9_gluon_bwd.py``,
  FlashAttention-3's one-kernel structure in Triton Gluon (sm_90 only; elsewhere unmeasured,
  the note says why), on the dense tensors, from the same forward's O and LSE.
* ``ch9_bwd_gluon_ws`` (variant, backward cases): the course's
  ``solutions/extras/ch9_gluon_ws_bwd.py``, FlashAttention-3's warp-specialized backward
  (producer warp, two consumer warpgroups), likewise; its gradients are checked at full size
  against SDPA's (cuDNN's where it runs) before it is timed, and a relative difference above
  ``WS_RTOL`` stops the run (``WrongGradients``).
* a ``public`` row beside ``ch9_fwdbwd``: the same training step as a reader writes it,
  ``flash_attention`` and ``torch.autograd.grad`` (checks and autograd included), launched.
* ``sdpa_cudnn_bwd``, ``sdpa_flash_bwd``: ``torch.autograd.grad`` of one SDPA call on one
  backend (the forward outside the timing, ``retain_graph``); ``sdpa_cudnn_fwdbwd``,
  ``sdpa_flash_fwdbwd``: the forward and that grad, both timed.

FLOPs: ``reference.attention_flops`` (4 N_q N_k d per head, halved when causal) times 2.5 for
a backward and 3.5 for forward + backward (the convention of FlashAttention-2's and cuDNN's
reports; our dQ kernel's recomputation is not credited). ``gbps``: ``bench.attention_bytes``
(Q, K, V, O once) / time, a lower bound. Every row is timed from a CUDA graph where it can be
captured (``bench_setups.measure``); the note of each of our rows gives
``max|dQ|dK|dV - sdpa_cudnn|`` (the first SDPA backend that accepts, if cuDNN refuses).
"""
from __future__ import annotations

import warnings

import torch

from flashbook import sources
from flashbook.bench import attention_bytes, free_cuda_cache, public_row, sdpa
from flashbook.bench_setups import measure
from flashbook.reference import attention_flops
from flashbook.results import Row, table

from .forward import forward
from .dense import from_packed, to_packed

__all__ = ["run", "table", "CASES", "GRAPH_TIMER", "bwd_flops", "sdpa_grads_fn", "ours_fns",
           "one_kernel_fn", "gluon_fn", "gluon_ws_fn", "WrongGradients", "WS_RTOL"]

GRAPH_TIMER = True
CASES = ((1, 16, 16384, 128, torch.float16, False, ("bwd", "fwdbwd")),
         (1, 16, 16384, 128, torch.float16, True, ("bwd", "fwdbwd")),
         (1, 16, 16384, 64, torch.bfloat16, True, ("fwdbwd",)))     # CS336 leaderboard
BASELINES = ("sdpa_cudnn", "sdpa_flash")
BWD_FACTOR, FWDBWD_FACTOR = 2.5, 3.5


def bwd_flops(B, H, N, d, causal, what: str) -> float:
    """FLOPs credited to a backward ("bwd") or forward + backward ("fwdbwd")."""
    f = attention_flops(B, H, N, N, d, causal)
    return f * (BWD_FACTOR if what == "bwd" else FWDBWD_FACTOR)


def sdpa_grads_fn(backend: str, q, k, v, do, causal: bool, what: str):
    """fn() timing SDPA's backward ("bwd": grad of a forward run once) or forward + backward
    on one backend, and the gradients of one call (dense (B, H, N, d))."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    run = sdpa(backend)

    def fwd():
        return run(q, k, v, causal)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        o = fwd()
    grads = torch.autograd.grad(o, (q, k, v), do, retain_graph=True)
    if what == "bwd":
        return (lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True)), grads
    return (lambda: torch.autograd.grad(fwd(), (q, k, v), do)), grads


def ours_fns(ns, q, k, v, do, causal: bool):
    """(bwd fn, fwdbwd fn, dense grads) of the solution on dense (B, H, N, d) inputs, run on
    their packed (B*N, H, d) copies (made once, not timed)."""
    B, H, N, d = q.shape
    pq, pk, pv, pdo = (to_packed(t) for t in (q, k, v, do))
    cu = torch.arange(B + 1, dtype=torch.int32, device=q.device) * N
    o, lse = forward(pq, pk, pv, cu, cu, N, N, causal=causal)
    backward = ns["attention_backward"]

    def bwd():
        return backward(pq, pk, pv, o, lse, pdo, cu, cu, N, N, causal)

    def fwdbwd():
        o2, lse2 = forward(pq, pk, pv, cu, cu, N, N, causal=causal, validate=False)
        return backward(pq, pk, pv, o2, lse2, pdo, cu, cu, N, N, causal)
    grads = tuple(from_packed(g, B) for g in bwd())
    return bwd, fwdbwd, grads


ONE_KERNEL = "extras/ch9_one_kernel.py"


def one_kernel_fn(q, k, v, do, causal: bool, dq_tma: bool, want=None, want_from=None):
    """(fn, note) of the one-kernel backward (``ONE_KERNEL``, dQ by TMA reduces or by scalar
    atomics): the note says whether two runs gave the same bits and, given SDPA's gradients
    ``want``, the largest difference from them."""
    fused_backward = sources.course_module(ONE_KERNEL).fused_backward
    B, H, N, d = q.shape
    pq, pk, pv, pdo = (to_packed(t) for t in (q, k, v, do))
    cu = torch.arange(B + 1, dtype=torch.int32, device=q.device) * N
    o, lse = forward(pq, pk, pv, cu, cu, N, N, causal=causal)

    def bwd():
        return fused_backward(pq, pk, pv, o, lse, pdo, cu, cu, N, N, causal, dq_tma=dq_tma)
    first, second = bwd(), bwd()
    same = all(torch.equal(a, b) for a, b in zip(first, second))
    err = "" if want is None else \
        "; " + _err_note(tuple(from_packed(g, B) for g in first), want, want_from)
    return bwd, f"two runs {'bitwise identical' if same else 'differ in dQ bits'}{err}"


GLUON = "extras/ch9_gluon_bwd.py"


def gluon_fn(q, k, v, do, causal: bool, want=None, want_from=None):
    """(fn, note) of the Gluon one-kernel backward (``GLUON``, sm_90 only) on dense
    ``(B, H, N, d)`` inputs, from Chapter 5's forward O and LSE; the note as
    ``one_kernel_fn``'s."""
    gluon_backward = sources.course_module(GLUON).gluon_backward
    o, lse = _dense_forward(q, k, v, causal)

    def bwd():
        return gluon_backward(q, k, v, o, lse, do, causal=causal)
    first, second = bwd(), bwd()
    same = all(torch.equal(a, b) for a, b in zip(first, second))
    err = "" if want is None else "; " + _err_note(first, want, want_from)
    return bwd, f"two runs {'bitwise identical' if same else 'differ in dQ bits'}{err}"


GLUON_WS = "extras/ch9_gluon_ws_bwd.py"
WS_RTOL = 2e-2          # max|ours - SDPA's| / max|SDPA's|, of each of dQ, dK, dV


class WrongGradients(AssertionError):
    """A kernel's gradients differ from SDPA's at the benchmark's own inputs."""


def _dense_forward(q, k, v, causal: bool):
    """O (B, H, N, d) and the natural-log LSE (B, H, N) of Chapter 5's forward, dense."""
    B, H, N, d = q.shape
    pq, pk, pv = (to_packed(t) for t in (q, k, v))
    cu = torch.arange(B + 1, dtype=torch.int32, device=q.device) * N
    o, lse = forward(pq, pk, pv, cu, cu, N, N, causal=causal)
    return from_packed(o, B).contiguous(), lse.view(H, B, N).transpose(0, 1).contiguous()


def check_grads(kernel: str, grads, want, name) -> str:
    """The note of ``_err_note``, after checking each of dQ, dK, dV against SDPA's gradients
    ``want`` (from backend ``name``): raises ``WrongGradients`` above ``WS_RTOL`` or on a
    NaN; says so in the note when there is nothing to check against."""
    if want is None:
        return "gradients unchecked: no SDPA gradients"
    for label, a, b in zip(("dQ", "dK", "dV"), grads, want):
        rel = (a.float() - b.float()).abs().max().item() / max(b.abs().max().item(), 1e-6)
        if not rel <= WS_RTOL:
            raise WrongGradients(f"{kernel}: {label} differs from {name}'s by {rel:.2e} of its "
                                 f"largest value (tolerance {WS_RTOL}) at {tuple(a.shape)}")
    return _err_note(grads, want, name)


def gluon_ws_fn(q, k, v, do, causal: bool, want=None, want_from=None, wrong=None):
    """(fn, note) of the warp-specialized Gluon backward (``GLUON_WS``, sm_90 only) on dense
    inputs, from Chapter 5's forward O and LSE; gradients checked by ``check_grads`` first (a
    failure is appended to ``wrong``, then raised)."""
    ws_backward = sources.course_module(GLUON_WS).ws_backward
    o, lse = _dense_forward(q, k, v, causal)

    def bwd():
        return ws_backward(q, k, v, o, lse, do, causal=causal)
    try:
        note = check_grads("ch9_bwd_gluon_ws", bwd(), want, want_from)
    except WrongGradients as e:
        (wrong if wrong is not None else []).append(e)
        raise
    return bwd, note


def training_step(ns, q, k, v, do, causal: bool):
    """The chapter's ``flash_attention`` forward and its gradients through autograd, as a
    model's training step runs them: checks on, no config, the Function's bookkeeping
    included."""
    leaves = tuple(t.detach().requires_grad_() for t in (q, k, v))

    def step():
        o = ns["flash_attention"](*leaves, causal=causal)
        return torch.autograd.grad(o, leaves, do)
    return step


def _err_note(grads, want, name) -> str:
    if want is None:
        return "no SDPA gradients to compare"
    err = max((a.float() - b.float()).abs().max().item() for a, b in zip(grads, want))
    return f"max|dQ,dK,dV-{name}|={err:.2e}"


def _row(kernel, role, fn_setup, B, H, N, d, dtype, causal, what) -> Row:
    return measure(kernel, role, fn_setup, B=B, H_q=H, N_q=N, d=d, dtype=dtype, causal=causal,
                   flops=bwd_flops(B, H, N, d, causal, what),
                   nbytes=attention_bytes(B, H, N, N, d, dtype.itemsize))


def run(cases=CASES, device="cuda", ns: dict | None = None,
        course_designs: bool | None = None) -> list[Row]:
    """The rows of every case; ``ns``: the namespace whose ``attention_backward`` is timed (a
    notebook's ``globals()``; default the chapter's solution, from the checkout).
    ``course_designs``: time the one-kernel designs of the course's ``solutions/extras`` too
    (default: only when timing the chapter's solution, so a notebook needs no checkout)."""
    if course_designs is None:
        course_designs = ns is None
    ns = ns or sources.solution_namespace("ch9")
    rows = []
    for B, H, N, d, dtype, causal, kinds in cases:
        g = torch.Generator(device=device).manual_seed(0)
        q, k, v, do = (torch.randn(B, H, N, d, device=device, dtype=dtype, generator=g)
                       for _ in range(4))
        want, want_from, base_rows = None, None, []
        for name in BASELINES:
            for what in kinds:
                def setup(name=name, what=what):
                    fn, grads = sdpa_grads_fn(name, q, k, v, do, causal, what)
                    return fn, ""
                base_rows.append(_row(f"{name}_{what}", "baseline", setup, B, H, N, d, dtype,
                                      causal, what))
            if want is None:
                try:
                    want = sdpa_grads_fn(name, q, k, v, do, causal, "bwd")[1]
                    want_from = name
                except Exception:  # noqa: BLE001 - a backend that refuses: try the next
                    free_cuda_cache()
        for what in kinds:
            def setup(what=what):
                bwd, fwdbwd, grads = ours_fns(ns, q, k, v, do, causal)
                return (bwd if what == "bwd" else fwdbwd), _err_note(grads, want, want_from)
            rows.append(_row(f"ch9_{what}", "reference", setup, B, H, N, d, dtype, causal, what))
            if what == "fwdbwd":        # a training step as a reader writes it, launched
                rows.append(public_row(rows[-1], training_step(ns, q, k, v, do, causal),
                                       "flash_attention(q, k, v, causal), then "
                                       "torch.autograd.grad(o, (q, k, v), dO)"))
        for kernel, dq_tma in (("ch9_bwd_atomic", False), ("ch9_bwd_fused", True)):
            if "bwd" in kinds and course_designs:
                rows.append(_row(kernel, "variant",
                                 lambda t=dq_tma: one_kernel_fn(q, k, v, do, causal, t, want,
                                                                want_from),
                                 B, H, N, d, dtype, causal, "bwd"))
        if "bwd" in kinds and course_designs:
            rows.append(_row("ch9_bwd_gluon", "variant",
                             lambda: gluon_fn(q, k, v, do, causal, want, want_from),
                             B, H, N, d, dtype, causal, "bwd"))
            wrong = []
            rows.append(_row("ch9_bwd_gluon_ws", "variant",
                             lambda: gluon_ws_fn(q, k, v, do, causal, want, want_from, wrong),
                             B, H, N, d, dtype, causal, "bwd"))
            if wrong:                   # measure() keeps a failure in the note: not this one
                raise wrong[0]
        rows += base_rows
        want = None                     # SDPA's gradients: free them before the next case
        free_cuda_cache()
    return rows
