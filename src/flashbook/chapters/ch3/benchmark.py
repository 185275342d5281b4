"""Chapter 3 benchmark: the chapter's FlashAttention forward kernels against torch SDPA's cuDNN
and FlashAttention-2 backends.

The reference kernel is the solution's ``attn_fwd_two_tiles`` (two query tiles per program,
Section 6); the one-tile ``attn_fwd_kernel`` of Exercise 2 is measured beside it. Both launch
with ``ch3.pick_config``.

GPU run (``flashbook bench ch3``): fp16, non-causal, (B, H, N, d) = (1,16,16384,128),
(4,16,4096,128), (4,16,4096,64), (4,16,1024,64), all in one process on one GPU. Every row is
timed replayed from a CUDA graph: at (4,16,1024,64) a forward takes about 0.05 ms, and a
Python-launched Triton kernel there measured its launch overhead instead.
"""
from __future__ import annotations

import torch

from flashbook import sources
from flashbook.bench import measure_attention, sdpa, sdpa_supports
from flashbook.chapters.ch3.launch import pick_config
from flashbook.results import Row

GRAPH_TIMER = True
SHAPES = [(1, 16, 16384, 128), (4, 16, 4096, 128), (4, 16, 4096, 64), (4, 16, 1024, 64)]

# (kernel name in the data, role, solution wrapper, two_tiles)
KERNELS = [("ch3_two_tiles", "reference", "attention_two_tiles", True),
           ("ch3_one_tile", "variant", "attention", False)]


def solution():
    """The chapter's solution namespace (kernels and their wrappers)."""
    return sources.solution_namespace("ch3")


def run(shapes=SHAPES, dtype=torch.float16) -> list[Row]:
    ns = solution()
    cap = torch.cuda.get_device_capability(0)
    rows = []
    for B, H, N, d in shapes:
        q, k, v = (torch.randn(B, H, N, d, device="cuda", dtype=dtype) for _ in range(3))
        kw = dict(B=B, H=H, N_q=N, N_k=N, d=d, dtype=dtype)
        want = sdpa("sdpa_cudnn")(q, k, v).float() if sdpa_supports("sdpa_cudnn", q, k, v) else None
        for name, role, wrapper, two_tiles in KERNELS:
            attention = ns[wrapper]
            cfg = pick_config(d, dtype, cap, two_tiles=two_tiles)
            o, _ = attention(q, k, v)
            err = (o.float() - want).abs().max().item() if want is not None else float("nan")
            r = measure_attention(name, role, lambda: attention(q, k, v), graph=True, **kw)
            r.note = (f"BLOCK_M={cfg.BLOCK_M} BLOCK_N={cfg.BLOCK_N} warps={cfg.num_warps} "
                      f"stages={cfg.num_stages}; max|O-cuDNN|={err:.1e}")
            rows.append(r)
        for name in ("sdpa_cudnn", "sdpa_flash"):
            if sdpa_supports(name, q, k, v):
                f = sdpa(name)
                rows.append(measure_attention(name, "baseline", lambda: f(q, k, v), graph=True,
                                              **kw))
        del q, k, v
        torch.cuda.empty_cache()
    return rows
