"""Chapter 3 benchmark: the chapter's FlashAttention forward (the solution's ``attn_fwd_kernel``,
launched with ``ch3.pick_config``) against torch SDPA's cuDNN and FlashAttention-2 backends.

GPU run (``flashbook bench ch3``): fp16, non-causal, (B, H, N, d) = (1,16,16384,128),
(4,16,4096,128), (4,16,4096,64), (4,16,1024,64), all in one process on one GPU.
"""
from __future__ import annotations

import torch

from ..bench import Measurement, measure_attention, sdpa, sdpa_supports

SHAPES = [(1, 16, 16384, 128), (4, 16, 4096, 128), (4, 16, 4096, 64), (4, 16, 1024, 64)]


def solution():
    """The chapter's solution namespace (kernels and the ``attention`` wrapper)."""
    from .. import notebooks
    return notebooks.solution_namespace("ch3")


def run(shapes=SHAPES, dtype=torch.float16, variants=True) -> list[Measurement]:
    from ..chapters import ch3
    ns = solution()
    attention = ns["attention"]
    cap = torch.cuda.get_device_capability(0)
    rows = []
    for B, H, N, d in shapes:
        q, k, v = (torch.randn(B, H, N, d, device="cuda", dtype=dtype) for _ in range(3))
        kw = dict(B=B, H=H, N_q=N, N_k=N, d=d, dtype=dtype)
        cfg = ch3.pick_config(d, dtype, cap)
        o, _ = attention(q, k, v)
        err = (o.float() - sdpa("sdpa_cudnn")(q, k, v).float()).abs().max().item() \
            if sdpa_supports("sdpa_cudnn", q, k, v) else float("nan")
        r = measure_attention("ch3_triton", "reference", lambda: attention(q, k, v), **kw)
        r.note = (f"BLOCK_M={cfg.BLOCK_M} BLOCK_N={cfg.BLOCK_N} warps={cfg.num_warps} "
                  f"stages={cfg.num_stages}; max|O-cuDNN|={err:.1e}")
        rows.append(r)
        if variants and d == 128:
            alt = ch3.Config(256, 64, 16, 3)
            try:
                r = measure_attention("ch3_triton_256x64", "variant",
                                      lambda: attention(q, k, v, config=alt), **kw)
                r.note = "BLOCK_M=256 BLOCK_N=64 warps=16 stages=3"
                rows.append(r)
            except Exception as e:  # noqa: BLE001 - a config that does not compile is data too
                rows.append(Measurement("ch3_triton_256x64", "variant", B, H, H, N, N, d,
                                        str(dtype).replace("torch.", ""), False, None, None,
                                        None, None, note=f"failed: {type(e).__name__}"))
        for name in ("sdpa_cudnn", "sdpa_flash"):
            if sdpa_supports(name, q, k, v):
                f = sdpa(name)
                rows.append(measure_attention(name, "baseline", lambda: f(q, k, v), **kw))
        del q, k, v
        torch.cuda.empty_cache()
    return rows
