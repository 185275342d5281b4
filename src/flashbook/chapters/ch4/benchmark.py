"""Chapter 4 benchmark: the chapter's varlen kernels on causal, packed and sliding-window
attention, against torch SDPA (cuDNN, FlashAttention-2, nested jagged tensors) and compiled
FlexAttention.

GPU run (``flashbook bench ch4``): fp16, H = 16, d = 128, all in one process on one GPU; every
row is timed replayed from a CUDA graph (``bench.time_ms(fn, graph=True)``), and a call that
cannot be captured is timed launched from Python instead, its note saying so. A row that fails
(refused inputs, out of memory, ...) is recorded with ``ms`` empty and its note saying why.
Our kernels are called through the solution's ``attention_varlen`` (and ``_one_tile``): once
with its argument checks (that call's O is the one compared), then timed with
``validate_varlen`` replaced by a no-op (``bench_setups.ours``): the timed call is the launch
alone, as
the baselines' are (the checks read cu_seqlens with ``cases.host_values``, which copies nothing
again for the same tensor and nothing at all during a capture, so the wrapper can be captured
with them too). Beside each reference row a ``public`` row times the same call as a reader
makes it (``public``: the checks on, no config, launched; ``bench.public_row``).

1. Dense causal, (B, H, N, d) = (1,16,16384,128) and (4,16,4096,128): ``ch4_two_tiles``
   (reference, ``attention_varlen``), ``ch4_one_tile`` (variant, ``attention_varlen_one_tile``),
   ``sdpa_cudnn`` and ``sdpa_flash`` (``is_causal=True``), ``flex_attention`` (compiled, causal
   block mask); non-causal ``ch4_two_tiles`` and ``sdpa_cudnn`` at (1,16,16384,128). Our
   kernels take the batch packed, ``q.view(B*N, H, d)`` with ``cu_seqlens = arange(B+1)*N``;
   the others contiguous (B, H, N, d) copies. Notes: ``max|O-cuDNN|``.
2. Varlen: 65536 tokens split by ``figures.lognormal_lengths(65536, seed=0)``, non-causal and
   causal. Rows: ``ch4_two_tiles`` on the packed batch; ``ch4_two_tiles`` on a uniform batch of
   the same tokens (4 x 16384, note ``uniform 4x16384``); SDPA on the batch padded to the
   longest sequence, (n_seqs, H, longest, d), with a key-padding mask (non-causal; top-left
   ``is_causal`` alone for causal, which is exact for right padding), named after the backend
   that accepted it (cuDNN, else memory-efficient, else flash); ``flex_attention`` on the packed
   batch as (1, H, 65536, d) with a document mask; ``sdpa_jagged`` (non-causal): SDPA on
   nested jagged tensors (n_seqs, H, j, d). These rows have N_q = N_k = the total token count,
   B = the sequence count (4 for the uniform batch) and notes starting ``varlen:``
   (``uniform`` for the uniform batch). The flex document mask is built eagerly by
   ``create_block_mask`` over the whole 65536^2 grid: ~47 GiB at the peak on an H200.
3. Sliding window at B = 1, N = 65536, causal: ``ch4_two_tiles`` with ``window_size`` (2048, 0),
   (4096, 0), (8192, 0) (note ``window=(left,0)``) and without a window (note
   ``window=(-1,-1)``); ``flex_attention`` with a sliding-window causal mask at 4096.

FLOP convention (every row): 4 * H * d per attended (query, key) pair, the two matmuls. Dense:
``reference.attention_flops`` (causal counts N^2/2 pairs per sequence). Varlen and window rows
count real pairs only: sum n_i^2 over the sequences, sum n_i^2/2 causal (the dense convention
per sequence), and for a causal window of ``left`` keys the exact count
sum_i min(i+1, left+1); padding, masked-out blocks and padded pairs computed by a baseline do
not count (the padded row's note gives the pairs it computed). GB/s: compulsory traffic (read
Q, K, V, write O once) of the real tokens.
"""
from __future__ import annotations

import functools
import warnings

import torch

from flashbook import bench_setups, sources
from flashbook.bench import attention_bytes, flex_compile_limits, free_cuda_cache, join_notes, \
    public_row, sdpa, sdpa_supports, why_failed
from flashbook.bench_setups import causal_mod, cu_seqlens, flex_setup, max_err, ours, \
    refused_setup, sdpa_backend
from flashbook.chapters.ch4.figures import lognormal_lengths
from flashbook.reference import attention_flops
from flashbook.results import Row
from flashbook.varlen import heads_per_section

GRAPH_TIMER = True
H, D, DTYPE = 16, 128, torch.float16
DENSE = [(1, 16, 16384, 128), (4, 16, 4096, 128)]
NON_CAUSAL_TOO = (1, 16384)              # (B, N) of the dense shape also measured non-causal
TOTAL = 65536                            # tokens of the varlen and window sections
UNIFORM_B = 4                            # the uniform batch: 4 x 16384
WINDOWS = (2048, 4096, 8192)
FLEX_WINDOW = 4096
KERNELS = [("ch4_two_tiles", "reference", "attention_varlen"),
           ("ch4_one_tile", "variant", "attention_varlen_one_tile")]


# ------------------------------------------------------------------ helpers (CPU-testable)

def window_pairs(n: int, left: int) -> int:
    """Visible pairs of one causal sequence of n tokens whose rows see ``left`` keys back:
    sum over rows i of min(i+1, left+1)."""
    w = min(left + 1, n)
    return w * (w + 1) // 2 + (n - w) * w


def real_pairs(lengths, causal: bool = False, left: int | None = None) -> float:
    """Attended (query, key) pairs of a batch of sequences (the module's FLOP convention)."""
    if left is not None:
        return float(sum(window_pairs(n, left) for n in lengths))
    return sum(n * n for n in lengths) / (2 if causal else 1)


def pad(x: torch.Tensor, lengths, longest: int) -> torch.Tensor:
    """Packed (total, H, d) -> zero-padded contiguous (n_seqs, H, longest, d)."""
    out = x.new_zeros(len(lengths), longest, *x.shape[1:])
    out[real_positions(lengths, longest, x.device)] = x
    return out.transpose(1, 2).contiguous()


def real_positions(lengths, longest: int, device="cpu") -> torch.Tensor:
    """(n_seqs, longest) bool, True at the positions a right-padded batch holds tokens."""
    n = torch.tensor(lengths, device=device)
    return torch.arange(longest, device=device)[None, :] < n[:, None]


def unpad(o: torch.Tensor, lengths) -> torch.Tensor:
    """Padded (n_seqs, H, longest, d) -> packed (total, H, d): the inverse of ``pad``."""
    return o.transpose(1, 2)[real_positions(lengths, o.shape[2], o.device)]


def measure(kernel, role, setup, *, B, N, causal, flops, tokens, note="") -> Row:
    """``bench_setups.measure`` with this chapter's columns: H heads of D, fp16, N_q = N_k = N;
    GB/s of Q, K, V and O of ``tokens`` tokens."""
    return bench_setups.measure(kernel, role, setup, B=B, H_q=H, N_q=N, d=D, dtype=DTYPE,
                                causal=causal, flops=flops, note=note,
                                nbytes=attention_bytes(1, H, tokens, tokens, D, DTYPE.itemsize))


def public(ns, row: Row, wrapper: str, args, **kw) -> Row:
    """The ``public`` companion of ``row``: ``ns[wrapper](*args, **kw)`` with its checks and no
    config, launched, as a reader calls it (``bench.public_row``)."""
    shown = ", ".join(["q, k, v, cu_seqlens_q, cu_seqlens_k", *map(str, args[5:])]
                      + [f"{name}={value!r}" for name, value in kw.items()])
    return public_row(row, functools.partial(ns[wrapper], *args, **kw), f"{wrapper}({shown})")


# ------------------------------------------------------------------------------ the run

def run(dense=DENSE, total=TOTAL, windows=WINDOWS, device="cuda", lengths=None) -> list[Row]:
    from torch.nn.attention.flex_attention import flex_attention
    ns = sources.solution_namespace("ch4")
    flex = torch.compile(flex_attention, dynamic=False)
    rows: list[Row] = []
    with flex_compile_limits():
        for shape in dense:
            rows += dense_rows(ns, flex, *shape, device=device)
            free_cuda_cache()
        lengths = [int(n) for n in (lengths or lognormal_lengths(total, seed=0))]
        rows += varlen_rows(ns, flex, lengths, device=device)
        free_cuda_cache()
        rows += window_rows(ns, flex, total, windows, device=device)
        free_cuda_cache()
    return rows


def dense_rows(ns, flex, B, Hh, N, d, device="cuda") -> list[Row]:
    assert (Hh, d) == (H, D), "the chapter's benchmark runs H=16, d=128"
    q, k, v = (torch.randn(B * N, H, D, device=device, dtype=DTYPE) for _ in range(3))
    cu = cu_seqlens([N] * B, device)
    q4, k4, v4 = (t.view(B, N, H, D).transpose(1, 2).contiguous() for t in (q, k, v))
    rows = []
    for causal in (True, False) if (B, N) == NON_CAUSAL_TOO else (True,):
        kw = dict(B=B, N=N, causal=causal, flops=attention_flops(B, H, N, N, D, causal),
                  tokens=B * N)
        want = cudnn(q4, k4, v4, causal)

        def check(o):
            return f"max|O-cuDNN|={max_err(o.view(B, N, H, D).transpose(1, 2), want):.1e}"
        for name, role, wrapper in KERNELS if causal else KERNELS[:1]:
            rows.append(measure(name, role, ours(ns, wrapper, (q, k, v, cu, cu, N, N), check,
                                                 causal=causal),
                                note=f"sections={sections(B * H, N, device)}", **kw))
            if role == "reference":
                rows.append(public(ns, rows[-1], wrapper, (q, k, v, cu, cu, N, N),
                                   causal=causal))
        rows += schedule_rows(ns, (q, k, v, cu, cu, N, N), B * H, causal, kw)
        for name in ("sdpa_cudnn", "sdpa_flash") if causal else ("sdpa_cudnn",):
            def setup(f=sdpa(name), name=name):
                if not sdpa_supports(name, q4, k4, v4, causal):
                    raise RuntimeError(f"{name} refuses these inputs")
                return (lambda: f(q4, k4, v4, causal)), ""
            rows.append(measure(name, "baseline", setup, **kw))
        if causal:
            rows.append(measure("flex_attention", "baseline",
                                flex_setup(flex, causal_mod, q4, k4, v4, want), **kw))
        want = None                                        # frees it before the next case
        free_cuda_cache()
    return rows


def sections(n_bh: int, max_seqlen_k: int, device) -> int:
    """The (sequence, head) pairs per section that ``launch_varlen`` picks by default."""
    return heads_per_section(n_bh, 2 * max_seqlen_k * D * DTYPE.itemsize, device)


def schedule_rows(ns, args, n_bh, causal, kw, note="") -> list[Row]:
    """The ablation of Section 4's schedule: the reference kernel with one (sequence, head) pair
    per section (tiles first: L2 locality alone) and with all of them in one (pure
    longest-first), beside the default ``ch4.heads_per_section``."""
    return [measure(name, "variant", ours(ns, "attention_varlen", args, causal=causal,
                                          sections=g), note=join_notes(note, f"sections={g}"), **kw)
            for name, g in (("ch4_two_tiles_tiles_first", 1), ("ch4_two_tiles_heads_first", n_bh))]


def cudnn(q, k, v, causal):
    """SDPA's cuDNN output (the dense rows' check), or None where cuDNN refuses."""
    try:
        return sdpa("sdpa_cudnn")(q, k, v, causal) \
            if sdpa_supports("sdpa_cudnn", q, k, v, causal) else None
    except Exception:  # noqa: BLE001 - no check then, never a stop
        return None


def varlen_rows(ns, flex, lengths, device="cuda") -> list[Row]:
    n_seqs, longest, total = len(lengths), max(lengths), sum(lengths)
    ratio = n_seqs * longest / total
    q, k, v = (torch.randn(total, H, D, device=device, dtype=DTYPE) for _ in range(3))
    cu = cu_seqlens(lengths, device)
    nu = total // UNIFORM_B
    cu_u = cu_seqlens([nu] * UNIFORM_B, device)
    qp, kp, vp = (pad(t, lengths, longest) for t in (q, k, v))
    keys = real_positions(lengths, longest, device)[:, None, None, :]   # (n_seqs, 1, 1, longest)
    q1, k1, v1 = (t.transpose(0, 1).unsqueeze(0).contiguous() for t in (q, k, v))
    doc = torch.repeat_interleave(torch.arange(n_seqs, device=device),
                                  torch.tensor(lengths, device=device))
    rows = []
    for causal in (False, True):
        pairs = real_pairs(lengths, causal)
        head = (f"varlen: {n_seqs} seqs, longest {longest}, padding ratio {ratio:.1f}; "
                "FLOPs on real pairs")
        kw = dict(B=n_seqs, N=total, causal=causal, flops=4.0 * H * D * pairs, tokens=total)

        # the padded SDPA baseline first: its output checks ours
        backend, want, refusals = None, None, []
        for name in ("sdpa_cudnn", "sdpa_efficient", "sdpa_flash"):
            mask = None if causal else keys
            if name == "sdpa_flash" and mask is not None:
                continue                                   # flash takes no mask
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    f = sdpa_backend(name, causal, mask=mask)
                    want = unpad(f(qp, kp, vp), lengths)
                backend = name
                break
            except Exception as e:  # noqa: BLE001 - refused or out of memory: try the next
                refusals.append(f"{name} ({why_failed(e)[:60]})")
                free_cuda_cache()

        def check(o):
            return f"max|O-{backend}|={max_err(o, want):.1e}" if backend else ""
        rows.append(measure("ch4_two_tiles", "reference",
                            ours(ns, "attention_varlen", (q, k, v, cu, cu, longest, longest),
                                 check, causal=causal),
                            note=join_notes(head, f"sections={sections(n_seqs * H, longest, device)}"),
                            **kw))
        rows.append(public(ns, rows[-1], "attention_varlen", (q, k, v, cu, cu, longest, longest),
                           causal=causal))
        rows += schedule_rows(ns, (q, k, v, cu, cu, longest, longest), n_seqs * H, causal, kw,
                              note=head)
        qu, ku, vu = (t[:nu * UNIFORM_B] for t in (q, k, v))
        rows.append(measure(
            "ch4_two_tiles", "reference",
            ours(ns, "attention_varlen", (qu, ku, vu, cu_u, cu_u, nu, nu), causal=causal),
            note=f"uniform {UNIFORM_B}x{nu}: same tokens, equal lengths; FLOPs on real pairs",
            **{**kw, "B": UNIFORM_B, "tokens": nu * UNIFORM_B,
               "flops": 4.0 * H * D * real_pairs([nu] * UNIFORM_B, causal)}))

        computed = n_seqs * longest * longest / (2 if causal else 1)
        how = "is_causal (top-left), no mask" if causal else "key-padding mask (bool)"
        pad_note = (f"{head}; padded to {n_seqs}x{longest}: {computed:.3g} pairs computed for "
                    f"{pairs:.3g} real; {how}")
        if backend is None:
            why = "every backend refused: " + ", ".join(refusals)
            rows.append(measure("sdpa_cudnn", "baseline", refused_setup(why), note=pad_note,
                                **kw))
        else:
            f = sdpa_backend(backend, causal, mask=None if causal else keys)
            rows.append(measure(backend, "baseline", lambda: (lambda: f(qp, kp, vp), ""),
                                note=join_notes(pad_note, f"backend {backend}",
                                           "refused: " + ", ".join(refusals) if refusals else ""),
                                **kw))

        def doc_mod(b, h, q_idx, kv_idx):
            same = doc[q_idx] == doc[kv_idx]
            return same & (q_idx >= kv_idx) if causal else same
        expect = want.transpose(0, 1).unsqueeze(0) if want is not None else None
        rows.append(measure("flex_attention", "baseline",
                            flex_setup(flex, doc_mod, q1, k1, v1, expect, backend),
                            note=join_notes(head, "document mask, packed as B=1"), **kw))
        if not causal:
            rows.append(measure("sdpa_jagged", "baseline",
                                lambda: jagged_setup(q, k, v, lengths, want, backend),
                                note=head, **kw))
        want = None                                        # frees it before the next case
        free_cuda_cache()
    return rows


def jagged_setup(q, k, v, lengths, want, name):
    """SDPA on nested jagged tensors (n_seqs, H, j, d) made from per-sequence (n_i, H, d)."""
    import torch.nn.functional as F
    starts = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    qj, kj, vj = (torch.nested.nested_tensor([t[a:b] for a, b in zip(starts, starts[1:])],
                                             layout=torch.jagged).transpose(1, 2)
                  for t in (q, k, v))
    fn = lambda: F.scaled_dot_product_attention(qj, kj, vj)  # noqa: E731
    o = fn().transpose(1, 2).values()
    try:
        from torch.nested._internal.sdpa import _select_sdp_backend
        chosen = _select_sdp_backend(qj, kj, vj, None, 0.0, False, False).name
    except Exception:  # noqa: BLE001 - private API: only for the note
        chosen = "?"
    return fn, join_notes(f"torch chose {chosen}", name and f"max|O-{name}|={max_err(o, want):.1e}")


def window_rows(ns, flex, n, windows=WINDOWS, device="cuda") -> list[Row]:
    q, k, v = (torch.randn(n, H, D, device=device, dtype=DTYPE) for _ in range(3))
    cu = cu_seqlens([n], device)
    rows, outs = [], {}
    for left in (None, *windows):
        pairs = real_pairs([n], True, left)
        note = f"window=({left},0)" if left is not None else "window=(-1,-1): plain causal"

        def keep(o, left=left):
            if left == FLEX_WINDOW:
                outs[left] = o                             # flex_attention's row checks it
            return ""
        setup = ours(ns, "attention_varlen", (q, k, v, cu, cu, n, n), keep, causal=True,
                     window_size=(left, 0) if left is not None else (-1, -1))
        rows.append(measure("ch4_two_tiles", "reference", setup, B=1, N=n, causal=True,
                            flops=4.0 * H * D * pairs, tokens=n,
                            note=f"{note}; FLOPs on real pairs ({pairs:.4g})"))
        rows.append(public(ns, rows[-1], "attention_varlen", (q, k, v, cu, cu, n, n),
                           causal=True, window_size=(left, 0) if left is not None else (-1, -1)))

    def window_mod(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx <= FLEX_WINDOW)
    q1, k1, v1 = (t.transpose(0, 1).unsqueeze(0).contiguous() for t in (q, k, v))
    mine = outs[FLEX_WINDOW].transpose(0, 1).unsqueeze(0) if FLEX_WINDOW in outs else None
    pairs = real_pairs([n], True, FLEX_WINDOW)
    rows.append(measure("flex_attention", "baseline",
                        flex_setup(flex, window_mod, q1, k1, v1, mine, "ch4"),
                        B=1, N=n, causal=True, flops=4.0 * H * D * pairs, tokens=n,
                        note=f"window=({FLEX_WINDOW},0); FLOPs on real pairs ({pairs:.4g})"))
    return rows
