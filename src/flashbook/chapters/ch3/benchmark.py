"""Chapter 3 benchmark: the chapter's FlashAttention forward kernels against torch SDPA's cuDNN
and FlashAttention-2 backends.

The reference kernel is the solution's ``attn_fwd_two_tiles`` (two query tiles per program,
Section 6); the one-tile ``attn_fwd_kernel`` of Exercise 2 is measured beside it, and so is the
ablation Section 6 describes: the two-tile kernel with the same tiles and warps but its step in
the order A then B (``attn_tile`` for A, then for B: no matmul overlaps a softmax), which
separates the gain of the reordering from that of the larger program. All launch with
``ch3.pick_config``; each row's note gives the config and the registers and spills per thread.

GPU run (``flashbook bench ch3``): fp16, non-causal, (B, H, N, d) = (1,16,16384,128),
(4,16,4096,128), (4,16,4096,64), (4,16,1024,64), all in one process on one GPU. Every row is
timed replayed from a CUDA graph: at (4,16,1024,64) a forward takes about 0.05 ms, and a
Python-launched Triton kernel there measured its launch overhead instead.
"""
from __future__ import annotations

import torch

from flashbook import sources
from flashbook.bench import FORWARD_SHAPES, compiled, measure_attention, public_row, registers, \
    sdpa, sdpa_supports
from flashbook.chapters.ch3.launch import pick_config
from flashbook.results import Row

GRAPH_TIMER = True
SHAPES = FORWARD_SHAPES

# The two-tile step in the order of two attn_tile calls (A, then B): the ablation of Section 6.
A_THEN_B_STEP = """
@triton.jit
def attn_two_tile_step(acc_a, l_a, m_a, q_a, acc_b, l_b, m_b, q_b, k_ptrs, v_ptrs, start_n,
                       N_k, qk_scale, offs_n, MASKED: tl.constexpr,
                       DOT_PRECISION: tl.constexpr):
    s_a = attn_scores(q_a, k_ptrs, start_n, N_k, offs_n, MASKED, DOT_PRECISION)
    acc_a, l_a, m_a = attn_update(acc_a, l_a, m_a, s_a, v_ptrs, start_n, N_k, qk_scale, offs_n,
                                  MASKED, DOT_PRECISION)
    s_b = attn_scores(q_b, k_ptrs, start_n, N_k, offs_n, MASKED, DOT_PRECISION)
    acc_b, l_b, m_b = attn_update(acc_b, l_b, m_b, s_b, v_ptrs, start_n, N_k, qk_scale, offs_n,
                                  MASKED, DOT_PRECISION)
    return acc_a, l_a, m_a, acc_b, l_b, m_b
"""

# (kernel name in the data, role, solution wrapper, kernel, two_tiles, namespace)
KERNELS = [("ch3_two_tiles", "reference", "attention_two_tiles", "attn_fwd_two_tiles", True, "as is"),
           ("ch3_two_tiles_a_then_b", "variant", "attention_two_tiles", "attn_fwd_two_tiles",
            True, "a then b"),
           ("ch3_one_tile", "variant", "attention", "attn_fwd_kernel", False, "as is")]


def solution(order: str = "as is") -> dict:
    """The chapter's solution namespace (kernels and their wrappers); ``order="a then b"``
    rebinds the two-tile step before anything compiles, in a namespace of its own."""
    ns = sources.solution_namespace("ch3")
    if order == "a then b":
        sources.exec_cell(A_THEN_B_STEP, "<ch3 benchmark: two-tile step, A then B>", ns)
    return ns


def run(shapes=SHAPES, dtype=torch.float16) -> list[Row]:
    namespaces = {order: solution(order) for order in ("as is", "a then b")}
    cap = torch.cuda.get_device_capability(0)
    rows, regs = [], {}
    for B, H, N, d in shapes:
        q, k, v = (torch.randn(B, H, N, d, device="cuda", dtype=dtype) for _ in range(3))
        kw = dict(B=B, H=H, N_q=N, N_k=N, d=d, dtype=dtype)
        want = sdpa("sdpa_cudnn")(q, k, v).float() if sdpa_supports("sdpa_cudnn", q, k, v) else None
        for name, role, wrapper, kernel, two_tiles, order in KERNELS:
            ns = namespaces[order]
            attention = ns[wrapper]
            cfg = pick_config(d, dtype, cap, two_tiles=two_tiles)
            before = compiled(ns[kernel])
            o, _ = attention(q, k, v)
            new = {key: c for key, c in compiled(ns[kernel]).items() if key not in before}
            regs[name, d] = registers(new) if new else regs.get((name, d), "regs n/a")
            err = (o.float() - want).abs().max().item() if want is not None else float("nan")
            r = measure_attention(name, role, lambda: attention(q, k, v), graph=True, **kw)
            r.note = (f"BLOCK_M={cfg.BLOCK_M} BLOCK_N={cfg.BLOCK_N} warps={cfg.num_warps} "
                      f"stages={cfg.num_stages}; {regs[name, d]}; "
                      f"max|O-cuDNN|={err:.1e}")
            rows.append(r)
            if role == "reference":       # the same call as a reader makes it, launched
                rows.append(public_row(r, lambda: attention(q, k, v), f"{wrapper}(q, k, v)"))
        for name in ("sdpa_cudnn", "sdpa_flash"):
            if sdpa_supports(name, q, k, v):
                f = sdpa(name)
                rows.append(measure_attention(name, "baseline", lambda: f(q, k, v), graph=True,
                                              **kw))
        del q, k, v
        torch.cuda.empty_cache()
    return rows
