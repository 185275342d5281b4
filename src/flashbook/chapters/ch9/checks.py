"""Chapter 9's graded checks: the preprocessing (D), the dK/dV kernel, the dQ kernel, and the
autograd Function (gradcheck in float64, then against SDPA's and the float64 reference's
gradients in fp32 and fp16, causal, packed and GQA included).

Every kernel check runs the student's kernel through ``launch`` on seeded inputs whose O and LSE
come from the float64 reference (so a kernel is graded alone), in CPU mode under the
out-of-bounds guard, and compares with float64 autograd gradients (``grads``).
"""
from __future__ import annotations

import contextlib
import dataclasses
import types

import torch

from flashbook import reference
from flashbook.case_sweeps import sweep
from flashbook.cases import AttnCase
from flashbook.check import CheckFailure, assert_close, no_nan, report, require_implemented, \
    run_student
from flashbook.device import current

from . import launch
from .dense import from_packed, to_packed
from .grads import backward_inputs

__all__ = ["check_preprocess", "check_dkdv", "check_dq", "check_autograd", "check_training",
           "kernel_cases", "autograd_cases", "training_cases", "GRAD_TOL"]

# (atol, rtol) of a gradient against float64, by input dtype: fp16 rounds P and dS to fp16
# before the matmuls (as every fp16 backward does), so its gradients carry ~1e-3 errors.
GRAD_TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (1e-2, 1e-2),
            torch.bfloat16: (5e-2, 5e-2)}

_HINTS = {
    "D": "D_i = sum_c dO[i, c] * O[i, c] in fp32, one value per (head, token).",
    "dV": "dV = P^T dO with P = exp(S * scale - LSE) recomputed per tile; LSE is in natural log "
          "(multiply it by log2(e) before exp2).",
    "dK": "dK = dS^T Q * scale with dS = P * (dP - D), dP = dO V^T; the scale once, at the end; "
          "with GQA each K/V head sums the dK of its G query heads; causal tiles need the mask.",
    "dQ": "dQ = dS K * scale accumulated in fp32 over the key tiles, the scale once; dS = "
          "P * (dP - D); causal tiles need the mask.",
}


def kernel_cases(hidden: bool = False) -> list[AttnCase]:
    """Packed cases (16 x 16 tiles in CPU mode): partial tiles, causal with N_q != N_k, GQA."""
    if not hidden:
        return [
            AttnCase("one sequence", seqlens=(40,), H_q=2, d=16),
            AttnCase("causal, N_q < N_k", seqlens=(24,), seqlens_k=(40,), H_q=2, d=16,
                     causal=True),
            AttnCase("GQA, causal, packed", seqlens=(17, 33), seqlens_k=(20, 33), H_q=4, H_kv=2,
                     d=16, causal=True),
            AttnCase("fp16 GQA", seqlens=(40,), H_q=4, H_kv=2, d=32, dtype=torch.float16),
            AttnCase("MQA, causal, N_q > N_k (empty rows)", seqlens=(40,), seqlens_k=(24,),
                     H_q=4, H_kv=1, d=16, causal=True, scale=0.3),
        ]
    return [
        AttnCase("packed with an empty sequence", seqlens=(9, 0, 30), seqlens_k=(12, 3, 30),
                 H_q=4, H_kv=2, d=16, causal=True),
        AttnCase("fp16 causal, large logits", seqlens=(48,), H_q=2, d=16, causal=True,
                 dtype=torch.float16, logit_boost=3.0),
    ]


def _with_sweep(kernel: str, hidden: bool) -> list[tuple[AttnCase, launch.BwdConfig | None]]:
    """The fixed cases with the launcher's tiles, then seeded random packed shapes (lengths next
    to tile edges, G 1-8, causal or not) with the H200's fp16 tiles of ``kernel`` ("dkdv" or
    "dq"), in CPU mode too: a bug at the edge of a GPU-sized tile shows on a CPU."""
    tile = launch.bwd_config(kernel, 16, torch.float16, (9, 0))
    cfg = None if current().gpu else dataclasses.replace(tile, num_stages=1)
    random_cases = sweep("random", seed=(90 if hidden else 9) + (kernel == "dq"),
                         n=3 if hidden else 2, block_m=tile.BLOCK_M, block_n=tile.BLOCK_N,
                         tiles=2, windows=False)
    return [(c, None) for c in kernel_cases(hidden)] + [(c, cfg) for c in random_cases]


def _tiles(cfg) -> str:
    return f", {cfg.BLOCK_M}x{cfg.BLOCK_N} tiles" if cfg else ""


def _packed_args(case, device):
    """(cu_seqlens_q, cu_seqlens_k on ``device``, the inputs' device; max_seqlen_q, _k)."""
    return (case.cu_seqlens().to(device), case.cu_seqlens(keys=True).to(device),
            max(case.seqlens), max(case.seqlens_k or case.seqlens))


def _compare(name, got, want, case, what):
    no_nan(got, f"{what}, {name}")
    atol, rtol = GRAD_TOL[case.dtype]
    dims = ("token", "h", "col") if got.dim() == 3 else ("b", "h", "row", "col")
    assert_close(got, want, what=f"{what}, {name}", dims=dims, dtype=case.dtype,
                 atol=atol, rtol=rtol, hint=_HINTS[name])


def _reference_delta(o, do):
    """D = rowsum(dO * O) in float64, (h, total_q): what the preprocessing must give, and what
    the dK/dV and dQ checks hand the kernels so that each part is graded alone."""
    return (do.double() * o.double()).sum(-1).transpose(0, 1)


def check_preprocess(preprocess_kernel, hidden: bool = False) -> None:
    """Exercise 1a: D = rowsum(dO * O) (h, total_q) in fp32 from ``preprocess_kernel``, on the
    kernel cases' packed tensors (token counts that are not a multiple of its block)."""
    title = "preprocess kernel (D)"
    require_implemented(preprocess_kernel, f"{title}: bwd_preprocess_kernel")
    guard = current().capability is None
    cases = kernel_cases(hidden)
    for i, case in enumerate(cases):
        q, k, v, do, o, lse, _ = backward_inputs(case, 10 * i + 1)
        what = f"{title}, case {case.describe()}"
        delta = run_student(launch.launch_preprocess, preprocess_kernel, o, do, what=what,
                            guard=guard)
        want_d = _reference_delta(o, do)
        assert_close(delta, want_d, what=f"{what}, D", dims=("h", "token"), dtype=torch.float32,
                     atol=1e-4, rtol=1e-4, hint=_HINTS["D"])
    report(title, len(cases), hidden=hidden)


def check_dkdv(step, dkdv_kernel, hidden: bool = False) -> None:
    """Exercise 1b: dK, dV from ``dkdv_kernel`` (which calls ``step``, the loop body); D is
    computed here in float64, so this part stands alone."""
    title = "dK/dV kernel"
    for kern, label in ((step, "dkdv_step"), (dkdv_kernel, "bwd_dkdv_kernel")):
        require_implemented(kern, f"{title}: {label}")
    cases = _with_sweep("dkdv", hidden)
    guard = current().capability is None
    for i, (case, cfg) in enumerate(cases):
        q, k, v, do, o, lse, (dq, dk, dv) = backward_inputs(case, 10 * i + 1)
        cu_q, cu_k, max_q, max_k = _packed_args(case, q.device)
        what = f"{title}, case {case.describe()}{_tiles(cfg)}"
        delta = _reference_delta(o, do).float().contiguous()
        got_dk, got_dv = run_student(launch.launch_dkdv, dkdv_kernel, q, k, v, do, lse, delta,
                                     cu_q, cu_k, max_k, causal=case.causal, scale=case.scale,
                                     config=cfg, what=what, guard=guard)
        _compare("dV", got_dv, dv, case, what)
        _compare("dK", got_dk, dk, case, what)
    report(title, len(cases), hidden=hidden)


def check_dq(step, dq_kernel, hidden: bool = False) -> None:
    """Exercise 2: dQ from ``dq_kernel`` (which calls ``step``); D is computed here in float64,
    so this exercise stands alone."""
    title = "dQ kernel"
    require_implemented(step, f"{title}: dq_step")
    require_implemented(dq_kernel, f"{title}: bwd_dq_kernel")
    cases = _with_sweep("dq", hidden)
    guard = current().capability is None
    for i, (case, cfg) in enumerate(cases):
        q, k, v, do, o, lse, (dq, dk, dv) = backward_inputs(case, 10 * i + 2)
        cu_q, cu_k, max_q, max_k = _packed_args(case, q.device)
        what = f"{title}, case {case.describe()}{_tiles(cfg)}"
        delta = _reference_delta(o, do).float().contiguous()
        got = run_student(launch.launch_dq, dq_kernel, q, k, v, do, lse, delta, cu_q, cu_k,
                          max_q, causal=case.causal, scale=case.scale, config=cfg, what=what,
                          guard=guard)
        _compare("dQ", got, dq, case, what)
    report(title, len(cases), hidden=hidden)


# ------------------------------------------------------------------ the autograd Function

_REFERENCE_PATH = ("tiled_backward", "tiled_backward_packed")   # the chapter's PyTorch backward


@contextlib.contextmanager
def kernel_path_only(function, what: str):
    """While fp16/fp32 cases run, the float64 path of the student's notebook (the reference
    forward, Section 2's tiled PyTorch backward) raises: those cases must run the kernels. The
    names are looked up in ``function``'s globals, the notebook's own, so this holds under the
    grader's fresh modules too."""
    ns = getattr(function, "__globals__", None) or getattr(
        getattr(function, "forward", None), "__globals__", {})
    saved = {}

    def refuse(name):
        def call(*args, **kwargs):
            raise CheckFailure(f"{what}: it ran {name} for a non-float64 case; float16 and "
                               "float32 must run the kernel path (ch9.forward and your "
                               "attention_backward), the float64 path is for gradcheck only.")
        return call
    for name in _REFERENCE_PATH:
        if callable(ns.get(name)):
            saved[name] = ns[name]
            ns[name] = refuse(name)
    for name, value in list(ns.items()):
        if value is reference:                   # `from flashbook import reference`
            saved[name] = value
            ns[name] = types.SimpleNamespace(**{
                **vars(reference), "attention": refuse("reference.attention"),
                "attention_varlen": refuse("reference.attention_varlen")})
    try:
        yield
    finally:
        ns.update(saved)


def _outputs(result, q, what):
    """apply()'s (O, LSE): O shaped like q that requires grad, LSE (h_q, total_q) that does not
    (marked non-differentiable)."""
    if not (isinstance(result, tuple) and len(result) == 2
            and all(isinstance(t, torch.Tensor) for t in result)):
        raise CheckFailure(f"{what}: apply() must return (O, LSE), two tensors, got "
                           f"{type(result).__name__}.")
    o, lse = result
    if not o.requires_grad:
        raise CheckFailure(f"{what}: O must require grad (it is the differentiable output).")
    want = (q.shape[1], q.shape[0])
    if tuple(lse.shape) != want or lse.requires_grad:
        raise CheckFailure(f"{what}: LSE must be (h_q, total_q) = {want}, marked "
                           f"non-differentiable (ctx.mark_non_differentiable(lse)); got shape "
                           f"{tuple(lse.shape)}, requires_grad={lse.requires_grad}.")
    return o, lse


def _grads_of(fn_apply, case, q, k, v, do, what):
    """(dQ, dK, dV, LSE) of apply() on the packed case."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    cu_q, cu_k, max_q, max_k = _packed_args(case, q.device)
    o, lse = _outputs(run_student(fn_apply, q, k, v, cu_q, cu_k, max_q, max_k, case.causal,
                                  case.scale, what=what), q, what)
    run_student(o.backward, do, what=what + ", backward")
    return [t.grad if t.grad is not None else torch.zeros_like(t) for t in (q, k, v)] + [lse]


def _sdpa_grads(q, k, v, do, causal, scale):
    """SDPA's float64 gradients of dense (B, H, N, d) tensors (N_q == N_k when causal)."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    o = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=causal, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return torch.autograd.grad(o, (q, k, v), do.double())


def autograd_cases(hidden: bool = False):
    """(gradcheck cases in float64, dense cases against SDPA, packed cases against the
    reference)."""
    gc = [AttnCase("gradcheck, GQA causal, packed", seqlens=(5, 7), seqlens_k=(6, 7), H_q=2,
                   H_kv=1, d=4, causal=True, scale=0.7, dtype=torch.float64)]
    dense = [AttnCase("vs SDPA, causal GQA", B=2, H_q=4, H_kv=2, N_q=24, d=16, causal=True,
                      scale=0.2),
             AttnCase("vs SDPA, fp16", B=1, H_q=2, N_q=40, d=32, dtype=torch.float16)]
    packed = [AttnCase("packed, causal GQA", seqlens=(17, 0, 30), seqlens_k=(20, 4, 30), H_q=4,
                       H_kv=2, d=16, causal=True)]
    if hidden:
        gc = [AttnCase("gradcheck, non-causal, N_q > N_k", seqlens=(9,), seqlens_k=(4,), H_q=3,
                       H_kv=3, d=4, dtype=torch.float64)]
        dense = [AttnCase("vs SDPA, MQA causal fp16", B=1, H_q=4, H_kv=1, N_q=33, d=16,
                          causal=True, dtype=torch.float16)]
        packed = [AttnCase("packed, causal, N_q > N_k, fp16", seqlens=(30, 8), seqlens_k=(12, 8),
                           H_q=2, d=16, causal=True, dtype=torch.float16, scale=0.5)]
    return gc, dense, packed


def check_autograd(function, hidden: bool = False) -> None:
    """Exercise 3: ``function.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
    max_seqlen_k, causal, softmax_scale)`` on packed tensors, differentiable in q, k, v."""
    title = "FlashAttentionFn"
    if not hasattr(function, "apply"):
        raise CheckFailure(f"{title}: expected a torch.autograd.Function subclass.")
    require_implemented(function.forward, f"{title}.forward")
    require_implemented(function.backward, f"{title}.backward")
    gc, dense, packed = autograd_cases(hidden)
    n = 0
    for i, case in enumerate(gc):
        q, k, v, do, *_ = backward_inputs(case, 30 + i)
        cu_q, cu_k, max_q, max_k = _packed_args(case, q.device)
        what = f"{title}, gradcheck (float64), case {case.describe()}"
        inputs = tuple(t.detach().clone().requires_grad_() for t in (q, k, v))
        try:
            _outputs(function.apply(*inputs, cu_q, cu_k, max_q, max_k, case.causal, case.scale),
                     q, what)
            ok = torch.autograd.gradcheck(
                lambda a, b, c: function.apply(a, b, c, cu_q, cu_k, max_q, max_k, case.causal,
                                               case.scale)[0], inputs, fast_mode=True,
                raise_exception=True)
        except NotImplementedError:
            raise CheckFailure(f"{what}: not implemented yet.") from None
        except RuntimeError as e:
            raise CheckFailure(f"{what}: the analytic gradients differ from finite differences "
                               f"(check the scale saved for the backward, the order of the "
                               f"returned gradients, the causal flag):\n{str(e)[:600]}") from None
        n += bool(ok)
    for i, case in enumerate(dense):
        q, k, v = (t for t in backward_inputs(case, 40 + i)[:3])
        do = backward_inputs(case, 40 + i)[3]
        what = f"{title}, case {case.describe()}"
        want = _sdpa_grads(q, k, v, do, case.causal, case.scale)
        packed_case = dataclasses.replace(case, seqlens=(case.N_q,) * case.B, B=case.B)
        with kernel_path_only(function, what):
            got = _grads_of(function.apply, packed_case,
                            *(to_packed(t) for t in (q, k, v, do)), what)[:3]
        for name, g, w in zip(("dQ", "dK", "dV"), got, want):
            _compare(name, from_packed(g, case.B), w, case, what + " (against SDPA)")
        n += 1
    for i, case in enumerate(packed):
        q, k, v, do, o, lse, want = backward_inputs(case, 50 + i)
        what = f"{title}, case {case.describe()}"
        with kernel_path_only(function, what):
            *got, got_lse = _grads_of(function.apply, case, q, k, v, do, what)
        assert_close(got_lse, lse.to(got_lse.device), what=f"{what}, LSE", dims=("h", "token"),
                     dtype=torch.float32, atol=2e-4, rtol=1e-4,
                     hint="return the forward's LSE (h_q, total_q), natural log, as it is.")
        for name, g, w in zip(("dQ", "dK", "dV"), got, want):
            _compare(name, g, w, case, what)
        n += 1
    report(title, n, hidden=hidden)


# ------------------------------------------------------------------ the dense wrapper, trained

def training_cases(hidden: bool = False) -> list[tuple[AttnCase, str, bool]]:
    """(case, layout, return_lse): (B, H, N, d) and flash-attn's (B, N, H, d)."""
    if not hidden:
        return [(AttnCase("dense, causal GQA, N_q < N_k", B=2, H_q=4, H_kv=2, N_q=12, N_k=20,
                          d=16, causal=True), "bhnd", False),
                (AttnCase("flash-attn's (B, N, H, d), causal GQA, with the LSE", B=2, H_q=4,
                          H_kv=2, N_q=9, N_k=14, d=16, causal=True), "bnhd", True)]
    return [(AttnCase("dense fp16, N_q > N_k", B=1, H_q=2, N_q=24, N_k=8, d=16,
                      dtype=torch.float16, scale=0.5), "bhnd", True),
            (AttnCase("(B, N, H, d) fp16, MQA", B=2, H_q=3, H_kv=1, N_q=7, N_k=11, d=16,
                      dtype=torch.float16), "bnhd", False)]


def _dense_call(flash_attention, case, layout, return_lse, q, k, v, what):
    """O (and the LSE) in (B, H, N, d), from a call in ``layout``: (B, N, H, d) tensors as
    flash-attn's callers allocate them (contiguous), whose batch folds into the tokens; the
    (B, H, N, d) ones, contiguous, fold into the heads (``dense.packed_views``)."""
    args = [t.transpose(1, 2).contiguous() if layout == "bnhd" else t for t in (q, k, v)]
    kwargs = dict(layout=layout, return_lse=True) if return_lse else \
        (dict(layout=layout) if layout == "bnhd" else {})
    out = run_student(flash_attention, *args, case.causal, case.scale, what=what, **kwargs)
    o, lse = out if return_lse and isinstance(out, tuple) and len(out) == 2 else (out, None)
    if return_lse and lse is None:
        raise CheckFailure(f"{what}: with return_lse=True, expected (O, LSE), got "
                           f"{type(out).__name__}.")
    if not isinstance(o, torch.Tensor) or o.shape != args[0].shape:
        raise CheckFailure(f"{what}: expected O shaped like q {tuple(args[0].shape)} (layout="
                           f"{layout!r}), got {getattr(o, 'shape', type(o).__name__)}.")
    _require_one_node(o, args, what)
    return (o.transpose(1, 2) if layout == "bnhd" else o), lse


def _require_one_node(o, inputs, what):
    """O must come out of one autograd node whose inputs are q, k and v themselves: every view
    or copy autograd records outside the Function costs host time on every training step."""
    def is_input(node, t):
        return node is t.grad_fn if t.grad_fn is not None else \
            getattr(node, "variable", None) is t            # a leaf's AccumulateGrad
    nodes = [n for n, _ in getattr(o.grad_fn, "next_functions", ()) if n is not None]
    if not all(any(is_input(n, t) for n in nodes) for t in inputs):
        raise CheckFailure(
            f"{what}: O's autograd node ({type(o.grad_fn).__name__}) does not take q, k and v "
            "directly: pack q, k, v and unpack O inside the Function's forward (and the "
            "gradients inside its backward). Autograd records every view or copy made outside "
            "the Function, and replays its bookkeeping on every training step.")


def check_training(flash_attention, hidden: bool = False) -> None:
    """Exercise 4: ``flash_attention(q, k, v, causal, softmax_scale, layout=..., return_lse=...)``
    on dense (B, H, N, d) or (B, N, H, d) tensors: O, the LSE and the gradients against float64
    autograd, then a few training steps of ``train.TinyLM`` whose losses must match the same
    run with SDPA."""
    from .train import sdpa_attention, train
    title = "flash_attention (dense) and training"
    require_implemented(flash_attention, title)
    for i, (case, layout, return_lse) in enumerate(training_cases(hidden)):
        q, k, v, do, o_ref, lse_ref, want = backward_inputs(case, 60 + i)
        what = (f"{title}, case {case.describe()}, layout={layout!r}"
                + (", return_lse=True" if return_lse else ""))
        q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
        with kernel_path_only(flash_attention, what):
            o, lse = _dense_call(flash_attention, case, layout, return_lse, q, k, v, what)
            run_student(o.backward, do, what=what + ", backward")
        atol, rtol = GRAD_TOL[case.dtype]
        assert_close(o, o_ref, what=f"{what}, output O", dims=("b", "h", "row", "col"),
                     dtype=case.dtype, atol=atol, rtol=rtol,
                     hint="pack (B, H, N, d) as (B*N, H, d) with cu_seqlens_q = arange(B+1) * "
                          "N_q and cu_seqlens_k = arange(B+1) * N_k; unpack O the same way.")
        if return_lse:
            assert_close(lse, lse_ref.to(lse.device), what=f"{what}, LSE",
                         dims=("b", "h", "row"), dtype=torch.float32, atol=2e-4, rtol=1e-4,
                         hint="the packed LSE is (h_q, B * N_q): ch9.lse_from_packed(lse, B) "
                              "makes it (B, h_q, N_q).")
        for name, t, w in zip(("dQ", "dK", "dV"), (q, k, v), want):
            _compare(name, t.grad, w, case, what)
    steps, seed = (4, 0) if not hidden else (3, 5)
    what = f"{title}: {steps} training steps of a tiny causal transformer (seed {seed})"
    dev = current().device                       # the model and its batches: where q was
    ours = run_student(train, lambda a, b, c: flash_attention(a, b, c, True, None), steps,
                       batch=2, seed=seed, device=dev, what=what)
    base = train(sdpa_attention, steps, batch=2, seed=seed, device=dev)
    worst = max(abs(a - b) for a, b in zip(ours, base))
    if worst > 1e-4:
        raise CheckFailure(f"{what}: the losses differ from the same run with SDPA by up to "
                           f"{worst:.3g} (ours {[round(x, 5) for x in ours]}, SDPA "
                           f"{[round(x, 5) for x in base]}).")
    report(title, len(training_cases(hidden)) + 1, hidden=hidden)
