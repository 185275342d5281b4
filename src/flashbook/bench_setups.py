"""What the chapters' benchmarks share (Chapters 4 to 9): one measurer of a guarded
setup, and the setups it takes.

A *setup* is a function of no arguments returning ``(fn, note)``: ``fn()`` is one call to time
and ``note`` goes into the row (a check's ``max|O-...|``, say). ``measure`` runs the setup and
the timing under one guard, so a refusal or an out-of-memory becomes the row's note and never
stops a run. The setups here: a chapter's kernel through its wrapper, timed without the
wrapper's argument checks (``ours``, ``quiet``); SDPA on one backend (``sdpa_setup``) and
compiled FlexAttention with a block mask (``flex_setup``); a baseline not run
(``refused_setup``); and the GPU's memory ceilings (``ceiling_rows``).
"""
from __future__ import annotations

import dataclasses
import functools
import types
import warnings

import torch

from .bench import free_cuda_cache, gpu_peak, join_notes, sdpa, timed_ms, why_failed
from .results import Row


# ------------------------------------------------------------------------------ arithmetic

def cu_seqlens(lengths, device="cpu") -> torch.Tensor:
    """int32 offsets [0, n_0, n_0+n_1, ...] of a length mix."""
    return torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0).to(torch.int32).to(device)


def decode_flops(B: int, h_q: int, n_new: int, context: int, d: int) -> float:
    """The two matmuls of a decode step: 4 * d per (query head, new token, cached key)."""
    return 4.0 * B * h_q * n_new * context * d


def kv_bytes(B: int, context: int, h_kv: int, d: int, itemsize: int = 2) -> float:
    """Bytes of K and V a decode step reads: every cached token of every K/V head, once."""
    return 2.0 * B * context * h_kv * d * itemsize


def max_err(a, b) -> float:
    """max |a - b| over elements, or nan when either is missing or they do not compare."""
    try:
        return (a.float() - b.float()).abs().max().item()
    except Exception:  # noqa: BLE001 - a failed check is reported as nan, never fatal
        return float("nan")


def err_note(name, want, tolerance=None):
    """A check: ``max|O-name|`` of an O laid out as ``want``; no note without ``want``. With
    ``tolerance``, an error above it (or NaN) is flagged ``WRONG``."""
    def note(o):
        if want is None:
            return ""
        err = max_err(o, want)
        wrong = tolerance is not None and not err <= tolerance
        return f"max|O-{name}|={err:.1e}" + (f" WRONG (> {tolerance:g})" if wrong else "")
    return note


def expanded_note(k, group: int) -> str:
    """The expanded-K/V rows' note: the extra memory of K and V (B, h_kv, N, d) expanded to
    h_q = group * h_kv heads."""
    return (f"K/V expanded to h_q heads (repeat_interleave, not timed): "
            f"+{2 * k.nbytes * (group - 1) / 2**20:.0f} MiB")


# ------------------------------------------------------------------------------ the measurer

def measure(kernel, role, setup, *, B, H_q, N_q, d, dtype, causal, flops, nbytes,
            H_kv=None, N_k=None, hbm=False, note="", timer=None) -> Row:
    """One row: ``setup()`` returns (fn, note) with fn() the call to time (from a CUDA graph
    where it can be captured, ``bench.timed_ms``; or by ``timer(fn) -> (ms, note)``, e.g.
    JAX's profiler for a JAX call); it and the timing run under one guard.
    ``gbps`` = ``nbytes`` / time; ``flops`` 0: no TFLOP/s; ``pct_peak``: of the datasheet
    tensor TFLOP/s, or with ``hbm`` of its HBM bandwidth."""
    row = dict(kernel=kernel, role=role, B=B, H_q=H_q, H_kv=H_kv or H_q, N_q=N_q,
               N_k=N_k or N_q, d=d, dtype=str(dtype).replace("torch.", ""), causal=causal)
    try:
        fn, extra = setup()
        ms, how = (timer or timed_ms)(fn)
    except Exception as e:  # noqa: BLE001 - one failing baseline never stops the run
        free_cuda_cache()
        return Row(**row, ms=None, tflops=None, gbps=None, pct_peak=None,
                   note=join_notes(note, f"not measured: {why_failed(e)}"))
    tflops = flops / (ms * 1e-3) / 1e12 if flops else None
    gbps = nbytes / (ms * 1e-3) / 1e9
    peak = gpu_peak()
    pct = None
    if peak is not None:
        pct = 100.0 * gbps / peak.hbm_gbps if hbm else \
            100.0 * tflops / peak.tensor_tflops if tflops is not None else None
    return Row(**row, ms=ms, tflops=tflops, gbps=gbps, pct_peak=pct,
               note=join_notes(note, extra, how))


def case_columns(case) -> dict:
    """``measure``'s keywords for a dense ``cases.AttnCase`` (bhnd): its shape columns, FLOPs
    (``reference.attention_flops``) and compulsory traffic (``bench.attention_bytes``)."""
    from flashbook.bench import attention_bytes
    from flashbook.reference import attention_flops
    B, H, N_q, N_k, d = case.B, case.H_q, case.N_q, case.n_k, case.d
    return dict(B=B, H_q=H, N_q=N_q, d=d, dtype=case.dtype, causal=case.causal,
                flops=attention_flops(B, H, N_q, N_k, d, case.causal),
                nbytes=attention_bytes(B, H, N_q, N_k, d, case.dtype.itemsize))


# ------------------------------------------------------------------------------ the setups

def quiet(ns: dict, validators=("validate_varlen", "validate_gqa", "validate_decode")) -> dict:
    """A copy of a solution namespace with its wrappers' ``validators`` made no-ops (the timed
    call is then the launch alone, as a baseline's is) and every solution function rebound to
    the copy, so a wrapper that calls another skips the checks too."""
    def noop(*a, **kw):
        return None
    out = {**ns, **{name: noop for name in validators if name in ns}}
    for name, f in ns.items():
        if isinstance(f, types.FunctionType) and f.__globals__ is ns and name not in validators:
            g = types.FunctionType(f.__code__, out, f.__name__, f.__defaults__, f.__closure__)
            g.__kwdefaults__ = f.__kwdefaults__
            out[name] = g
    return out


def ours(ns, wrapper, args, check=None, **kw):
    """A setup of a chapter kernel: one checked call (its O goes to ``check(O) -> note``),
    then the call timed without the checks (``quiet``)."""
    def setup():
        o = ns[wrapper](*args, **kw)[0]
        fast = quiet(ns)[wrapper]
        how = "" if isinstance(fast, types.FunctionType) and fast is not ns[wrapper] else \
            "timed with its argument checks"          # not a plain function: as it is
        return (lambda: fast(*args, **kw)), join_notes(check(o) if check else "", how)
    return setup


def sdpa_backend(backend: str, causal: bool = False, gqa: bool = False, mask=None):
    """``bench.sdpa`` with the mask flags fixed, as f(q, k, v)."""
    run = sdpa(backend, gqa=gqa, mask=mask)
    return lambda q, k, v: run(q, k, v, causal)


def refusal(e: BaseException, caught) -> str:
    """Why a backend refused: torch's own reason (a UserWarning) where it gave one."""
    skip = ("not used because", "runtime disabled", "Aborting execution")
    why = [str(w.message).split(" (Triggered internally")[0].strip() for w in caught]
    why = [w for w in why if w and not any(s in w for s in skip)]
    return "refused: " + (why or [(str(e).strip().splitlines() or [""])[0]])[0][:140]


def sdpa_setup(backend, q, k, v, causal, expand=False, gqa=True, check=None):
    """A setup: SDPA on one backend with ``enable_gqa`` (``gqa=False``: without it, as for
    inputs with as many K/V heads as query heads; ``expand``: on K/V expanded to the query
    heads first, not timed); a refusal raises with torch's reason. ``check(O) -> note``."""
    def setup():
        kk, vv = k, v
        if expand:
            g = q.shape[1] // k.shape[1]
            kk, vv = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
        f = sdpa_backend(backend, causal, gqa=gqa and not expand)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                o = f(q, kk, vv)
            except RuntimeError as e:
                raise RuntimeError(refusal(e, caught)) from None
        return (lambda: f(q, kk, vv)), check(o) if check else ""
    return setup


def expect(q, k, v, causal, backends, gqa=True):
    """(name, O) of the first SDPA backend that accepts these inputs (the check), or ("", None)."""
    for name in backends:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return name, sdpa_backend(name, causal, gqa=gqa)(q, k, v)
        except Exception:  # noqa: BLE001 - refused or out of memory: try the next
            free_cuda_cache()
    return "", None


def flex_setup(flex, mask_mod, q, k, v, expect=None, name="cuDNN"):
    """A setup: compiled FlexAttention, the block mask built once, the call warmed up."""
    def setup():
        from torch.nn.attention.flex_attention import create_block_mask
        B, _, N, _ = q.shape
        block_mask = create_block_mask(mask_mod, None, None, N, N, device=q.device)
        fn = lambda: flex(q, k, v, block_mask=block_mask)  # noqa: E731
        o = fn()                                          # compiles outside the timing
        return fn, f"max|O-{name}|={max_err(o, expect):.1e}" if expect is not None else ""
    return setup


def causal_mod(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def refused_setup(why):
    """A setup for a baseline that is not run (``why``, a message or the exception itself,
    becomes its row's note)."""
    def setup():
        raise why if isinstance(why, BaseException) else RuntimeError(why)
    return setup


# ------------------------------------------------------------------------------ ceilings

READ_BYTES, COPY_BYTES = 4 * 2**30, 2 * 2**30      # past the L2 cache many times over
READ_OPS = {"x.sum()": lambda x: x.sum(),
            "torch.linalg.vector_norm(x)": lambda x: torch.linalg.vector_norm(x)}


def ceiling_rows(read_bytes, copy_bytes, B, h_q, h_kv, context, d, device="cuda",
                 dtype=torch.float16) -> list[Row]:
    """``hbm_read`` (the faster of the ``READ_OPS``) and ``d2d_copy``, with a decode case's
    shape columns (they are not attention: no TFLOP/s)."""
    kw = dict(B=B, H_q=h_q, H_kv=h_kv, N_q=1, N_k=context, d=d, dtype=dtype, causal=False,
              flops=0.0, hbm=True)

    def filled(nbytes):
        return torch.ones(nbytes // dtype.itemsize, device=device, dtype=dtype)

    def read_setup(op):
        x = filled(read_bytes)                             # in the guard of ``measure``
        return (lambda: READ_OPS[op](x)), ""
    tried = {}
    for op in READ_OPS:
        tried[op] = measure("hbm_read", "baseline", functools.partial(read_setup, op),
                            nbytes=read_bytes, note=f"read ceiling: {op} over "
                            f"{read_bytes / 2**30:.2f} GiB of fp16", **kw)
        free_cuda_cache()
    best = min(tried, key=lambda op: (tried[op].ms is None, tried[op].ms or 0.0))
    others = "; ".join(f"{op}: " + (f"{r.gbps:.0f} GB/s" if r.ms is not None else "failed")
                       for op, r in tried.items() if op != best)
    rows = [dataclasses.replace(tried[best], note=join_notes(tried[best].note,
                                                            others and f"beside {others}"))]

    def copy_setup():
        src = filled(copy_bytes)
        dst = torch.empty_like(src)
        return (lambda: dst.copy_(src)), ""
    rows.append(measure("d2d_copy", "baseline", copy_setup, nbytes=2 * copy_bytes,
                        note=f"dst.copy_(src) of {copy_bytes / 2**30:.2f} GiB: gbps counts "
                             "bytes read + written", **kw))
    free_cuda_cache()
    return rows
