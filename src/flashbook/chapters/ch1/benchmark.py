"""Chapter 1 benchmark: naive attention (materialises S and P) against torch SDPA.

GPU run (``flashbook bench ch1``): fp16, B=1, H=16, d=64, N = 512 ... 65536, until the naive
version runs out of memory. Each size records time and peak extra memory.

``naive_torch`` (reference) is the three-kernel model of Section 4 in the input dtype. Beside it
a ``public`` row times the chapter's own ``naive_attention(q, k, v)`` (the solution's, with its
float32 scores and its LSE) as a reader calls it (``bench.public_row``).
"""
from __future__ import annotations

import math

import torch

from flashbook import sources
from flashbook.bench import measure_attention, public_row, sdpa, sdpa_supports
from flashbook.results import Row


def naive_attention(q, k, v, causal=False):
    """Three kernels and two N x N intermediates: S = QK^T (write N^2), P = softmax(S)
    (read N^2, write N^2), O = PV (read N^2). Everything in the input dtype."""
    s = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
    if causal:
        n_q, n_k = s.shape[-2:]
        keep = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).tril(n_k - n_q)
        s = s.masked_fill(~keep, float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def sweep(Ns, *, B=1, H=16, d=64, dtype=torch.float16, device="cuda",
          baselines=("sdpa_flash", "sdpa_efficient", "sdpa_cudnn", "sdpa_math"),
          chapter_attention=None) -> list[Row]:
    """``chapter_attention``: the chapter's ``naive_attention`` (its public row), or None."""
    rows, naive_oom = [], False
    for N in Ns:
        try:
            q, k, v = (torch.randn(B, H, N, d, device=device, dtype=dtype) for _ in range(3))
        except torch.OutOfMemoryError:
            break
        shape = dict(B=B, H=H, N_q=N, N_k=N, d=d, dtype=dtype)
        if naive_oom:
            # a larger N cannot fit either: record it without trying
            rows.append(Row("naive_torch", "reference", B, H, H, N, N, d,
                            str(dtype).replace("torch.", ""), False, None, None, None, None,
                            note="out of memory"))
        else:
            r = measure_attention("naive_torch", "reference", lambda: naive_attention(q, k, v),
                                  memory=True, **shape)
            naive_oom = r.note == "out of memory"
            rows.append(r)
            if chapter_attention is not None and r.ms is not None:
                rows.append(public_row(r, lambda: chapter_attention(q, k, v),
                                       "naive_attention(q, k, v)"))
        for name in baselines:
            if name is None:
                fn = sdpa(None)
                label = "sdpa"
            else:
                if not sdpa_supports(name, q[:, :, :128], k[:, :, :128], v[:, :, :128]):
                    continue
                fn, label = sdpa(name), name
            rows.append(measure_attention(label, "baseline", lambda: fn(q, k, v),
                                          memory=True, **shape))
        del q, k, v
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


def run() -> list[Row]:
    Ns = [2**i for i in range(9, 17)]  # 512 ... 65536
    return sweep(Ns, chapter_attention=sources.solution_namespace("ch1")["naive_attention"])
