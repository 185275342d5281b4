"""The device code of Chapter 6's Gluon FA3 kernel: ``fa3_kernel`` runs the toolkit's
FlashAttention-3 roles (``flashbook.fa3_roles``, forked by ``fa3_body``) with FA3's softmax (exp2 on the special-function
unit, O rescaled at every tile). ``fa3_launch`` is its host side and describes it; Chapter 7's
benchmark runs it too, with its tricks as hooks.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from flashbook.fa3_body import fa3_forward
from flashbook.fa3_roles import exp2_mufu, move_max, rescale_o

__all__ = ["fa3_kernel"]


@gluon.jit(do_not_specialize=["N_Q", "N_K"])     # one binary for every length
def fa3_kernel(q_desc, k_desc, v_desc, o_desc, LSE, N_Q, N_K, qk_scale,
               BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
               STAGES: gl.constexpr, CAUSAL: gl.constexpr, OVERLAP: gl.constexpr,
               CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
               PERSISTENT: gl.constexpr, GROUP: gl.constexpr, CONSUMERS: gl.constexpr):
    fa3_forward(q_desc, k_desc, v_desc, o_desc, LSE, N_Q, N_K, qk_scale, BLOCK_M, BLOCK_N,
                HEAD_DIM, STAGES, CAUSAL, OVERLAP, CONSUMER_REGS, PRODUCER_REGS, exp2_mufu,
                move_max, rescale_o, PERSISTENT, GROUP, CONSUMERS)
